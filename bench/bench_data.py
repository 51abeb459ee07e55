"""Benchmark: validate + leak-check 50,000 text records and 5,000 images (and the default
sound-effect set, whose near-duplicate search is the costly one per item).

Goal (issue #6): under 30 s for the text set and under 60 s for the images on this machine.
The data is generated first (not timed); each measurement then runs in a fresh subprocess so
its wall time and peak RSS are its own. Planted near-duplicates check that the timed run also
finds what it should. The load average is printed with the figures: on a shared machine they
are only comparable under similar load.

    python bench/bench_data.py [--texts 50000] [--images 5000] [--clips-per-class 60] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.train.metrics import peak_rss_mb  # noqa: E402

PLANTED = 50
PLANTED_CLIPS = 10


def make_text_set(root: Path, n: int) -> None:
    """`n` SFT records of random prose over a 5,000-word vocabulary, with PLANTED near-copies
    of training records placed in the test split (case, punctuation and one word changed)."""
    import numpy as np

    from engine.data.dataset import write_manifest
    from engine.data.splits import block_split

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(5000)]
    root.mkdir(parents=True)
    records = []
    for i in range(n - PLANTED):
        words = rng.choice(vocabulary, rng.integers(20, 60))
        cut = len(words) // 3
        records.append({"id": f"r{i:06d}", "instruction": " ".join(words[:cut]) + "?",
                        "response": " ".join(words[cut:]) + ".", "group": f"g{i:06d}",
                        "split": block_split(i, 0)})
    train = [r for r in records if r["split"] == "train"]
    for k in range(PLANTED):
        source = train[k * 7]
        records.append(dict(source, id=f"leak{k:03d}", group=f"leak{k:03d}", split="test",
                            instruction=source["instruction"].upper().replace("?", " ?"),
                            response=source["response"] + " indeed"))
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_manifest(root, "text-sft", "bench-text")


def make_image_set(root: Path, n: int) -> None:
    """`n` generated shape scenes, PLANTED of them replaced by re-encoded near-copies."""
    import io

    from PIL import Image, ImageEnhance

    from engine.data.dataset import write_manifest
    from engine.data.generators.shapes import generate_shapes

    generate_shapes(root, n=n, size=64, seed=1)
    records = [json.loads(line) for line in (root / "records.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    tests = [r for r in records if r["split"] == "test"]
    for source, target in zip(train[:PLANTED], tests[:PLANTED]):
        image = ImageEnhance.Brightness(Image.open(root / source["image"])).enhance(1.05)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        (root / target["image"]).write_bytes(buffer.getvalue())
        (root / target["mask"]).write_bytes((root / source["mask"]).read_bytes())
        target.update(label=source["label"], box=source["box"])
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    old = json.loads((root / "dataset.json").read_text())
    write_manifest(root, "image-masks", "bench-images", records="records.jsonl",
                   classes=old["classes"], image=old["image"])


def make_audio_set(root: Path, per_class: int) -> None:
    """The sfx set, PLANTED_CLIPS test clips replaced by quieter, shifted copies of train clips."""
    import hashlib
    import io

    import numpy as np
    import soundfile

    from engine.data.dataset import write_manifest
    from engine.data.generators.sfx import generate_sfx

    generate_sfx(root, n_per_class=per_class, seed=1)
    records = [json.loads(line) for line in (root / "clips.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    tests = [r for r in records if r["split"] == "test"]
    for k, (source, target) in enumerate(zip(train[::5], tests[:PLANTED_CLIPS])):
        wave, rate = soundfile.read(str(root / source["path"]))
        buffer = io.BytesIO()
        soundfile.write(buffer, np.roll(wave * 0.7, 37 * k), rate, subtype="PCM_16",
                        format="WAV")
        (root / target["path"]).write_bytes(buffer.getvalue())
        target.update(label=source["label"], sha256=hashlib.sha256(buffer.getvalue()).hexdigest())
    (root / "clips.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    old = json.loads((root / "dataset.json").read_text())
    write_manifest(root, "audio-clips", "bench-sfx", records="clips.jsonl",
                   classes=old["classes"], audio=old["audio"])


def measure(path: str) -> dict:
    """Validate (hashes, records, media) then leak-check; time and peak RSS of this process."""
    from engine.data.dataset import load_dataset
    from engine.data.leaks import find_leaks

    start = time.perf_counter()
    dataset = load_dataset(path)
    validated = time.perf_counter()
    report = find_leaks([dataset])
    done = time.perf_counter()
    return {"records": len(dataset.records()), "validate_s": round(validated - start, 2),
            "leaks_s": round(done - validated, 2), "total_s": round(done - start, 2),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "leaks_found": len(report.leaks), "findings": len(report.findings),
            "by_kind": report.to_json()["by_kind"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=50_000)
    parser.add_argument("--images", type=int, default=5_000)
    parser.add_argument("--clips-per-class", type=int, default=60)
    parser.add_argument("--keep", help="generate into this folder and keep it")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return 0
    base = Path(args.keep or tempfile.mkdtemp(prefix="forgebench-bench-"))
    text_dir, image_dir, audio_dir = base / "text", base / "images", base / "sfx"
    if not text_dir.exists():
        print(f"generating {args.texts} text records in {text_dir} ...", flush=True)
        make_text_set(text_dir, args.texts)
    if not image_dir.exists():
        print(f"generating {args.images} images in {image_dir} ...", flush=True)
        make_image_set(image_dir, args.images)
    if not audio_dir.exists():
        print(f"generating {3 * args.clips_per_class} clips in {audio_dir} ...", flush=True)
        make_audio_set(audio_dir, args.clips_per_class)
    goals = {"text": 30.0, "images": 60.0, "audio": None}
    planted = {"text": PLANTED, "images": PLANTED, "audio": PLANTED_CLIPS}
    print("load average before: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    for name, folder in (("text", text_dir), ("images", image_dir), ("audio", audio_dir)):
        result = json.loads(subprocess.run(
            [sys.executable, __file__, "--measure", str(folder)], check=True,
            capture_output=True, text=True).stdout)
        verdict = "no goal set" if goals[name] is None else \
            f"{'within' if result['total_s'] < goals[name] else 'OVER'} " \
            f"the {goals[name]:.0f} s goal"
        print(f"{name:6s}: {result['records']} records, validate {result['validate_s']} s + "
              f"leak check {result['leaks_s']} s = {result['total_s']} s ({verdict}), "
              f"peak RSS {result['peak_rss_mb']} MB, {result['leaks_found']} cross-split leaks "
              f"found (planted {planted[name]}), findings by kind {result['by_kind']}")
    print("load average after: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
