"""pytest-qt flows (offscreen) through the real window: the sample workspace, a planted dataset
error marked at its record, mask editing saved as a new version, inline form validation, and a
missing workspace reported with ways out."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from app_wait import GuiThreadGuard, settle
from PySide6.QtCore import QPoint, Qt, QTimer
from PySide6.QtWidgets import QLineEdit
from test_app_support import make_workspace

import app.viewmodels.datasets as datasets_vm
from app.main import open_initial_workspace
from app.viewmodels.masks import read_mask
from app.viewmodels.workspace import BUNDLED_SAMPLE, Settings
from app.views.dataset_tabs.records import ERROR_BG
from app.views.main_window import MainWindow
from engine.data.dataset import load_dataset
from engine.eval.masks import boundary


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FORGEBENCH_DATA_DIR", str(tmp_path / "data"))
    win = MainWindow(Settings())
    win.close_policy = "leave"
    qtbot.addWidget(win)
    win.resize(1440, 900)
    win.show()
    return win


def test_first_launch_opens_the_sample_workspace(window, tmp_path):
    assert window.settings.first_launch
    assert open_initial_workspace(window)
    copy = tmp_path / "data" / "sample-workspace"
    assert window.workspace.root == copy.resolve()
    assert not window.banner.isVisible()
    bundled_configs = sorted(p.name for p in (BUNDLED_SAMPLE / "configs").glob("*.toml"))
    combo = window.runs.config_combo
    assert sorted(combo.itemText(i) + ".toml" for i in range(combo.count())) == bundled_configs
    bundled_datasets = sorted(p.name for p in (BUNDLED_SAMPLE / "datasets").glob("*/")
                              if (p / "dataset.json").is_file())
    assert sorted(e.path.name for e in window.datasets.entries) == bundled_datasets
    # The finished example runs are in the ledger, each marked so nobody takes it for their own.
    bundled_runs = sorted(p.name for p in (BUNDLED_SAMPLE / "runs").glob("*/")
                          if (p / "run.json").is_file())
    ledger = window.runs.ledger
    assert bundled_runs and sorted(r.name for r in ledger.rows) == bundled_runs
    assert all(ledger.data(ledger.index(i, 0)) == f"{row.name} (example)"
               for i, row in enumerate(ledger.rows))
    tip = ledger.data(ledger.index(0, 0), Qt.ItemDataRole.ToolTipRole)
    assert "example run shipped with the sample workspace" in tip
    assert window.settings.recent == [str(copy.resolve())]
    # The segmenter and the recogniser examples reach their panes: predictions worst first,
    # transcripts with the half-trained model's errors marked.
    predictions = window.masks.predictions
    assert predictions.source.currentText() == "shapes-segmenter · val-step-000400"
    ious = [predictions.table.item(i, 2).data(Qt.ItemDataRole.DisplayRole)
            for i in range(predictions.table.rowCount())]
    assert len(ious) > 1 and ious == sorted(ious)
    transcripts = window.transcripts
    assert transcripts.run_combo.currentText() == "speech-commands"
    assert transcripts.eval_combo.count() == 2 and transcripts.list.count() > 0
    assert "title='substituted'" in transcripts.alignment.text()
    # Reports opens on the first run listed, the cartridge example's held-out comparison;
    # the tabular example has its selection report, PR curve and reliability plot.
    reports = window.reports
    assert reports.run_combo.currentText() == "cartridge-guide"
    assert reports.cartridge.table.rowCount() == 3
    reports.show_run(copy.resolve() / "runs" / "sensor-alert")
    assert reports.run_combo.currentText() == "sensor-alert"
    assert "(TP)" in reports.summary.text() and len(reports.pictures) == 2
    # The second launch reopens the most recent workspace.
    assert open_initial_workspace(window) and window.workspace.root == copy.resolve()


def test_an_example_run_is_deleted_from_the_ledger_but_not_while_a_job_holds_it(window, qtbot):
    from engine.runlock import RunLock
    assert open_initial_workspace(window)
    runs, ws = window.runs, window.workspace
    held, example = ws.runs_dir / "sfx-generator", ws.runs_dir / "sensor-alert"
    lock = RunLock(held).acquire("sample")     # as if a sampling job were reading it
    try:
        for path in (held, example):
            runs.select_run(path, add=True)
        runs.delete_selected(confirm=False)
    finally:
        lock.release()
    assert not example.exists() and runs.ledger.row(example) is None
    assert held.is_dir() and runs.ledger.row(held) is not None        # kept: a job held it


def test_the_runs_reports_button_opens_the_selected_run_s_reports(window, qtbot):
    assert open_initial_workspace(window)
    runs, ws = window.runs, window.workspace
    runs.select_run(ws.runs_dir / "where-demo")              # no evals/: nothing to open
    assert not runs.reports_button.isEnabled()
    runs.select_run(ws.runs_dir / "sensor-alert")
    assert runs.reports_button.isEnabled()
    qtbot.mouseClick(runs.reports_button, Qt.MouseButton.LeftButton)
    assert window.sidebar.currentItem().text() == "Reports"
    assert window.reports.run_combo.currentText() == "sensor-alert"
    assert window.reports.report_combo.currentText() == "selection-step-000001"
    runs.select_run(ws.runs_dir / "speech-commands")
    runs.reports_button.click()
    assert window.reports.run_combo.currentText() == "speech-commands"


def test_planted_dataset_error_is_marked_at_its_record(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=12, records=False)
    records = ws.datasets_dir / "shapes" / "records.jsonl"
    lines = records.read_text().split("\n")
    planted = json.loads(lines[8])
    planted["label"] = "hexagon"
    lines[8] = json.dumps(planted)
    records.write_text("\n".join(lines))
    assert window.open_workspace(ws.root)
    pane = window.datasets
    window.sidebar.setCurrentRow(0)
    pane.select_dataset(ws.datasets_dir / "shapes")
    settle(qtbot, pane)
    qtbot.mouseClick(pane.validate_button, Qt.MouseButton.LeftButton)
    settle(qtbot, pane)
    assert "error" in pane.header.text()
    records = pane.records_tab
    model = records.records
    marked = [r for r in range(model.rowCount())
              if model.data(model.index(r, 0), Qt.ItemDataRole.BackgroundRole) == ERROR_BG]
    assert [pane.table.rows[r].where for r in marked] == ["line 9"]
    label_col = model.columns.index("label")
    assert model.data(model.index(marked[0], label_col),
                      Qt.ItemDataRole.BackgroundRole) == ERROR_BG
    assert "unknown label 'hexagon'" in model.data(model.index(marked[0], 0),
                                                   Qt.ItemDataRole.ToolTipRole)
    # Jump from the findings list to the record, through a filter that hid it.
    records.filter.setText("label=circle")
    finding = next(pane.findings_tab.item(i) for i in range(pane.findings_tab.count())
                   if "hexagon" in pane.findings_tab.item(i).text())
    pane.findings_tab.itemActivated.emit(finding)
    assert records.current_row() == marked[0] and pane.tabs.currentIndex() == 0
    assert json.loads(records.editor.toPlainText())["label"] == "hexagon"
    assert "unknown label" in records.edit_status.text()
    assert not records.save_record_button.isEnabled()
    # Fix it in the record editor: inline validation clears and the fix saves a new version.
    records.editor.setPlainText(json.dumps(dict(planted, label=planted["label"].replace(
        "hexagon", "circle"))))
    assert "valid" in records.edit_status.text() and records.save_record_button.isEnabled()


def test_unparseable_dataset_shows_errors_not_a_crash(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=6, records=False)
    broken = ws.datasets_dir / "broken"
    broken.mkdir()
    (broken / "dataset.json").write_text('{"kind": "image-masks", "files": ')
    assert window.open_workspace(ws.root)
    window.datasets.select_dataset(broken)
    settle(qtbot, window)
    assert "error" in window.datasets.header.text()
    texts = [window.datasets.findings_tab.item(i).text()
             for i in range(window.datasets.findings_tab.count())]
    assert any("dataset.json" in t and "not valid JSON" in t for t in texts)


def test_edit_mask_undo_save_makes_a_new_dataset_version(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=12, records=False)
    assert window.open_workspace(ws.root)
    window.sidebar.setCurrentRow(1)
    pane = window.masks
    qtbot.waitUntil(lambda: pane.editor is not None, timeout=60_000)   # loaded off-thread
    qtbot.waitExposed(pane.canvas)
    record = pane.record
    before = pane.editor.mask.copy()
    canvas = pane.canvas
    pane.radius.setValue(2)
    # Paint a stroke across the top-left of the canvas, then undo it.
    scale, ox, oy = canvas._geometry()
    start = QPoint(int(ox + 3 * scale), int(oy + 3 * scale))
    end = QPoint(int(ox + 20 * scale), int(oy + 3 * scale))
    qtbot.mousePress(canvas, Qt.MouseButton.LeftButton, pos=start)
    qtbot.mouseMove(canvas, end)
    qtbot.mouseRelease(canvas, Qt.MouseButton.LeftButton, pos=end)
    painted = pane.editor.mask.copy()
    assert painted[3, 3:21].all() and pane.undo_button.isEnabled()
    qtbot.mouseClick(pane.undo_button, Qt.MouseButton.LeftButton)
    assert np.array_equal(pane.editor.mask, before) and not pane.save_button.isEnabled()
    qtbot.mouseClick(pane.redo_button, Qt.MouseButton.LeftButton)
    assert np.array_equal(pane.editor.mask, painted)
    pane.eraser.setChecked(True)
    qtbot.mouseClick(canvas, Qt.MouseButton.LeftButton, pos=start)
    erased = pane.editor.mask.copy()
    assert not erased[3, 3]
    pane.opacity.setValue(80)
    interior = erased & ~boundary(erased)
    assert set(canvas.overlay()[interior][..., 3]) == {int(255 * 0.8)}
    qtbot.mouseClick(pane.save_button, Qt.MouseButton.LeftButton)
    new_root = ws.datasets_dir / "shapes-v2"
    saved = load_dataset(new_root)
    assert saved.manifest["parent"] == load_dataset(ws.datasets_dir / "shapes").version
    new_record = next(r for r in saved.records() if r["id"] == record["id"])
    assert np.array_equal(read_mask(new_record["mask"]), erased)
    assert pane.dataset_combo.currentData() == str(new_root)
    qtbot.waitUntil(lambda: pane.editor is not None, timeout=60_000)
    assert not pane.editor.dirty  # the pane now shows the saved version
    assert any(e.path == new_root for e in window.datasets.entries)


def test_invalid_form_values_are_marked_and_block_start(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0)
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    runs = window.runs
    runs.left_tabs.setCurrentIndex(1)
    form = runs.form_widget
    assert runs.start_button.isEnabled()
    form.set_value("model.dim", "sixteen")
    editor = form.editors["model.dim"]
    assert isinstance(editor, QLineEdit) and editor.property("invalid")
    assert form.error_labels["model.dim"].text() == "expected a whole number"
    assert not runs.start_button.isEnabled() and not runs.queue_button.isEnabled()
    assert runs.start_from_form() is None and not ws.run_dirs()
    form.set_value("model.dim", "16")
    form.set_value("optim.lr", "0")
    assert "greater than 0" in form.error_labels["optim.lr"].text()
    assert not runs.start_button.isEnabled()
    form.set_value("optim.lr", "0.003")
    assert runs.start_button.isEnabled() and not editor.property("invalid")


def test_missing_workspace_is_reported_with_ways_out(window, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    assert window.open_workspace(ws.root)
    ws.root.rename(tmp_path / "moved")
    assert not open_initial_workspace(window)  # the recent workspace was moved
    assert window.banner.isVisible()
    assert "missing" in window.banner.text.text()
    assert window.banner.forget.isVisible()
    window.banner.forget.click()
    assert str(ws.root) not in window.settings.recent
    window.banner.open_sample.click()
    assert not window.banner.isVisible()
    assert window.workspace.root == (tmp_path / "data" / "sample-workspace").resolve()


def test_leak_report_jumps_to_both_records(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=12, records=False)
    from app.viewmodels.datasets import DatasetTable
    table = DatasetTable(ws.datasets_dir / "shapes")
    first = table.rows[0].record
    other = next(i for i, r in enumerate(table.rows) if r.record["split"] != first["split"])
    # Put a record of another split in the first record's group: a group leak.
    leaked = table.save_record(other, dict(table.rows[other].record, group=first["group"]))
    assert window.open_workspace(ws.root)
    pane = window.datasets
    pane.select_dataset(leaked.root)
    settle(qtbot, pane)
    qtbot.mouseClick(pane.leaks_tab.button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: pane.leaks_tab.process is None, timeout=120_000)
    assert "1 leak(s)" in pane.leaks_tab.status.text(), pane.leaks_tab.status.text()
    kinds = [pane.leaks_tab.leaks.item(r, 1).text() for r in range(pane.leaks_tab.leaks.rowCount())]
    assert "same-group" in kinds
    row = kinds.index("same-group")
    ids = {pane.leaks_tab.leaks.item(row, 2).data(Qt.ItemDataRole.UserRole),
           pane.leaks_tab.leaks.item(row, 3).data(Qt.ItemDataRole.UserRole)}
    assert ids == {first["id"], table.rows[other].record["id"]}
    for column in (2, 3):
        pane.leaks_tab.leaks.cellDoubleClicked.emit(row, column)
        shown = json.loads(pane.records_tab.editor.toPlainText())["id"]
        assert shown == pane.leaks_tab.leaks.item(row, column).data(Qt.ItemDataRole.UserRole)


def write_segmentation_eval(folder: Path, shifts: list[int]) -> None:
    """A per-image segmentation eval of an 8x8 square predicted shifted right by each shift."""
    from PIL import Image

    from engine.eval.masks import boundary_f1, iou
    (folder / "panels").mkdir(parents=True, exist_ok=True)
    target = np.zeros((16, 16), bool)
    target[4:12, 4:12] = True
    lines = []
    for k, shift in enumerate(shifts):
        prediction = np.roll(target, shift, axis=1)
        panels = {}
        for name, mask in (("prediction", prediction), ("target", target)):
            panels[name] = f"panels/img{k}-{name}.png"
            Image.fromarray(mask.astype(np.uint8) * 255).save(folder / panels[name])
        lines.append(json.dumps({"id": f"img{k}", "label": "square",
                                 "iou": iou(prediction, target),
                                 "boundary_f1": boundary_f1(prediction, target, 0),
                                 "panels": panels}))
    (folder / "per_image.jsonl").write_text("\n".join(lines) + "\n")


def test_segmentation_predictions_sorted_worst_first(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    (ws.runs_dir / "seg-run").mkdir()
    (ws.runs_dir / "seg-run" / "run.json").write_text('{"recipe": "image-segment"}')
    # predictions shifted right by 0, 3 and 1 pixels
    write_segmentation_eval(ws.runs_dir / "seg-run" / "evals" / "val-step-000010", [0, 3, 1])
    assert window.open_workspace(ws.root)
    view = window.masks.predictions
    assert view.source.currentText() == "seg-run · val-step-000010"
    order = [view.table.item(r, 0).text() for r in range(view.table.rowCount())]
    assert order == ["img1", "img2", "img0"]  # worst IoU first
    # 8x8 square shifted by 3: overlap 5x8 = 40, union 88 -> IoU 0.4545.
    assert float(view.table.item(0, 2).text()) == pytest.approx(40 / 88, abs=1e-4)
    assert view.shown_row()["id"] == "img1"
    assert not view.images["prediction"].pixmap().isNull()
    assert not view.images["target"].pixmap().isNull()
    view.table.sortItems(3, Qt.SortOrder.DescendingOrder)  # best boundary F1 first
    assert view.table.item(0, 0).text() == "img0"


def test_segmentation_predictions_follow_new_and_rewritten_evaluations(window, qtbot, tmp_path):
    """No reopening: an evaluation a run writes appears at the workspace watch's next look,
    the chosen one stays chosen, and one written again (`forgebench eval` re-run) is re-read."""
    import os

    from app.viewmodels.workspace import WorkspaceWatch
    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    run = ws.runs_dir / "seg-run"
    run.mkdir()
    (run / "run.json").write_text('{"recipe": "image-segment"}')
    write_segmentation_eval(run / "evals" / "val-step-000010", [0, 3, 1])
    assert window.open_workspace(ws.root)
    view = window.masks.predictions
    watch = WorkspaceWatch(window.workspace)

    def look() -> set[str]:                   # what the window's watch timer does
        changes = watch.changes()
        window.refresh_panes(changes)
        return changes

    # twin: a training step's metrics line is no change, and the list stays as it was
    (run / "metrics.jsonl").write_text('{"step": 11, "loss": 0.5}\n')
    assert look() == set() and view.source.count() == 1
    write_segmentation_eval(run / "evals" / "val-step-000020", [2, 0])
    assert look() == {"runs"}
    assert [view.source.itemText(i) for i in range(view.source.count())] == [
        "seg-run · val-step-000010", "seg-run · val-step-000020"]
    assert view.source.currentText() == "seg-run · val-step-000010"      # still chosen
    assert view.table.item(0, 0).text() == "img1"
    # Re-evaluated in place: every prediction now exact (dated a second on, as a filesystem
    # may keep coarse times).
    table = run / "evals" / "val-step-000010" / "per_image.jsonl"
    write_segmentation_eval(table.parent, [0, 0, 0])
    later = table.stat().st_mtime_ns + 1_000_000_000
    os.utime(table, ns=(later, later))
    os.utime(table.parent, ns=(later, later))
    assert look() == {"runs"}
    assert view.source.currentText() == "seg-run · val-step-000010"
    assert [float(view.table.item(r, 2).text()) for r in range(3)] == [1.0, 1.0, 1.0]


def test_jobs_outlive_the_window_and_are_reattached(qtbot, tmp_path, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    from test_app_support import write_run
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    run = write_run(ws.runs_dir / "live", steps=8, state="running")
    # A stand-in job: it holds the run lock, as a training job does, and sleeps.
    job = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from engine.runlock import RunLock; "
         "RunLock(sys.argv[1]).acquire('job'); print('held', flush=True); time.sleep(120)",
         str(run.path)], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
        text=True)
    try:
        assert job.stdout.readline().strip() == "held"
        run.set_status("running", pid=job.pid)
        first = MainWindow(Settings())
        qtbot.addWidget(first)
        assert first.open_workspace(ws.root)
        assert first.runs.active_runs() == [run.path]
        first.close_policy = "leave"
        first.close()
        assert job.poll() is None  # still running after the window closed
        second = MainWindow(Settings())
        qtbot.addWidget(second)
        second.close_policy = "stop"
        assert second.open_workspace(ws.root)  # re-attaches by reading the run's files
        assert second.runs.ledger.rows[0].state == "running"
        second.runs.select_run(run.path)
        assert second.runs.charts.point_count() == 8
        assert "1 job running" in second.jobs_button.text()
        second.close()  # "stop": the job gets SIGTERM (checkpoint-and-exit for a real job)
        assert job.wait(timeout=10) == -15
    finally:
        job.kill()


def test_sft_token_view_reports_a_missing_base_model(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    (ws.configs_dir / "sft.toml").write_text(
        'recipe = "lm-sft"\n[model]\ngguf = "missing.gguf"\n[data]\npath = "../datasets/x"\n')
    assert window.open_workspace(ws.root)
    view = window.masks.sft
    assert view.config.currentText() == "sft"
    view.inspect()
    qtbot.waitUntil(lambda: view.process is None, timeout=120_000)
    assert "inspect-sft failed" in view.status.text()
    assert "missing" in view.status.text()


@pytest.mark.realmodel
def test_sft_token_view_colours_supervised_tokens_of_the_pirate_set(window, qtbot):
    from app.viewmodels.workspace import install_sample_workspace
    assert window.open_workspace(install_sample_workspace())
    view = window.masks.sft
    view.config.setCurrentText("lm-sft-pirate")
    view.inspect()
    qtbot.waitUntil(lambda: view.process is None, timeout=300_000)
    assert view.samples, view.status.text()
    for sample in view.samples:
        supervised = "".join(t for t, s in sample.spans if s)
        assert supervised.strip() and sample.supervised_tokens > 0
    assert "#c8e6c9" in view.text.toHtml()  # supervised spans are drawn on green


def test_the_gallery_plays_dataset_audio_or_says_why_it_cannot(qtbot, tmp_path):
    """An audio dataset's Gallery lists its clips; activating one plays the clip's own samples
    at the quiet start level; with no sound device the tab says so and nothing breaks."""
    from media_support import make_sfx

    from app.audio import START_GAIN_DB, apply_gain
    from app.viewmodels.samples import waveform
    from app.views.datasets_pane import DatasetsPane

    root = make_sfx(tmp_path, 2)
    pane = DatasetsPane()
    qtbot.addWidget(pane)
    pane.open_dataset(root)
    settle(qtbot, pane)
    tab = pane.gallery_tab
    assert tab.gallery.audio and tab.gallery.rowCount() == len(pane.table.rows) > 0
    assert tab.gallery.data(tab.gallery.index(0)).startswith("▶ ")

    played = []

    class Device:       # stands in for sounddevice: records what would reach the speaker
        def play(self, wave, rate, blocking=False):
            played.append((wave, rate))

        def stop(self):
            pass

    tab.player._sd, tab.player.problem = Device(), None
    assert tab.play(0)
    wave, rate = waveform(tab.gallery.items[0][1])
    assert played[0][1] == rate and (played[0][0] == apply_gain(wave, START_GAIN_DB)).all()
    assert "playing" in tab.hint.text()

    tab.player._sd = None                   # no output device
    tab.player.problem = "audio playback is unavailable: no output device"
    assert not tab.play(1)
    assert "unavailable" in tab.hint.text() and len(played) == 1
    pane.select_row(tab.gallery.items[1][2])        # the rest of the pane keeps working
    assert pane.tabs.currentWidget() is pane.records_tab


def test_validation_runs_off_the_gui_thread_while_the_window_answers(qtbot, tmp_path,
                                                                     monkeypatch):
    """Structural, not a timing: the engine's validator is called only on a worker thread, and
    it is held there until the GUI thread has processed an event queued after the click, which
    it could not do if the click's handler validated the dataset itself."""
    from app.views.datasets_pane import DatasetsPane
    from engine.data.dataset import validate_dataset

    answered = threading.Event()
    guard = GuiThreadGuard(monkeypatch)
    guard.wrap(datasets_vm, "validate_dataset", before=lambda: answered.wait(60))
    ws = make_workspace(tmp_path / "ws", shapes=6, records=False)
    pane = DatasetsPane()
    qtbot.addWidget(pane)
    pane.set_workspace(ws)
    QTimer.singleShot(0, answered.set)
    settle(qtbot, pane)
    answered.clear()
    qtbot.mouseClick(pane.validate_button, Qt.MouseButton.LeftButton)
    assert pane.loading                             # the click returned before validating
    QTimer.singleShot(0, answered.set)
    with qtbot.waitSignal(pane.message, timeout=60_000) as verdict:
        pass
    assert verdict.args == ["shapes is valid"]
    assert guard.on_gui == [] and len(guard.off_gui) == 2
    # Twin: the guard sees a validation made on the GUI thread.
    answered.set()
    datasets_vm.DatasetTable(ws.datasets_dir / "shapes")
    assert guard.on_gui == ["app.viewmodels.datasets.validate_dataset"]
    assert validate_dataset is not datasets_vm.validate_dataset     # the wrapped one ran
