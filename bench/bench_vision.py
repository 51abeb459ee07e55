"""Training throughput of the image and audio recipes, fp32 vs bf16 autocast.

Runs each recipe's real training loop (its default config from resources/configs, data
augmentation included) for a few steps on freshly generated data and prints optimizer
steps/s and examples/s measured between the first and the last step (setup, final eval and
checkpoint excluded).

    python bench/bench_vision.py [--steps 30] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.config import validate_config  # noqa: E402
from engine.jobs import execute, start_run  # noqa: E402

RECIPES = ["image-classify", "image-detect", "image-segment", "image-generate", "audio-generate"]


def measure(recipe: str, precision: str, data: Path, root: Path, steps: int,
            threads: int) -> tuple[float, float]:
    raw = tomllib.loads((REPO / "resources" / "configs" / f"{recipe}.toml").read_text())
    raw.update(steps=steps, eval_every=0, save_every=0, log_every=1, precision=precision)
    raw["data"] = {"dir": str(data)}
    if "sample" in raw:
        raw["sample"]["grid_every_checkpoint"] = False
    config = validate_config(raw)
    run = start_run(config, root / f"{recipe}-{precision}", ["bench"], threads=threads)
    execute(run, config, None, threads=threads, progress=False)
    train = [m for m in run.metrics() if m.get("split") == "train"]
    seconds = train[-1]["elapsed_s"] - train[0]["elapsed_s"]
    return (len(train) - 1) / seconds, (len(train) - 1) * config.batch_size / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from engine.data.generators.sfx import generate_sfx
    from engine.data.generators.shapes import generate_shapes

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shapes = generate_shapes(root / "shapes", n=200)
        sfx = generate_sfx(root / "sfx", n_per_class=20)
        print(f"{'recipe':16} {'precision':9} {'steps/s':>8} {'examples/s':>11}")
        for recipe in RECIPES:
            data = sfx if recipe.startswith("audio") else shapes
            for precision in ("fp32", "bf16"):
                steps_s, examples_s = measure(recipe, precision, data, root, args.steps,
                                              args.threads)
                print(f"{recipe:16} {precision:9} {steps_s:8.2f} {examples_s:11.1f}", flush=True)


if __name__ == "__main__":
    main()
