"""Device choice for every recipe: `device = "auto" | "cpu" | "cuda" | "cuda:N"`.

Contract:
- A recipe that trains on a GPU says so in its registry row (`cuda`, and `multi_process` for
  one that trains on several processes: engine/recipe_registry.py); for the others "auto" is
  the CPU and "cuda" is refused with the reason.
- `resolve(requested, local_rank)` turns the config's word into a `torch.device`, or raises a
  `ForgebenchError` that says why (no CUDA device, index out of range). "auto" is CUDA when
  `torch.cuda.is_available()`, else the CPU. Under torchrun, "cuda" means `cuda:LOCAL_RANK`, so
  every process of a node gets its own GPU.
- `describe(device)` is what run.json records (`environment.device`) and what resume compares:
  the device type decides whether a resume is exact (same type) or a recorded override.
- `cuda_report()` is what `forgebench doctor` prints: the GPUs, their memory, bf16 support and
  the torch CUDA version, or None on a machine without one.
- `module_device(module)` is where a model is, for evaluation and generation code that moves
  its inputs to it.
- `to_device(tensor, device)` is the loader's copy: pinned host memory and a non-blocking copy
  on CUDA (no host sync), the tensor itself on the CPU.

The CPU build of torch imports this module fine; nothing here touches CUDA unless asked for.
"""

from __future__ import annotations

import re

import torch

from engine.config import DEVICE_PATTERN
from engine.errors import ForgebenchError

CUDA_INSTALL_HINT = ("install a CUDA build of torch (README: 'Training on a GPU') or set "
                     "device = \"cpu\"")


def resolve(requested: str, local_rank: int = 0, where: str = "field 'device'", *,
            cuda_ok: bool = True) -> torch.device:
    """The torch device a job trains on (see the module docstring). `cuda_ok` False: the
    recipe trains on the CPU only, so "auto" is the CPU and "cuda" is refused."""
    if not re.match(DEVICE_PATTERN, requested):
        raise ForgebenchError(f"unknown device {requested!r}", where=where,
                              hint="auto, cpu, cuda or cuda:N")
    if requested == "cpu" or (requested == "auto" and not (cuda_ok and
                                                           torch.cuda.is_available())):
        return torch.device("cpu")
    if not cuda_ok:
        raise ForgebenchError(f"this recipe trains on the CPU only; device {requested!r} was "
                              "asked for", where=where, hint="set device = \"cpu\" or \"auto\"")
    if not torch.cuda.is_available():
        build = (f"this torch ({torch.__version__}) is a CPU-only build"
                 if torch.version.cuda is None else
                 f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU")
        raise ForgebenchError(f"device {requested!r} was asked for, but {build}", where=where,
                              hint=CUDA_INSTALL_HINT)
    count = torch.cuda.device_count()
    index = int(requested.partition(":")[2]) if ":" in requested else local_rank
    if index >= count:
        raise ForgebenchError(f"device cuda:{index} does not exist: this machine has {count} "
                              "CUDA device(s)", where=where,
                              hint=f"use cuda:0 .. cuda:{count - 1}, or fewer processes")
    return torch.device("cuda", index)


def bf16_supported(device: torch.device) -> bool:
    """bf16 arithmetic is native here: on CUDA, compute capability 8.0 (Ampere) and later."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True   # the CPU always runs bf16 (fast with avx512_bf16/AMX, emulated without)


def describe(device: torch.device) -> dict:
    """The device as run.json records it."""
    info = {"type": device.type, "index": device.index}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}", bf16=bf16_supported(device),
                    cuda=torch.version.cuda,
                    allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                    cudnn_allow_tf32=torch.backends.cudnn.allow_tf32)
    return info


def cuda_report() -> dict | None:
    """Every CUDA device with its memory and bf16 support, or None without one."""
    if not torch.cuda.is_available():
        return None
    gpus = []
    for index in range(torch.cuda.device_count()):
        gpus.append(describe(torch.device("cuda", index)))
    return {"cuda": torch.version.cuda, "devices": gpus}


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a module's weights are (the CPU for one without any)."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on `device`: from pinned memory without a host sync on CUDA, unchanged on CPU."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def require_bf16(precision: str, device: torch.device, where: str) -> None:
    """bf16 autocast asked for on a GPU without native bf16 is refused, not silently slow."""
    if precision == "bf16" and not bf16_supported(device):
        name = torch.cuda.get_device_name(device)
        raise ForgebenchError(f"{name} has no native bf16 (compute capability 8.0 or later "
                              "needed)", where=where, hint="set it to \"f32\" on this GPU")
