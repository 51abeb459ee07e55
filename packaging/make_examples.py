"""Make the sample workspace's finished example runs (`make examples`).

Each example is a real run of a config the sample workspace ships (resources/sample-workspace/
configs), made by the real engine (`forgebench run`, one thread) in a scratch copy of the
workspace, so it records exactly what a user's run of that config records. Two settings are
changed to keep the repository small, and are recorded in the run's config like any other:
`keep_last = 1` (one checkpoint; two for the sound generator, so Blind A/B has a pair) and, for
the recognisable image generator, its sample grid at the end only.

The finished run is copied to resources/sample-workspace/runs/<name>/ portable
(`engine.rundir.make_portable`: the scratch workspace's folder is written `{workspace}`;
installing the sample workspace writes the new folder back) with `example.json` beside run.json,
which marks it as an example in the app. A run that failed is an error, never shipped.

    python packaging/make_examples.py                 # every example (about 25 CPU-minutes)
    python packaging/make_examples.py sensor-alert    # only the named ones
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.viewmodels.forms import dump_toml  # noqa: E402
from engine.fsutil import atomic_write_json, atomic_write_text, human_bytes  # noqa: E402
from engine.rundir import EXAMPLE_FILE, LOCK_NAME, RunDir, make_portable  # noqa: E402

SAMPLE = REPO / "resources" / "sample-workspace"
SHIPPED = ("datasets", "configs", "workspace.json")
KEEP_ONE = {"keep_last": 1}

# name -> (shipped config, what it shows, settings changed for shipping)
EXAMPLES: dict[str, tuple[str, str, dict]] = {
    "shapes-generator": ("image-generate-shapes",
                         "a class-conditional DDPM whose circles, squares and triangles are "
                         "recognisable (Samples, Blind A/B of images, Export)",
                         dict(KEEP_ONE, sample={"grid_every_checkpoint": False})),
    "where-demo": ("lm-pretrain-demo",
                   "the `forgebench demo` model: a tiny decoder that answers "
                   "'Where is X?' from the record", KEEP_ONE),
    "quick-image-generator": ("image-generate",
                              "the quick 16x16 generator, whose samples are still blobs: the "
                              "other side of a Blind A/B against shapes-generator", KEEP_ONE),
    # two checkpoints (steps 100 and 200, a few hundred KB each): a Blind A/B of sounds
    "sfx-generator": ("audio-generate",
                      "a 1-D DDPM of the sfx clips (Samples and Blind A/B of sounds, Export)",
                      {"keep_last": 2}),
    "sensor-alert": ("tabular-classify",
                     "the calibrated fault alert on the sensors table", KEEP_ONE),
}


def merged(config: dict, changes: dict) -> dict:
    out = dict(config)
    for key, value in changes.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def make_example(name: str, scratch: Path) -> Path:
    config_name, shows, changes = EXAMPLES[name]
    raw = tomllib.loads((SAMPLE / "configs" / f"{config_name}.toml").read_text())
    config = scratch / "configs" / f"example-{name}.toml"
    atomic_write_text(config, dump_toml(merged(raw, changes)))
    out = scratch / "runs" / name
    subprocess.run([sys.executable, "-m", "engine", "run", str(config), "--out", str(out),
                    "--threads", "1"], cwd=scratch, check=True)
    state = RunDir(out).live_status().get("state")
    if state != "completed":
        raise SystemExit(f"error: example {name} ended {state}; see {out}/events.jsonl")
    (out / LOCK_NAME).unlink(missing_ok=True)
    make_portable(out, scratch)
    atomic_write_json(out / EXAMPLE_FILE, {
        "name": name, "config": f"configs/{config_name}.toml", "shows": shows,
        "changed_for_shipping": changes, "made_by": "make examples (packaging/make_examples.py)"})
    target = SAMPLE / "runs" / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(out, target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"examples to make (default: all): {', '.join(EXAMPLES)}")
    names = parser.parse_args().names or list(EXAMPLES)
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
            target = make_example(name, scratch)
            size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
            print(f"{name}: {human_bytes(size)} in {target.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
