"""Training throughput and model FLOPs utilisation of the image and audio recipes: precision
"auto" against both fixed precisions, fp32 and bf16 autocast, run interleaved.

"auto" settles itself on each run's own first batch (engine.train.precision,
measure_step_precision); its rows say what it chose, the step times it chose by, what the trial
cost at run start, and its speed over the best fixed precision's. The three runs of a recipe go
round `--rounds` times in rotating order, so a change in the machine's load falls on all three;
each figure is the median over the rounds, with the load average before and after.

Runs each recipe's real training loop (its default config from resources/configs, data
augmentation included) for a few steps on freshly generated data and prints optimizer
steps/s and examples/s measured between the first and the last step (setup, final eval and
checkpoint excluded), the MFU its metrics rows report (FLOPs counted on the first step over
the cached matmul peak, engine.train.metrics), and the biggest remaining costs of three
profiled steps (steps 4 to 6) by kind of op (with `--profile`).

    python bench/bench_vision.py [--steps 30] [--rounds 3] [--threads N] [--profile]
                                 [--recipes image-classify,...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tomllib
from torch.profiler import ProfilerActivity, profile, schedule

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.costs import print_costs  # noqa: E402
from engine import jobs  # noqa: E402
from engine.config import validate_config  # noqa: E402

# steps left out of the rates: a fresh run's first steps are several times slower (allocations,
# oneDNN's kernels), and "auto" ran its trial steps before them, so with them in an 8-step
# run auto=f32 read 12x fixed f32
WARMUP_STEPS = 3
PROFILED = (3, 6)     # profile the steps after the 3rd step_done up to the 6th

RECIPES = ["image-classify", "image-detect", "image-segment", "image-generate", "audio-generate"]


def measure(recipe: str, precision: str, data: Path, root: Path, steps: int,
            threads: int, with_profile: bool, tag: str) -> dict:
    raw = tomllib.loads((REPO / "resources" / "configs" / f"{recipe}.toml").read_text())
    raw.update(steps=steps, eval_every=0, save_every=0, log_every=1, precision=precision)
    raw["data"] = {"dir": str(data)}
    if "sample" in raw:
        raw["sample"]["grid_every_checkpoint"] = False
    config = validate_config(raw)
    run = jobs.start_run(config, root / f"{recipe}-{precision}-{tag}", ["bench"],
                         threads=threads)
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
    if prof is None:
        return result
    train = [m for m in run.metrics() if m.get("split") == "train"]
    profiled = train[PROFILED[1] - 1]["elapsed_s"] - train[PROFILED[0] - 1]["elapsed_s"]
    return {**result, "prof": prof, "profiled_s": profiled}


def rates(run, config) -> dict:
    """Steps/s and examples/s between the step after the warm-up and the last, FLOPs and MFU."""
    train = [m for m in run.metrics() if m.get("split") == "train"][WARMUP_STEPS:]
    seconds = train[-1]["elapsed_s"] - train[0]["elapsed_s"]
    return {"steps_s": (len(train) - 1) / seconds,
            "examples_s": (len(train) - 1) * config.batch_size / seconds,
            "flops": train[0]["flops"], "mfu": statistics.median(m["mfu"] for m in train[1:])}


def auto_note(choice: dict) -> str:
    """What "auto" chose, by which step times, and what the trial cost at run start."""
    step = choice.get("step")
    if not step:
        return f"auto -> {choice['precision']} (no step trial: {choice['reason']})"
    return (f"auto -> {choice['precision']}: step {step['f32_s'] * 1e3:.1f} ms f32, "
            f"{step['bf16_s'] * 1e3:.1f} ms bf16 ({step['bf16_speedup']:.2f}x), "
            f"trial {step['trial_s']:.2f} s"
            + (" (read back: timed before here)" if "timed before" in choice["reason"] else ""))


def print_recipe(recipe: str, results: dict[str, list[dict]], load: str) -> None:
    """A recipe's medians per precision, and auto against the best fixed one in wall and CPU
    time (the CPU time of the process, all threads: steadier on a shared machine)."""
    keys = ("steps_s", "examples_s", "cpu_s_step", "flops", "mfu")
    median = {p: {k: statistics.median(r[k] for r in rs) for k in keys}
              for p, rs in results.items()}
    for precision, m in median.items():
        print(f"{recipe:16} {precision:9} {m['steps_s']:8.2f} {m['examples_s']:11.1f} "
              f"{m['cpu_s_step'] * 1e3:12.1f} {m['flops'] / 1e9:11.3f} {m['mfu']:6.1%} "
              f"{load:>10}", flush=True)
    best = max(("fp32", "bf16"), key=lambda p: median[p]["steps_s"])
    print(f"{'':16} wall: auto / best fixed ({best}): "
          f"{median['auto']['steps_s'] / median[best]['steps_s']:.2f}x; "
          f"bf16 / fp32: {median['bf16']['steps_s'] / median['fp32']['steps_s']:.2f}x")
    best = min(("fp32", "bf16"), key=lambda p: median[p]["cpu_s_step"])
    print(f"{'':16} CPU time: auto / best fixed ({best}): "
          f"{median[best]['cpu_s_step'] / median['auto']['cpu_s_step']:.2f}x; bf16 / fp32: "
          f"{median['fp32']['cpu_s_step'] / median['bf16']['cpu_s_step']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each of auto, fp32, bf16 runs per recipe, interleaved")
    parser.add_argument("--profile", action="store_true",
                        help="print the biggest costs of three profiled steps of each run")
    args = parser.parse_args()
    from engine.data.generators.sfx import generate_sfx
    from engine.data.generators.shapes import generate_shapes
    from engine.kernels.cpu import detected
    from engine.train.precision import cpu_bf16_features

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shapes = generate_shapes(root / "shapes", n=200)
        sfx = generate_sfx(root / "sfx", n_per_class=20)
        units = ", ".join(sorted(cpu_bf16_features())) or "none"
        simd = ", ".join(sorted(f for f in detected()[0] if f.startswith(("avx", "amx"))))
        print(f"{args.threads} thread(s), {args.steps} steps, {args.rounds} interleaved "
              f"round(s), medians; CPU {simd}; bf16 units: {units}")
        print(f"{'recipe':16} {'precision':9} {'steps/s':>8} {'examples/s':>11} "
              f"{'CPU ms/step':>12} {'GFLOP/step':>11} {'MFU':>6} {'load':>10}")
        for recipe in args.recipes.split(","):
            data = sfx if recipe.startswith("audio") else shapes
            order = ["auto", "fp32", "bf16"]
            results: dict[str, list[dict]] = {p: [] for p in order}
            load_before = os.getloadavg()[0]
            for i in range(args.rounds):
                for precision in order[i % 3:] + order[:i % 3]:
                    r = measure(recipe, precision, data, root, args.steps, args.threads,
                                args.profile, str(i))
                    results[precision].append(r)
                    if args.profile:
                        print(f"{recipe} {precision} round {i + 1}:")
                        print_costs(r["prof"], r["profiled_s"])
            print_recipe(recipe, results, f"{load_before:.1f}-{os.getloadavg()[0]:.1f}")
            for r in results["auto"]:
                print(f"{'':16} {auto_note(r['choice'])}")


if __name__ == "__main__":
    main()
