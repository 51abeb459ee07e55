"""ggml's reference quantizers in C (kquants.c): the k-quants (Q4_K, Q5_K, Q6_K) and the legacy
32-value blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), for every conversion's quantized tensors.

The numpy port in engine/gguf/quantize.py gives the same bytes (the tests compare the two and
both with llama.cpp); this build makes a conversion faster than llama-quantize's. It
is compiled once per machine into the user cache with the system C compiler, like the engine's
other kernels (engine/kernels/native.py, which this does not import: that module loads torch,
which the streaming conversion keeps out of its address space). Without a compiler, or with
FORGEBENCH_NATIVE=0, `quantize_rows` returns None and the numpy port runs.
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

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from engine.fsutil import cache_dir

SOURCE = Path(__file__).with_name("kquants.c")
# no FMA contraction, no fast-math: the reference C's float arithmetic, operation by operation
# (-march=native only widens registers: without contraction or reassociation every float
# operation rounds as in the reference)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("FORGEBENCH_NATIVE", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"kquants-{key}.so"
    if not lib_path.exists():
        tmp = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.tmp")
        try:
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise OSError(done.stderr.strip()[:300] or f"{cc} exited {done.returncode}")
            os.replace(tmp, lib_path)
        except OSError as err:
            print(f"forgebench: could not build {SOURCE.name} ({err}); quantizing with numpy",
                  file=sys.stderr)
            tmp.unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(lib_path))
    lib.fb_kquantize_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_void_p]
    lib.fb_kquantize_rows.restype = ctypes.c_int
    lib.fb_kquantize_rows_f16.argtypes = lib.fb_kquantize_rows.argtypes
    lib.fb_kquantize_rows_f16.restype = ctypes.c_int
    return lib


def quantize_rows(values: np.ndarray, ggml_type: T) -> np.ndarray | None:
    """`values` (f32, or f16 read as they are; rows on the last axis, a multiple of the type's
    block long) as `ggml_type` blocks, uint8 of shape (..., row bytes); None when the type has
    no C quantizer here or the build is unavailable."""
    lib = _library() if T(ggml_type) in TYPES else None
    if lib is None:
        return None
    half = values.dtype == np.float16     # an f16 file's values go in as they are (exact)
    x = np.ascontiguousarray(values, dtype=np.float16 if half else np.float32)
    cols = x.shape[-1] if x.ndim else 1
    rows = x.size // cols
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    if cols % block:
        return None
    out = np.empty(x.shape[:-1] + (cols // block * size,), np.uint8)
    # ctypes releases the GIL for the call, so row blocks quantize in parallel on the pool
    entry = lib.fb_kquantize_rows_f16 if half else lib.fb_kquantize_rows
    if entry(int(ggml_type), x.ctypes.data, rows, cols, out.ctypes.data) != 0:
        return None
    return out
