"""The speech dataset kind and its generated corpus: espeak-ng voices as speakers, splits by
speaker, a recorded transcript policy, and every bad input (a WAV without a transcript, a
transcript outside the policy, a speaker in two splits) as a finding with line and field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.data.dataset import load_dataset, validate_dataset, write_manifest
from engine.data.speech import DEFAULT_POLICY, transcript_problem
from engine.errors import ForgebenchError
from tests.lm_pretrain_support import forgebench

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None,
                                reason="espeak-ng and sox are not installed (make system-deps)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from engine.data.generators.speech import generate_speech

    return generate_speech(tmp_path_factory.mktemp("speech") / "cmd", n_speakers=20,
                           per_session=2, seed=0, progress=False)


def records(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "utterances.jsonl").read_text().splitlines()]


def edited(corpus: Path, tmp_path: Path, edit) -> Path:
    """A copy of the corpus with its records file edited and the manifest rewritten (so the
    file hashes match and only the edit is wrong)."""
    root = tmp_path / "edited"
    shutil.copytree(corpus, root)
    rows = edit(records(root))
    (root / "utterances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = json.loads((root / "dataset.json").read_text())
    for key in ("files", "version", "parent", "created", "kind", "name", "schema_version"):
        manifest.pop(key, None)
    write_manifest(root, "speech", "edited", **manifest)
    return root


def test_corpus_validates_and_splits_whole_speakers(corpus):
    dataset = load_dataset(corpus)
    assert dataset.kind == "speech" and dataset.manifest["transcripts"] == DEFAULT_POLICY
    rows = dataset.records()
    assert len(rows) == 20 * 2 * 2
    speaker_split = {}
    for row in rows:
        assert speaker_split.setdefault(row["speaker"], row["split"]) == row["split"]
        assert row["session"].startswith(row["speaker"])
    counts = {s: sum(v == s for v in speaker_split.values()) for s in ("train", "val", "test")}
    assert counts == {"train": 16, "val": 2, "test": 2}
    voices = {row["voice"] for row in rows}
    assert len(voices) == 20                                    # one accent+variant a speaker
    test_voices = {r["voice"] for r in rows if r["split"] == "test"}
    assert not test_voices & {r["voice"] for r in rows if r["split"] == "train"}
    assert all(transcript_problem(r["text"], DEFAULT_POLICY) is None for r in rows)
    assert set(dataset.manifest["terms"]) == {"domain", "negation", "quantity"}


def test_clips_are_16k_mono_speech_with_room_tone(corpus):
    import soundfile

    rows = load_dataset(corpus).records()
    spoken = next(r for r in rows if r["text"])
    wave, rate = soundfile.read(spoken["path"])
    assert rate == 16000 and wave.ndim == 1 and 0.2 < np.abs(wave).max() <= 0.9
    # a room-tone frame (the lead-in) is far quieter than the speech but not digital silence
    lead = wave[:800]
    assert 0 < np.sqrt(np.mean(lead ** 2)) < 0.1 * np.sqrt(np.mean(wave ** 2))


def test_generation_is_deterministic(corpus, tmp_path):
    from engine.data.generators.speech import generate_speech

    again = generate_speech(tmp_path / "again", n_speakers=20, per_session=2, seed=0,
                            progress=False)
    first, second = (json.loads((p / "dataset.json").read_text()) for p in (corpus, again))
    assert first["files"] == second["files"]


@pytest.mark.parametrize("text,reason", [
    ("replace the m8 bolt on pump three", "digit '8'"),
    ("Replace the m eight bolt", "capital letters"),
    ("do not restart pump three.", "punctuation characters outside"),
    ("check  the seal", "single spaces"),
])
def test_transcript_outside_the_policy_names_line_and_field(corpus, tmp_path, text, reason):
    def edit(rows):
        rows[4]["text"] = text
        return rows
    root = edited(corpus, tmp_path, edit)
    first = validate_dataset(root).errors[0]
    assert first.file == "utterances.jsonl" and first.where.startswith("line 5")
    assert first.field == "text" and reason in first.reason
    with pytest.raises(ForgebenchError) as caught:
        load_dataset(root)
    assert "line 5" in caught.value.where and "'text'" in caught.value.where


def test_a_wav_without_a_transcript_is_reported_both_ways(corpus, tmp_path):
    def edit(rows):
        del rows[2]["text"]          # a record naming its WAV but no transcript
        return rows[:-1]             # and a WAV no record names at all
    root = edited(corpus, tmp_path, edit)
    errors = validate_dataset(root).errors
    missing = next(e for e in errors if e.field == "text")
    assert missing.where.startswith("line 3") and "required field is missing" in missing.reason
    orphans = {e.file for e in errors if "without a transcript" in e.reason}
    assert orphans == {records(corpus)[2]["path"], records(corpus)[-1]["path"]}


def test_a_wav_dropped_into_the_folder_by_hand_is_reported(corpus, tmp_path):
    root = edited(corpus, tmp_path, lambda rows: rows)
    assert not [e for e in validate_dataset(root).errors if "without a transcript" in e.reason]
    first = root / records(corpus)[0]["path"]
    shutil.copy(first, first.with_name("new-take.wav"))       # no record, not in dataset.json
    found = [e for e in validate_dataset(root).errors if "without a transcript" in e.reason]
    assert [e.file for e in found] == [f"{Path(records(corpus)[0]['path']).parent}/new-take.wav"]
    assert "neither dataset.json nor" in found[0].reason


def test_a_speaker_in_two_splits_is_refused(corpus, tmp_path):
    def edit(rows):
        victim = next(i for i, r in enumerate(rows) if r["split"] == "train" and i > 0
                      and rows[i - 1]["speaker"] == r["speaker"])
        rows[victim]["split"] = "test"
        return rows
    root = edited(corpus, tmp_path, edit)
    fields = {e.field for e in validate_dataset(root).errors if "split whole" in e.reason}
    assert fields == {"speaker", "session"}


def test_a_missing_policy_is_a_manifest_finding(corpus, tmp_path):
    root = tmp_path / "nopolicy"
    shutil.copytree(corpus, root)
    manifest = json.loads((root / "dataset.json").read_text())
    del manifest["transcripts"]
    (root / "dataset.json").write_text(json.dumps(manifest))
    first = validate_dataset(root).errors[0]
    assert first.file == "dataset.json" and first.field == "transcripts"


def test_cli_reports_a_bad_transcript_as_one_error_line(corpus, tmp_path):
    def edit(rows):
        rows[0]["text"] = "set pump 2 to forty bar"
        return rows
    root = edited(corpus, tmp_path, edit)
    result = forgebench("data", "validate", str(root), check=False)
    assert result.returncode != 0 and "line 1" in result.stdout + result.stderr
    assert "digit '2'" in result.stdout + result.stderr


def test_missing_espeak_is_a_clear_error(monkeypatch, tmp_path):
    from engine.data.generators import speech

    monkeypatch.setattr(speech.shutil, "which", lambda name: None)
    with pytest.raises(ForgebenchError) as caught:
        speech.generate_speech(tmp_path / "x", n_speakers=2, per_session=1, progress=False)
    assert "not installed" in caught.value.message and "make system-deps" in caught.value.hint
    assert not (tmp_path / "x").exists()
