"""speech-recognize end to end on a tiny generated corpus: a real `forgebench run` stopped by
SIGTERM and resumed matches an uninterrupted run bit for bit; `forgebench eval` writes the
greedy/beam report, every clip's transcripts and the probe counts; bad input exits 2.

The default suite trains a handful of steps (the numbers prove the plumbing, not accuracy);
the accuracy run is `bench/bench_speech.py` and the slow-marked test beside it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from media_support import same_tensors

from engine.config import load_config
from engine.fsutil import read_json
from engine.jobs import execute, start_run
from engine.rundir import RunDir
from tests.lm_pretrain_support import forgebench

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None or shutil.which("sox") is None,
                                reason="espeak-ng and sox are not installed (make system-deps)")
REPO = Path(__file__).resolve().parents[1]
TINY = """
[model]
channels = 16
layers = 2
[decode]
beam = 4
probes = 2
[optim]
lr = 3e-3
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from engine.data.generators.speech import generate_speech

    return generate_speech(tmp_path_factory.mktemp("speech") / "cmd", n_speakers=20,
                           per_session=2, seed=0, progress=False)


def write_config(path: Path, data: Path, steps: int = 4) -> Path:
    path.write_text(f'recipe = "speech-recognize"\nseed = 1\nsteps = {steps}\nlog_every = 1\n'
                    f'eval_every = 2\nsave_every = 2\nbatch_size = 4\nprecision = "fp32"\n'
                    f'[data]\ndir = "{data}"\n{TINY}', encoding="utf-8")
    return path


def train_series(run: RunDir) -> dict:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in run.metrics()
            if m.get("split") == "train"}


def test_stop_resume_is_exact_and_eval_reports_everything(corpus, tmp_path):
    config_path = write_config(tmp_path / "c.toml", corpus)
    reference = start_run(load_config(config_path), tmp_path / "ref", ["test"], threads=1)
    execute(reference, load_config(config_path), None, threads=1, progress=False)

    out = tmp_path / "run"
    forgebench("run", str(config_path), "--out", str(out), "--threads", "1",
               "--stop-after-step", "1")
    run = RunDir(out)
    assert run.status()["state"] == "stopped"
    forgebench("resume", str(out), "--threads", "1")
    assert run.status()["state"] == "completed"
    assert sorted(train_series(run)) == [1, 2, 3, 4]
    assert train_series(run) == train_series(reference)
    for name in ("model", "optimizer"):
        same_tensors(out / f"checkpoints/step-000004/{name}.safetensors",
                     reference.path / f"checkpoints/step-000004/{name}.safetensors")
    meta = read_json(out / "checkpoints/step-000004/meta.json")
    assert meta["recipe"] == "speech-recognize" and "".join(meta["classes"]).startswith("abc")
    val_rows = [m for m in run.metrics() if m.get("split") == "val"]
    assert [m["step"] for m in val_rows] == [2, 4] and all("wer" in m for m in val_rows)

    report = json.loads(forgebench("eval", str(out), "--split", "val").stdout)
    assert report["split"] == "val" and report["greedy"]["clips"] == 8
    assert set(report["greedy"]) >= {"raw", "lexical", "empty_reference", "speakers", "terms"}
    assert set(report["greedy"]["terms"]) == {"domain", "negation", "quantity"}
    assert len(report["greedy"]["speakers"]) == 2                    # the two val voices
    probes = report["probes"]
    assert {k: v["clips"] for k, v in probes["kinds"].items()} == {
        "silence": 2, "room_tone": 2, "music_noise": 2, "clipped": 2, "quiet": 2}
    # clipped and quiet speech are flagged from the signal whatever the model says
    assert probes["kinds"]["clipped"]["flagged"] == 2 and probes["kinds"]["quiet"]["flagged"] == 2
    assert probes["kinds"]["silence"]["empty_or_flagged"] == 2
    lines = (out / report["transcripts"]).read_text().splitlines()
    first = json.loads(lines[0])
    assert len(lines) == 8 and {"reference", "greedy", "beam", "flags", "path"} <= set(first)
    assert os.path.isfile(first["path"])
    from app.viewmodels.transcripts import load_clips, transcript_files
    assert transcript_files(out) == [out / report["transcripts"]]
    assert [c.reference for c in load_clips(out / report["transcripts"])] == \
        [json.loads(line)["reference"] for line in lines]


def test_a_bad_transcript_fails_the_run_with_exit_2(corpus, tmp_path):
    data = tmp_path / "bad"
    shutil.copytree(corpus, data)
    rows = (data / "utterances.jsonl").read_text().splitlines()
    record = json.loads(rows[1])
    record["text"] = "replace the M8 bolt"
    rows[1] = json.dumps(record)
    (data / "utterances.jsonl").write_text("\n".join(rows) + "\n")
    manifest = json.loads((data / "dataset.json").read_text())
    from engine.fsutil import sha256_file
    manifest["files"]["utterances.jsonl"] = sha256_file(data / "utterances.jsonl")
    (data / "dataset.json").write_text(json.dumps(manifest))
    result = forgebench("run", str(write_config(tmp_path / "c.toml", data)), "--out",
                        str(tmp_path / "run"), check=False)
    assert result.returncode == 2 and result.stderr.startswith("error:")
    assert "utterances.jsonl: line 2" in result.stderr and "'text'" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FORGEBENCH_SLOW") != "1",
                    reason="the acceptance run trains 1500 steps (about 10 minutes on 2 cores): "
                           "set FORGEBENCH_SLOW=1")
def test_held_out_voices_are_transcribed_and_probes_come_out_empty_or_flagged(tmp_path):
    """The issue's acceptance, on the shipped config: test-split WER below 15 % on voices the
    model never heard, and at least 90 % of silence/noise probes empty or flagged."""
    import sys
    sys.path.insert(0, str(REPO))
    from bench.bench_speech import acceptance

    result = acceptance(None, tmp_path, steps=1500, threads=2)
    test = result["test"]
    test_speakers = set(test["greedy"]["speakers"])
    train_speakers = {r["speaker"] for r in map(json.loads, (tmp_path / "speech" /
                      "utterances.jsonl").read_text().splitlines()) if r["split"] == "train"}
    assert test_speakers and not test_speakers & train_speakers
    assert test["wer"] < 0.15, test["greedy"]["lexical"]
    assert test["probes"]["share"] >= 0.9, test["probes"]
    assert result["curve"][-1]["loss"] < result["curve"][0]["loss"]
