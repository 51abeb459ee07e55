"""The newcomer's whole road through the window, without reopening the workspace: first launch
(a scratch HOME, so the sample workspace is installed) → validate a dataset → a new config from
the lm-pretrain template → start it (its charts are selected by themselves) → stop →
resume → its samples → a blind A/B of two of its checkpoints → export with the wizard.

Every job is a real `forgebench` subprocess. Each user action runs inside the event loop (as a
click would). The check is structural, not a timing: every engine call, validation, config or
schema load, workspace scan, launch write and process start the journey reaches is wrapped, and
none may run on the GUI thread. A 10 ms timer records the longest event-loop gap of each phase;
those figures are printed (they depend on how loaded the machine is), never asserted."""

from __future__ import annotations

import pytest
from app_part2_support import wait_for
from app_wait import GuiThreadGuard, settle
from PySide6.QtCore import Qt, QTimer
from test_app_runs import LoopWatch

from app.main import open_initial_workspace
from app.viewmodels.workspace import Settings
from app.views.main_window import MainWindow

TIMEOUT_MS = 300_000
# The model of the template, shrunk so the journey trains in seconds.
TINY = {"model.dim": "16", "model.n_layers": "1", "model.n_heads": "2", "model.n_kv_heads": "1",
        "model.ffn_dim": "32", "model.context": "16", "train.batch_size": "2",
        "eval_every": "0", "save_every": "0", "steps": "5000", "sample.max_tokens": "6",
        "sample.prompts": "Record item\nThe price is"}


