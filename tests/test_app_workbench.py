"""The workbench as a new user meets it (issue: panes stay current, nothing freezes, progress
everywhere, the window fits a laptop): pytest-qt flows through the real window, offscreen,
with real `forgebench` subprocesses where a job runs."""

from __future__ import annotations

import json

import pytest
from app_wait import settle
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication, QComboBox, QScrollArea
from test_app_support import make_workspace, write_run

from app.viewmodels import jobs
from app.viewmodels.jobs import forgebench_argv
from app.viewmodels.workspace import Settings
from app.views.job_runner import JobRunner
from app.views.jobs_panel import job_center
from app.views.main_window import MainWindow
from engine.data.generators.records import generate_records

TIMEOUT_MS = 120_000


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    win = MainWindow(Settings())
    win.close_policy = "stop"
    win.timer.setInterval(100)
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()


def _committed_checkpoint(run, step: int) -> None:
    folder = run.path / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))


def _combo_data(combo: QComboBox) -> list:
    return [combo.itemData(i) for i in range(combo.count())]


def test_panes_follow_the_workspace_without_reopening(window, qtbot, tmp_path):
    """A config, a run with a checkpoint and a dataset made outside the panes appear in the
    new-run list, Samples, Export, Blind A/B and the dataset list; what the user had chosen
    stays chosen."""
    ws = make_workspace(tmp_path / "ws", shapes=6)
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    window.datasets.select_dataset(ws.datasets_dir / "shapes")
    settle(qtbot, window)
    opened = window.datasets.table
    assert window.runs.config_combo.count() == 1

    (ws.configs_dir / "second.toml").write_text((ws.configs_dir / "tiny.toml").read_text())
    qtbot.waitUntil(lambda: window.runs.config_combo.count() == 2, timeout=5000)
    assert window.runs.config_combo.currentText() == "tiny"      # the choice is kept

    run = write_run(ws.runs_dir / "made-elsewhere", steps=10)
    _committed_checkpoint(run, 10)
    qtbot.waitUntil(lambda: str(run.path) in _combo_data(window.export.run_combo),
                    timeout=5000)
    assert str(run.path) in _combo_data(window.samples.run_combo)
    systems = [window.ab.systems.item(i).text() for i in range(window.ab.systems.count())]
    assert any("made-elsewhere" in s for s in systems)

    generate_records(ws.datasets_dir / "more-records", n=20)
    qtbot.waitUntil(lambda: any(e.path.name == "more-records"
                                for e in window.datasets.entries), timeout=5000)
    assert window.datasets.table is opened          # the open dataset was not re-read


def test_a_new_run_is_selected_and_its_stage_shows_in_the_jobs_panel(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0, steps=3000)
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    runs = window.runs
    runs.threads = 1
    out = runs.start_from_form()
    qtbot.waitUntil(lambda: runs.selected_paths() == [out], timeout=TIMEOUT_MS)
    key = f"run:{out}"
    qtbot.waitUntil(lambda: key in job_center().jobs and
                    job_center().jobs[key].stage.startswith("step "), timeout=TIMEOUT_MS)
    assert "1 job running" in window.jobs_button.text()
    panel = window.jobs_panel
    assert panel.table.rowCount() == 1 and out.name in panel.table.item(0, 0).text()
    with qtbot.waitSignal(job_center().finished, timeout=TIMEOUT_MS) as ended:
        panel.table.cellWidget(0, 3).click()            # Stop, from the jobs panel
    assert ended.args[0] == out.name and ended.args[1] is True
    assert "stopped at step" in ended.args[2]
    assert window.notifier.last[0] == f"{out.name} finished"
    assert window.notifier.toast.isVisible()


def test_a_refused_start_keeps_its_reason_in_view(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0)
    other = write_run(ws.runs_dir / "earlier-run", steps=4)
    (ws.datasets_dir / "records" / "train.txt").unlink()
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    runs = window.runs
    runs.select_run(other.path)
    runs.start_from_form()
    qtbot.waitUntil(lambda: not runs.launch_problem.isHidden(), timeout=TIMEOUT_MS)
    for _ in range(3):                  # later polls and selections do not wipe it
        runs.poll(force=True)
        runs.select_run(other.path)
    assert not runs.launch_problem.isHidden() and "train.txt" in runs.launch_problem.text()
    assert runs.launch_problem.text().count("error") >= 1
    assert window.notifier.last[0].endswith("failed")


def test_leaks_and_stats_belong_to_the_dataset_on_screen(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=12)
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    pane = window.datasets
    pane.select_dataset(ws.datasets_dir / "shapes")
    settle(qtbot, pane)
    leaks = pane.leaks_tab
    leaks.check()
    qtbot.waitUntil(lambda: leaks.process is None, timeout=TIMEOUT_MS)
    assert "12 records checked" in leaks.status.text()
    pane.select_dataset(ws.datasets_dir / "records")
    settle(qtbot, pane)
    assert leaks.leaks.rowCount() == 0 and "records checked" not in leaks.status.text()
    assert "Not yet checked: records" in leaks.status.text()

    pane.tabs.setCurrentWidget(pane.stats_tab)
    for name in ("shapes", "records", "shapes"):
        pane.select_dataset(ws.datasets_dir / name)
        settle(qtbot, pane)
    splits = pane.stats_tab.table.split_counts()
    legend = [label.text for _, label in pane.stats_tab.legend.items]
    assert sorted(legend) == sorted(splits)             # one entry per split, never repeated


