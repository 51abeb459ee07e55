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

The image and audio recipes (engine.train.loop) settle "auto" by their own step, not by the
generic peaks: on an AMX Xeon their bf16 runs measured 0.27-0.82x their f32 speed (issue 53)
although the bf16 matmul peak is several times the f32 one. A fresh run times one training
step (forward, backward, optimizer) of its first batch in both precisions
(`measure_step_precision`: two untimed steps each, then at least four interleaved pairs, more
within about two seconds, in this process's CPU time, which other processes' load does not
stretch as it does wall time), keeps bf16 only if its median step over the later half of the
pairs, at least the last three (a fresh process's first steps are still warming up; a median of
two is their mean, one lucky step moves it), is at least STEP_MIN_SPEEDUP times
faster (`choose_from_step_times`), and rewrites its run.json `precision` entry with the step
times and why. The trial runs inside `untouched` (parameters, buffers, gradients, optimizer
state and torch's RNG restored bit for bit, the data generator a copy), so the run's floats
are those of a run fixed to the chosen precision. `pinned_auto` makes the recipes'
autocast("auto") compute as recorded.

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
# How a bf16 run computes, as its run.json reason says it: most recipes under torch's autocast;
# nanochat's GPT as nanochat itself does in bf16 (engine/models/nanochat.py), whose embedding
# tables are stored in bf16, so "f32 master weights" would not be true of it.
AUTOCAST_SCHEME = "bf16 autocast, f32 master weights and loss"
NANOCHAT_SCHEME = ("nanochat's bf16: embedding tables and activations in bf16, f32 matrix "
                   "weights and logits")


def bf16_scheme(config) -> str:
    """How `config`'s run computes when it runs in bf16 (one of the schemes above)."""
    model = getattr(config, "model", None)
    return NANOCHAT_SCHEME if getattr(model, "family", None) == "nanochat" else AUTOCAST_SCHEME


@dataclass(frozen=True)
class PrecisionChoice:
    """What a run computes in: `precision` "f32" or "bf16", asked as `requested`, and why."""

    precision: str
    requested: str
    reason: str
    # "auto" settled by the run's own step: its times in both precisions (seconds)
    step: dict | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "step" or v is not None}


def choose_precision(requested: str, features: frozenset[str],
                     speedup: float | None = None,
                     scheme: str = AUTOCAST_SCHEME) -> PrecisionChoice:
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
                               f"auto: {has} ({scheme})")
    measured = f"its bf16 matmul measured {speedup:.2f}x f32"
    if speedup < BF16_MIN_SPEEDUP:
        return PrecisionChoice("f32", requested, f"auto: {has}, but {measured}, under the "
                                                 f"{BF16_MIN_SPEEDUP}x that pays for the casts")
    return PrecisionChoice("bf16", requested, f"auto: {has} and {measured} ({scheme})")


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


def resolve_precision(requested: str, scheme: str = AUTOCAST_SCHEME) -> PrecisionChoice:
    """`choose_precision` on this machine: for "auto" on a CPU with bf16 units, after
    measuring (or reading) how much faster its bf16 matmul is."""
    units = cpu_bf16_features()
    speedup = measured_bf16_speedup() if requested == "auto" and units else None
    choice = choose_precision(requested, units, speedup, scheme)
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
        precision = _pinned_auto or resolve_precision(precision).precision
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


# -- "auto" decided by the recipe's own step (the image and audio recipes) ---------------------
# a bf16 training step must take at most 1/STEP_MIN_SPEEDUP of the f32 one: a smaller gain
# is within the noise of a few timed steps on a shared machine, and keeping f32 then costs
# under 5% (the bound on "auto" against the best fixed precision)
STEP_MIN_SPEEDUP = 1.05
# the trial: STEP_WARMUP untimed steps per precision, then interleaved pairs: at least
# STEP_MIN_ROUNDS (one pair let a load spike on either side decide: at load 8-9 on 2 cores a
# 0.4 s step took 2-3.4 s of wall time and "auto" picked the slower precision), at most
# STEP_ROUNDS, stopping once the timed part passes STEP_BUDGET_S of CPU time. A fresh process's
# steps keep getting faster for a few steps past the first (image-segment's, in CPU time:
# f32 1550, 426, 234 ms, bf16 1304, 1291, 234 ms; image-generate's bf16 1774, 1939, 933 ms,
# which read 0.95x f32 on the first pairs and 1.55x over the run), so only the later half of
# the pairs judges (`step_from_times`), but never fewer than the last STEP_JUDGED: a slow step
# gets only STEP_MIN_ROUNDS pairs, whose later half is two steps, whose median is their mean,
# so one lucky step decided (audio-generate on a Zen 4 at load 16, CPU ms: bf16 694, 720, 728,
# 500 against f32 668, 679, 638, 657 read bf16 1.06x faster and chose it, where fresh runs
# fixed to each took bf16 722 against f32 684 CPU ms/step: bf16 was 0.95x)
STEP_WARMUP = 2
STEP_MIN_ROUNDS = 4
STEP_ROUNDS = 8
STEP_BUDGET_S = 2.0
STEP_JUDGED = 3
# what the trial's answers are keyed by in the cache: answers timed by an older trial (wall
# time, one pair; a later half of two steps) are not read back
STEP_TRIAL_VERSION = "step-cpu4-last3"
_pinned_auto: str | None = None


