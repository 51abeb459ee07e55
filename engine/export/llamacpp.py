"""Opening a GGUF in llama-cpp-python (the export check's llama.cpp stage, and the tests' oracle).

llama-cpp-python compiles llama.cpp with -march=native. On a CPU with AMX-INT8 and AVX512-VNNI
(Sapphire Rapids and later) that build puts quantized weights in ggml's AMX buffer, and its AMX
matmul (`ggml_backend_amx_mul_mat`) crashes on the first batch of more than one token: a
segfault in an OpenMP worker (llama-cpp-python 0.3.36 on an AMX Xeon, a 64-wide test model and
gemma-3-270m Q4_K_M alike; llama.cpp issue #20824 reports the same crash), or SIGILL at its first
AMX instruction (`tilezero`, seen under gdb on another Sapphire Rapids machine with a 5-token
batch of a tiny Q4_K or Q8_0 model). On such a build the file is opened without
the extra buffer types (`use_extra_bufts = false`, what `llama-server --no-repack` sets), so
llama.cpp runs its plain CPU kernels (neither AMX tiles nor the repacked Q4_0/Q4_K ones: the tiled
K-quant matmul, llamafile's tinyBLAS and the vec_dot loop), and `AMX_NOTE` says so wherever a
result depends on it. The engine's llama.cpp numerics follow that configuration on such a CPU
(engine/kernels/cpu.py: `plan().repacked` is False there, decided by the same AMX-INT8 +
AVX512-VNNI rule), bit for bit. Everywhere else llama.cpp opens the file with its defaults, as a
user's llama.cpp would. `open_options()` gives the matching llama.cpp command-line options, for
telling a user how to run the file.

`open_llama` is the one place that decides; it never changes what a default build computes on a
CPU without AMX.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

AMX_NOTE = ("llama.cpp ran without its extra buffer types (llama-server --no-repack): this "
            "build has ggml's AMX kernels, whose matmul crashes (llama.cpp issue #20824)")


@functools.lru_cache(maxsize=1)
def build_flags() -> dict[str, bool]:
    """The instruction sets the installed llama.cpp was compiled for, as
    llama_print_system_info() names them ("AVX2": True, "AMX_INT8": False, ...)."""
    import llama_cpp

    text = llama_cpp.llama_print_system_info().decode()
    flags = {}
    for part in text.replace("|", "\n").splitlines():
        name, _, value = part.partition("=")
        if value.strip() in ("0", "1"):
            flags[name.strip()] = value.strip() == "1"
    return flags


def amx_build() -> bool:
    """Whether the installed llama.cpp was compiled with its AMX kernels (ggml registers the
    AMX buffer only then)."""
    return build_flags().get("AMX_INT8", False)


def open_llama(path: str | Path, **kwargs):
    """`llama_cpp.Llama(path, **kwargs)`, without the extra buffer types on an AMX build.

    llama-cpp-python's `Llama` takes no switch for them: it fills its model parameters from
    `llama_model_default_params()`, so that function is wrapped for the one call."""
    import llama_cpp

    if not amx_build():
        return llama_cpp.Llama(str(path), **kwargs)
    with default_params_without_extra_buffers():
        return llama_cpp.Llama(str(path), **kwargs)


@contextlib.contextmanager
def default_params_without_extra_buffers():
    """While open, llama-cpp-python's `llama_model_default_params()` answers with
    `use_extra_bufts = false` (what `llama-server --no-repack` sets): every `Llama` made inside
    runs llama.cpp's plain CPU kernels. `open_llama` and the benches' llama.cpp servers use it."""
    from llama_cpp import llama as high_level

    low_level = high_level.llama_cpp
    defaults = low_level.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        low_level.llama_model_default_params = defaults


NO_REPACK_OPTION = "--no-repack"   # llama-server / llama-cli: use_extra_bufts = false


def open_options() -> list[str]:
    """The llama.cpp command-line options that open a file as `open_llama` does here:
    ["--no-repack"] on an AMX build, else none."""
    return [NO_REPACK_OPTION] if amx_build() else []


def open_note() -> str | None:
    """What a report says about how llama.cpp opened the file (None: with its defaults)."""
    return AMX_NOTE if amx_build() else None
