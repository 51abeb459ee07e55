"""Quality acceptance on the generated shapes and sounds (minutes of CPU each).

Skipped unless FORGEBENCH_SLOW=1. Each test trains a recipe with its shipped config
(resources/configs) on freshly generated data and checks the issue's bounds: classifier test
macro-F1 >= 0.9, segmenter val IoU >= 0.85, detector val mean IoU >= 0.7, and generated
images / sounds recognised as their class well above chance by independent judges (the
trained classifier; a spectrogram classifier fitted on the training clips).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile
import tomllib
import torch
from media_support import REPO, forgebench
from PIL import Image

from engine.config import recipe_module, validate_config
from engine.data.dataset import load_dataset
from engine.eval.audio import SpectrogramClassifier
from engine.jobs import execute, start_run
from engine.models.vision import SmallCNN
from engine.rundir import RunDir
from engine.train.loop import checkpoint_meta, load_weights

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("FORGEBENCH_SLOW") != "1",
    reason="quality acceptance run (minutes of CPU each): set FORGEBENCH_SLOW=1")]


def train_shipped(recipe: str, data: Path, out: Path, folder: str = "resources/configs",
                  **overrides) -> RunDir:
    raw = tomllib.loads((REPO / folder / f"{recipe}.toml").read_text())
    raw["data"] = {"dir": str(data)}
    raw.update(overrides)
    config = validate_config(raw)
    run = start_run(config, out, ["quality-test"], threads=torch.get_num_threads())
    execute(run, config, None, threads=torch.get_num_threads(), progress=False)
    return RunDir(run.path)


def judge_images(classifier: RunDir, pngs: list[Path]) -> float:
    """Share of generated images the trained classifier assigns to their requested class."""
    checkpoint = classifier.checkpoint("best")
    meta = checkpoint_meta(checkpoint)
    model = SmallCNN(len(meta["classes"]), batch_norm=meta["model"]["batch_norm"])
    load_weights(checkpoint, model)
    images, wanted = [], []
    size = meta["preprocessing"]["size"]
    for png in pngs:
        image = Image.open(png).convert("RGB").resize((size, size), Image.BILINEAR)
        images.append(np.asarray(image).transpose(2, 0, 1))
        wanted.append(meta["classes"].index(json.loads(png.with_suffix(".json").read_text())["class"]))
    with torch.no_grad():
        predicted = model(torch.from_numpy(np.stack(images)).float() / 255).argmax(1)
    return float((predicted == torch.tensor(wanted)).float().mean())


def judge_sounds(dataset_dir: Path, wavs: list[Path]) -> tuple[float, float]:
    """(accuracy on generated clips, accuracy on the real val clips) of a spectrogram
    classifier fitted on the training clips."""
    dataset = load_dataset(dataset_dir)
    train = dataset.records("train")
    judge = SpectrogramClassifier(dataset.classes).fit(
        [soundfile.read(r["path"])[0] for r in train], [r["label"] for r in train])
    val = dataset.records("val")
    val_acc = np.mean(np.array(judge.predict([soundfile.read(r["path"])[0] for r in val]))
                      == np.array([r["label"] for r in val]))
    wanted = [json.loads(w.with_suffix(".json").read_text())["class"] for w in wavs]
    got = judge.predict([soundfile.read(w)[0] for w in wavs])
    return float(np.mean(np.array(got) == np.array(wanted))), float(val_acc)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from engine.data.generators.shapes import generate_shapes

    return generate_shapes(tmp_path_factory.mktemp("quality") / "shapes", n=2000)


@pytest.fixture(scope="module")
def classifier(shapes, tmp_path_factory):
    return train_shipped("image-classify", shapes, tmp_path_factory.mktemp("cls") / "run")


def test_classifier_test_macro_f1(classifier):
    report = recipe_module("image-classify").evaluate(classifier, classifier.checkpoint("best"),
                                                      "test")
    print("classifier test macro-F1", report["macro_f1"])
    assert report["macro_f1"] >= 0.9


def test_segmenter_val_iou(shapes, tmp_path):
    run = train_shipped("image-segment", shapes, tmp_path / "run")
    report = recipe_module("image-segment").evaluate(run, run.checkpoint("best"), "val")
    print("segmenter val IoU", report["iou"], "boundary F1", report["boundary_f1"])
    assert report["iou"] >= 0.85


def test_detector_val_mean_iou(shapes, tmp_path):
    run = train_shipped("image-detect", shapes, tmp_path / "run")
    report = recipe_module("image-detect").evaluate(run, run.checkpoint("best"), "val")
    print("detector val mean IoU", report["mean_iou"])
    assert report["mean_iou"] >= 0.7


def test_generated_images_are_recognised_by_the_classifier(shapes, classifier, tmp_path):
    # Measured (one thread, shipped config: 1000 steps, channels [32, 64, 128], 661 CPU s):
    # 48 samples recognised 0.67 at the configured cfg 4 (0.65 at cfg 3, 0.58 at cfg 2);
    # channels [16, 32, 64] gave 0.35 at 1000 steps and 0.54 at 3000 steps (cfg 2).
    run = train_shipped("image-generate", shapes, tmp_path / "run")
    out = tmp_path / "samples"
    forgebench("sample", str(run.path), "--n", "16", "--seed", "0", "--steps", "64",
               "--out", str(out), timeout=1800)
    accuracy = judge_images(classifier, sorted(out.glob("*.png")))
    print("generated images recognised", accuracy)
    assert accuracy >= 0.6  # chance is 1/3


def test_sample_workspace_generator_is_recognised(classifier, tmp_path):
    # Measured (one thread, 689 s on a busy 2-core machine): 48 samples recognised 0.46 after
    # 250 steps, 0.56 after 500, 0.65 after 750, 0.83 after 1000; the quick 16x16 config
    # (image-generate.toml) gave 0.42 after its 300 steps and 0.25 after 3000. On the outlined
    # shapes, the 2000-step config: 0.69 (64 sampler steps, a 1200-step judge; the earlier
    # 1000-step config 0.60).
    sample = REPO / "resources/sample-workspace"
    run = train_shipped("image-generate-shapes", sample / "datasets/shapes", tmp_path / "run",
                        folder="resources/sample-workspace/configs")
    out = tmp_path / "samples"
    forgebench("sample", str(run.path), "--n", "16", "--seed", "0", "--out", str(out),
               timeout=1800)
    accuracy = judge_images(classifier, sorted(out.glob("*.png")))
    print("sample workspace generator: images recognised", accuracy)
    assert accuracy >= 0.6  # chance is 1/3


def test_generated_sounds_are_recognised_by_a_spectrogram_classifier(tmp_path):
    from engine.data.generators.sfx import generate_sfx

    sfx = generate_sfx(tmp_path / "sfx", n_per_class=200)
    # Measured (one thread, shipped config): 600 steps = 244 CPU s; 24 clips recognised 1.00
    # at cfg 2 and 0.83 at cfg 1 by the judge (1.00 on the real val clips).
    run = train_shipped("audio-generate", sfx, tmp_path / "run", steps=600)
    out = tmp_path / "samples"
    forgebench("sample", str(run.path), "--n", "8", "--seed", "0", "--steps", "64",
               "--cfg", "2", "--out", str(out), timeout=1800)
    accuracy, val_accuracy = judge_sounds(sfx, sorted(out.glob("*.wav")))
    print("generated sounds recognised", accuracy, "judge on real val clips", val_accuracy)
    assert val_accuracy >= 0.9 and accuracy >= 0.6  # chance is 1/3
