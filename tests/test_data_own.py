"""A user's own files (issue 46, item 8): every image mode a PNG holds becomes the 8-bit RGB the
image recipes read by one rule that `data validate` and the loader share (checked against
numpy arithmetic written from the formats' definitions); a dataset's version covers what a
run reads from dataset.json, and a run recorded before that still resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from engine.data import media
from engine.data.dataset import (
    VERSION_SCHEME,
    data_change,
    dataset_version,
    load_dataset,
    validate_dataset,
    version_id,
    write_manifest,
)
from engine.errors import ForgebenchError
from engine.train.media_data import read_rgb

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "resources" / "sample-workspace"
RNG = np.random.default_rng(7)
GREY = RNG.integers(0, 256, (6, 5), dtype=np.uint8)
COLOUR = RNG.integers(0, 256, (6, 5, 3), dtype=np.uint8)
ALPHA = RNG.integers(0, 256, (6, 5), dtype=np.uint8)
DEEP = RNG.integers(0, 65536, (6, 5), dtype=np.uint16)


def over_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Straight-alpha "over" onto white: c * a + 255 * (1 - a), a = alpha / 255."""
    a = alpha[..., None].astype(np.float64) / 255
    return colour.astype(np.float64) * a + 255 * (1 - a)


def mode_files(folder: Path) -> dict[str, np.ndarray]:
    """One PNG per mode under folder/<mode-name>/, and the RGB each must read as."""
    palette = Image.fromarray(COLOUR).quantize(colors=16)
    palette_rgb = np.asarray(palette.convert("RGB"))
    transparent = palette.copy()
    transparent.info["transparency"] = 0              # palette index 0 is transparent
    index = np.asarray(transparent)
    files = {
        "rgb": (Image.fromarray(COLOUR), COLOUR),
        "grey": (Image.fromarray(GREY), np.repeat(GREY[..., None], 3, 2)),
        "bilevel": (Image.fromarray(GREY > 127).convert("1"),
                    np.repeat(np.where(GREY > 127, 255, 0)[..., None], 3, 2)),
        "palette": (palette, palette_rgb),
        "palette-transparent": (transparent, np.where((index == 0)[..., None], 255,
                                                      palette_rgb)),
        "rgba": (Image.fromarray(np.dstack([COLOUR, ALPHA])), over_white(COLOUR, ALPHA)),
        "grey-alpha": (Image.merge("LA", [Image.fromarray(GREY), Image.fromarray(ALPHA)]),
                       over_white(np.repeat(GREY[..., None], 3, 2), ALPHA)),
        "grey16": (Image.fromarray(DEEP),
                   np.repeat(np.rint(DEEP / 257.0)[..., None], 3, 2)),
    }
    expected = {}
    for name, (image, rgb) in files.items():
        (folder / name).mkdir(parents=True)
        image.save(folder / name / "a.png")
        expected[name] = rgb
    return expected


def test_every_png_mode_validates_and_loads_as_the_rgb_its_format_defines(tmp_path):
    root = tmp_path / "modes"
    expected = mode_files(root)
    write_manifest(root, "image-classify", "modes", layout="folders")
    report = validate_dataset(root)
    assert report.ok, [f.render() for f in report.errors]
    opened = {name: Image.open(root / name / "a.png").mode for name in expected}
    assert opened["grey16"].startswith("I") and opened["palette"] == "P"
    converted = {mode: sum(m == mode for n, m in opened.items() if n != "rgb")
                 for mode in set(opened.values()) - {"RGB"}}
    assert report.conversions == converted
    section = SimpleNamespace(resize="none", size=5)
    with pytest.raises(ForgebenchError, match="the config expects 5x5"):
        read_rgb(root / "rgb" / "a.png", section)                   # 5 wide, 6 high
    for name, rgb in expected.items():
        image, reason = media.to_rgb(Image.open(root / name / "a.png"))
        assert reason is None and image.mode == "RGB"
        # compositing a translucent alpha rounds once in PIL; every other reading is exact
        tolerance = 1 if name in ("rgba", "grey-alpha") else 0
        assert np.abs(np.asarray(image, dtype=np.float64) - rgb).max() <= tolerance, name
    # the loader reads through the same conversion (stretched to the configured size)
    array, size = read_rgb(root / "grey" / "a.png", SimpleNamespace(resize="stretch", size=6))
    assert size == (5, 6) and array.shape == (6, 6, 3) and array.dtype == np.uint8
    assert (array[..., 0] == array[..., 1]).all() and (array[..., 1] == array[..., 2]).all()


