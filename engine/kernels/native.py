"""The C build of the llama.cpp kernels (ggml_kernels.c), compiled once per machine on first use.

The torch code in ggml_matmul.py and numerics.py is the reference; the C file repeats the same
arithmetic about two orders of magnitude faster (one pass, no f64 intermediates). It is built
with the system C compiler into the user cache (nothing is downloaded). Without a compiler, or
with FORGEBENCH_NATIVE=0, the torch reference runs instead: same numbers, slower.
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

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "q0_matmul": [_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR],
    "q4_k_matmul": [_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _PTR],
    "q6_k_matmul": [_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _PTR],
    "f16_dot": [_I64, _I64, _I64, _I64, _PTR, _PTR, _INT, _INT, _PTR],
}
RETURNS = {"cpu_features": _I64}


def cache_dir() -> Path:
    """Where forgebench keeps what it builds or measures once per machine."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "forgebench"


@functools.lru_cache(maxsize=1)
def kernels() -> ctypes.CDLL | None:
    """The loaded library, building it if needed; None where it cannot be built."""
    if os.environ.get("FORGEBENCH_NATIVE", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"ggml_kernels-{key}.so"
    if not lib_path.exists():
        tmp = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.tmp")
        try:
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(
                [cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise OSError(
                    f"{cc} exited with {done.returncode}: "
                    f"{done.stderr.strip()[:300] or 'no message'}"
                )
            os.replace(tmp, lib_path)
        except OSError as err:
            print(
                f"forgebench: could not build {SOURCE.name} into {lib_path.parent} ({err}); "
                "using the slower torch kernels (same numbers). Set CC to a working C compiler "
                "or XDG_CACHE_HOME "
                "to a writable folder.",
                file=sys.stderr,
            )
            tmp.unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(lib_path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    for name, restype in RETURNS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [], restype
    return lib


def ptr(t: torch.Tensor) -> int:
    """Address of a contiguous tensor's data, for the C calls."""
    if not t.is_contiguous():
        raise ValueError("native kernels need contiguous tensors")
    return t.data_ptr()


__all__ = ["kernels", "ptr"]
