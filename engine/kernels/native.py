"""The C builds, compiled once per machine on first use: the llama.cpp kernels (ggml_kernels.c)
and the training step's fused elementwise passes (train_kernels.c, used by fused.py).

The torch code in ggml_matmul.py, numerics.py and engine/models/blocks.py is the reference; the
llama.cpp file repeats the same arithmetic about two orders of magnitude faster (one pass, no f64
intermediates), up to a whole decoder forward (fb_forward). Each file is built with the system C
compiler into the user cache (nothing is downloaded). Without a compiler, or with
FORGEBENCH_NATIVE=0, torch runs instead: the same numbers for the llama.cpp kernels, torch's own
op chains (equal up to the last bits, see train_kernels.c) for the training passes; slower.

The ctypes structures below mirror the C structs of the same names (fb_weight, fb_plan, fb_layer,
fb_model); a change to one is a change to both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.fsutil import cache_dir
from engine.gguf.layouts import BLOCK_LAYOUTS
from engine.kernels.cpu import forced_simd

if TYPE_CHECKING:
    import numpy as np
    import torch

SOURCE = Path(__file__).with_name("ggml_kernels.c")
# -ffp-contract=off: only the explicit fmaf() calls fuse, as in ggml's intrinsics
FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
]
# the training step's fused passes: torch's arithmetic, one thread (see the file's header)
TRAIN_SOURCE = Path(__file__).with_name("train_kernels.c")
# ggml_vec_dot_f32's tail loop compiled as pip compiles llama.cpp here (ggml_tail_probe.c)
PROBE_SOURCE = Path(__file__).with_name("ggml_tail_probe.c")
PROBE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
TRAIN_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-fast-math", "-shared", "-fPIC"]
# the target an AVX2-only x86 CPU builds for (AVX2, FMA, F16C, BMI2: 8-lane vectors)
AVX2_MARCH = "-march=x86-64-v3"

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# ggml type ids the C kernels take (GGMLQuantizationType values): the weight-layout table's
# rows with a C kernel (engine/gguf/layouts.py)
WEIGHT_TYPES = {layout.name: int(layout.ggml_type) for layout in BLOCK_LAYOUTS if layout.native}


class Weight(ctypes.Structure):
    """fb_weight: a matrix in unpack_blocks' layout (F16: the raw halves; TQ1_0 / TQ2_0: the
    GGUF blocks, `q2` a PTQTP weight's second plane or NULL; `raw` a Q6_K matrix's GGUF blocks,
    which its one-row kernel then reads instead of the unpacked parts, or NULL)."""

    _fields_ = [("type", ctypes.c_int32), ("pad_", ctypes.c_int32), ("rows", _I64),
                ("cols", _I64), ("q", _PTR), ("scales", _PTR), ("mins", _PTR), ("d", _PTR),
                ("dmin", _PTR), ("bias", _PTR), ("q2", _PTR), ("raw", _PTR)]


class Plan(ctypes.Structure):
    """fb_plan: the summation orders of the llama.cpp build (engine/kernels/cpu.py)."""

    _fields_ = [("f16_lanes", ctypes.c_int32), ("softmax_lanes", ctypes.c_int32),
                ("repack", ctypes.c_int32)]


class Layer(ctypes.Structure):
    """fb_layer: one decoder layer's weights, norms (NULL = none), window and RoPE settings."""

    _fields_ = [*((name, Weight) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                *((name, _PTR) for name in ("attn_norm", "q_norm", "k_norm", "post_attn_norm",
                                            "mlp_norm", "post_mlp_norm")),
                ("window", _I64), ("rope_step", _F32), ("rope_freq_scale", _F32),
                ("rope_freq_factors", _PTR)]


class Model(ctypes.Structure):
    """fb_model: the decoder's shape, scales and layers."""

    _fields_ = [*((name, _I64) for name in ("n_layers", "dim", "n_heads", "n_kv_heads",
                                             "head_dim", "ffn_dim")),
                ("norm_eps", _F32), ("q_scale", _F32), ("kq_scale", _F32),
                ("rope_neox", ctypes.c_int32), ("gelu", ctypes.c_int32), ("gelu_table", _PTR),
                ("output_norm", _PTR), ("layers", _PTR)]


SIGNATURES = {
    "f16_dot": [_I64, _I64, _I64, _I64, _PTR, _PTR, _INT, _INT, _PTR],
    "fb_unpack": [_INT, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
}
# train_kernels.c: dtype codes 0 = f32, 1 = bf16 (engine/kernels/fused.py)
TRAIN_SIGNATURES = {
    "fb_softmax_chunk": ([_I64, _I64, _PTR, _INT, _PTR, _PTR, _PTR], None),
    "fb_rmsnorm_fwd": ([_I64, _I64, _PTR, _INT, _PTR, _F32, _PTR, _INT, _PTR], None),
    "fb_rmsnorm_bwd": ([_I64, _I64, _PTR, _INT, _PTR, _PTR, _PTR, _INT, _PTR, _INT, _PTR], None),
    "fb_glu_fwd": ([_I64, _INT, _PTR, _PTR, _INT, _PTR], None),
    "fb_glu_bwd": ([_I64, _INT, _PTR, _PTR, _PTR, _INT, _PTR, _PTR], None),
    "fb_rope_fwd": ([_I64, _I64, _I64, _I64, _PTR, _INT, _PTR, _PTR, _F32, _INT, _PTR], None),
    "fb_rope_bwd": ([_I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _F32, _INT, _PTR, _INT], None),
}
RETURNS = {"cpu_features": ([], _I64),
           "fb_matmul": ([_PTR, _I64, _PTR, _PTR, _INT, _PTR], _INT),
           "fb_forward": ([_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _INT],
                          _INT),
           # one decode step of several sequences, each row as fb_forward gives it alone
           "fb_matmul_rowwise": ([_PTR, _I64, _PTR, _PTR, _INT, _PTR], _INT),
           "fb_decode_batch": ([_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
                               _INT)}


def _build(source: Path, flags: list[str]) -> ctypes.CDLL | None:
    """`source` compiled into the user cache (once per source, compiler and flags) and loaded;
    None with FORGEBENCH_NATIVE=0 or where it cannot be built (said once on stderr)."""
    if os.environ.get("FORGEBENCH_NATIVE", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256(source.read_bytes() + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"{source.stem}-{key}.so"
    if not lib_path.exists():
        tmp = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.tmp")
        try:
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(
                [cc, *flags, str(source), "-o", str(tmp), "-lm"], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise OSError(
                    f"{cc} exited with {done.returncode}: "
                    f"{done.stderr.strip()[:300] or 'no message'}"
                )
            os.replace(tmp, lib_path)
        except OSError as err:
            print(
                f"forgebench: could not build {source.name} into {lib_path.parent} ({err}); "
                "using torch's slower ops instead. Set CC to a working C compiler "
                "or XDG_CACHE_HOME "
                "to a writable folder.",
                file=sys.stderr,
            )
            tmp.unlink(missing_ok=True)
            return None
    return ctypes.CDLL(str(lib_path))


def _declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


@functools.lru_cache(maxsize=1)
def kernels() -> ctypes.CDLL | None:
    """The loaded llama.cpp kernels (ggml_kernels.c), building them if needed, for this CPU or,
    under FORGEBENCH_SIMD=avx2, for an AVX2-only one (the code such a CPU runs: a benchmark of
    the AVX2 path on an AVX-512 machine measures it, not the AVX-512 kernels); None where they
    cannot be built."""
    return build_kernels(forced_simd())


def build_kernels(simd: str | None) -> ctypes.CDLL | None:
    """ggml_kernels.c built for this machine (`simd` None, what `kernels()` loads) or for an
    AVX2-only CPU ("avx2": -march=x86-64-v3, no AVX-512 and no VNNI, the code such a CPU runs:
    the tests hold both builds to the same bits), and declared; None where it cannot be built."""
    flags = [AVX2_MARCH if simd == "avx2" and f == "-march=native" else f for f in FLAGS]
    lib = _build(SOURCE, flags)
    if lib is None:
        return None
    return _declare(lib, {**{name: (argtypes, None) for name, argtypes in SIGNATURES.items()},
                          **RETURNS})


def build_train_kernels(simd: str | None) -> ctypes.CDLL | None:
    """train_kernels.c built for this machine (`simd` None) or for an AVX2-only CPU ("avx2": what
    FORGEBENCH_SIMD=avx2 builds, the 8-lane code such a CPU runs), and declared; None where it
    cannot be built."""
    flags = [AVX2_MARCH if simd == "avx2" and f == "-march=native" else f for f in TRAIN_FLAGS]
    lib = _build(TRAIN_SOURCE, flags)
    return None if lib is None else _declare(lib, TRAIN_SIGNATURES)


@functools.lru_cache(maxsize=1)
def tail_probe() -> ctypes.CDLL | None:
    """ggml_tail_probe.c built as llama.cpp's own sources are here; None where it cannot be."""
    lib = _build(PROBE_SOURCE, PROBE_FLAGS)
    if lib is None:
        return None
    lib.fb_vec_dot_f32_tail.argtypes = [_INT, _INT, _PTR, _PTR]
    lib.fb_vec_dot_f32_tail.restype = _F32
    return lib


@functools.lru_cache(maxsize=1)
def train_kernels() -> ctypes.CDLL | None:
    """The loaded fused training passes (train_kernels.c), building them if needed, for this
    CPU or, under FORGEBENCH_SIMD=avx2, for an AVX2-only one; None where they cannot be built
    (torch's ops then run them)."""
    return build_train_kernels(forced_simd())


def ptr(t: torch.Tensor | np.ndarray) -> int:
    """Address of a contiguous tensor's or numpy array's data, for the C calls. (No torch import
    here: the torch-free generate path, engine/llm/native_lm.py, loads these kernels too.)"""
    if hasattr(t, "data_ptr"):
        if not t.is_contiguous():
            raise ValueError("native kernels need contiguous tensors")
        return t.data_ptr()
    if not t.flags.c_contiguous:
        raise ValueError("native kernels need contiguous arrays")
    return t.ctypes.data


__all__ = ["Layer", "Model", "Plan", "WEIGHT_TYPES", "Weight", "build_kernels",
           "build_train_kernels", "kernels", "ptr", "train_kernels"]