def test_modes_that_have_no_rgb_reading_are_refused_by_the_same_rule():
    for image in (Image.new("F", (2, 2)), Image.new("HSV", (2, 2))):
        how, reason = media.rgb_conversion(image)
        assert how is None and f"mode {image.mode} cannot be read as RGB" in reason
        assert media.to_rgb(image) == (None, reason)
    wide = Image.fromarray(np.array([[0, 70000]], dtype=np.int32))
    assert "range is unknown" in media.rgb_conversion(wide)[1]
    narrow = Image.fromarray(np.array([[0, 65535]], dtype=np.int32))
    assert np.asarray(media.to_rgb(narrow)[0])[0, 1].tolist() == [255, 255, 255]


def test_a_manifest_that_requires_rgb_still_refuses_a_grey_file(tmp_path):
    """The twin: conversion is what a recipe reads; a dataset that declares mode RGB keeps
    its own requirement, and load_dataset names the file and field."""
    root = tmp_path / "strict"
    mode_files(root)
    shutil.rmtree(root / "rgb")
    write_manifest(root, "image-classify", "strict", layout="folders", image={"mode": "RGB"})
    report = validate_dataset(root)
    assert not report.ok and "image mode is L, the dataset requires RGB" in \
        " ".join(f.reason for f in report.errors)
    with pytest.raises(ForgebenchError) as caught:
        load_dataset(root)
    assert caught.value.where and "field 'image'" in caught.value.where


# -- versions ------------------------------------------------------------------------------
def small_dataset(root: Path) -> Path:
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        Image.fromarray(GREY).save(root / label / "x.png")
    write_manifest(root, "image-classify", "small", layout="folders", classes=["a", "b"])
    return root


def edit_manifest(root: Path, **changes) -> None:
    manifest = json.loads((root / "dataset.json").read_text())
    manifest.update(changes)
    (root / "dataset.json").write_text(json.dumps(manifest))


def test_editing_what_a_run_reads_changes_the_version_and_descriptions_do_not(tmp_path):
    root = small_dataset(tmp_path / "small")
    written = json.loads((root / "dataset.json").read_text())
    assert written["version_scheme"] == VERSION_SCHEME
    assert written["version"] == load_dataset(root).version == dataset_version(written)
    assert validate_dataset(root).findings == []

    edit_manifest(root, name="renamed", rights={"train": "yes"}, card={"task": "letters"},
                  description="two letters")
    assert load_dataset(root).version == written["version"]
    assert validate_dataset(root).findings == []

    edit_manifest(root, classes=["b", "a"])          # the label indices a model learns
    edited = load_dataset(root).version
    assert edited != written["version"]
    [warning] = validate_dataset(root).findings
    assert warning.severity == "warning" and warning.field == "version"
    assert f"version is now {edited}" in warning.reason
    for change in ({"image": {"size": [5, 6]}}, {"records": "other.jsonl"},
                   {"layout": None}, {"table": {}}):
        assert dataset_version({**written, **change}) != written["version"], change


