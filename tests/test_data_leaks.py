"""The leak detector finds every planted leak and raises no alarm on the clean generated sets."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image, ImageEnhance

from engine.data.dataset import load_dataset, save_new_version, write_manifest
from engine.data.generators.records import generate_records
from engine.data.generators.sfx import generate_sfx
from engine.data.generators.shapes import generate_shapes
from engine.data.generators.text import generate_pirate, generate_style_pairs
from engine.data.leaks import find_leaks


def _records(root: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (root / name).read_text().splitlines()]


def _rewrite(root: Path, name: str, records: list[dict], kind: str, **manifest) -> None:
    (root / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    old = json.loads((root / "dataset.json").read_text())
    keep = {k: v for k, v in old.items() if k in ("classes", "image", "audio", "mask_values")}
    write_manifest(root, kind, old["name"], records=name, **keep, **manifest)


def _pairs(report) -> dict[frozenset, tuple[str, str]]:
    return {frozenset((f.a, f.b)): (f.kind, f.severity) for f in report.findings}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    base = tmp_path_factory.mktemp("clean")
    """Every generator at its default size (what `forgebench data generate` writes)."""
    return {"style": generate_style_pairs(base / "style"),
            "pirate": generate_pirate(base / "pirate"),
            "shapes": generate_shapes(base / "shapes"),
            "sfx": generate_sfx(base / "sfx"),
            "records": generate_records(base / "records")}


@pytest.mark.parametrize("name", ["style", "pirate", "shapes", "sfx", "records"])
def test_no_false_alarm_on_clean_generated_sets(clean, name):
    report = find_leaks([load_dataset(clean[name], check_media=False)])
    assert report.findings == [], [f.render() for f in report.findings]


def test_template_text_is_ignored_and_the_cut_is_reported(clean):
    """The records corpus is one template filled with entities: with every shingle counted,
    hundreds of clean cross-split pairs pass the threshold; the report says what it ignored."""
    dataset = load_dataset(clean["records"], check_media=False)
    everything = find_leaks([dataset], text_common_share=1.0)
    assert len(everything.leaks) > 100  # what the template alone would raise
    settings = find_leaks([dataset]).settings["near-text"]
    assert settings["template_cut"] == 50 and settings["template_shingles_ignored"] > 100
    assert settings["texts_only_template"] == 0 and "more than 50 of the 1000" in \
        settings["explain"]


def test_planted_paraphrase_inside_templated_records_is_found(clean):
    """A train record restated in the test split (questions in another order, other case and
    punctuation) is found although every record shares the template."""
    dataset = load_dataset(clean["records"], check_media=False)
    source = next(r for r in dataset.raw_records() if r["split"] == "train")
    head, *questions = source["text"].split(" Question: ")
    paraphrase = " ".join([head.upper()] + [f"QUESTION - {q}" for q in reversed(questions)])
    test_txt = (dataset.root / "test.txt").read_text() + paraphrase + "\n"
    planted = save_new_version(dataset, {"test.txt": test_txt.encode()}, "planted leak",
                               out_dir=dataset.root.parent / "records-planted")
    new_id = f"test.txt:{test_txt.count(chr(10))}"
    report = find_leaks([planted])
    assert [(f.kind, f.severity, {f.a, f.b}) for f in report.findings] == \
        [("near-text", "error", {source["id"], new_id})], [f.render() for f in report.findings]
    evidence = report.findings[0].evidence
    assert evidence["jaccard"] >= 0.7
    assert evidence["ignored_shingles_in_more_than"] == "50 of 1001 texts"


def test_planted_text_leaks_are_all_found(clean, tmp_path):
    root = Path(shutil.copytree(clean["style"], tmp_path / "style"))
    records = _records(root, "records.jsonl")
    train = [r for r in records if r["split"] == "train"]
    a, b, c = train[0], train[10], train[20]
    planted = [
        # the same group placed in two splits (a paraphrase that escaped its group)
        dict(a, id="leak-group", split="test",
             instruction=a["instruction"].replace("this", "the following")),
        # identical text under a new id and group
        dict(b, id="leak-exact", group="elsewhere-1", split="val"),
        # near-duplicate: case, punctuation and one word changed
        dict(c, id="leak-near", group="elsewhere-2", split="test",
             instruction=c["instruction"].upper().replace(":", " -") + " please",
             response=c["response"].rstrip(".") + "!"),
    ]
    _rewrite(root, "records.jsonl", records + planted, "text-sft")
    report = find_leaks([load_dataset(root)])
    pairs = _pairs(report)
    assert pairs[frozenset((a["id"], "leak-group"))] == ("same-group", "error")
    assert pairs[frozenset((b["id"], "leak-exact"))] == ("identical-text", "error")
    assert pairs[frozenset((c["id"], "leak-near"))] == ("near-text", "error")
    # a planted copy is near its source's paraphrase siblings too (they differ from the source
    # only in the instruction template, which is ignored): each such pair is listed
    near = [f for f in report.findings if f.kind == "near-text"]
    expected = {frozenset((r["id"], "leak-near")) for r in records if r["group"] == c["group"]}
    expected |= {frozenset((r["id"], "leak-exact")) for r in records
                 if r["group"] == b["group"] and r["id"] != b["id"]}
    assert {frozenset((f.a, f.b)) for f in near} == expected
    assert all(0.7 <= f.evidence["jaccard"] for f in near)
    assert len(report.findings) == 2 + len(near), [f.render() for f in report.findings]


def test_duplicate_within_a_split_is_a_warning(clean, tmp_path):
    root = Path(shutil.copytree(clean["pirate"], tmp_path / "pirate"))
    records = _records(root, "records.jsonl")
    _rewrite(root, "records.jsonl", records + [dict(records[0], id="copy", group="copy")],
             "text-sft")
    (finding,) = find_leaks([load_dataset(root)]).findings
    assert (finding.kind, finding.severity, finding.split_a) == ("identical-text", "warning",
                                                                 "train")


def test_same_id_across_two_datasets(clean, tmp_path):
    train = load_dataset(clean["pirate"])
    other = Path(tmp_path / "eval")
    other.mkdir()
    (other / "records.jsonl").write_text(json.dumps(
        {"id": "pirate-3", "instruction": "Completely unrelated prompt about trains?",
         "response": "Trains run on rails.", "split": "test"}) + "\n")
    write_manifest(other, "text-sft", "eval")
    report = find_leaks([train, load_dataset(other)])
    assert _pairs(report) == {frozenset(("pirate:pirate-3", "eval:pirate-3")):
                              ("same-id", "error")}


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_planted_image_leaks_are_all_found(clean, tmp_path):
    root = Path(shutil.copytree(clean["shapes"], tmp_path / "shapes"))
    records = _records(root, "records.jsonl")
    sources = [r for r in records if r["split"] == "train" and r["label"] != "empty"][:5]
    rng = np.random.default_rng(0)

    def jpeg(im):
        buffer = io.BytesIO()
        im.save(buffer, format="JPEG", quality=80)
        return Image.open(buffer).convert("RGB")

    variants = {
        "copy": lambda im: im,
        "jpeg": jpeg,
        "brighter": lambda im: ImageEnhance.Brightness(im).enhance(1.1),
        "noisy": lambda im: Image.fromarray(np.clip(np.asarray(im) + rng.normal(0, 5, (64, 64, 3)),
                                                    0, 255).astype(np.uint8)),
        "rescaled": lambda im: im.resize((100, 100), Image.Resampling.BICUBIC)
        .resize((64, 64), Image.Resampling.BICUBIC),
    }
    planted = []
    for source, (name, change) in zip(sources, variants.items()):
        image = Image.open(root / source["image"]).convert("RGB")
        data = (root / source["image"]).read_bytes() if name == "copy" else _png(change(image))
        (root / "images" / f"leak-{name}.png").write_bytes(data)
        planted.append(dict(source, id=f"leak-{name}", group=f"leak-{name}", split="test",
                            image=f"images/leak-{name}.png"))
    _rewrite(root, "records.jsonl", records + planted, "image-masks")
    report = find_leaks([load_dataset(root)])
    pairs = _pairs(report)
    for source, name in zip(sources, variants):
        expected = "identical-bytes" if name == "copy" else "near-image"
        assert pairs.get(frozenset((source["id"], f"leak-{name}"))) == (expected, "error"), name
    assert len(report.findings) == len(variants), [f.render() for f in report.findings]


def test_planted_audio_leaks_are_all_found(clean, tmp_path):
    root = Path(shutil.copytree(clean["sfx"], tmp_path / "sfx"))
    records = _records(root, "clips.jsonl")
    sources = [r for r in records if r["split"] == "train"][::12][:5]
    rng = np.random.default_rng(1)
    variants = {
        "copy": None,
        "quieter": lambda w: w * 0.6,
        "noisy-shifted": lambda w: np.roll(w * 0.8, 90) + rng.normal(0, 0.001, w.shape),
        "shifted": lambda w: np.roll(w, 200),
        # the start cut off, silence after: its loudness envelope no longer lines up
        "trimmed": lambda w: np.concatenate([w[300:], np.zeros(300)]) * 0.9,
    }
    planted = []
    for source, (name, change) in zip(sources, variants.items()):
        path = root / source["path"]
        if change is None:
            data = path.read_bytes()
        else:
            wave, rate = soundfile.read(str(path))
            buffer = io.BytesIO()
            soundfile.write(buffer, np.clip(change(wave), -1, 1), rate, subtype="PCM_16",
                            format="WAV")
            data = buffer.getvalue()
        (root / "clips" / f"leak-{name}.wav").write_bytes(data)
        planted.append(dict(source, id=f"leak-{name}", group=f"leak-{name}", split="val",
                            path=f"clips/leak-{name}.wav",
                            sha256=hashlib.sha256(data).hexdigest()))
    _rewrite(root, "clips.jsonl", records + planted, "audio-clips")
    report = find_leaks([load_dataset(root)])
    pairs = _pairs(report)
    for source, name in zip(sources, variants):
        expected = "identical-bytes" if name == "copy" else "near-audio"
        assert pairs.get(frozenset((source["id"], f"leak-{name}"))) == (expected, "error"), name
    assert len(report.findings) == len(variants), [f.render() for f in report.findings]


def test_common_shingles_are_those_in_more_than_the_cut_of_texts():
    """drop_common_shingles against a plain count of texts per shingle."""
    from collections import Counter

    from engine.data.similarity import drop_common_shingles

    rng = np.random.default_rng(5)
    sets = [np.unique(rng.integers(0, 60, rng.integers(0, 30))).astype(np.uint64)
            for _ in range(200)]
    kept, cut, n_common = drop_common_shingles(sets, max_share=0.2, min_texts=20)
    in_texts = Counter(int(v) for s in sets for v in s)
    common = {v for v, n in in_texts.items() if n > 40}
    assert cut == 40 and n_common == len(common) > 0
    assert [set(map(int, k)) for k in kept] == [set(map(int, s)) - common for s in sets]
    small, cut, n_common = drop_common_shingles(sets[:10], max_share=0.2, min_texts=20)
    assert (cut, n_common) == (20, 0)  # in a small set a shared phrase may be a copy: kept
    assert all(np.array_equal(a, b) for a, b in zip(small, sets[:10]))
