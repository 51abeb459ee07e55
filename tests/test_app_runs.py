"""The Runs pane against the real engine: start a tiny lm-pretrain from the recipe form, watch
the loss chart gain points while the job runs (with the event loop never blocked for 100 ms),
stop it, resume it, and see the curve continue. Jobs are real `forgebench` subprocesses."""

from __future__ import annotations

import pytest
from app_wait import settle
from PySide6.QtCore import QElapsedTimer, Qt, QTimer
from test_app_support import make_workspace, write_run

from app.viewmodels.workspace import Settings
from app.views.main_window import MainWindow
from engine.rundir import RunDir

JOB_TIMEOUT_MS = 120_000


class LoopWatch:
    """Records the longest gap between ticks of a 10 ms timer: how long the event loop was
    blocked."""

    def __init__(self):
        self.clock = QElapsedTimer()
        self.timer = QTimer()
        self.timer.setInterval(10)
        self.timer.timeout.connect(self._tick)
        self.max_gap_ms = 0
        self.ticks = 0

    def start(self) -> None:
        self.clock.start()
        self.total = QElapsedTimer()
        self.total.start()
        self.timer.start()

    def clock_total_ms(self) -> int:
        return self.total.elapsed()

    def _tick(self) -> None:
        self.max_gap_ms = max(self.max_gap_ms, self.clock.restart())
        self.ticks += 1

    def stop(self) -> None:
        self.timer.stop()


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    win = MainWindow(Settings())
    win.close_policy = "stop"  # never a modal question in tests; jobs are asked to stop
    win.timer.setInterval(100)
    qtbot.addWidget(win)
    win.resize(1440, 900)
    win.show()
    yield win
    win.close()


@pytest.mark.slow
def test_start_watch_stop_resume_a_real_run(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0, steps=3000)
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    window.sidebar.setCurrentRow(2)
    runs = window.runs
    runs.threads = 1
    assert runs.config_combo.currentText() == "tiny" and runs.start_button.isEnabled()

    qtbot.mouseClick(runs.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(ws.run_dirs()) == 1, timeout=JOB_TIMEOUT_MS)
    run = RunDir(ws.run_dirs()[0])
    qtbot.waitUntil(lambda: runs.ledger.paths() == [run.path], timeout=5000)
    runs.select_run(run.path)
    charts = runs.charts
    qtbot.waitUntil(lambda: charts.point_count() >= 3, timeout=JOB_TIMEOUT_MS)

    # The chart gains points while the job runs, over several polls; the longest event-loop
    # gap meanwhile is printed (a figure of the machine's load, not asserted).
    watch = LoopWatch()
    counts = []
    charts.redrawn.connect(lambda m: m == "loss" and counts.append(charts.point_count()))
    watch.start()
    qtbot.waitUntil(lambda: len(counts) >= 5 and watch.clock_total_ms() >= 2000,
                    timeout=JOB_TIMEOUT_MS)
    watch.stop()
    assert run.live_status()["state"] == "running"
    assert counts == sorted(counts) and counts[-1] > counts[0]
    drawn = charts.plots["loss"].listDataItems()[0].getData()[0]
    assert len(drawn) >= counts[-1] > counts[0]  # the plotted curve itself grew
    assert watch.ticks > 10  # the 10 ms watch timer really ran during the window
    print(f"longest event-loop gap while charting a live job: {watch.max_gap_ms} ms "
          f"over {watch.ticks} ticks, {len(counts)} redraws")
    assert "1 job running" in window.jobs_button.text()

    # Stop: the job finishes its step, checkpoints and exits.
    qtbot.mouseClick(runs.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: run.live_status()["state"] == "stopped", timeout=JOB_TIMEOUT_MS)
    stopped_at = run.status()["step"]
    assert run.latest_checkpoint().step == stopped_at
    qtbot.waitUntil(lambda: charts.series[str(run.path)].xy("loss")[0][-1] == stopped_at,
                    timeout=5000)
    row = runs.ledger.rows[0]
    qtbot.waitUntil(lambda: runs.ledger.rows[0].state == "stopped", timeout=5000)
    assert "no jobs running" in window.jobs_button.text()

    # Resume to 15 more steps: the curve continues from the stop, marked as a new invocation.
    runs.resume_steps.setValue(stopped_at + 15)
    qtbot.mouseClick(runs.resume_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: run.live_status()["state"] == "completed", timeout=JOB_TIMEOUT_MS)
    series = charts.series[str(run.path)]
    qtbot.waitUntil(lambda: series.xy("loss")[0][-1] == stopped_at + 15, timeout=5000)
    steps = series.xy("loss")[0]
    assert steps == list(range(1, stopped_at + 16))  # one continuous curve, no gap or repeat
    assert series.invocation_steps == [0, stopped_at]
    assert stopped_at in series.checkpoint_steps
    qtbot.waitUntil(lambda: runs.ledger.rows[0].state == "completed", timeout=5000)
    assert row.name == run.path.name


