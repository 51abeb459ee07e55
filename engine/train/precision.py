"""Mixed precision on the CPU or a GPU: one switch for every recipe, and the rule that picks it.

A config asks for "auto" (the default), "f32" or "bf16" ("fp32" is the media recipes' spelling
of "f32"). "auto" resolves to "bf16" (torch's CPU autocast: bf16 matmuls, f32 master weights,
f32 loss and optimizer) only where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)
*and* torch's bf16 matmul measures at least BF16_MIN_SPEEDUP times its f32 one there, and to
"f32" elsewhere. Without the units torch emulates bf16 and a step is several times slower than in
f32. With them the units alone do not settle it: torch's bf16 matmul ran 2.9x its f32 on an AMD
EPYC with AVX512-BF16 and faster still on AMX, but 0.64x on an Intel Xeon that lists
AVX512-BF16 without AMX (74 vs 115 GFLOP/s on one thread), where a bf16 LoRA step took 1.35x an
f32 one. So the two peaks are measured (engine.train.metrics.peak_matmul_flops, one thread,
once per machine and torch, cached) and compared. The choice and its reason are made once,
when a run starts, and recorded in run.json (`precision`); every later invocation of the run
(resume, eval) reads it back, so a run never changes precision half way and resumes exactly
in either.

`choose_precision` is the rule as a pure function of a feature set and the measured speed-up;
`cpu_bf16_features` asks torch (and cpuid / /proc/cpuinfo, engine.kernels.cpu) what this machine
has; `measured_bf16_speedup` measures (or reads) the peaks' ratio.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from engine.kernels.cpu import as_forced, forced_simd

REQUESTS = ("auto", "f32", "fp32", "bf16")
# cpuinfo flag names of the units that can make a bf16 matmul faster than an f32 one
BF16_UNITS = ("avx512_bf16", "amx_bf16")
# bf16 matmul peak over f32 peak that "auto" needs: autocast also casts activations and
# gradients, which a smaller gain in the matmuls does not pay for
BF16_MIN_SPEEDUP = 1.2


@dataclass(frozen=True)
class PrecisionChoice:
    """What a run computes in: `precision` "f32" or "bf16", asked as `requested`, and why."""

    precision: str
    requested: str
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def choose_precision(requested: str, features: frozenset[str],
                     speedup: float | None = None) -> PrecisionChoice:
    """The precision for a config's request on a CPU with these (cpuinfo-named) features, whose
    bf16 matmul measured `speedup` times its f32 one (None: not measured; the units decide)."""
    if requested not in REQUESTS:
        raise ValueError(f"precision {requested!r} is not one of {', '.join(REQUESTS)}")
    units = [unit for unit in BF16_UNITS if unit in features]
    if requested in ("f32", "fp32"):
        return PrecisionChoice("f32", requested, "asked for f32")
    if requested == "bf16":
        note = ("bf16 units: " + ", ".join(units)) if units else \
            "no AVX512-BF16 or AMX here: torch emulates bf16, slower than f32"
        return PrecisionChoice("bf16", requested, f"asked for bf16 ({note})")
    if not units:
        return PrecisionChoice("f32", requested, "auto: this CPU has no AVX512-BF16 or AMX, "
                                                 "where bf16 would be emulated and slower than f32")
    has = "this CPU has " + " and ".join(units)
    if speedup is None:
        return PrecisionChoice("bf16", requested,
                               f"auto: {has} (bf16 autocast, f32 master weights and loss)")
    measured = f"its bf16 matmul measured {speedup:.2f}x f32"
    if speedup < BF16_MIN_SPEEDUP:
        return PrecisionChoice("f32", requested, f"auto: {has}, but {measured}, under the "
                                                 f"{BF16_MIN_SPEEDUP}x that pays for the casts")
    return PrecisionChoice("bf16", requested, f"auto: {has} and {measured} (bf16 autocast, "
                                              "f32 master weights and loss)")


def cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The flags /proc/cpuinfo lists for this CPU (empty where there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.split(":")[0].strip() == "flags"), "")
    return frozenset(line.partition(":")[2].split())


def listed_bf16_features() -> frozenset[str]:
    """The BF16_UNITS /proc/cpuinfo lists (none under FORGEBENCH_SIMD=avx2): what the app's form
    reads. Never cpuid: that goes through the native kernels, which may compile them (seconds
    on the GUI thread, even in a process that has torch loaded, as a test process does)."""
    return as_forced(cpuinfo_flags(), forced_simd()) & frozenset(BF16_UNITS)


@functools.lru_cache(maxsize=1)
def cpu_bf16_features() -> frozenset[str]:
    """The BF16_UNITS this machine has, from /proc/cpuinfo, and in a process that has torch
    loaded (a job) also from cpuid (engine.kernels.cpu; amx_bf16 has no cpuid bit there) and
    torch's own CPU checks (what its kernels use); none under FORGEBENCH_SIMD=avx2, which
    computes as an AVX2-only CPU would. The app's form reads the flags alone
    (`listed_bf16_features`)."""
    found = set(cpuinfo_flags())
    torch = sys.modules.get("torch")
    if torch is not None:
        from engine.kernels.cpu import detected

        found |= detected()[0]
    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        found.add("avx512_bf16")
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        found.add("amx_bf16")        # every CPU with AMX tiles so far has AMX-BF16
    return as_forced(frozenset(found), forced_simd()) & frozenset(BF16_UNITS)


def measured_bf16_speedup() -> float:
    """This machine's bf16 matmul peak over its f32 one, one thread (measured once, cached)."""
    from engine.train.metrics import peak_matmul_flops

    return peak_matmul_flops("bf16", 1) / peak_matmul_flops("f32", 1)


def cached_bf16_speedup() -> float | None:
    """The same ratio where both peaks were measured before (a run chose "auto" here), else
    None: never measures, never imports torch (the app's form reads it on the GUI thread)."""
    from engine.train.metrics import cached_peak_matmul_flops

    bf16, f32 = cached_peak_matmul_flops("bf16", 1), cached_peak_matmul_flops("f32", 1)
    return bf16 / f32 if bf16 and f32 else None


def resolve_precision(requested: str) -> PrecisionChoice:
    """`choose_precision` on this machine: for "auto" on a CPU with bf16 units, after
    measuring (or reading) how much faster its bf16 matmul is."""
    units = cpu_bf16_features()
    speedup = measured_bf16_speedup() if requested == "auto" and units else None
    choice = choose_precision(requested, units, speedup)
    if forced := forced_simd():
        choice = replace(choice, reason=f"{choice.reason} (FORGEBENCH_SIMD={forced}: computed "
                                        "as on a CPU without AVX-512)")
    return choice


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