def test_a_run_recorded_before_versions_covered_dataset_json_still_resumes(tmp_path):
    """The shipped example run's data record (version = the files' hash, no scheme) against
    the same data today: resume's check accepts it through the real `prepare_resume`."""
    from engine.jobs import prepare_resume
    from engine.rundir import RunDir, relocate

    workspace = tmp_path / "ws"
    shutil.copytree(SAMPLE / "datasets" / "sensors", workspace / "datasets" / "sensors")
    shutil.copytree(SAMPLE / "runs" / "sensor-alert", workspace / "runs" / "sensor-alert")
    (workspace / "configs").mkdir()
    run_dir = workspace / "runs" / "sensor-alert"
    relocate(run_dir, workspace)
    recorded = RunDir(run_dir).manifest()["data"]
    assert "version_scheme" not in recorded
    assert recorded["version"] == version_id(recorded["files"])  # what scheme 1 recorded

    run, _ = prepare_resume(run_dir, {}, allow_code_change=True)
    run.release_lock()

    current = dict(recorded, version="0" * 16, version_scheme=VERSION_SCHEME)
    assert data_change(recorded, current) is None
    # the twins: a changed file is still caught in an old record, and a new record sees an
    # edit to dataset.json that leaves every data file alone
    changed = dict(current, files=dict(current["files"], **{"rows.csv": "f" * 64}))
    assert data_change(recorded, changed) == "rows.csv has a different SHA-256"
    assert "dataset.json changed" in data_change(current, dict(current, version="1" * 16))


