"""Torch dequantization kernels are element-exact (bitwise) against the gguf package's numpy
`dequantize`, for every supported type, on fixture tensors and on arbitrary block bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from fixtures_gguf import QTYPES, write_tiny_gguf
from gguf import GGMLQuantizationType as T

from engine.errors import ForgebenchError
from engine.gguf.constants import SUPPORTED_TYPES
from engine.gguf.dequant import dequantize
from engine.gguf.reader import open_gguf


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = a.astype(np.float32), b.astype(np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", QTYPES)
def test_fixture_tensors_match_gguf_package(tmp_path, qtype):
    f = open_gguf(write_tiny_gguf(tmp_path / "m.gguf", "llama", qtype))
    for name in (
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.1.ffn_down.weight",
        "output.weight",
    ):
        info = f.tensors[name]
        assert info.ggml_type == T[qtype]
        want = gguf.dequantize(info.raw, info.ggml_type).reshape(info.shape)
        got = dequantize(torch.from_numpy(info.raw), info.ggml_type, info.shape).numpy()
        assert _bits_equal(got, want), name
        assert np.abs(want).max() > 0


@pytest.mark.parametrize(
    "qtype", [t.name for t in SUPPORTED_TYPES if t not in (T.F32, T.F16, T.BF16)]
)
def test_arbitrary_block_bytes_match(qtype):
    """Every bit pattern of the packed fields decodes identically (random bytes; f16 scales may be
    inf/NaN, compared NaN-aware)."""
    t = T[qtype]
    bs, size = gguf.GGML_QUANT_SIZES[t]
    raw = np.random.default_rng(7).integers(0, 256, (64, size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = gguf.dequantize(raw, t)
    got = dequantize(torch.from_numpy(raw.copy()), t, (64, bs)).numpy()
    assert got.shape == want.shape
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert _bits_equal(got[finite], want[finite])


def test_unsupported_type_is_refused_with_its_name():
    raw = torch.zeros(84, dtype=torch.uint8)
    with pytest.raises(ForgebenchError, match="Q2_K"):
        dequantize(raw, T.Q2_K, (256,), name="blk.0.attn_q.weight")


def test_shape_mismatch_is_refused():
    raw = torch.zeros(34 * 2, dtype=torch.uint8)  # two Q8_0 blocks = 64 values
    with pytest.raises(ForgebenchError, match="64 values"):
        dequantize(raw, T.Q8_0, (3, 32), name="x")


@pytest.mark.parametrize(
    "qtype", [t.name for t in SUPPORTED_TYPES if t not in (T.F32, T.F16, T.BF16)]
)
def test_single_blocks_and_row_slices_match(qtype):
    """One block at a time, and rows sliced out of a larger buffer at an odd byte stride (the
    embedding lookup dequantizes single rows), decode as the whole buffer does."""
    t = T[qtype]
    bs, size = gguf.GGML_QUANT_SIZES[t]
    raw = np.random.default_rng(3).integers(0, 256, (5, size), dtype=np.uint8)
    whole = dequantize(torch.from_numpy(raw.copy()), t, (5, bs)).view(torch.int32)  # bitwise
    for i in range(5):
        row = dequantize(torch.from_numpy(raw)[i : i + 1], t, (1, bs))
        assert torch.equal(row.view(torch.int32), whole[i : i + 1]), i
    rows = dequantize(torch.from_numpy(raw)[[4, 1]], t, (2, bs))
    assert torch.equal(rows.view(torch.int32), whole[[4, 1]])


@pytest.mark.realmodel
def test_real_model_tensors_match_gguf_package(gemma_gguf):
    """Every tensor of gemma-3-270m Q4_K_M (Q8_0, Q5_0, Q4_K, Q6_K, F32): its first and last 64
    rows decode bit for bit as the gguf package decodes them."""
    f = open_gguf(gemma_gguf)
    for name, info in f.tensors.items():
        rows = info.shape[0] if len(info.shape) > 1 else 1
        raw = info.raw.reshape(rows, -1)
        cols = info.shape[-1]
        for part in (raw[:64], raw[-64:]):
            want = gguf.dequantize(part, info.ggml_type).reshape(part.shape[0], cols)
            got = dequantize(torch.from_numpy(part), info.ggml_type, (part.shape[0], cols)).numpy()
            assert _bits_equal(got, want), name
