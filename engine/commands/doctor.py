"""`forgebench doctor`: this machine as the engine sees it, and what the llama.cpp numerics match.

Prints the CPU features (cpuid), the kernel orders the engine follows, the llama.cpp configuration
it matches (extra buffer types on, or off as engine/export/llamacpp.py opens an AMX build: the
`--no-repack` one), which kernel families are bit-exact against llama.cpp built for this CPU and
which agree only to f32 rounding (and why),
whether the C kernels are built, and the versions that matter. Imports no llama-cpp-python: its
version is read from the installed package metadata. Then the GPUs training can use
(engine/train/devices.py): each one's memory and bf16 support and the torch CUDA version, or
"no CUDA device" and why.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def report() -> dict:
    import torch

    from engine.kernels import cpu, native
    from engine.train import devices

    p = cpu.plan()
    lib, train_lib = native.kernels(), native.train_kernels()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_kernels": torch.backends.cpu.get_cpu_capability(),   # AVX2 under FORGEBENCH_SIMD
        "llama_cpp_python": _version("llama-cpp-python"),
        "native_kernels": str(lib._name)
        if lib is not None
        else "not built (torch reference kernels)",
        "train_kernels": str(train_lib._name)
        if train_lib is not None
        else "not built (training runs torch's op chains)",
        "cpu_source": p.source,
        "cpu_features": sorted(p.features),
        "kernel_orders": p.isa,
        "llamacpp_configuration": p.configuration,   # repacked, or no extra buffer types
        "forced": p.forced,
        "summary": p.summary(),
        "kernels": [{"name": k.name, "status": k.status, "detail": k.detail} for k in p.kernels],
        "lines": cpu.describe(p),
        "torch_cuda": torch.version.cuda,
        "cuda": devices.cuda_report(),
    }


def gpu_lines(info: dict) -> list[str]:
    """The GPU part of the report, or why there is none."""
    if info["cuda"] is None:
        why = ("this torch is a CPU-only build" if info["torch_cuda"] is None
               else f"torch is built for CUDA {info['torch_cuda']} but finds no GPU")
        return [f"no CUDA device ({why}); training runs on the CPU"]
    lines = [f"CUDA {info['cuda']['cuda']}:"]
    for gpu in info["cuda"]["devices"]:
        lines.append(f"  cuda:{gpu['index']} {gpu['name']}, {gpu['memory_bytes'] / 2**30:.1f} GiB, "
                     f"compute {gpu['capability']}, bf16 {'yes' if gpu['bf16'] else 'no'}, "
                     f"tf32 matmul {'on' if gpu['allow_tf32'] else 'off'}")
    return lines


def cmd_doctor(args) -> int:
    info = report()
    if args.json:
        print(json.dumps({k: v for k, v in info.items() if k != "lines"}, indent=2))
        return 0
    print(
        f"python {info['python']}, torch {info['torch']} ({info['torch_threads']} threads, "
        f"{info['torch_kernels']} kernels), llama-cpp-python {info['llama_cpp_python']}"
    )
    print(f"native kernels: {info['native_kernels']}")
    print(f"training's fused passes: {info['train_kernels']}")
    print("llama.cpp numerics:")
    for line in info["lines"]:
        print(f"  {line}")
    print(info["summary"])
    print("GPU:")
    for line in gpu_lines(info):
        print(f"  {line}")
    sys.stdout.flush()
    return 0
