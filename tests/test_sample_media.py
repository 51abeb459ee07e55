"""What the sample workspace shows a person is clean: every clip it ships (the sfx and speech
sets, and every sound its example generators wrote) passes the project's own clip checks
(`engine.eval.audio.integrity_flags`, the flags the Samples pane shows), each generated clip's
sidecar states the flags its file really has, and the image set's every object stands out from
its background; the where-demo example's sample is its answer, not the next record. Each check
has a twin that shows it catches the defect it is there for (a DC offset, a click at a cut
edge, an object painted in its background's colour, a sample run past its answer).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from app.viewmodels.samples import run_samples, showcase_order
from app.viewmodels.workspace import BUNDLED_SAMPLE
from engine.data.dataset import validate_dataset
from engine.data.media import read_audio
from engine.eval.audio import finished_clip, integrity_flags

DATASETS = BUNDLED_SAMPLE / "datasets"
RUNS = BUNDLED_SAMPLE / "runs"
DATASET_CLIPS = sorted((DATASETS / "sfx" / "clips").glob("*.wav")) + \
    sorted((DATASETS / "speech" / "clips").glob("*.wav"))
GENERATED_CLIPS = sorted(RUNS.glob("*/samples/*/*.wav"))
MIN_OBJECT_CONTRAST = 40.0      # RGB distance, object interior against the ring around it


def mono(path: Path) -> tuple[np.ndarray, int]:
    wave, rate, reason = read_audio(path)
    assert wave is not None, (path, reason)
    return wave.mean(axis=0).astype(np.float64), rate


def test_the_sample_workspace_ships_clips_of_each_kind():
    assert len(DATASET_CLIPS) >= 200 and len(GENERATED_CLIPS) >= 12


@pytest.mark.parametrize("path", DATASET_CLIPS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_shipped_dataset_clip_passes_the_clip_checks(path):
    flags = integrity_flags(mono(path)[0])
    assert flags["flags"] == [], (path, flags)


@pytest.mark.parametrize("path", GENERATED_CLIPS, ids=lambda p: str(p.relative_to(RUNS)))
def test_every_generated_example_clip_is_written_clean_and_says_so(path):
    """No DC offset, no edge click, no silence in any written clip; the sidecar's flags are the
    file's (one truth for the Samples pane). The model's own output, before finishing, is kept
    in the sidecar with its flags."""
    wave, _ = mono(path)
    measured = integrity_flags(wave)
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["integrity"]["flags"] == measured["flags"]
    assert not {"dc_offset", "edge_click", "silence"} & set(measured["flags"]), measured
    assert "flags" in sidecar["integrity_model_output"]
    assert sidecar["settings"]["mean_removed"] and sidecar["settings"]["edge_fade_s"] > 0


def test_each_generator_shows_flag_free_clips_from_its_best_checkpoint_first():
    """The clips the Samples pane lists first (the best checkpoint's) have no flag at all;
    an earlier, half-trained checkpoint may still clip, and shows it."""
    generators = sorted({p.parents[2] for p in GENERATED_CLIPS})
    assert generators
    for run in generators:
        samples = [s for s in run_samples(run) if s.kind == "audio"]
        best = showcase_order(run, {s.checkpoint for s in samples})[0]
        assert samples[0].checkpoint == best
        assert all(s.integrity_flags == [] for s in samples if s.checkpoint == best), run


def test_twin_a_clip_with_dc_offset_or_a_cut_edge_is_flagged_and_finishing_cures_it():
    wave, rate = mono(DATASETS / "sfx" / "clips" / "thump-0000.wav")
    assert integrity_flags(wave)["flags"] == []
    offset = wave + 0.03                               # above the 0.02 DC limit
    cut = wave[int(0.03 * rate):]                      # starts in the middle of the thump
    assert integrity_flags(offset)["flags"] == ["dc_offset"]
    assert integrity_flags(cut)["flags"] == ["edge_click"]
    for broken in (offset, cut):
        fixed = finished_clip(broken, rate)
        assert integrity_flags(fixed)["flags"] == []
        # only the mean and the 5 ms ends change: the middle is the input less its mean
        middle = slice(int(0.005 * rate), -int(0.005 * rate))
        np.testing.assert_allclose(fixed[middle], (broken - broken.mean())[middle], atol=1e-12)


def object_contrasts(root: Path) -> dict[str, float]:
    """RGB distance between an object's interior (the mask less 2 px) and the ring 2-4 px
    around it, per non-empty record of an image-masks set."""
    from PIL import Image

    found = {}
    for line in (root / "records.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["label"] == "empty":
            continue
        image = np.asarray(Image.open(root / record["image"])).astype(np.float64)
        mask = np.asarray(Image.open(root / record["mask"])) > 0
        found[record["id"]] = contrast(image, mask)
    return found


def around(mask: np.ndarray) -> np.ndarray:
    """The ring 2-4 px outside a mask."""
    dilated = ndimage.binary_dilation
    return dilated(mask, iterations=4) & ~dilated(mask, iterations=1)


def contrast(image: np.ndarray, mask: np.ndarray) -> float:
    inner = ndimage.binary_erosion(mask, iterations=2)
    ring = around(mask)
    return float(np.linalg.norm(image[inner].mean(axis=0) - image[ring].mean(axis=0)))


def test_the_shipped_image_set_validates_and_every_object_stands_out():
    report = validate_dataset(DATASETS / "shapes")
    assert report.ok and report.findings == [], [f.message for f in report.findings]
    contrasts = object_contrasts(DATASETS / "shapes")
    assert len(contrasts) > 250
    low = {k: v for k, v in contrasts.items() if v < MIN_OBJECT_CONTRAST}
    assert low == {}


def test_twin_an_object_painted_in_its_background_colour_does_not_stand_out():
    from PIL import Image

    root = DATASETS / "shapes"
    record = next(json.loads(line) for line in (root / "records.jsonl").read_text().splitlines()
                  if json.loads(line)["label"] != "empty")
    image = np.asarray(Image.open(root / record["image"])).astype(np.float64)
    mask = np.asarray(Image.open(root / record["mask"])) > 0
    assert contrast(image, mask) >= MIN_OBJECT_CONTRAST
    ring = around(mask)
    hidden = image.copy()
    hidden[ndimage.binary_dilation(mask, iterations=1)] = image[ring].mean(axis=0)
    assert contrast(hidden, mask) < MIN_OBJECT_CONTRAST


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The where-demo example with its data and configs, relocated as installing does."""
    import shutil

    from engine.rundir import relocate

    workspace = tmp_path_factory.mktemp("home") / "sample-workspace"
    for part in ("configs", "datasets/where-records", "runs/where-demo"):
        shutil.copytree(BUNDLED_SAMPLE / part, workspace / part)
    relocate(workspace / "runs" / "where-demo", workspace)
    return workspace


def test_the_where_demo_sample_is_its_answer_and_ends_there(installed):
    from engine.recipes.lm_pretrain import complete
    from engine.rundir import RunDir
    from engine.sampling import SamplingSettings
    from engine.train.pretrain_model import load_model

    run = RunDir(installed / "runs" / "where-demo")
    checkpoint = run.latest_checkpoint()
    shipped = json.loads((run.samples_dir / checkpoint.name / "samples.jsonl").read_text()
                         .splitlines()[0])
    model, tokenizer, config = load_model(run, checkpoint)

    def answer(stop: list[str]) -> str:
        return complete(model, tokenizer, shipped["prompt"], max_tokens=config.sample.max_tokens,
                        settings=SamplingSettings(), seed=0, stop=stop)

    assert config.sample.stop == ["\n"]
    assert shipped["text"] == answer(config.sample.stop) == " the hall."
    # twin: without its stop the same base model goes on to write the next record
    unstopped = answer([])
    assert unstopped.startswith(" the hall.\n") and "Record" in unstopped