def choose_from_step_times(requested: str, features: frozenset[str], f32_s: float | None,
                           bf16_s: float | None) -> PrecisionChoice:
    """`choose_precision` where "auto" is settled by the run's own step, timed in both
    precisions (seconds of one training step, f32 and bf16; None: not measured, the
    matmul-peak rule stands): bf16 only where this CPU has bf16 units and its step is at least
    STEP_MIN_SPEEDUP times faster. The figures go into the choice (and run.json)."""
    if requested != "auto" or f32_s is None or bf16_s is None \
            or not set(BF16_UNITS) & set(features):
        return choose_precision(requested, features)
    units = " and ".join(unit for unit in BF16_UNITS if unit in features)
    speedup = f32_s / bf16_s
    measured = (f"the recipe's own step (step on its first batch, median CPU time) took "
                f"{bf16_s * 1e3:.1f} ms in bf16 against {f32_s * 1e3:.1f} ms in f32 "
                f"({speedup:.2f}x)")
    step = {"f32_s": f32_s, "bf16_s": bf16_s, "bf16_speedup": round(speedup, 4),
            "min_speedup": STEP_MIN_SPEEDUP}
    if speedup < STEP_MIN_SPEEDUP:
        return PrecisionChoice("f32", requested, f"auto: this CPU has {units}, but {measured}, "
                                                 f"under the {STEP_MIN_SPEEDUP}x bf16 needs",
                               step)
    return PrecisionChoice("bf16", requested, f"auto: this CPU has {units} and {measured} "
                                              f"({AUTOCAST_SCHEME})",
                           step)


@contextlib.contextmanager
def pinned_auto(precision: str):
    """Within it, `autocast("auto")` computes in `precision` ("f32" or "bf16"): the choice
    recorded for the run, so a recipe that hands its config's "auto" to autocast computes as
    run.json says (and a trial step in the precision being timed)."""
    global _pinned_auto
    if precision not in ("f32", "bf16"):
        raise ValueError(f"pin 'f32' or 'bf16', not {precision!r}")
    before, _pinned_auto = _pinned_auto, precision
    try:
        yield
    finally:
        _pinned_auto = before


@contextlib.contextmanager
def untouched(module, optimizer=None):
    """Whatever trial training steps of `module` change, put back bit for bit when the block
    ends: parameters and buffers (BatchNorm's running statistics and counters), the gradients,
    the optimizer's state (moments, step counts, learning rates) and torch's global random
    state (dropout). The data generator is the trial's own copy."""
    import copy

    import torch

    saved = {name: value.detach().clone() for name, value in module.state_dict().items()}
    grads = [(p, None if p.grad is None else p.grad.detach().clone())
             for p in module.parameters()]
    rng = torch.get_rng_state()
    optimizer_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in module.state_dict().items():
                value.copy_(saved[name])
        for p, grad in grads:
            p.grad = grad
        torch.set_rng_state(rng)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)


