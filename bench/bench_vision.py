"""Training throughput and model FLOPs utilisation of the image and audio recipes, fp32 vs
bf16 autocast ("auto" marked).

Runs each recipe's real training loop (its default config from resources/configs, data
augmentation included) for a few steps on freshly generated data and prints optimizer
steps/s and examples/s measured between the first and the last step (setup, final eval and
checkpoint excluded), the MFU its metrics rows report (FLOPs counted on the first step over
the cached matmul peak, engine.train.metrics), and the biggest remaining costs of three
profiled steps (steps 4 to 6) by kind of op.

    python bench/bench_vision.py [--steps 30] [--threads N] [--recipes image-classify,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import tomllib
from torch.profiler import ProfilerActivity, profile, schedule

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.costs import print_costs  # noqa: E402
from engine import jobs  # noqa: E402
from engine.config import validate_config  # noqa: E402
from engine.train.precision import resolve_precision  # noqa: E402

PROFILED = (3, 6)     # profile the steps after the 3rd step_done up to the 6th

RECIPES = ["image-classify", "image-detect", "image-segment", "image-generate", "audio-generate"]


def measure(recipe: str, precision: str, data: Path, root: Path, steps: int,
            threads: int) -> dict:
    raw = tomllib.loads((REPO / "resources" / "configs" / f"{recipe}.toml").read_text())
    raw.update(steps=steps, eval_every=0, save_every=0, log_every=1, precision=precision)
    raw["data"] = {"dir": str(data)}
    if "sample" in raw:
        raw["sample"]["grid_every_checkpoint"] = False
    config = validate_config(raw)
    run = jobs.start_run(config, root / f"{recipe}-{precision}", ["bench"], threads=threads)
    prof = profile(activities=[ProfilerActivity.CPU],
                   schedule=schedule(wait=PROFILED[0] - 1, warmup=1,
                                     active=PROFILED[1] - PROFILED[0], repeat=1))
    step_done = jobs.Job.step_done

    def step_done_and_profile(self, step, **fields):
        step_done(self, step, **fields)
        prof.step()

    jobs.Job.step_done = step_done_and_profile
    try:
        with prof:
            jobs.execute(run, config, None, threads=threads, progress=False)
    finally:
        jobs.Job.step_done = step_done
    train = [m for m in run.metrics() if m.get("split") == "train"]
    seconds = train[-1]["elapsed_s"] - train[0]["elapsed_s"]
    profiled = train[PROFILED[1] - 1]["elapsed_s"] - train[PROFILED[0] - 1]["elapsed_s"]
    return {"steps_s": (len(train) - 1) / seconds,
            "examples_s": (len(train) - 1) * config.batch_size / seconds,
            "flops": train[0]["flops"], "mfu": statistics.median(m["mfu"] for m in train[1:]),
            "prof": prof, "profiled_s": profiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    auto = resolve_precision("auto").precision
    auto = "fp32" if auto == "f32" else auto
    from engine.data.generators.sfx import generate_sfx
    from engine.data.generators.shapes import generate_shapes

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shapes = generate_shapes(root / "shapes", n=200)
        sfx = generate_sfx(root / "sfx", n_per_class=20)
        print(f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}; "
              f"precision auto: {auto}")
        print(f"{'recipe':16} {'precision':9} {'steps/s':>8} {'examples/s':>11} "
              f"{'GFLOP/step':>11} {'MFU':>6}")
        for recipe in args.recipes.split(","):
            data = sfx if recipe.startswith("audio") else shapes
            for precision in ("fp32", "bf16"):
                r = measure(recipe, precision, data, root, args.steps, args.threads)
                mark = "  <- auto" if precision == auto else ""
                print(f"{recipe:16} {precision:9} {r['steps_s']:8.2f} {r['examples_s']:11.1f} "
                      f"{r['flops'] / 1e9:11.3f} {r['mfu']:6.1%}{mark}", flush=True)
                print_costs(r["prof"], r["profiled_s"])


if __name__ == "__main__":
    main()
