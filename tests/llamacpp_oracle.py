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

from engine.export.llamacpp import build_flags
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
    """The engine's plan, after skipping (with the reason) when the oracle runs other orders."""
    ours, theirs = plan(), oracle_plan()
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