def time_step_precisions(trial, rounds: int = STEP_ROUNDS, budget_s: float = STEP_BUDGET_S,
                         min_rounds: int = STEP_MIN_ROUNDS,
                         clock=None) -> dict[str, list[float]]:
    """Seconds of `trial(precision)` in "f32" and "bf16" by `clock` (default: this process's
    CPU time, all its threads; other processes' load on a shared machine stretches wall time,
    not this): STEP_WARMUP untimed calls each (warm-up: allocations, oneDNN's kernel choice), then
    interleaved pairs in alternating order (so a change in the machine's load falls on both),
    each timed call right after an untimed one of its own precision (a step right after one in
    the other precision is slower than a run of one precision ever sees: image-classify's bf16
    step read 0.30x f32 alternating, 3.5x over runs fixed to each, on a Sapphire Rapids),
    at least `min_rounds` and at most `rounds`, stopping once the timed calls pass
    `budget_s`."""
    import time

    clock = clock or time.process_time
    for precision in ("f32", "bf16") * STEP_WARMUP:
        trial(precision)
    times: dict[str, list[float]] = {"f32": [], "bf16": []}
    spent = 0.0
    for i in range(rounds):
        for precision in (("f32", "bf16") if i % 2 == 0 else ("bf16", "f32")):
            trial(precision)        # untimed: the timed step follows one of its own precision
            start = clock()
            trial(precision)
            took = clock() - start
            times[precision].append(took)
            spent += took
        if spent > budget_s and i + 1 >= min_rounds:
            break
    return times


def step_from_times(times: list[float]) -> float:
    """The step time a precision is judged by: the median of the later half of its timed steps
    (the earlier ones are still warming up; the minimum let one lucky step decide), and of at
    least the last STEP_JUDGED (the median of two is their mean, which one lucky step moves)."""
    import statistics

    return statistics.median(times[max(min(len(times) // 2, len(times) - STEP_JUDGED), 0):])


def step_cache_key(recipe: str, module, batch_size: int, threads: int) -> str:
    """What a step trial's answer holds for: this machine, torch and thread count (the matmul
    peaks' key), the recipe, its model's parameter shapes and the batch size."""
    import hashlib
    import json

    from engine.train.metrics import _peak_cache_key

    shapes = [(name, list(p.shape)) for name, p in module.named_parameters()]
    digest = hashlib.sha256(json.dumps([recipe, shapes, batch_size]).encode()).hexdigest()
    return f"{_peak_cache_key(STEP_TRIAL_VERSION, threads)}|{digest[:16]}"


def _step_cache_path() -> Path:
    from engine.fsutil import cache_dir

    return cache_dir() / "step-precision.json"


def _cached_steps() -> dict:
    import json

    try:
        cached = json.loads(_step_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def measure_step_precision(run, requested: str | None, module, trial, optimizer=None,
                           key: str | None = None) -> PrecisionChoice | None:
    """Settle a fresh run's "auto" by its own step and record it in run.json's `precision`
    entry (with the step times and why), where the request is "auto" and this CPU has bf16
    units; `trial(precision)` runs one training step (forward, backward, `optimizer` step) of
    the first batch in that precision, inside `untouched(module, optimizer)`, so the run's
    floats stay those of a run fixed to the chosen precision. None (nothing measured, nothing
    written) for another request, a CPU without bf16 units (the entry already says why f32),
    or an entry already measured. A resumed run never calls this: it reads the entry back."""
    from engine.fsutil import atomic_write_json

    if requested != "auto":
        return None
    manifest = run.manifest()
    entry = manifest.get("precision") or {}
    units = cpu_bf16_features()
    if not units or "step" in entry:
        return None
    import time

    cached = _cached_steps().get(key) if key else None
    if isinstance(cached, dict) and cached.get("step"):
        # the same model, batch and threads were timed here before: the same answer, so two
        # runs of one config on one machine compute alike (as the matmul-peak rule did)
        choice = PrecisionChoice(cached["precision"], requested, cached["reason"] + " (timed "
                                 "before on this machine for this model, batch and threads)",
                                 cached["step"])
        run.amend_manifest({"precision": choice.as_dict()})
        return choice
    start = time.perf_counter()
    with untouched(module, optimizer):
        times = time_step_precisions(trial)
    choice = choose_from_step_times(requested, units, step_from_times(times["f32"]),
                                    step_from_times(times["bf16"]))
    choice = replace(choice, step={**choice.step, "f32_runs_s": times["f32"],
                                   "bf16_runs_s": times["bf16"],
                                   "trial_s": round(time.perf_counter() - start, 4)})
    run.amend_manifest({"precision": choice.as_dict()})
    if key:
        with contextlib.suppress(OSError):      # read-only cache: the next run times again
            atomic_write_json(_step_cache_path(), {**_cached_steps(), key: choice.as_dict()})
    return choice