def forgebench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def test_resume_refuses_a_run_whose_dataset_json_was_edited(tmp_path):
    root = tmp_path / "letters"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.roll(GREY, i + 3 * (label == "b"), 0)).save(
                root / label / f"{i}.png")
    splits = {f"{label}/{i}": "val" if i == 5 else "train" for label in "ab" for i in range(6)}
    (root / "splits.json").write_text(json.dumps({"groups": splits}))
    write_manifest(root, "image-classify", "letters", layout="folders", classes=["a", "b"])
    config = tmp_path / "run.toml"
    config.write_text(f'recipe = "image-classify"\nsteps = 4\nsave_every = 2\neval_every = 4\n'
                      f'batch_size = 4\ninclude_empty = false\n[data]\ndir = "{root}"\n'
                      '[image]\nsize = 16\nresize = "stretch"\n')
    run = tmp_path / "run"
    started = forgebench("run", str(config), "--out", str(run), "--threads", "1",
                         "--stop-after-step", "2")
    assert started.returncode == 0, started.stderr
    original = (root / "dataset.json").read_bytes()
    edit_manifest(root, classes=["b", "a"])
    refused = forgebench("resume", str(run))
    assert refused.returncode == 2
    assert "the training data changed since the run started: dataset.json changed" in \
        refused.stderr
    (root / "dataset.json").write_bytes(original)
    resumed = forgebench("resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "status.json").read_text())["step"] == 4


# -- tables --------------------------------------------------------------------------------
MIXED = """patient_id,age,smoker,city,note,diagnosis
p1,61,yes,Lyon,first visit,M
p2,,no,Paris,"follow-up, stable",B
p3,47,No,Lyon,referred by GP,B
p4,55,YES,Nice,second opinion,M
p5,38,no,Paris,routine check,B
p6,70,yes,Lyon,,B
"""


def test_a_tables_schema_is_inferred_with_types_roles_reasons_and_missing_cells(tmp_path):
    from engine.data.tabular import infer_table, table_split

    root = tmp_path / "clinic"
    root.mkdir()
    (root / "visits.csv").write_text(MIXED)
    table, guesses = infer_table(root / "visits.csv")
    by_name = {g.name: g for g in guesses}
    assert [(g.type, g.missing, g.role) for g in guesses] == [
        ("text", 0, "id"), ("number", 1, "feature"), ("boolean", 0, "feature"),
        ("categorical", 0, "ignored"), ("text", 1, "ignored"), ("categorical", 0, "target")]
    assert by_name["diagnosis"].reason == "named like a label, two values; 'M' is read as 1"
    assert table == {"target": "diagnosis", "group": None, "positive": "M", "id": "patient_id",
                     "features": {"age": "number", "smoker": "boolean"},
                     "ignored": {"city": by_name["city"].reason,
                                 "note": by_name["note"].reason}}
    # written by `data init`, read by the recipe's own reader: the numbers by hand
    done = forgebench("data", "init", str(root), "--kind", "tabular", "--name", "clinic")
    assert done.returncode == 0, done.stderr
    assert "smoker" in done.stdout and "boolean" in done.stdout
    (root / "dataset.json").unlink()
    splits = {f"p{i}": "train" for i in range(1, 7)}
    (root / "splits.json").write_text(json.dumps({"groups": splits}))
    write_manifest(root, "tabular", "clinic", records="visits.csv", table=table)
    data = table_split(load_dataset(root), "train")
    assert data.ids == ["p1", "p2", "p3", "p4", "p5", "p6"]
    assert data.target.tolist() == [1, 0, 0, 1, 0, 0]
    np.testing.assert_array_equal(data.features, [[61, 1], [np.nan, 0], [47, 0], [55, 1],
                                                  [38, 0], [70, 1]])


def test_a_chosen_target_and_group_and_bad_choices(tmp_path):
    from engine.data.tabular import infer_table

    root = tmp_path / "clinic"
    root.mkdir()
    (root / "rows.csv").write_text(MIXED)
    table, guesses = infer_table(root / "rows.csv", target="smoker", group="city")
    assert table["target"] == "smoker" and table["positive"] == "yes"   # YES and yes alike
    assert table["group"] == "city" and table["features"] == {"age": "number"}
    assert {g.name: g.role for g in guesses}["diagnosis"] == "ignored"
    write_manifest(root, "tabular", "clinic", table=table)
    records = {r["id"]: r for r in load_dataset(root).records()}
    assert records["p4"]["group"] == "Nice"           # the group column is the split unit
    for target, words in (("nope", "no column 'nope'"), ("age", "5 distinct values")):
        with pytest.raises(ForgebenchError) as caught:
            infer_table(root / "rows.csv", target=target)
        assert caught.value.where == "--target" and words in caught.value.message


def test_init_lists_a_folders_problems_once_and_writes_nothing(tmp_path):
    """30 bad records: 20 findings printed, the rest counted, exit 2, no dataset.json."""
    root = tmp_path / "pairs"
    root.mkdir()
    (root / "records.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "instruction": "hi"}) + "\n" for i in range(30)))
    done = forgebench("data", "init", str(root), "--kind", "text-sft")
    assert done.returncode == 2
    assert done.stdout.count("required field is missing") == 20
    assert "... and 10 more" in done.stdout
    assert "30 error(s), listed above; no dataset.json was written" in done.stderr
    assert not (root / "dataset.json").exists()


def test_init_reads_a_folder_per_class_of_grey_pngs_without_being_told(tmp_path):
    root = tmp_path / "letters"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        Image.fromarray(GREY).save(root / label / "x.png")
    done = forgebench("data", "init", str(root), "--kind", "image-classify")
    assert done.returncode == 0, done.stderr
    assert "reading a folder per class" in done.stdout
    assert f"next: no record has a split yet; `forgebench data split {root}`" in done.stdout
    assert "2 images converted from L to RGB on load" in done.stdout
    assert load_dataset(root).classes == ["a", "b"]
    for command in ("validate", "stats"):                  # the same count everywhere
        shown = forgebench("data", command, str(root))
        assert shown.returncode == 0 and "2 images converted from L to RGB" in shown.stdout
    assert json.loads(forgebench("data", "validate", str(root), "--json").stdout)[
        "conversions"] == {"L": 2}


def test_an_sft_runs_data_record_covers_its_dataset_json(tmp_path):
    """lm-sft (and lm-es) over a dataset folder record its version beside its files: an edit
    to a field the run reads is caught, and a record made before is still read."""
    from lm_sft_support import write_config

    from engine.config import load_config
    from engine.data.generators.text import generate_pirate
    from engine.llm.sft_data import data_manifest

    data = tmp_path / "pirate"
    generate_pirate(data)
    config = load_config(write_config(tmp_path, tmp_path / "base.gguf", data=data))
    before = data_manifest(config)
    assert before["versions"] == {"pirate": load_dataset(data).version}
    assert data_change({"files": before["files"]}, before) is None      # an older record
    edit_manifest(data, split_policy={"method": "by hand"})
    after = data_manifest(config)
    assert after["files"] == before["files"]
    assert data_change(before, after).startswith("pirate/dataset.json changed (version ")
