"""Judge a shapes generator run: does each class's sample look like that shape?

The judge is an independent classifier: the shipped `image-classify` recipe
(resources/configs/image-classify.toml, 1200 steps) trained on freshly generated shapes
(`generate_shapes`, 2000 scenes, seed 1, so none is a scene the generator was trained on). It knows
the three shapes and 'empty', so chance is 1/4. The judge is trained once into --judge and reused.

The generator's checkpoint is sampled with `forgebench sample` (N per class, a fixed seed), or
an existing folder of samples (PNG + JSON sidecar naming the class) is judged with --samples.
Prints the judge's own test accuracy, then per class how many samples it recognised and what
it saw instead.

    python packaging/judge_shapes.py resources/sample-workspace/runs/shapes-generator
    python packaging/judge_shapes.py RUN --checkpoint step-003000 --n 16 --cfg 3
    python packaging/judge_shapes.py --samples RUN/samples/step-002000
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SAMPLE_WORKSPACE = REPO / "resources" / "sample-workspace"
JUDGE_SCENES = 2000
JUDGE_SEED = 1          # the sample workspace's shapes are seed 0
JUDGE_STEPS = 1200


def train_judge(folder: Path):
    """The trained classifier run in `folder` (trained there first if it has none)."""
    import tomllib

    from engine.config import validate_config
    from engine.data.generators.shapes import generate_shapes
    from engine.jobs import execute, start_run
    from engine.rundir import RunDir

    run_dir = folder / "run"
    if (run_dir / "status.json").exists() and \
            RunDir(run_dir).live_status().get("state") == "completed":
        return RunDir(run_dir)
    data = folder / "shapes"
    if not (data / "dataset.json").exists():
        generate_shapes(data, n=JUDGE_SCENES, seed=JUDGE_SEED)
    raw = tomllib.loads((REPO / "resources/configs/image-classify.toml").read_text())
    raw.update(data={"dir": str(data)}, steps=JUDGE_STEPS)
    config = validate_config(raw)
    run = start_run(config, run_dir, ["judge_shapes"], threads=1)
    execute(run, config, None, threads=1, progress=False)
    return RunDir(run.path)


def judge_accuracy(judge) -> float:
    from engine.config import recipe_module

    report = recipe_module("image-classify").evaluate(judge, judge.checkpoint("best"), "test")
    return float(report["accuracy"] if "accuracy" in report else report["macro_f1"])


def classify(judge, pngs: list[Path]) -> list[tuple[str, str]]:
    """(requested class, judged class) of each sample."""
    import numpy as np
    import torch
    from PIL import Image

    from engine.models.vision import SmallCNN
    from engine.train.loop import checkpoint_meta, load_weights

    checkpoint = judge.checkpoint("best")
    meta = checkpoint_meta(checkpoint)
    classes = meta["classes"]
    model = SmallCNN(len(classes), batch_norm=meta["model"]["batch_norm"])
    load_weights(checkpoint, model)
    model.eval()
    size = meta["preprocessing"]["size"]
    images = [np.asarray(Image.open(p).convert("RGB").resize((size, size), Image.BILINEAR))
              .transpose(2, 0, 1) for p in pngs]
    wanted = [json.loads(p.with_suffix(".json").read_text())["class"] for p in pngs]
    with torch.no_grad():
        predicted = model(torch.from_numpy(np.stack(images)).float() / 255).argmax(1).tolist()
    return [(w, classes[k]) for w, k in zip(wanted, predicted)]


def usable_copy(run: Path, scratch: Path) -> Path:
    """A copy of the run to sample from, so judging never writes into the run's own event log
    (its checkpoints are linked, not copied); a shipped example's copy, whose paths are written
    `{workspace}`, is given the sample workspace it ships in."""
    from engine.rundir import WORKSPACE_TOKEN, relocate

    copy = scratch / run.name
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "samples"))
    (copy / "checkpoints").mkdir()
    for checkpoint in (run / "checkpoints").iterdir():
        (copy / "checkpoints" / checkpoint.name).symlink_to(checkpoint.resolve())
    if WORKSPACE_TOKEN in (run / "run.json").read_text():
        relocate(copy, SAMPLE_WORKSPACE)
    return copy


def sample(run: Path, checkpoint: str | None, n: int, seed: int, steps: int,
           cfg: float | None, out: Path) -> None:
    args = [sys.executable, "-m", "engine", "sample", str(run), "--n", str(n), "--seed",
            str(seed), "--steps", str(steps), "--out", str(out)]
    if checkpoint:
        args += ["--checkpoint", checkpoint]
    if cfg is not None:
        args += ["--cfg", str(cfg)]
    subprocess.run(args, cwd=REPO, check=True)


def report(pairs: list[tuple[str, str]]) -> str:
    lines = []
    for wanted in sorted({w for w, _ in pairs}):
        seen = Counter(got for w, got in pairs if w == wanted)
        total = sum(seen.values())
        others = ", ".join(f"{k} {v}" for k, v in seen.most_common() if k != wanted)
        lines.append(f"  {wanted:9s} {seen[wanted]:3d}/{total}" + (f"  (seen as {others})"
                                                                   if others else ""))
    right = sum(w == g for w, g in pairs)
    lines.append(f"  all       {right:3d}/{len(pairs)} = {right / len(pairs):.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", type=Path, help="a shapes generator run folder")
    parser.add_argument("--checkpoint", help="checkpoint to sample (default: the run's last)")
    parser.add_argument("--samples", type=Path, help="judge this folder of samples instead")
    parser.add_argument("--n", type=int, default=16, help="samples per class")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=64, help="sampler steps")
    parser.add_argument("--cfg", type=float, help="guidance scale (default: the run's config)")
    parser.add_argument("--judge", type=Path,
                        default=Path(tempfile.gettempdir()) / "forgebench-shapes-judge",
                        help="folder of the judge (trained there once, then reused)")
    args = parser.parse_args()
    if (args.run is None) == (args.samples is None):
        parser.error("give a run folder or --samples FOLDER")
    args.judge.mkdir(parents=True, exist_ok=True)
    judge = train_judge(args.judge)
    print(f"judge: {judge.path} (test accuracy {judge_accuracy(judge):.3f})")
    if args.samples:
        folder = args.samples
    else:
        scratch = Path(tempfile.mkdtemp(prefix="judge-samples-"))
        folder = scratch / "samples"
        sample(usable_copy(args.run.resolve(), scratch), args.checkpoint, args.n, args.seed,
               args.steps, args.cfg, folder)
    pngs = sorted(p for p in folder.glob("*.png") if p.with_suffix(".json").exists()
                  and "class" in json.loads(p.with_suffix(".json").read_text()))
    if not pngs:
        raise SystemExit(f"error: no samples with a class sidecar in {folder}")
    print(f"samples: {folder} ({len(pngs)})")
    print(report(classify(judge, pngs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
