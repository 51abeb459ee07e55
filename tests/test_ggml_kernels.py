"""llama.cpp's CPU kernels as the engine reproduces them (engine/kernels/ggml_matmul.py, numerics.py).

Two kinds of checks:
- the C build (ggml_kernels.c) against the torch reference, bit for bit, on random blocks for
  every path a matmul can take (fast, offline; skipped with the reason when no C compiler);
- each kernel against the very function llama.cpp runs, called in libggml-cpu.so through ctypes
  (marker `llamacpp`): activation quantizers, the Q8_0/Q5_0/Q6_K/f16 dot products, the softmax.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.kernels.ggml_matmul import TILED_MIN_ROWS, ExactWeight
from engine.kernels.native import kernels
from engine.kernels.numerics import (dot_f16, dot_tinyblas, dot_vec_f16, quantize_q8_0, quantize_q8_k, round_f16,
                                 softmax_ggml)
from fixtures_gguf import encode_tensor

needs_native = pytest.mark.skipif(kernels() is None, reason="no C compiler to build ggml_kernels.c")


def random_weight(qtype: T, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    raw = encode_tensor(np.random.default_rng(seed), (rows, cols), qtype)
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1).copy())


def activations(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 40                                             # an outlier, as real activations have
    return x


@needs_native
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("rows", [1, 3, 5, TILED_MIN_ROWS, 13])   # vec_dot/gemv, gemm+gemv, tiled
def test_c_kernels_equal_torch_reference(qtype, rows):
    raw = random_weight(qtype, 24, 512)
    x = activations(rows, 512)
    native = ExactWeight(raw, qtype, 24, 512).matmul(x)
    reference = ExactWeight(raw, qtype, 24, 512, native=False).matmul(x)
    assert torch.equal(native, reference)


@needs_native
@pytest.mark.parametrize("tinyblas", [True, False])
def test_c_f16_dots_equal_torch_reference(tinyblas):
    a = round_f16(torch.randn(2, 3, 5, 64))
    b = round_f16(torch.randn(2, 3, 7, 64))
    reference = dot_tinyblas(a, b) if tinyblas else dot_vec_f16(a, b)
    assert torch.equal(dot_f16(a, b, tinyblas), reference)


def test_exact_kernels_differ_from_plain_product_only_in_rounding():
    """The emulation is still the matmul: it agrees with the f64 product of the quantized values
    to f32 rounding, and is not simply torch's own f32 matmul of them (the point of it)."""
    raw = random_weight(T.Q5_0, 64, 512)
    x = activations(9, 512)
    ours = ExactWeight(raw, T.Q5_0, 64, 512, native=False).matmul(x)
    from engine.gguf.dequant import dequantize
    w = dequantize(raw, T.Q5_0, (64, 512))
    q, d = quantize_q8_0(x)
    xq = (q * d[..., None]).reshape(9, 512)
    exact = xq.double() @ w.double().T
    assert torch.allclose(ours.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())
    assert not torch.equal(ours, xq @ w.T)


# --- against libggml-cpu itself --------------------------------------------------------------

@pytest.fixture(scope="module")
def ggml():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `verify` extra) is not installed")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_cpu_init()
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("quantize_row_q8_0", "quantize_row_q8_K"):
        getattr(lib, name).argtypes = [P, P, I64]
    lib.ggml_quantize_mat_q8_K_4x8.argtypes = [P, P, I64]
    for name in ("ggml_vec_dot_q8_0_q8_0", "ggml_vec_dot_q5_0_q8_0", "ggml_vec_dot_q6_K_q8_K", "ggml_vec_dot_f16"):
        getattr(lib, name).argtypes = [I, P, ctypes.c_size_t, P, ctypes.c_size_t, P, ctypes.c_size_t, I]
    lib.ggml_vec_soft_max_f32.argtypes = [I, P, P, ctypes.c_float]
    lib.ggml_vec_soft_max_f32.restype = ctypes.c_double
    return lib