def test_the_window_fits_1024x700_and_long_messages_wrap(window, qtbot):
    window.resize(1024, 700)
    long_line = "x" * 3000                              # no space to break at
    window.export.step_error.setText(long_line)
    window.export.verdict.setText(long_line)
    window.runs.launch_problem.setText(long_line)
    window.runs.launch_problem.show()
    window.datasets.header.setText(long_line)
    for row in range(window.sidebar.count()):
        window.sidebar.setCurrentRow(row)
        QApplication.processEvents()
        hint = window.minimumSizeHint()
        assert hint.width() <= 1024 and hint.height() <= 700, (row, hint)
        assert window.width() == 1024 and window.height() == 700, row
        scroll = window.stack.currentWidget()       # nothing cut off: no sideways scrolling
        assert scroll.widget().minimumSizeHint().width() <= scroll.viewport().width(), row
        for inner in scroll.widget().findChildren(QScrollArea):     # nor inside the pane
            if inner.isVisible() and inner.widgetResizable() and inner.widget() is not None:
                assert inner.widget().minimumSizeHint().width() <= inner.viewport().width(), \
                    (row, type(inner.widget()).__name__)


def test_the_wheel_scrolls_the_form_and_never_edits_an_unfocused_field(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0)
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    combo = window.runs.form_widget.editors["optim.schedule"]
    before = combo.currentText()
    event = QWheelEvent(QPointF(5, 5), QPointF(combo.mapToGlobal(QPoint(5, 5))), QPoint(0, 0),
                        QPoint(0, -120), Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier,
                        Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(combo, event)
    assert combo.currentText() == before
    samples_seed = window.samples.seed                  # pane spin boxes are guarded too
    value = samples_seed.value()
    QApplication.sendEvent(samples_seed, QWheelEvent(
        QPointF(5, 5), QPointF(5, 5), QPoint(0, 0), QPoint(0, 120), Qt.MouseButton.NoButton,
        Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False))
    assert samples_seed.value() == value


def test_a_background_command_is_listed_then_notified(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0)
    runner = JobRunner("check")
    qtbot.addWidget(runner)
    runner.start(forgebench_argv() + ["data", "validate", str(ws.datasets_dir / "records")],
                 "validating records")
    assert [j.title for j in job_center().jobs.values()] == ["validating records"]
    with qtbot.waitSignal(job_center().finished, timeout=TIMEOUT_MS) as ended:
        pass
    assert ended.args[:2] == ["validating records", True]
    assert job_center().jobs == {}
    assert window.notifier.last[0] == "validating records finished"


def test_stage_lines_and_etas():
    now = 1000.0
    running = {"state": "running", "step": 0, "target_steps": 30,
               "stage_detail": "loading base 250 MB"}
    assert jobs.run_stage_line(running, None) == "loading base 250 MB"
    stepping = {"state": "running", "step": 10, "target_steps": 30, "stage_detail": None}
    # 10 s a step measured after the warm-up, 20 steps to go: 200 s
    assert jobs.run_stage_line(stepping, jobs.Pace(10, 10.0)) == "step 10/30, ETA 3 min"
    # the metrics' step is the one shown (the charts' source); no ETA until it is measured
    assert jobs.run_stage_line(stepping, jobs.Pace(12, None)) == "step 12/30"
    assert jobs.run_stage_line(stepping, None) == "step 10/30"
    assert jobs.run_stage_line({"state": "completed", "step": 30}, None) == "completed"
    assert jobs.duration_text(45) == "45 s" and jobs.duration_text(4000) == "1 h 6 min"
    job = jobs.BackgroundJob("k", "export", "exporting", started=now - 30, done=3, total=9)
    assert job.progress_text(now) == "3/9, ETA 1 min"
    assert jobs.BackgroundJob("k", "x", "t", started=now - 5).progress_text(now) == \
        "running for 5 s"


def test_a_run_held_by_a_job_this_window_did_not_start_shows_running_elsewhere(
        window, qtbot, tmp_path):
    """The #16 lock: a run whose lock another process holds (here: this test, as a terminal
    would) is "running elsewhere", with who holds it in the tooltip; once released, it is not."""
    from engine.runlock import RunLock

    ws = make_workspace(tmp_path / "ws", shapes=0)
    run = write_run(ws.runs_dir / "from-a-terminal", steps=4, state="running")
    lock = RunLock(run.path).acquire("train")
    try:
        assert window.open_workspace(ws.root)
        settle(qtbot, window)
        ledger = window.runs.ledger
        state = ledger.index(0, 1)
        assert ledger.data(state) == "running elsewhere"
        tip = ledger.data(state, Qt.ItemDataRole.ToolTipRole)
        assert "train job" in tip and "pid" in tip
        ledger.own_pids.add(ledger.rows[0].holder["pid"])     # as if this window started it
        assert ledger.data(state) == "running"
    finally:
        lock.release()
    run.set_status("stopped", step=4, target_steps=4)
    window.runs.poll(force=True)
    assert window.runs.ledger.data(window.runs.ledger.index(0, 1)) == "stopped"
    assert window.runs.ledger.rows[0].holder is None
