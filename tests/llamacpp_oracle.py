"""llama.cpp as the tests' oracle: its library, the instruction set it was compiled for, and the
check that the engine follows the same kernel orders.

llama-cpp-python compiles llama.cpp for the machine it is built on (-march=native), so the oracle's
kernels are those of this CPU unless it was built otherwise (CMAKE_ARGS with GGML_NATIVE=OFF). The
engine reads the CPU itself (engine/kernels/cpu.py); a test compares the two plans first and skips
with the reason when they differ, instead of reporting a numerics bug that is a build mismatch.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from engine.export.llamacpp import amx_build, build_flags
from engine.kernels.cpu import EXACT, KernelPlan, plan, plan_for

# llama_print_system_info() names -> /proc/cpuinfo names (engine/kernels/cpu.py FEATURE_BITS)
SYSTEM_INFO_NAMES = {
    "AVX": "avx",
    "AVX2": "avx2",
    "FMA": "fma",
    "F16C": "f16c",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
    "AVX_VNNI": "avx_vnni",
    "AMX_INT8": "amx_int8",
}


def oracle_plan() -> KernelPlan:
    """The kernel plan of the installed llama.cpp build. ggml reports AVX512 (F) and VNNI but not
    DQ, BW or VL; every AVX-512 CPU that llama.cpp's kernels target has them, so they follow F."""
    flags = build_flags()
    features = {SYSTEM_INFO_NAMES[k] for k, on in flags.items() if on and k in SYSTEM_INFO_NAMES}
    if "avx512f" in features:
        features |= {"avx512dq", "avx512bw", "avx512vl"}
    return plan_for(frozenset(features), "llama_print_system_info")


def require_same_plan() -> KernelPlan:
    """The engine's plan, after skipping (with the reason) when the oracle runs other orders or
    opens in another configuration than the plan follows (engine/export/llamacpp.py open_llama
    turns the extra buffer types off on an AMX build; the plan decides it from the CPU)."""
    ours, theirs = plan(), oracle_plan()
    if ours.x86_exact and ours.repacked == amx_build():
        pytest.skip(
            f"the engine follows llama.cpp {ours.configuration}, but open_llama opens this "
            f"build {'without' if amx_build() else 'with'} its extra buffer types "
            "(AMX_INT8 in llama_print_system_info decides): a llama.cpp built for another CPU"
        )
    if (
        ours.x86_exact
        and theirs.x86_exact
        and (ours.f16_lanes, ours.softmax_lanes) != (theirs.f16_lanes, theirs.softmax_lanes)
    ):
        pytest.skip(
            f"llama.cpp was built for {theirs.isa} but the engine follows {ours.isa} "
            f"(FORGEBENCH_SIMD={ours.forced or 'unset'}): rebuild llama-cpp-python for this CPU, "
            "or set FORGEBENCH_SIMD to match it (docs/numerics.md)"
        )
    return ours


def assert_kernel_matches(ours: np.ndarray, theirs: np.ndarray, kernel: str, p: KernelPlan) -> None:
    """Bit-equality where the plan reproduces `kernel` on this machine; elsewhere agreement to f32
    rounding, then a visible xfail naming the kernel (never a silent pass of the weaker check)."""
    status = next((k.status for k in p.kernels if k.name == kernel), None)
    if status is None:
        raise KeyError(f"no kernel named {kernel!r} in the plan")
    if status == EXACT and p.x86_exact:
        assert np.array_equal(ours, theirs), f"{kernel}: max |diff| {np.abs(ours - theirs).max()}"
        return
    scale = max(float(np.abs(theirs).max()), 1e-30)
    assert np.allclose(ours, theirs, rtol=0, atol=1e-5 * scale)
    pytest.xfail(
        f"{kernel}: llama.cpp's kernel on this CPU ({p.isa}) is not reproduced bit for bit; "
        f"agrees to {np.abs(ours - theirs).max():.2e}"
    )


def ggml_cpu_library():
    """libggml-cpu.so of the installed llama-cpp-python, initialised, for direct kernel calls."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python (the `verify` extra) is not installed"
    )
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_cpu_init()
    return lib


class _InitParams(ctypes.Structure):
    """ggml_init_params."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


def ggml_graph_library():
    """libggml-base.so and libggml-cpu.so of the installed llama-cpp-python, set up to build and
    compute one-op graphs (ggml_init, ggml_mul_mat, ggml_graph_compute_with_ctx)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python (the `verify` extra) is not installed"
    )
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ggml_cpu_library()
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.restype, base.ggml_init.argtypes = P, [_InitParams]
    base.ggml_new_tensor_2d.restype = P
    base.ggml_new_tensor_2d.argtypes = [P, ctypes.c_int, I64, I64]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = P, [P, P, P]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = P, [P]
    base.ggml_build_forward_expand.argtypes = [P, P]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = P, [P]
    base.ggml_free.argtypes = [P]
    cpu.ggml_graph_compute_with_ctx.argtypes = [P, P, ctypes.c_int]
    return base, cpu


def ggml_mul_mat(raw: np.ndarray, ggml_type: int, rows: int, cols: int, x: np.ndarray,
                 threads: int = 2) -> np.ndarray:
    """x [R, cols] f32 times the weight (`raw`: its GGUF blocks, `rows` x `cols`) as ggml's CPU
    backend computes one MUL_MAT node in plain host memory: no extra buffer types, so neither the
    repacked nor the AMX kernels — exactly what llama.cpp runs with `--no-repack`
    (use_extra_bufts = false): tiled K-quants, llamafile's tinyBLAS or the vec_dot loop, whichever
    ggml_compute_forward_mul_mat picks for this type and batch. -> [R, rows] f32."""
    base, cpu = ggml_graph_library()
    x = np.ascontiguousarray(x, dtype=np.float32)
    blocks = np.ascontiguousarray(raw).view(np.uint8)
    ctx = base.ggml_init(_InitParams(blocks.nbytes + 2 * x.nbytes + x.shape[0] * rows * 4
                                     + (16 << 20), None, False))
    try:
        w = base.ggml_new_tensor_2d(ctx, int(ggml_type), cols, rows)
        xt = base.ggml_new_tensor_2d(ctx, 0, cols, x.shape[0])  # GGML_TYPE_F32
        ctypes.memmove(base.ggml_get_data(w), blocks.ctypes.data, blocks.nbytes)
        ctypes.memmove(base.ggml_get_data(xt), x.ctypes.data, x.nbytes)
        y = base.ggml_mul_mat(ctx, w, xt)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, y)
        if cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) != 0:
            raise RuntimeError("ggml_graph_compute_with_ctx failed")
        out = (ctypes.c_float * (x.shape[0] * rows)).from_address(base.ggml_get_data(y))
        return np.ctypeslib.as_array(out).reshape(x.shape[0], rows).copy()
    finally:
        base.ggml_free(ctx)