def q8_blocks(lib, name: str, x: np.ndarray, block_bytes: int) -> np.ndarray:
    out = np.zeros(x.size // (32 if block_bytes == 34 else 256) * block_bytes, dtype=np.uint8)
    getattr(lib, name)(x.ctypes.data, out.ctypes.data, x.size)
    return out.reshape(-1, block_bytes)


@pytest.mark.llamacpp
def test_activation_quantizers_match_ggml(ggml):
    x = activations(4, 1024).numpy()
    ours_q, ours_d = quantize_q8_0(torch.from_numpy(x))
    blocks = q8_blocks(ggml, "quantize_row_q8_0", np.ascontiguousarray(x), 34)
    assert np.array_equal(blocks[:, :2].copy().view(np.float16).astype(np.float32).ravel(), ours_d.numpy().ravel())
    assert np.array_equal(blocks[:, 2:].view(np.int8).astype(np.float32).ravel(), ours_q.numpy().ravel())
    ours_q, ours_d = quantize_q8_k(torch.from_numpy(x))
    blocks = q8_blocks(ggml, "quantize_row_q8_K", np.ascontiguousarray(x), 292)
    assert np.array_equal(blocks[:, :4].copy().view(np.float32).ravel(), ours_d.numpy().ravel())
    assert np.array_equal(blocks[:, 4:260].view(np.int8).astype(np.float32).ravel(), ours_q.numpy().ravel())
    # the 4-row quantizer in front of the repacked Q4_K gemm (its scale once differed from ours by
    # an ulp: torch's `scalar / tensor` is not a correctly rounded division)
    packed = np.zeros(4 * 1168, dtype=np.uint8)
    ggml.ggml_quantize_mat_q8_K_4x8(np.ascontiguousarray(x).ctypes.data, packed.ctypes.data, 1024)
    d = packed.reshape(4, 1168)[:, :16].copy().view(np.float32)           # [block, row]
    assert np.array_equal(d.T, ours_d.numpy())


@pytest.mark.llamacpp
@pytest.mark.parametrize("qtype,fn,act_bytes", [(T.Q8_0, "ggml_vec_dot_q8_0_q8_0", 34),
                                                (T.Q5_0, "ggml_vec_dot_q5_0_q8_0", 34),
                                                (T.Q6_K, "ggml_vec_dot_q6_K_q8_K", 292)])
def test_dot_products_match_ggml(ggml, qtype, fn, act_bytes):
    raw = random_weight(qtype, 16, 1024)
    x = activations(1, 1024)
    act = q8_blocks(ggml, "quantize_row_q8_0" if act_bytes == 34 else "quantize_row_q8_K",
                    np.ascontiguousarray(x.numpy()), act_bytes)
    theirs = np.zeros(16, dtype=np.float32)
    for n in range(16):
        s = ctypes.c_float()
        row = np.ascontiguousarray(raw[n].numpy())
        getattr(ggml, fn)(1024, ctypes.byref(s), 0, row.ctypes.data, 0, act.ctypes.data, 0, 1)
        theirs[n] = s.value
    for native in (False, True):
        if native and kernels() is None:
            continue
        ours = ExactWeight(raw, qtype, 16, 1024, native=native).matmul(x)[0]
        assert np.array_equal(ours.numpy(), theirs)


@pytest.mark.llamacpp
def test_f16_dot_and_softmax_match_ggml(ggml):
    a = round_f16(torch.randn(8, 256)).numpy()
    b = round_f16(torch.randn(8, 256)).numpy()
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    theirs = np.zeros((8, 8), dtype=np.float32)
    for i in range(8):
        for j in range(8):
            s = ctypes.c_float()
            ggml.ggml_vec_dot_f16(256, ctypes.byref(s), 0, a16[i].ctypes.data, 0, b16[j].ctypes.data, 0, 1)
            theirs[i, j] = s.value
    assert np.array_equal(dot_vec_f16(torch.from_numpy(a), torch.from_numpy(b)).numpy(), theirs)

    scores = (torch.randn(6, 256) * 6).numpy()
    probs = np.zeros_like(scores)
    for r in range(6):
        y = np.zeros(256, dtype=np.float32)
        row = np.ascontiguousarray(scores[r])
        total = ggml.ggml_vec_soft_max_f32(256, y.ctypes.data, row.ctypes.data, float(row.max()))
        probs[r] = y * np.float32(1.0 / total)
    ours = softmax_ggml(torch.from_numpy(scores), torch.ones(6, 256, dtype=torch.bool))
    assert np.array_equal(ours.numpy(), probs)


def test_a_failed_build_says_why_and_falls_back(tmp_path, monkeypatch, capsys):
    """No working compiler or no writable cache: one message naming the cause, then the torch
    kernels (same numbers), never an exception."""
    build = kernels.__wrapped__                                   # bypass the per-process cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    assert build() is None
    assert "/bin/false exited with 1" in capsys.readouterr().err
    monkeypatch.delenv("CC")
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-such-folder")
    assert build() is None
    assert "XDG_CACHE_HOME to a writable folder" in capsys.readouterr().err
