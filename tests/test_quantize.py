"""Quantizers against the `gguf` package's numpy quantizers and hand-derived ggml facts (offline).

Byte equality with ggml itself, K-quants included, is in test_quantize_llamacpp.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T
from gguf_write_fixtures import awkward_weights

from engine.gguf.quantize import QUANTIZED_TYPES, quantize, quantize_numpy

LEGACY = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)


def _weights(seed: int = 0) -> np.ndarray:
    x = awkward_weights(np.random.default_rng(seed), (48, 512))
    return x[1:]  # the gguf package differs from ggml on all-zero blocks (sign of d), see below


@pytest.mark.parametrize("kind", LEGACY, ids=lambda t: t.name)
def test_legacy_types_equal_gguf_package(kind):
    x = _weights()
    assert np.array_equal(quantize(x, kind), quants.quantize(x, kind))


@pytest.mark.parametrize("kind", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_output_size_and_roundtrip_error(kind):
    """Every type packs rows into whole blocks and dequantizes (gguf package) close to the
    input: the error of a b-bit code is a fraction of the block's range."""
    x = _weights(1)
    q = quantize(x, kind)
    block, size = GGML_QUANT_SIZES[kind]
    assert q.shape == (x.shape[0], x.shape[1] // block * size) and q.dtype == np.uint8
    back = quants.dequantize(q, kind).reshape(x.shape)
    blocks = x.reshape(-1, block)
    err = np.abs(back.reshape(-1, block) - blocks).max(axis=1)
    spread = np.abs(blocks).max(axis=1)
    bits = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5,
            T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}[kind]
    # half a step of a b-bit grid over [-max, max], with slack for the 6-bit sub-block scales
    assert np.all(err <= spread * 2.0 / (2 ** bits - 1) + 1e-7)


def test_all_zero_block_keeps_ggml_sign_of_d():
    """ggml's quantize_row_q4_0_ref: max stays 0.0, d = 0.0 / -8 = -0.0, stored as f16 0x8000;
    every quant is (int8_t)(0 * 0 + 8.5) = 8, so the nibbles read 0x88."""
    q = quantize(np.zeros((1, 32), np.float32), T.Q4_0)[0]
    assert q[:2].tobytes() == b"\x00\x80" and np.all(q[2:] == 0x88)
    q8 = quantize(np.zeros((1, 32), np.float32), T.Q8_0)[0]   # amax/127 = +0.0
    assert not q8.any()


def test_q8_0_rounds_half_away_from_zero():
    """roundf: with amax 127 the scale is 1, and 0.5 -> 1, -2.5 -> -3 (not banker's rounding)."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 0.5, -2.5, 1.5]
    q = quantize(x, T.Q8_0)[0]
    assert np.frombuffer(q[:2].tobytes(), np.float16)[0] == 1.0
    assert q[2:6].view(np.int8).tolist() == [127, 1, -3, 2]


def test_rows_must_fill_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.ones((2, 640), np.float32), T.Q4_K)
    assert quantize(np.ones((2, 640), np.float32), T.Q5_0).shape == (2, 20 * 22)


@pytest.mark.parametrize("kind", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_c_quantizer_equals_the_numpy_port(kind):
    """ggml's reference quantizers in C (engine/hf/kquants.c, what `quantize` runs where a
    compiler is) give the numpy port's bytes: zero blocks, signed zeros, outliers, five decades
    of scale; the twin flips one block's signs and only that row's bytes change."""
    from engine.hf.kquants import quantize_rows

    x = awkward_weights(np.random.default_rng(11), (48, 512)).astype(np.float32)
    x[3, :256] = 0.0
    x[4, :40] = -0.0
    native = quantize_rows(x, kind)
    if native is None:
        pytest.skip("no C compiler here (or FORGEBENCH_NATIVE=0): the numpy port runs")
    assert np.array_equal(native, quantize_numpy(x, kind))
    y = x.copy()
    y[5, :32] *= -1
    changed = np.flatnonzero((quantize_rows(y, kind) != native).any(axis=1))
    assert changed.tolist() == [5]


@pytest.mark.parametrize("kind", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_f16_values_quantize_as_their_f32_widening(kind):
    """An f16 file's values go to the quantizer as they are (widened row by row in C): the
    bytes are those of the same values widened to f32 first; the twin, one value made the
    row's largest, changes that row's bytes alone."""
    half = awkward_weights(np.random.default_rng(5), (16, 512)).astype(np.float16)
    got = quantize(half, kind)
    assert np.array_equal(got, quantize_numpy(half.astype(np.float32), kind))
    moved = half.copy()
    moved[9, 7] = -4 * np.abs(half[9]).max()
    changed = np.flatnonzero((quantize(moved, kind) != got).any(axis=1))
    assert changed.tolist() == [9]
