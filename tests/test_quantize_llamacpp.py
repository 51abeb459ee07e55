"""Byte equality with llama.cpp's own quantizer (llama-cpp-python is the oracle).

Two levels: the encoders against ggml's `ggml_quantize_chunk` on awkward arrays, and whole files
— `engine.gguf.convert` against `llama_model_quantize` on the same dense GGUF, comparing every
tensor's type (the per-tensor policy) and bytes — at rows of 256 and Gemma-3-270m's 640.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf_write_fixtures import awkward_weights, llama_quantize, write_dense_llama

from engine.gguf.convert import convert_gguf
from engine.gguf.quantize import QUANTIZED_TYPES, quantize, quantize_numpy
from engine.gguf.writer import read_gguf_content

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def ggml_quantize_chunk():
    """ggml's quantize entry point, the function llama-quantize calls, from llama-cpp-python's
    bundled libggml-base."""
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def run(x: np.ndarray, kind: T) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        rows, n = x.shape
        block, size = GGML_QUANT_SIZES[kind]
        out = np.zeros((rows, n // block * size), np.uint8)
        assert fn(int(kind), x.ctypes.data, out.ctypes.data, 0, rows, n, None) == out.nbytes
        return out
    return run


@pytest.mark.parametrize("encoder", [quantize, quantize_numpy], ids=["c", "numpy"])
@pytest.mark.parametrize("kind", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_encoders_equal_ggml(ggml_quantize_chunk, kind, encoder):
    """Both of the engine's quantizers (ggml's C where it builds, the numpy port) byte for byte
    against ggml's own on awkward rows."""
    rng = np.random.default_rng(7)
    x = np.concatenate([awkward_weights(rng, (40, 512)),
                        (rng.standard_t(2, (8, 512)) * 0.02).astype(np.float32),   # heavy tails
                        rng.integers(-3, 4, (8, 512)).astype(np.float32),          # integers
                        (rng.standard_normal((8, 512)) * 1e-6).astype(np.float32)])
    x[7, :40] = -0.0                                   # signed zeros: ggml keeps their sign
    x[8, 100:300] = 0.0
    assert np.array_equal(encoder(x, kind), ggml_quantize_chunk(x, kind))


CASES = [(640, "F16", dtype) for dtype in ("q8_0", "q4_0", "q4_k_s", "q4_k_m", "q5_k_m", "q6_k")] \
    + [(256, "F16", dtype) for dtype in ("q4_0", "q4_k_m", "q5_k_m", "q6_k")] \
    + [(640, "F32", "q4_k_m"), (256, "BF16", "q4_k_s"), (256, "F32", "f16"), (256, "F32", "bf16")]


@pytest.mark.parametrize("dim,source,dtype", CASES,
                         ids=[f"{d}-{s}-{t}" for d, s, t in CASES])
def test_file_equals_llama_quantize(tmp_path, dim, source, dtype):
    src = write_dense_llama(tmp_path / "src.gguf", dim=dim, ffn=2 * dim if dim == 256 else 1024,
                            dtype=source)
    ours = read_gguf_content(convert_gguf(src, tmp_path / "ours.gguf", dtype).path)
    ref = read_gguf_content(llama_quantize(src, tmp_path / "ref.gguf", dtype))
    ref_tensors = {t.name: t for t in ref.tensors}
    assert sorted(ref_tensors) == sorted(t.name for t in ours.tensors)
    for tensor in ours.tensors:
        expected = ref_tensors[tensor.name]
        assert tensor.ggml_type == expected.ggml_type, tensor.name
        assert bytes(tensor.data) == bytes(expected.data), tensor.name
    if dim == 640 and dtype == "q4_k_m":   # the Gemma-width fallbacks were exercised
        kinds = {t.ggml_type for t in ours.tensors}
        assert {T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K} <= kinds
    for key in ("general.file_type", "general.quantization_version"):
        if key in ref.metadata:
            assert ours.metadata[key].value == ref.metadata[key].value
