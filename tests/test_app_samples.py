"""The Samples pane over real engine runs: a sampling job started from the pane (progress,
cancel), image grids with the nearest training image, audio clips shown exactly as written
with their integrity flags, playback that only applies the level control (and says clearly
when there is no audio device), and rubric ratings appended to ratings/."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile
from app_part2_support import media_workspace, wait_for
from media_support import REPO
from PySide6.QtCore import Qt

from app import audio
from app.viewmodels import jobs
from app.viewmodels import samples as vm
from app.views.samples_pane import SamplesPane


def test_part2_viewmodels_import_neither_qt_nor_torch_nor_sounddevice():
    code = ("import sys, app.viewmodels.samples, app.viewmodels.ab, "
            "app.viewmodels.export_wizard, app.audio; "
            "print([m for m in ('PySide6', 'torch', 'sounddevice') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_playback_applies_only_the_level_and_starts_quiet():
    quiet = 0.01 * np.sin(np.linspace(0, 40, 4000)).astype(np.float32)   # peak 0.01
    out = audio.apply_gain(quiet, audio.START_GAIN_DB)
    # -18 dB is a factor of 10^(-18/20) = 0.12589...; nothing is scaled up to full range
    np.testing.assert_allclose(out, quiet * 0.12589254117941673, rtol=1e-6)
    assert np.abs(out).max() < 0.0013
    assert audio.Player().gain_db == audio.START_GAIN_DB == -18.0
    np.testing.assert_array_equal(audio.apply_gain(quiet, 0.0), quiet)
    np.testing.assert_allclose(audio.apply_gain(quiet, +12.0), quiet)     # capped at 0 dB


def test_no_portaudio_is_reported_and_playing_does_nothing(monkeypatch):
    real_import = builtins.__import__

    def no_portaudio(name, *args, **kwargs):
        if name == "sounddevice":
            raise OSError("PortAudio library not found")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_portaudio)
    player = audio.Player()
    assert not player.available
    assert "PortAudio is missing" in player.problem
    assert player.play(np.zeros(100, np.float32), 16_000) is False


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return media_workspace(tmp_path_factory)


@pytest.fixture
def pane(qtbot, workspace):
    widget = SamplesPane()
    qtbot.addWidget(widget)
    widget.set_workspace(workspace)
    return widget


@pytest.mark.slow
def test_generate_view_and_rate_image_samples(pane, qtbot, workspace):
    run = workspace.runs_dir / "image"
    pane.select_run(run)
    pane.checkpoint.setCurrentText("step-000002")
    pane.n.setValue(4)
    pane.seed.setValue(7)
    qtbot.mouseClick(pane.generate_button, Qt.MouseButton.LeftButton)
    assert pane.job.running and not pane.generate_button.isEnabled()
    wait_for(qtbot, pane.job)
    assert pane.job.status.text() == "done" and pane.job.bar.value() == pane.job.bar.maximum()

    sidecars = sorted((run / "samples" / "step-000002").glob("*-seed7-*.json"))
    assert len(sidecars) == 12                              # 3 classes x 4 per class
    assert {json.loads(p.read_text())["seed"] for p in sidecars} == {7}
    rows, columns, _ = pane.grid_index
    assert rows == ["circle", "square", "triangle"]
    # other tests in this module may have sampled other checkpoints of the shared run
    assert [c for c in columns if c[0] == "step-000002"] == [
        ("step-000002", 7, f"{i:03d}") for i in range(4)]
    assert pane.grid.rowCount() == 3 and pane.grid.columnCount() == len(columns)
    column = columns.index(("step-000002", 7, "002"))
    assert not pane.grid.item(1, column).icon().isNull()

    pane.grid.setCurrentCell(1, column)                     # square, seed 7, #2
    assert pane.current.path == run / "samples" / "step-000002" / "square-seed7-002.png"
    pane.show_neighbour()
    wanted = json.loads(pane.current.path.with_suffix(".json").read_text())
    near_id = wanted["nearest_training"]["pixel"]["id"]
    assert near_id in pane.info.text()
    records = [json.loads(line) for line in
               (workspace.root.parent / "data" / "shapes" / "records.jsonl").read_text()
               .splitlines()]
    expected = next(r["image"] for r in records if r["id"] == near_id)
    assert expected in pane.info.text()                     # the training file, by its id

    assert list(pane.rubric.combos) == list(vm.RUBRICS["image"])
    pane.rubric.combos["content"].setCurrentIndex(pane.rubric.combos["content"].findData(4))
    pane.rubric.combos["memorization"].setCurrentIndex(2)   # score 2
    qtbot.mouseClick(pane.rubric.save_button, Qt.MouseButton.LeftButton)
    lines = (workspace.root / "ratings" / "rubric-image.jsonl").read_text().splitlines()
    saved = json.loads(lines[-1])
    assert saved["sample"] == "samples/step-000002/square-seed7-002.png"
    assert saved["scores"] == {"content": 4, "memorization": 2} and saved["kind"] == "image"
    pane.grid.setCurrentCell(0, 0)
    assert pane.rubric.scores() == {}
    pane.grid.setCurrentCell(1, column)                     # the saved scores come back
    assert pane.rubric.scores() == {"content": 4, "memorization": 2}


@pytest.mark.slow
def test_audio_clips_are_shown_as_written_with_flags_and_rated(pane, qtbot, workspace):
    run = workspace.runs_dir / "audio"
    pane.select_run(run)
    pane.checkpoint.setCurrentText("step-000004")
    pane.class_name.setCurrentIndex(pane.class_name.findData("ping"))
    pane.n.setValue(2)
    pane.seed.setValue(3)
    pane.generate()
    wait_for(qtbot, pane.job)
    assert pane.job.status.text() == "done"
    clips = [s for s in pane.samples if s.kind == "audio"]
    assert [c.item for c in clips] == ["ping-seed3-000", "ping-seed3-001"]
    assert pane.clips.count() == 2

    pane.clips.setCurrentRow(1)
    written, rate = soundfile.read(str(clips[1].path), dtype="float32")
    x, y = pane.audio.wave_curve.getData()
    np.testing.assert_array_equal(y, written)               # never normalized for display
    assert rate == 16_000 and x[-1] == pytest.approx((written.size - 1) / 16_000)
    flags = clips[1].sidecar["integrity"]["flags"]
    shown = pane.audio.flags.text()
    assert all(flag in shown for flag in flags) and ("no flags" in shown) == (not flags)
    assert pane.audio.spec_image.image.shape == vm.spectrogram(written).shape
    if not pane.player.available:                           # this machine: no PortAudio
        assert not pane.audio.play_button.isEnabled()
        assert "unavailable" in pane.audio.device.text()
        assert "Everything else works" in pane.audio.device.text()

    assert list(pane.rubric.combos) == ["class correctness", "integrity", "diversity",
                                        "memorization"]
    pane.rubric.combos["class correctness"].setCurrentIndex(5)
    pane.rubric.combos["integrity"].setCurrentIndex(1)
    pane.save_rating()
    saved = json.loads((workspace.root / "ratings" / "rubric-audio.jsonl").read_text()
                       .splitlines()[-1])
    assert saved["scores"] == {"class correctness": 5, "integrity": 1}
    assert saved["sample"] == "samples/step-000004/ping-seed3-001.wav"


@pytest.mark.slow
def test_cancelling_a_sampling_job_writes_nothing(pane, qtbot, workspace):
    run = workspace.runs_dir / "audio"
    pane.select_run(run)
    pane.checkpoint.setCurrentText("step-000002")
    pane.n.setValue(6)
    pane.seed.setValue(99)
    pane.generate()
    qtbot.waitUntil(lambda: "sample" in pane.job.output or not pane.job.running, timeout=120_000)
    pane.job.cancel()
    wait_for(qtbot, pane.job)
    assert pane.job.status.text().startswith("cancelled")
    assert not list((run / "samples").glob("*/*-seed99-*"))
    assert pane.generate_button.isEnabled()


def test_rubric_refuses_unknown_dimensions_and_scores(tmp_path):
    from engine.errors import ForgebenchError

    run = tmp_path / "runs" / "r"
    store = vm.RubricStore(tmp_path / "ratings", run)
    with pytest.raises(ForgebenchError, match="not a audio rubric dimension: style"):
        store.record(run / "samples/a.wav", "audio", {"style": 3}, "me")
    with pytest.raises(ForgebenchError, match="1..5"):
        store.record(run / "samples/a.wav", "audio", {"integrity": 9}, "me")
    assert not store.path.exists()
    store.record(run / "samples/a.wav", "audio", {"integrity": 2}, "me")
    store.record(run / "samples/a.wav", "audio", {"integrity": 4}, "me")
    assert store.latest(run / "samples/a.wav", "me")["scores"] == {"integrity": 4}
    assert len(store.ratings()) == 2                        # append-only: both kept


def test_progress_is_read_from_tqdm_output():
    chunk = ("sample:  25%|██▌       | 2/8 [00:05<00:15]\r"
             "sample:  38%|███▊      | 3/8 [00:06<00:10]")
    assert jobs.parse_progress(chunk) == (3, 8)
    assert jobs.parse_progress("loading") is None
    assert jobs.job_error("x\nsample: 1/2\nerror: bad.toml: field 'n': must be at least 1\n"
                        "  hint: fix it\n") == "error: bad.toml: field 'n': must be at least 1\n" \
                                               "  hint: fix it"


def test_before_after_of_a_run_from_scratch_and_of_a_tuned_run(tmp_path):
    """A run trained from scratch with one checkpoint of answers still shows them (no empty
    table) under columns naming its checkpoints; an SFT run's step 0 is its base (BEFORE)."""
    name, field = next(iter(vm.TEXT_FILES.items()))[0], next(iter(vm.TEXT_FILES.values()))[1]

    def answers(run, checkpoint, text):
        folder = run / "samples" / checkpoint
        folder.mkdir(parents=True)
        (folder / name).write_text(json.dumps({"prompt": "Hi", field: text}) + "\n")

    scratch = tmp_path / "scratch"
    answers(scratch, "step-000040", "hello")
    assert vm.before_after(scratch) == [("Hi", "—", "hello")]
    assert vm.before_after_headers(scratch) == ("—", "latest (step-000040)")
    answers(scratch, "step-000080", "hello there")
    assert vm.before_after(scratch) == [("Hi", "hello", "hello there")]
    assert vm.before_after_headers(scratch) == ("first (step-000040)", "latest (step-000080)")
    tuned = tmp_path / "tuned"
    answers(tuned, "step-000000", "base answer")
    answers(tuned, "step-000030", "Ahoy")
    assert vm.before_after_headers(tuned) == ("BEFORE (base)", "AFTER (step-000030)")


