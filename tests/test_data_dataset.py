"""Datasets: the generated sample sets, loading, validation findings and new versions."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from engine.data.dataset import load_dataset, save_new_version, validate_dataset, write_manifest
from engine.data.generators.sfx import generate_sfx
from engine.data.generators.shapes import generate_shapes
from engine.data.media import box_from_mask
from engine.errors import ForgebenchError


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("shapes") / "shapes", n=40, size=32, seed=3,
                           empty_prob=0.2)


@pytest.fixture(scope="module")
def sfx_dir(tmp_path_factory) -> Path:
    return generate_sfx(tmp_path_factory.mktemp("sfx") / "sfx", n_per_class=5, seed=1)


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def _rewrite_records(root: Path, name: str, edit, tail: str = "") -> None:
    """Edit the records file and re-hash the manifest (as a user creating a dataset would)."""
    path = root / name
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in edit(records)) + tail)
    manifest = json.loads((root / "dataset.json").read_text())
    manifest["files"][name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (root / "dataset.json").write_text(json.dumps(manifest))


def test_box_from_mask_matches_the_handbook_worked_example():
    mask = np.zeros((10, 10), dtype=np.uint8)
    mask[2:6, 2:7] = 255  # rows 2..5, columns 2..6 inclusive
    assert box_from_mask(mask) == [0.2, 0.2, 0.7, 0.6]
    assert box_from_mask(np.zeros((4, 4))) is None


def test_shapes_records_images_masks_and_boxes_agree(shapes_dir):
    dataset = load_dataset(shapes_dir)
    assert dataset.kind == "image-masks"
    assert dataset.classes == ["circle", "square", "triangle"]
    records = dataset.records()
    assert len(records) == 40
    assert {s: len(dataset.records(s)) for s in ("train", "val", "test")} == \
        {"train": 32, "val": 4, "test": 4}
    labels = {r["label"] for r in records}
    assert {"circle", "square", "triangle", "empty"} <= labels
    for record in records:
        image = Image.open(record["image"])
        mask = np.asarray(Image.open(record["mask"]))
        assert image.mode == "RGB" and image.size == (32, 32)
        assert set(np.unique(mask)) <= {0, 255}
        ys, xs = np.nonzero(mask)
        if record["label"] == "empty":
            assert record["box"] is None and xs.size == 0
        else:  # independent recomputation: exclusive max edge, normalized by width/height
            assert record["box"] == [xs.min() / 32, ys.min() / 32,
                                     (xs.max() + 1) / 32, (ys.max() + 1) / 32]
        for key in ("group", "source", "rights"):
            assert record[key]
    assert set(dataset.files_manifest()) >= {"records.jsonl", "images/shape-00000.png"}


def test_shapes_colours_do_not_reveal_the_class(shapes_dir):
    """Mean object colour per class is near the overall mean: colour is not a class cue."""
    dataset = load_dataset(shapes_dir)
    colours = {}
    for record in dataset.records():
        if record["label"] == "empty":
            continue
        image = np.asarray(Image.open(record["image"])).astype(float)
        inside = np.asarray(Image.open(record["mask"])) > 0
        colours.setdefault(record["label"], []).append(image[inside].mean(axis=0))
    means = {k: np.mean(v, axis=0) for k, v in colours.items()}
    spread = max(np.abs(a - b).max() for a in means.values() for b in means.values())
    assert spread < 90  # uniform colours; a class-coded palette would differ by ~128+


def test_generators_extend_without_changing_existing_items(tmp_path):
    small = generate_shapes(tmp_path / "a", n=10, size=24, seed=5)
    large = generate_shapes(tmp_path / "b", n=25, size=24, seed=5)
    a = [json.loads(line) for line in (small / "records.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (large / "records.jsonl").read_text().splitlines()]
    assert a == b[:10]
    for record in a:
        assert (small / record["image"]).read_bytes() == (large / record["image"]).read_bytes()


def test_generator_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(ForgebenchError, match="not empty"):
        generate_shapes(tmp_path / "x", n=2)
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


def test_sfx_clips_are_mono_16k_pcm16_8192_and_hashed(sfx_dir):
    dataset = load_dataset(sfx_dir)
    assert dataset.kind == "audio-clips" and dataset.classes == ["thump", "ping", "hiss"]
    centroid = {}
    for record in dataset.records():
        info = soundfile.info(str(record["path"]))
        assert (info.samplerate, info.channels, info.subtype, info.frames) == \
            (16000, 1, "PCM_16", 8192)
        assert hashlib.sha256(record["path"].read_bytes()).hexdigest() == record["sha256"]
        wave, _ = soundfile.read(str(record["path"]))
        assert 0.2 < np.abs(wave).max() < 0.95  # audible, never clipped
        spectrum = np.abs(np.fft.rfft(wave)) ** 2
        freqs = np.fft.rfftfreq(wave.size, 1 / 16000)
        centroid.setdefault(record["label"], []).append((spectrum * freqs).sum() / spectrum.sum())
    # power centroids: thumps are low, pings and hisses far higher: audibly distinct
    assert max(centroid["thump"]) < 400 < min(centroid["ping"])
    assert max(centroid["thump"]) < min(centroid["hiss"])


def test_validation_names_file_line_field_and_reason(shapes_dir, tmp_path):
    root = _copy(shapes_dir, tmp_path / "bad")

    def damage(records):
        records[0]["box"] = [0.5, 0.5, 0.4, 0.9]          # not ordered
        records[1]["label"] = "hexagon"                    # unknown class
        records[2]["image"] = "../outside.png"             # escapes the folder
        records[3]["id"] = records[4]["id"]                # duplicate id
        del records[5]["mask"]                             # missing required field
        records[6]["box"] = [0.0, 0.0, 1.0, 1.0] if records[6]["box"] else [0, 0, .5, .5]
        return records

    _rewrite_records(root, "records.jsonl", damage, tail="{not json\n")
    report = validate_dataset(root)
    got = {(f.where.split(" ")[1], f.field) for f in report.errors if f.where}
    assert {("1", "box"), ("2", "label"), ("3", "image"), ("5", "id"), ("6", "mask"),
            ("7", "box"), ("41", None)} <= got
    assert all(f.file == "records.jsonl" for f in report.errors)
    box_finding = next(f for f in report.errors if f.where.startswith("line 7"))
    assert "derived from the mask" in box_finding.reason
    with pytest.raises(ForgebenchError) as info:
        load_dataset(root)
    assert "records.jsonl" in str(info.value) and "line 1" in str(info.value)


def test_changed_raw_file_is_caught_by_its_hash(shapes_dir, tmp_path):
    root = _copy(shapes_dir, tmp_path / "edited")
    Image.new("L", (32, 32), 0).save(root / "masks" / "shape-00001.png")
    report = validate_dataset(root)
    assert any(f.file == "masks/shape-00001.png" and "changed" in f.reason
               for f in report.errors)


def test_lying_or_wrong_audio_is_reported(sfx_dir, tmp_path):
    root = _copy(sfx_dir, tmp_path / "sfx")
    clip = root / "clips" / "ping-0000.wav"
    data = bytearray(clip.read_bytes())
    data[40:44] = (10 ** 6).to_bytes(4, "little")  # data chunk claims far more than it holds
    clip.write_bytes(bytes(data))
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(8192), 22050, subtype="PCM_16", format="WAV")
    (root / "clips" / "hiss-0001.wav").write_bytes(buffer.getvalue())
    write_manifest(root, "audio-clips", "sfx", records="clips.jsonl",
                   audio={"sample_rate": 16000, "channels": 1, "subtype": "PCM_16",
                          "samples": 8192})
    findings = {}
    for finding in validate_dataset(root).errors:
        findings.setdefault((finding.record_id, finding.field), []).append(finding.reason)
    assert "22050" in findings["hiss-0001", "path"][0]
    assert "claims 1000000 bytes" in findings["ping-0000", "path"][0]
    # the edited files no longer match the checksums in the records either
    assert findings["ping-0000", "sha256"] and findings["hiss-0001", "sha256"]


def test_path_outside_folder_via_symlink_is_refused(shapes_dir, tmp_path):
    root = _copy(shapes_dir, tmp_path / "linked")
    outside = tmp_path / "secret.png"
    Image.new("RGB", (32, 32)).save(outside)
    (root / "images" / "shape-00000.png").unlink()
    (root / "images" / "shape-00000.png").symlink_to(outside)
    report = validate_dataset(root)
    assert any(f.file == "images/shape-00000.png" and "outside" in f.reason
               for f in report.errors)


def test_missing_or_broken_manifest_is_one_clear_error(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ForgebenchError, match="dataset.json"):
        load_dataset(tmp_path / "d")
    (tmp_path / "d" / "dataset.json").write_text('{"kind": "video"}')
    report = validate_dataset(tmp_path / "d")
    assert report.errors[0].field == "kind" and "text-sft" in report.errors[0].reason


def test_save_new_version_leaves_the_original_untouched(shapes_dir, tmp_path):
    root = _copy(shapes_dir, tmp_path / "shapes")
    dataset = load_dataset(root)
    before = {rel: (root / rel).read_bytes() for rel in dataset.files_manifest()}
    target = next(r for r in dataset.raw_records() if r["label"] != "empty")
    edited = np.zeros((32, 32), dtype=np.uint8)
    edited[4:10, 8:20] = 255
    buffer = io.BytesIO()
    Image.fromarray(edited, "L").save(buffer, format="PNG")
    new = save_new_version(dataset, {target["mask"]: buffer.getvalue()}, note="fixed mask")
    assert new.root == tmp_path / "shapes-v2"
    assert new.manifest["parent"] == dataset.version != new.version
    assert new.manifest["history"][-1]["note"] == "fixed mask"
    assert {rel: (root / rel).read_bytes() for rel in dataset.files_manifest()} == before
    assert load_dataset(root).version == dataset.version
    record = next(r for r in new.raw_records() if r["id"] == target["id"])
    assert record["box"] == [8 / 32, 4 / 32, 20 / 32, 10 / 32]  # re-derived from the new mask
    assert new.files_manifest()[target["mask"]] != dataset.files_manifest()[target["mask"]]


def test_recipe_requirements_are_checked_on_every_file(sfx_dir):
    dataset = load_dataset(sfx_dir, require={"audio": {"samples": 8192, "sample_rate": 16000}})
    assert len(dataset.records()) == 15
    with pytest.raises(ForgebenchError, match="22050 Hz") as info:
        load_dataset(sfx_dir, require={"audio": {"sample_rate": 22050}})
    assert "clips.jsonl" in str(info.value) and "field 'path'" in str(info.value)


def test_folder_per_class_images(tmp_path):
    root = tmp_path / "parts"
    for split, label, n in [("train", "bent", 2), ("train", "ok", 3), ("test", "ok", 1)]:
        (root / split / label).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / split / label / f"{i}.png")
    write_manifest(root, "image-classify", "parts", layout="folders")
    dataset = load_dataset(root)
    assert dataset.classes == ["bent", "ok"]
    assert {r["id"]: (r["split"], r["label"]) for r in dataset.records()}["train/ok/2"] == \
        ("train", "ok")
    assert len(dataset.records("train")) == 5 and len(dataset.records("test")) == 1


def test_captions_and_preferences_formats(tmp_path):
    captions = tmp_path / "captions"
    captions.mkdir()
    Image.new("RGB", (8, 8)).save(captions / "a.png")
    (captions / "metadata.jsonl").write_text(
        json.dumps({"file_name": "a.png", "text": "a black square", "group": "s1"}) + "\n" +
        json.dumps({"file_name": "a.png", "text": "", "group": "s2"}) + "\n" +
        json.dumps({"file_name": "missing.png", "text": "gone", "group": "s3"}) + "\n")
    write_manifest(captions, "captioned-images", "captions")
    findings = {(f.where.split(" (")[0], f.field) for f in validate_dataset(captions).errors}
    assert findings == {("line 2", "text"), ("line 3", "file_name")}

    prefs = tmp_path / "prefs"
    prefs.mkdir()
    (prefs / "records.jsonl").write_text(
        json.dumps({"id": "p1", "prompt": "Say hi", "chosen": "Hi!", "rejected": "No."}) + "\n" +
        json.dumps({"id": "p2", "prompt": "Say hi", "chosen": "Hi!"}) + "\n")
    write_manifest(prefs, "preferences", "prefs")
    (finding,) = validate_dataset(prefs).errors
    assert (finding.record_id, finding.field, finding.reason) == \
        ("p2", "rejected", "required field is missing")
