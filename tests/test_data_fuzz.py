"""Fuzzing the validators: malformed JSONL, wrong types, broken images, WAV headers that lie.
They never crash; every problem comes back as a structured finding."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from engine.data.dataset import Report, validate_dataset, write_manifest
from engine.data.generators.shapes import generate_shapes
from engine.data.media import wav_header_problem

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                      children, max_size=4),
    max_leaves=12)


def _structured(report: Report) -> None:
    for finding in report.findings:
        assert isinstance(finding.file, str) and finding.file
        assert isinstance(finding.reason, str) and finding.reason
        assert finding.severity in ("error", "warning")
        assert finding.where is None or isinstance(finding.where, str)


def _sft_dir(records_bytes: bytes) -> Path:
    root = Path(tempfile.mkdtemp(prefix="fuzz-sft-"))
    (root / "records.jsonl").write_bytes(records_bytes)
    write_manifest(root, "text-sft", "fuzz")
    return root


@FUZZ
@given(st.lists(st.binary(max_size=40) | st.text(max_size=40).map(str.encode), max_size=6))
def test_malformed_jsonl_never_crashes(lines):
    root = _sft_dir(b"\n".join(lines))
    try:
        report = validate_dataset(root)
        _structured(report)
        assert not report.ok  # random bytes are never a valid SFT record
        assert all(f.file == "records.jsonl" for f in report.errors)
    finally:
        shutil.rmtree(root)


@FUZZ
@given(st.dictionaries(st.sampled_from(["id", "instruction", "response", "messages", "group",
                                        "split", "source", "rights", "system"]),
                       json_values, max_size=9))
def test_wrong_types_give_findings_not_exceptions(record):
    root = _sft_dir((json.dumps(record) + "\n").encode())
    try:
        report = validate_dataset(root)
        _structured(report)
        valid = (isinstance(record.get("id"), str) and record["id"].strip()
                 and isinstance(record.get("instruction"), str) and record["instruction"].strip()
                 and isinstance(record.get("response"), str) and record["response"].strip()
                 and "messages" not in record)
        if not valid:
            assert report.errors and all(f.where == "line 1" or f.where.startswith("line 1 ")
                                         for f in report.errors)
    finally:
        shutil.rmtree(root)


@FUZZ
@given(json_values)
def test_random_manifest_never_crashes(manifest):
    root = Path(tempfile.mkdtemp(prefix="fuzz-manifest-"))
    try:
        (root / "dataset.json").write_text(json.dumps(manifest))
        report = validate_dataset(root)
        _structured(report)
        assert not report.ok
    finally:
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def shapes_template(tmp_path_factory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("fuzz") / "shapes", n=3, size=16)


@FUZZ
@given(data=st.binary(max_size=300), keep=st.integers(0, 400))
def test_broken_images_are_findings(shapes_template, data, keep):
    root = Path(tempfile.mkdtemp(prefix="fuzz-img-")) / "d"
    shutil.copytree(shapes_template, root)
    try:
        target = root / "images" / "shape-00001.png"
        target.write_bytes(target.read_bytes()[:keep] + data)  # truncated and/or garbage
        old = json.loads((root / "dataset.json").read_text())
        write_manifest(root, "image-masks", "shapes", classes=old["classes"], image=old["image"])
        report = validate_dataset(root)
        _structured(report)
        readable = True
        try:
            with Image.open(target) as image:
                image.load()
                readable = image.mode == "RGB" and image.size == (16, 16)
        except Exception:
            readable = False
        if not readable:
            assert any(f.record_id == "shape-00001" and f.field == "image" for f in report.errors)
    finally:
        shutil.rmtree(root.parent)


def _wav() -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.sin(np.arange(256) / 5) * 0.3, 16000, subtype="PCM_16",
                    format="WAV")
    return buffer.getvalue()


@FUZZ
@given(offset=st.integers(0, 43), value=st.binary(min_size=1, max_size=4),
       cut=st.integers(0, 600))
def test_wav_headers_that_lie(offset, value, cut):
    original = _wav()
    data = bytearray(original)
    data[offset:offset + len(value)] = value
    data = bytes(data[:max(cut, 0)] if cut < len(data) else data)
    root = Path(tempfile.mkdtemp(prefix="fuzz-wav-"))
    try:
        (root / "clips").mkdir()
        (root / "clips" / "a.wav").write_bytes(data)
        (root / "clips.jsonl").write_text(json.dumps(
            {"id": "a", "path": "clips/a.wav", "label": "ping", "split": "train", "group": "a",
             "source": "fuzz", "rights": "fuzz",
             "sha256": hashlib.sha256(data).hexdigest()}) + "\n")
        write_manifest(root, "audio-clips", "fuzz",
                       audio={"sample_rate": 16000, "channels": 1, "subtype": "PCM_16",
                              "samples": 256})
        report = validate_dataset(root)
        _structured(report)
        if wav_header_problem(data) or len(data) != len(original):
            assert any(f.record_id == "a" and f.field == "path" for f in report.errors)
    finally:
        shutil.rmtree(root)


def test_wav_header_problem_names_the_lie():
    good = _wav()
    assert wav_header_problem(good) is None
    lying = bytearray(good)
    lying[40:44] = (10 ** 6).to_bytes(4, "little")
    assert "claims 1000000 bytes" in wav_header_problem(bytes(lying))
    rate = bytearray(good)
    rate[24:28] = (44100).to_bytes(4, "little")  # byte rate no longer matches
    assert "inconsistent fmt chunk" in wav_header_problem(bytes(rate))