def test_sampler_steps_reach_the_job_and_the_rubric_follows_the_run(pane, qtbot, workspace):
    run = workspace.runs_dir / "image"
    pane.select_run(run)
    levels = json.loads((run / "run.json").read_text())["config"]["diffusion"]["levels"]
    assert pane.steps.maximum() == levels and pane.steps.isEnabled()
    pane.checkpoint.setCurrentText("step-000004")
    pane.class_name.setCurrentIndex(pane.class_name.findData("circle"))
    pane.n.setValue(1)
    pane.seed.setValue(31)
    pane.steps.setValue(3)
    qtbot.mouseClick(pane.generate_button, Qt.MouseButton.LeftButton)
    wait_for(qtbot, pane.job)
    sidecar = json.loads((run / "samples" / "step-000004" / "circle-seed31-000.json")
                         .read_text())
    assert sidecar["settings"]["steps"] == 3
    assert list(pane.rubric.combos) == list(vm.RUBRICS["image"])
    pane.select_run(workspace.runs_dir / "audio")       # another run: never image dimensions
    audio_samples = [s for s in vm.run_samples(workspace.runs_dir / "audio")
                     if s.kind == "audio"]
    assert list(pane.rubric.combos) == (list(vm.RUBRICS["audio"]) if audio_samples else [])
