"""Training throughput and model FLOPs utilisation of the image and audio recipes: precision
"auto" against both fixed precisions, fp32 and bf16 autocast, each run in its own fresh process.

Every (recipe, precision) run is a child process of this bench (`--child`): runs of one
process that computed the same thing differed 2-12x in CPU ms/step from each other (the
allocator's and oneDNN's state, thread pools and caches left by the runs before), so a run never
follows another in the same process. The three precisions of a recipe go round `--rounds` times
in rotating order (auto, fp32, bf16; then fp32, bf16, auto; ...), so a change in the machine's
load falls on all three. Each row is the median over the rounds with its spread (lowest and
highest run); the load average is read before and after each recipe.

"auto" settles itself on each run's own first batch (engine.train.precision,
measure_step_precision). Each auto child times its trial afresh (a step cache of its own,
empty): a machine's cache would answer every round after the first with the first round's
choice, hiding how often the trial lands on each side. Its rows say what it chose in each round,
the step times it chose by and what the trial cost at run start; auto's speed is set against the
best fixed precision's in CPU time (the child's, all threads: other processes' load on a
shared machine stretches wall time far more than this) and in wall time. CPU time is not immune
either: with two threads a thread that waits for its descheduled partner spins (GOMP_SPINCOUNT,
engine/__init__.py) on the clock, so on 2 cores at load 5-6 one image-classify bf16 run read
23.8 ms/step where its two repeats read 57-60; hence the rounds, the medians and the spread.

Each child runs its recipe's real training loop (its default config from resources/configs,
data augmentation included) for `--steps` steps on data generated once by the parent and
reports optimizer steps/s and examples/s between the step after WARMUP_STEPS and the last
(setup, final eval and checkpoint excluded), its CPU ms/step over the same steps, the MFU its
metrics rows report (FLOPs counted on the first step over the cached matmul peak,
engine.train.metrics), and with `--profile` the biggest costs of three profiled steps (steps 4
to 6) by kind of op.

The header names the CPU's instruction sets (cpuid), the bf16 units "auto" sees, torch's kernel
capability and the library caps in force: under FORGEBENCH_SIMD=avx2 every child computes as an
AVX2-only CPU would (engine/kernels/cpu.py, engine/__init__.py: ATen, MKL and oneDNN capped at
AVX2, "auto" seeing no bf16 units).

    [FORGEBENCH_SIMD=avx2] python bench/bench_vision.py [--steps 30] [--rounds 3] [--threads N]
        [--profile] [--recipes image-classify,...] [--precisions auto,fp32,bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# steps left out of the rates: a fresh run's first steps are several times slower (allocations,
# oneDNN's kernels), and "auto" ran its trial steps before them, so with them in an 8-step
# run auto=f32 read 12x fixed f32
WARMUP_STEPS = 3
PROFILED = (3, 6)     # profile the steps after the 3rd step_done up to the 6th
PRECISIONS = ("auto", "fp32", "bf16")
RECIPES = ["image-classify", "image-detect", "image-segment", "image-generate", "audio-generate"]
BENCH = "BENCH "      # prefix of the line a child reports its figures on
LIBRARY_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


# -- a child: one run of one recipe in one precision ----------------------------------------
def measure(recipe: str, precision: str, data: Path, root: Path, steps: int,
            threads: int, with_profile: bool) -> dict:
    import contextlib

    import tomllib
    from torch.profiler import ProfilerActivity, profile, schedule

    from bench.costs import print_costs
    from engine import jobs
    from engine.config import validate_config

    raw = tomllib.loads((REPO / "resources" / "configs" / f"{recipe}.toml").read_text())
    raw.update(steps=steps, eval_every=0, save_every=0, log_every=1, precision=precision)
    raw["data"] = {"dir": str(data)}
    if "sample" in raw:
        raw["sample"]["grid_every_checkpoint"] = False
    config = validate_config(raw)
    run = jobs.start_run(config, root / "run", ["bench"], threads=threads)
    prof = profile(activities=[ProfilerActivity.CPU],
                   schedule=schedule(wait=PROFILED[0] - 1, warmup=1,
                                     active=PROFILED[1] - PROFILED[0], repeat=1)) \
        if with_profile else None
    cpu_at_step: list[float] = []          # this process's CPU time (all threads) at each step
    step_done = jobs.Job.step_done

    def step_done_and_clock(self, step, **fields):
        step_done(self, step, **fields)
        cpu_at_step.append(time.process_time())
        if prof is not None:
            prof.step()

    jobs.Job.step_done = step_done_and_clock
    try:
        with prof if prof is not None else contextlib.nullcontext():
            jobs.execute(run, config, None, threads=threads, progress=False)
    finally:
        jobs.Job.step_done = step_done
    result = {**rates(run, config), "choice": run.manifest()["precision"],
              "cpu_s_step": (cpu_at_step[-1] - cpu_at_step[WARMUP_STEPS])
              / (len(cpu_at_step) - 1 - WARMUP_STEPS)}
    if prof is not None:
        train = [m for m in run.metrics() if m.get("split") == "train"]
        profiled = train[PROFILED[1] - 1]["elapsed_s"] - train[PROFILED[0] - 1]["elapsed_s"]
        print(f"{recipe} {precision}, three profiled steps:")
        print_costs(prof, profiled)
    return result


def rates(run, config) -> dict:
    """Steps/s and examples/s between the step after the warm-up and the last, FLOPs and MFU."""
    train = [m for m in run.metrics() if m.get("split") == "train"][WARMUP_STEPS:]
    seconds = train[-1]["elapsed_s"] - train[0]["elapsed_s"]
    return {"steps_s": (len(train) - 1) / seconds,
            "examples_s": (len(train) - 1) * config.batch_size / seconds,
            "flops": train[0]["flops"], "mfu": statistics.median(m["mfu"] for m in train[1:])}


def child(args) -> None:
    """One run in this fresh process; its figures on one BENCH line of stdout."""
    from engine.train import precision as precision_module

    root = Path(args.root)
    # a step cache of this run's own: auto times its trial afresh in every round
    precision_module._step_cache_path = lambda: root / "step-precision.json"
    result = measure(args.recipe, args.precision, Path(args.data), root, args.steps,
                     args.threads, args.profile)
    print(BENCH + json.dumps(result), flush=True)


# -- the parent: data, rounds of children, the table ------------------------------------------
def run_child(args, recipe: str, precision: str, data: Path, work: Path) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"{recipe}-{precision}-", dir=work))
    argv = [sys.executable, __file__, "--child", "--recipe", recipe, "--precision", precision,
            "--data", str(data), "--root", str(root), "--steps", str(args.steps),
            "--threads", str(args.threads)] + (["--profile"] if args.profile else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith(BENCH)]
    if done.returncode != 0 or not lines:
        sys.exit(f"{recipe} {precision}: the child failed (exit {done.returncode}):\n"
                 f"{done.stderr[-3000:]}")
    for line in done.stdout.splitlines():
        if not line.startswith(BENCH):
            print(line)                     # the profile, when asked for
    return json.loads(lines[-1][len(BENCH):])


def spread(values: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    """Median and lowest-highest of a figure over the rounds."""
    return (f"{statistics.median(values) * scale:{fmt}} "
            f"[{min(values) * scale:{fmt}}-{max(values) * scale:{fmt}}]")


def auto_note(choice: dict) -> str:
    """What "auto" chose, by which step times, and what the trial cost at run start."""
    step = choice.get("step")
    if not step:
        return f"auto -> {choice['precision']} (no step trial: {choice['reason']})"
    return (f"auto -> {choice['precision']}: step {step['f32_s'] * 1e3:.1f} ms f32, "
            f"{step['bf16_s'] * 1e3:.1f} ms bf16 ({step['bf16_speedup']:.2f}x), "
            f"trial {step['trial_s']:.2f} s")


def print_recipe(recipe: str, results: dict[str, list[dict]], load: str) -> dict | None:
    """A recipe's medians (and spread over the rounds) per precision, and auto against the best
    fixed precision in CPU and wall time; returns auto/best in both (None without auto or a
    fixed precision)."""
    for precision, rs in results.items():
        m = {k: statistics.median(r[k] for r in rs) for k in ("examples_s", "flops", "mfu")}
        print(f"{recipe:15} {precision:5} {spread([r['cpu_s_step'] for r in rs], 1e3):>22} "
              f"{spread([r['steps_s'] for r in rs], fmt='.2f'):>19} {m['examples_s']:8.1f} "
              f"{m['flops'] / 1e9:7.3f} {m['mfu']:6.1%} {load:>9}", flush=True)
    cpu = {p: statistics.median(r["cpu_s_step"] for r in rs) for p, rs in results.items()}
    wall = {p: statistics.median(r["steps_s"] for r in rs) for p, rs in results.items()}
    fixed = [p for p in ("fp32", "bf16") if p in results]
    if "auto" not in results or not fixed:
        return None
    best_cpu = min(fixed, key=cpu.get)
    best_wall = max(fixed, key=wall.get)
    ratio = {"cpu": cpu[best_cpu] / cpu["auto"], "wall": wall["auto"] / wall[best_wall]}
    picks = [r["choice"]["precision"] for r in results["auto"]]
    both = (f"; bf16 / fp32: CPU {cpu['fp32'] / cpu['bf16']:.2f}x, wall "
            f"{wall['bf16'] / wall['fp32']:.2f}x") if len(fixed) == 2 else " (alone measured)"
    print(f"{'':15} auto / best fixed: CPU time {ratio['cpu']:.2f}x ({best_cpu}), wall "
          f"{ratio['wall']:.2f}x ({best_wall}){both}; auto chose "
          + ", ".join(f"{p} {picks.count(p)}/{len(picks)}" for p in ("f32", "bf16")
                      if picks.count(p)))
    for r in results["auto"]:
        print(f"{'':15} {auto_note(r['choice'])}")
    return ratio


def cpu_line() -> str:
    """The CPU's instruction sets (cpuid), the bf16 units auto sees, torch's kernel capability
    and the library caps in force."""
    import torch

    from engine.kernels.cpu import detected
    from engine.train.precision import cpu_bf16_features

    simd = ", ".join(sorted(f for f in detected()[0] if f.startswith(("avx", "amx"))))
    units = ", ".join(sorted(cpu_bf16_features())) or "none"
    caps = ", ".join(f"{k}={os.environ[k]}" for k in LIBRARY_CAPS if k in os.environ) or "none"
    return (f"CPU {simd}; bf16 units seen by auto: {units}; torch {torch.__version__} kernels "
            f"{torch.backends.cpu.get_cpu_capability()}; library caps: {caps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each of auto, fp32, bf16 runs per recipe, interleaved")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help="which of auto, fp32, bf16 run (auto / best needs auto and one more)")
    parser.add_argument("--profile", action="store_true",
                        help="print the biggest costs of three profiled steps of each run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--recipe", "--precision", "--data", "--root"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import engine  # noqa: F401  (sets the library caps of FORGEBENCH_SIMD before torch loads)
    from engine.data.generators.sfx import generate_sfx
    from engine.data.generators.shapes import generate_shapes

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shapes = generate_shapes(work / "shapes", n=200)
        sfx = generate_sfx(work / "sfx", n_per_class=20)
        print(f"{args.threads} thread(s), {args.steps} steps (rates over the last "
              f"{args.steps - 1 - WARMUP_STEPS}), {args.rounds} round(s), one fresh process per "
              f"run, medians [lowest-highest]; {cpu_line()}")
        print(f"{'recipe':15} {'prec':5} {'CPU ms/step':>22} {'steps/s (wall)':>19} "
              f"{'ex/s':>8} {'GFLOP':>7} {'MFU':>6} {'load':>9}")
        ratios = {}
        chosen = [p for p in PRECISIONS if p in args.precisions.split(",")]
        for recipe in args.recipes.split(","):
            data = sfx if recipe.startswith("audio") else shapes
            results: dict[str, list[dict]] = {p: [] for p in chosen}
            load_before = os.getloadavg()[0]
            for i in range(args.rounds):
                for precision in chosen[i % len(chosen):] + chosen[:i % len(chosen)]:
                    results[precision].append(run_child(args, recipe, precision, data, work))
            ratio = print_recipe(recipe, results, f"{load_before:.1f}-{os.getloadavg()[0]:.1f}")
            if ratio:
                ratios[recipe] = ratio
        if not ratios:
            return
        worst = min(ratios, key=lambda r: ratios[r]["cpu"])
        print(f"worst auto / best fixed in CPU time: {ratios[worst]['cpu']:.2f}x ({worst})")


if __name__ == "__main__":
    main()
