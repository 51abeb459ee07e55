"""The Transcripts pane: reference and hypothesis aligned with the scorer's own alignment and
every error marked (view-model, no Qt), then the real widget on a workspace whose speech run
has an evaluation: the clips list, the marked alignment and the clip's waveform."""

from __future__ import annotations

import json

import numpy as np

from app.viewmodels import transcripts as vm
from app.viewmodels.workspace import Workspace


def test_alignment_marks_each_error_kind():
    # the handbook's example: "the" deleted (not every later word shifted), "off" -> "on"
    assert vm.aligned("turn the pump off", "turn pump on") == [
        ("ok", "turn", "turn"), ("del", "the", None), ("ok", "pump", "pump"), ("sub", "off", "on")]
    assert vm.aligned("stop pump", "stop the pump") == [
        ("ok", "stop", "stop"), ("ins", None, "the"), ("ok", "pump", "pump")]
    page = vm.alignment_html("Turn the pump off.", "turn pump on")
    assert page.count("title='deleted'") == 2              # the word and its gap
    assert page.count("title='substituted'") == 2 and "title='inserted'" not in page
    assert "<td>turn</td>" in page and "<td>pump</td>" in page   # lexical: case, '.' ignored
    # twin: a perfect transcript has nothing marked
    assert "title=" not in vm.alignment_html("stop pump two", "stop pump two")


def write_speech_run(root, clip_path):
    run = root / "runs" / "speech-1"
    (run / "evals").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"recipe": "speech-recognize"}))
    rows = [{"id": "a", "path": str(clip_path), "speaker": "spk1",
             "reference": "do not restart pump three", "greedy": "do restart pump tree",
             "beam": "do restart pump three", "flags": [], "confidence": 0.9},
            {"id": "b", "path": str(clip_path), "speaker": "spk2", "reference": "",
             "greedy": "pump", "beam": "pump", "flags": ["low_confidence"], "confidence": 0.3}]
    (run / "evals" / "val-step-000004-transcripts.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    return run


def sine_clip(path):
    import soundfile

    soundfile.write(path, 0.3 * np.sin(np.arange(8000) / 16000 * 2 * np.pi * 440), 16000,
                    subtype="PCM_16")
    return path


def test_pane_plays_a_clip_with_its_aligned_transcripts(qtbot, tmp_path):
    from app.views.transcripts_pane import TranscriptsPane

    workspace = Workspace.create(tmp_path / "ws", name="speech")
    write_speech_run(workspace.root, sine_clip(tmp_path / "clip.wav"))
    pane = TranscriptsPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    assert pane.run_combo.count() == 1 and pane.eval_combo.currentText() == "val-step-000004"
    labels = [pane.list.item(i).text() for i in range(pane.list.count())]
    assert labels == ["a (spk1) — 2 errors", "b (spk2) — 1 error · flagged: low_confidence"]
    text = pane.alignment.text()
    assert "title='deleted'" in text and "title='substituted'" in text
    assert pane.audio.wave is not None and pane.audio.wave.size == 8000
    pane.list.setCurrentRow(1)
    assert "title='inserted'" in pane.alignment.text()
    assert "not to be trusted" in pane.details.text()
    pane.play()          # plays, or says why not (no PortAudio device here): never raises


def test_clip_labels_wrap_to_the_list_width(qtbot, tmp_path):
    """At 1024x700 the clips list is narrower than a label such as "spk008-booth-000 (spk008)
    — 4 errors · flagged: unknown_words": the label wraps and shows whole, its end (the errors
    and flags the list is scanned for) never out of sight behind a sideways scroll."""
    from layout_support import items_cut_off
    from PySide6.QtWidgets import QSplitter

    from app.views.transcripts_pane import TranscriptsPane

    workspace = Workspace.create(tmp_path / "ws", name="speech")
    write_speech_run(workspace.root, sine_clip(tmp_path / "clip.wav"))
    pane = TranscriptsPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    pane.resize(850, 600)
    pane.show()
    qtbot.waitExposed(pane)
    flagged = pane.list.item(1)
    width = pane.list.fontMetrics().horizontalAdvance(flagged.text()) * 2 // 3  # two lines
    pane.findChild(QSplitter).setSizes([width, 850 - width])
    qtbot.waitUntil(lambda: pane.list.viewport().width() <= width)
    assert pane.list.horizontalScrollBar().maximum() == 0
    assert items_cut_off(pane.list) == []
    # twin: the flagged label did need to wrap (it is taller than the other)
    assert pane.list.visualItemRect(flagged).height() > pane.list.visualItemRect(
        pane.list.item(0)).height()


def test_datasets_pane_lists_speech_clips_with_their_transcripts(tmp_path):
    import shutil

    import pytest
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        pytest.skip("espeak-ng and sox are not installed (make system-deps)")
    from app.viewmodels.datasets import DatasetTable
    from engine.data.generators.speech import generate_speech

    root = generate_speech(tmp_path / "cmd", n_speakers=2, per_session=2, progress=False)
    table = DatasetTable(root)
    assert table.ok and len(table.clips) == 8
    rows = [json.loads(line) for line in (root / "utterances.jsonl").read_text().splitlines()]
    assert [caption.split("\n")[1] for caption, _, _ in table.clips] == [r["text"] for r in rows]


def test_pane_shows_an_evaluation_as_soon_as_its_file_is_written(qtbot, tmp_path):
    """No checkpoint lands and the run is not chosen again: the workspace watch reports the
    eval written into the run, and the pane refreshed on that lists its clips; the same
    evaluation written again is read again with the chosen clip kept."""
    import os

    from app.viewmodels.workspace import WorkspaceWatch
    from app.views.transcripts_pane import NO_RUN, TranscriptsPane

    workspace = Workspace.create(tmp_path / "ws", name="speech")
    run = write_speech_run(workspace.root, sine_clip(tmp_path / "clip.wav"))
    evaluation = run / "evals" / "val-step-000004-transcripts.jsonl"
    rows = evaluation.read_text()
    evaluation.unlink()                         # the run before `forgebench eval`
    pane = TranscriptsPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    watch = WorkspaceWatch(workspace)
    assert pane.list.count() == 0 and pane.alignment.text() == NO_RUN

    def refresh() -> set[str]:                  # what MainWindow.refresh_panes does
        changes = watch.changes()
        if "runs" in changes:
            pane.refresh_runs()
        return changes

    # twin: what a training step writes (metrics) is no change, and the pane stays empty
    (run / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
    assert refresh() == set() and pane.list.count() == 0
    evaluation.write_text(rows)
    assert refresh() == {"runs"}
    assert pane.eval_combo.currentText() == "val-step-000004"
    assert [pane.list.item(i).text() for i in range(2)][0] == "a (spk1) — 2 errors"
    # Re-evaluated: the same file, a perfect first clip (dated a second on: a filesystem may
    # keep coarse times, the eval that rewrites it takes longer than that).
    pane.list.setCurrentRow(1)
    evaluation.write_text(rows.replace('"greedy": "do restart pump tree"',
                                       '"greedy": "do not restart pump three"'))
    later = evaluation.stat().st_mtime_ns + 1_000_000_000
    os.utime(evaluation, ns=(later, later))
    assert refresh() == {"runs"}
    assert pane.list.item(0).text() == "a (spk1) — exact"
    assert pane.list.currentRow() == 1