def test_failed_run_shows_its_error_and_traceback(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    run = write_run(ws.runs_dir / "broken-run", steps=4, state="running")
    run.log_event("error", stage="forward", step=4, message="RuntimeError: shapes do not match",
                  traceback="Traceback (most recent call last):\n  File \"model.py\", line 9")
    run.set_status("failed", stage="forward", error="RuntimeError: shapes do not match",
                   pid=None)
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    runs = window.runs
    runs.select_run(run.path)
    assert runs.ledger.data(runs.ledger.index(0, 1)) == "failed (forward)"
    text = runs.details.toPlainText()
    assert "failed during forward: RuntimeError: shapes do not match" in text
    assert "Traceback (most recent call last)" in text


def dpo_guarded_run(path, collapse_action: str) -> RunDir:
    """A DPO run from 3 pairs as the engine records it: lm-dpo's own guardrail code logs the
    too-few-pairs warning and checks a collapsing step (margin 27 at step 2); the status is
    written as engine/jobs.py writes a stopped run's, with the stop reason the guard asked."""
    from types import SimpleNamespace

    from engine.recipes.lm_dpo import Guard, warn_few_pairs

    run = write_run(path, steps=2, state="running")
    asked = []
    job = SimpleNamespace(run=run, request_stop=asked.append, config=SimpleNamespace(
        dpo=SimpleNamespace(beta=0.1), guard=SimpleNamespace(
            min_pairs=8, collapse=collapse_action, max_margin=10.0, max_chosen_drop=20.0)))
    warn_few_pairs(job, 3)
    Guard(job).check(2, {"reward_margin": 27.0, "chosen_reward": 0.5})
    run.set_status("stopped" if asked else "completed", step=2, stage="done",
                   stop_reason=asked[0] if asked else None, pid=None)
    return run


def test_a_runs_warnings_and_why_it_stopped_show_in_its_details(window, qtbot, tmp_path):
    """lm-dpo's "fewer than min_pairs" warning and its collapse stop, in the details of the
    selected run; the twin run that only warned on collapse says so and was not stopped, and a
    plain run's details stay empty."""
    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    stopped = dpo_guarded_run(ws.runs_dir / "dpo-stopped", "stop")
    warned = dpo_guarded_run(ws.runs_dir / "dpo-warned", "warn")
    plain = write_run(ws.runs_dir / "plain", steps=4, state="completed")
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    runs = window.runs
    runs.select_run(stopped.path)
    qtbot.waitUntil(lambda: "dpo-stopped" in runs.details.toPlainText())
    text = runs.details.toPlainText()
    assert "warning: only 3 preference pair(s) (guard.min_pairs is 8)" in text
    assert "DPO collapse at step 2:" in text and "(run stopped)" in text
    assert "stopped at step 2: DPO collapse at step 2" in text
    runs.select_run(warned.path)
    qtbot.waitUntil(lambda: "dpo-warned" in runs.details.toPlainText())
    text = runs.details.toPlainText()
    assert "only 3 preference pair(s)" in text and "(warned only)" in text
    assert "stopped at" not in text
    runs.select_run(plain.path)
    qtbot.waitUntil(lambda: runs.details.toPlainText() == "")
    plain.set_status("stopped", step=4, stop_reason="SIGTERM", pid=None)     # the Stop button
    runs.select_run(stopped.path)
    qtbot.waitUntil(lambda: "dpo-stopped" in runs.details.toPlainText())
    runs.select_run(plain.path)
    qtbot.waitUntil(lambda: "stopped at step 4: asked to stop" in runs.details.toPlainText())


def test_a_refused_start_shows_the_engine_message(window, qtbot, tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0)
    (ws.datasets_dir / "records" / "train.txt").unlink()  # the corpus is incomplete
    assert window.open_workspace(ws.root)
    settle(qtbot, window)
    runs = window.runs
    out = runs.start_from_form()
    qtbot.waitUntil(lambda: "did not start" in runs.details.toPlainText(),
                    timeout=JOB_TIMEOUT_MS)
    assert "train.txt" in runs.details.toPlainText()
    assert not RunDir(out).exists()