@pytest.mark.slow
def test_a_new_user_goes_from_first_launch_to_a_verified_export(qtbot, tmp_path, monkeypatch):
    for name, sub in (("HOME", "home"), ("XDG_CONFIG_HOME", "home/.config"),
                      ("XDG_DATA_HOME", "home/.local/share")):
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.delenv("FORGEBENCH_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FORGEBENCH_DATA_DIR", raising=False)
    guard = GuiThreadGuard(monkeypatch).guard_the_window()
    window = MainWindow(Settings())
    window.close_policy = "stop"
    qtbot.addWidget(window)
    window.timer.setInterval(100)
    window.resize(1024, 700)
    window.show()
    gaps: dict[str, int] = {}
    watch = LoopWatch()

    def act(action):
        """Run a user action inside the event loop, as a click's handler runs."""
        result = []
        QTimer.singleShot(0, lambda: result.append(action()))
        qtbot.waitUntil(lambda: bool(result), timeout=TIMEOUT_MS)
        return result[0]

    def phase(name: str) -> None:
        gaps[name] = watch.max_gap_ms
        watch.max_gap_ms = 0

    # First launch opens the sample workspace before the event loop starts (as app.main).
    assert open_initial_workspace(window)
    ws = window.workspace
    assert ws.root == tmp_path / "home/.local/share/forgebench/sample-workspace"
    watch.start()
    settle(qtbot, window)
    qtbot.wait(200)
    phase("first paint")

    # Validate a dataset.
    datasets = window.datasets
    act(lambda: datasets.select_dataset(ws.datasets_dir / "records"))
    settle(qtbot, datasets)
    with qtbot.waitSignal(datasets.message, timeout=TIMEOUT_MS) as verdict:
        act(lambda: qtbot.mouseClick(datasets.validate_button, Qt.MouseButton.LeftButton))
    assert verdict.args == ["records is valid"]
    phase("validate a dataset")

    # A new config from the recipe template, made tiny in the form, started.
    act(lambda: window.sidebar.setCurrentRow(2))
    runs = window.runs
    runs.threads = 1
    act(lambda: runs.form.new_config("lm-pretrain", "journey"))
    settle(qtbot, runs)
    config = ws.configs_dir / "journey.toml"
    assert runs.config_combo.currentData() == str(config)
    assert runs.form_widget.form.text["data.dir"] == "../datasets/records"
    for name, value in TINY.items():
        act(lambda: runs.form_widget.set_value(name, value))
    assert runs.start_button.isEnabled(), runs.form_widget.form.errors
    act(lambda: qtbot.mouseClick(runs.start_button, Qt.MouseButton.LeftButton))
    out = runs.follow
    qtbot.waitUntil(lambda: runs.selected_paths() == [out], timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: runs.charts.point_count() >= 5, timeout=TIMEOUT_MS)
    assert "1 job running" in window.jobs_button.text()
    phase("start a run from a template; its charts are selected")

    # Stop, then resume 10 steps further.
    act(lambda: qtbot.mouseClick(runs.stop_button, Qt.MouseButton.LeftButton))
    # The sample workspace's example runs share the ledger: follow this run's own line.
    qtbot.waitUntil(lambda: runs.ledger.row(out).state == "stopped", timeout=TIMEOUT_MS)
    stopped_at = runs.ledger.row(out).step
    runs.resume_steps.setValue(stopped_at + 10)
    act(lambda: qtbot.mouseClick(runs.resume_button, Qt.MouseButton.LeftButton))
    qtbot.waitUntil(lambda: runs.ledger.row(out).state == "completed", timeout=TIMEOUT_MS)
    assert window.notifier.last[0] == f"{out.name} finished"
    phase("stop and resume")

    # Its samples: the BEFORE/AFTER generations appear in Samples without reopening.
    act(lambda: window.sidebar.setCurrentRow(3))
    samples = window.samples
    qtbot.waitUntil(lambda: samples.run_combo.findData(str(out)) >= 0, timeout=10_000)
    act(lambda: samples.select_run(out))
    assert samples.views.currentWidget() is samples.text_table
    assert samples.text_table.item(0, 0).text() == "Record item"
    phase("samples")

    # Blind A/B of the stop checkpoint against the final one.
    act(lambda: window.sidebar.setCurrentRow(4))
    ab = window.ab
    checkpoints = [f"step-{stopped_at:06d}", f"step-{stopped_at + 10:06d}"]
    # The final checkpoint reaches the pane with the workspace watch's next look (as in Samples).
    def listed() -> set[tuple[str, str]]:
        return {tuple(ab.systems.item(i).data(Qt.ItemDataRole.UserRole))
                for i in range(ab.systems.count())}
    qtbot.waitUntil(lambda: {(str(out), c) for c in checkpoints} <= listed(), timeout=10_000)
    for checkpoint in checkpoints:
        act(lambda: ab.check_system(out, checkpoint))
    assert len(ab.chosen()) == 2, [ab.systems.item(i).text() for i in range(ab.systems.count())]
    ab.gen_prompts.setPlainText("Record item\nThe price is")
    ab.gen_max_tokens.setValue(4)
    ab.name.setText("journey")
    act(ab.generate_button.click)
    qtbot.waitUntil(lambda: ab.session is not None, timeout=TIMEOUT_MS)
    for _ in range(4 * ab.session.total):               # every pair, every rubric question
        if ab.session.finished:
            break
        act(lambda: ab.key_pressed("A"))
    assert ab.session.finished
    assert (ws.root / "ratings" / "journey.jsonl").is_file()
    phase("blind A/B")

    # Export the final checkpoint with the wizard: base, sizes, export and verify.
    act(lambda: window.sidebar.setCurrentRow(5))
    export = window.export
    qtbot.waitUntil(lambda: export.run_combo.findData(str(out)) >= 0, timeout=10_000)
    act(lambda: export.select_run(out, checkpoints[1]))
    act(lambda: export.go(1))
    qtbot.waitUntil(lambda: not export.call.running, timeout=TIMEOUT_MS)
    assert "from scratch" in export.base_text.text()
    act(lambda: export.go(2))
    qtbot.waitUntil(lambda: not export.call.running, timeout=TIMEOUT_MS)
    act(lambda: export.set_dtype("f16"))
    act(lambda: export.go(3))
    assert export.stages.rowCount() == 0           # nothing from an earlier export
    export.out_name.setText("journey-f16")
    act(export.export)
    wait_for(qtbot, export.export_job, 600)
    assert "Verified" in export.verdict.text(), export.export_job.output[-2000:]
    phase("export with the wizard")
    watch.stop()

    report = "; ".join(f"{name}: {gap} ms" for name, gap in gaps.items())
    print(f"longest event-loop gap per phase: {report}")
    assert watch.ticks > 100
    assert guard.on_gui == [], f"on the GUI thread: {sorted(set(guard.on_gui))}"
    reached = set(guard.off_gui)        # the guard really saw the journey's work
    assert {"app.viewmodels.datasets.validate_dataset", "app.viewmodels.forms.schema_for",
            "app.views.runs_pane.start_detached", "WorkspaceWatch.changes",
            "app.viewmodels.export_wizard.base_info"} <= reached, reached
    window.close()
