"""Mixed precision on the CPU or a GPU: one switch for every recipe, and the rule that picks it.

A config asks for "auto" (the default), "f32" or "bf16" ("fp32" is the media recipes' spelling
of "f32"). "auto" resolves to "bf16" (torch's CPU autocast: bf16 matmuls, f32 master weights,
f32 loss and optimizer) only where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), and
to "f32" elsewhere: without them torch emulates bf16 and a step is several times slower than in
f32. The choice and its reason are made once, when a run starts, and recorded in run.json
(`precision`); every later invocation of the run (resume, eval) reads it back, so a run never
changes precision half way and resumes exactly in either.

`choose_precision` is the rule as a pure function of a feature set; `cpu_bf16_features` asks
torch (and cpuid / /proc/cpuinfo, engine.kernels.cpu) what this machine has.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REQUESTS = ("auto", "f32", "fp32", "bf16")
# cpuinfo flag names of the units that make a bf16 matmul faster than an f32 one
BF16_UNITS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class PrecisionChoice:
    """What a run computes in: `precision` "f32" or "bf16", asked as `requested`, and why."""

    precision: str
    requested: str
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def choose_precision(requested: str, features: frozenset[str]) -> PrecisionChoice:
    """The precision for a config's request on a CPU with these (cpuinfo-named) features."""
    if requested not in REQUESTS:
        raise ValueError(f"precision {requested!r} is not one of {', '.join(REQUESTS)}")
    units = [unit for unit in BF16_UNITS if unit in features]
    if requested in ("f32", "fp32"):
        return PrecisionChoice("f32", requested, "asked for f32")
    if requested == "bf16":
        note = ("bf16 units: " + ", ".join(units)) if units else \
            "no AVX512-BF16 or AMX here: torch emulates bf16, slower than f32"
        return PrecisionChoice("bf16", requested, f"asked for bf16 ({note})")
    if units:
        return PrecisionChoice("bf16", requested, "auto: this CPU has " + " and ".join(units)
                               + " (bf16 autocast, f32 master weights and loss)")
    return PrecisionChoice("f32", requested, "auto: this CPU has no AVX512-BF16 or AMX, where "
                                             "bf16 would be emulated and slower than f32")


def _proc_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.split(":")[0].strip() == "flags"), "")
    return frozenset(line.partition(":")[2].split())


def listed_bf16_features() -> frozenset[str]:
    """The BF16_UNITS /proc/cpuinfo lists: what the app's form reads. Never cpuid: that goes
    through the native kernels, which may compile them (seconds on the GUI thread, even in a
    process that has torch loaded, as a test process does)."""
    return _proc_flags() & frozenset(BF16_UNITS)


@functools.lru_cache(maxsize=1)
def cpu_bf16_features() -> frozenset[str]:
    """The BF16_UNITS this machine has, from /proc/cpuinfo, and in a process that has torch
    loaded (a job) also from cpuid (engine.kernels.cpu; amx_bf16 has no cpuid bit there) and
    torch's own CPU checks (what its kernels use). The app's form reads the flags alone
    (`listed_bf16_features`)."""
    found = set(_proc_flags())
    torch = sys.modules.get("torch")
    if torch is not None:
        from engine.kernels.cpu import detected

        found |= detected()[0]
    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        found.add("avx512_bf16")
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        found.add("amx_bf16")        # every CPU with AMX tiles so far has AMX-BF16
    return frozenset(found) & frozenset(BF16_UNITS)


def resolve_precision(requested: str) -> PrecisionChoice:
    """`choose_precision` on this machine."""
    return choose_precision(requested, cpu_bf16_features())


def requested_precision(config) -> str | None:
    """The request of a recipe config: `train.precision` (language models) or `precision`
    (image/audio recipes); None for a recipe without the switch."""
    train = getattr(config, "train", None)
    value = getattr(train, "precision", None) or getattr(config, "precision", None)
    return value if isinstance(value, str) else None


def run_precision(run, config) -> str:
    """The precision a run computes in: the choice recorded in its run.json (made when it
    started), or, for a run recorded before the choice was, the config's request resolved
    here."""
    recorded = (run.manifest().get("precision") or {}).get("precision")
    return recorded or resolve_precision(requested_precision(config) or "f32").precision


def torch_dtype(precision: str):
    """The dtype a precision's products run in: bfloat16 for "bf16", float32 otherwise."""
    import torch

    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(precision: str, device_type: str = "cpu"):
    """torch's autocast to bfloat16 for "bf16" ("auto" resolved on this machine) on the CPU or
    CUDA (`device_type`); a no-op context for "f32". The weights (and full fine-tuning's master
    copy) stay f32."""
    if precision == "auto":
        precision = resolve_precision(precision).precision
    if precision == "bf16":
        import torch

        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def migrate_autocast(values):
    """A language-model `train` table written before `precision` existed names `autocast`
    ("none" or "bf16"): read it as the precision it asked for, so such configs and the runs
    recorded with them still load."""
    if isinstance(values, dict) and "autocast" in values and "precision" not in values:
        values = dict(values)
        old = values.pop("autocast")
        values["precision"] = "f32" if old == "none" else old
    return values
