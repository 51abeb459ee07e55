"""A running job's status (issue 46, item 4): the ETA comes from the step time measured after
the warm-up, and the step shown in the ledger, its stage line and the figures beside the charts
all come from the metrics the charts draw."""

from __future__ import annotations

from pathlib import Path

from app.viewmodels import jobs
from engine.rundir import RunDir


def test_the_eta_is_the_step_time_measured_after_the_warm_up(tmp_path):
    """Worked example: loading and the first step took 20 s (invocation at t=980, step 1 logged
    at 1000), then 0.5 s a step. At step 3 of 30 the ETA is 27 × 0.5 = 13.5 s; the rate since
    the invocation began (21 s for 3 steps) would have said 189 s."""
    from app.viewmodels.runs import StepPace, ledger_row

    run = RunDir(tmp_path / "run")
    run.create({"recipe": "lm-pretrain", "created": 970.0, "config": {"steps": 30}})
    run.log_invocation({"id": 1, "start_step": 0, "time": 980.0})
    for step, at in ((1, 1000.0), (2, 1000.5), (3, 1001.0)):
        run.log_metric({"invocation": 1, "step": step, "split": "train", "loss": 1.0,
                        "time": at})
    run.set_status("running", step=2, target_steps=30)     # status.json lags the metrics
    pace = StepPace(run.path)
    assert pace.update() == jobs.Pace(3, 0.5)
    row = ledger_row(run.path, pace=StepPace(run.path))
    assert row.step == 3 and row.stage_line == "step 3/30, ETA 14 s"
    # a resume is measured afresh from its own first logged step
    for step, at in ((4, 2000.0), (5, 2002.0)):
        run.log_metric({"invocation": 2, "step": step, "split": "train", "loss": 1.0,
                        "time": at})
    assert pace.update() == jobs.Pace(5, 2.0)
    run.log_metric({"invocation": 3, "step": 5, "split": "train", "loss": 1.0, "time": 3000.0})
    assert pace.update() == jobs.Pace(5, None)           # one step of the new invocation yet


def test_the_figures_beside_live_charts_follow_every_read(qtbot, tmp_path):
    """New metric lines at every poll keep the staggered redraw busy; the figures beside the
    plots are written on each read all the same (they said "no metrics yet" beside curves)."""
    from app.views.charts import RunCharts

    run = RunDir(tmp_path / "run")
    run.create({"recipe": "lm-pretrain", "created": 970.0, "config": {"steps": 30}})
    run.set_status("running", step=0, target_steps=30)
    charts = RunCharts()
    qtbot.addWidget(charts)
    charts.set_runs([run.path])
    assert "no metrics yet" in charts.summary.text()
    charts.stagger.stop()
    charts.stagger.timeout.disconnect()         # the redraw never gets to finish
    for step in (1, 2):
        run.log_metric({"invocation": 1, "step": step, "split": "train", "loss": 2.5,
                        "lr": 1e-3, "time": 1000.0 + step})
        assert charts.refresh()
        assert "no metrics yet" not in charts.summary.text()
        assert f"step {step}" in charts.summary.text()


def test_each_sides_requests_go_to_its_own_worker(tmp_path):
    """Side-by-side chat: a request line goes to the worker of the side it names, a cancel to
    the worker streaming the reply it cancels (one worker per side: issue 46, item 9)."""
    import json

    from app.viewmodels.chat import ChatSession, Source, worker_side

    session = ChatSession(tmp_path)
    for side in ("A", "B"):
        session.choose(side, Source(f"model: {side}", "library", {"model": f"{side}.gguf"}))
        session.loaded[side] = {}
    lines = session.send("hello")
    assert [worker_side(session, line) for line in lines] == ["A", "B"]
    cancels = session.stop()
    assert [worker_side(session, line) for line in cancels] == ["A", "B"]
    assert {json.loads(c)["target"] for c in cancels} == {json.loads(x)["request"]
                                                          for x in lines}
    # twin: a request of no side (none the worker knows) goes to the first worker
    assert worker_side(session, json.dumps({"op": "shutdown"})) == "A"


def process_state(pid: int) -> str | None:
    """The state letter /proc gives a process (Z: a zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def test_a_detached_job_that_ends_leaves_no_process_behind(qtbot, tmp_path):
    import subprocess
    import sys

    from app.views.engine_process import start_detached

    pid = start_detached([sys.executable, "-c", "pass"], tmp_path / "job.log")
    qtbot.waitUntil(lambda: process_state(pid) is None, timeout=30_000)
    # twin: a child nobody waits for stays behind as a zombie, and the check sees it
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    qtbot.waitUntil(lambda: process_state(child.pid) == "Z", timeout=30_000)
    child.wait()
    assert process_state(child.pid) is None


def test_notifications_replace_each_other_instead_of_stacking(qtbot, monkeypatch):
    """Three jobs end in a row: one toast, its text replaced by "3 jobs ended"; while the user
    is away, one desktop message at once and one gathering the other two when the quiet
    period ends (never three stacked)."""
    from PySide6.QtWidgets import QSystemTrayIcon, QWidget

    from app.views import jobs_panel

    window = QWidget()
    qtbot.addWidget(window)
    window.resize(800, 500)
    window.show()
    notifier = jobs_panel.Notifier(window)
    sent = []

    class Tray:
        def showMessage(self, title, text, icon, ms):      # noqa: N802 (Qt's name)
            sent.append((title, text))

    notifier.tray = Tray()
    notifier.quiet.setInterval(300)
    monkeypatch.setattr(QSystemTrayIcon, "supportsMessages", staticmethod(lambda: True))
    monkeypatch.setattr(notifier, "user_away", lambda: True)
    notifier.notify("run-a", True, "completed at step 30")
    notifier.notify("run-b", False, "failed: out of memory\ntraceback")
    notifier.notify("run-c", True, "completed at step 5")
    toasts = [t for t in window.findChildren(jobs_panel.Toast) if t.isVisible()]
    assert toasts == [notifier.toast]
    text = notifier.toast.text.text()
    assert "3 jobs ended" in text and "run-b failed: failed: out of memory" in text
    assert sent == [("run-a finished", "completed at step 30")]
    qtbot.waitUntil(lambda: len(sent) == 2, timeout=5000)
    assert sent[1][0] == "2 jobs ended" and "run-c finished" in sent[1][1]
    qtbot.wait(500)
    assert len(sent) == 2                       # nothing more to say: no further message
    # while the user looks at the window, the toast alone says it
    monkeypatch.setattr(notifier, "user_away", lambda: False)
    notifier.notify("run-d", True, "completed")
    qtbot.wait(400)
    assert len(sent) == 2 and "run-d finished" in notifier.toast.text.text()


def test_rating_keys_work_without_a_click_in_the_pane(qtbot, tmp_path, monkeypatch):
    """The Blind A/B pane chosen in the sidebar (the sidebar keeps the focus): A rates. Typed
    into the pane's name field, A is text; with another pane shown, A does nothing there. The
    Labels & Masks pane's B (brush) is not taken by the A/B pane's B."""
    from PySide6.QtCore import Qt

    from app.viewmodels.workspace import Settings, Workspace
    from app.views.main_window import MainWindow

    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    from PySide6.QtWidgets import QApplication

    # a window another test left open could hold the activation: this one must be the user's
    for other in QApplication.topLevelWidgets():
        if other.isVisible():
            other.close()
    window = MainWindow(Settings())
    window.close_policy = "leave"
    qtbot.addWidget(window)
    window.show()
    window.open_workspace(Workspace.create(tmp_path / "ws").root)
    window.raise_()
    window.activateWindow()
    # A desktop activates the window the user raised. Offscreen Qt may keep the activation on a
    # window an earlier test showed and closed; then it is handed over the way the window
    # system would (QApplication.setActiveWindow), so the shortcuts below see the user's window.
    try:
        qtbot.waitUntil(window.isActiveWindow, timeout=2000)
    except qtbot.TimeoutError:
        QApplication.setActiveWindow(window)
        qtbot.waitUntil(window.isActiveWindow)
    pressed = []
    ab, masks = window.ab, window.masks
    monkeypatch.setattr(ab, "key_pressed", pressed.append)
    window.show_pane("Blind A/B")
    window.sidebar.setFocus()
    qtbot.keyClick(window.sidebar, Qt.Key.Key_A)
    assert pressed == ["A"]
    ab.name.setFocus()
    ab.name.clear()
    qtbot.keyClick(ab.name, Qt.Key.Key_A)
    assert pressed == ["A"] and ab.name.text() == "a"
    window.show_pane("Labels & Masks")
    window.sidebar.setFocus()
    masks.eraser.setChecked(True)
    qtbot.keyClick(window.sidebar, Qt.Key.Key_B)
    assert pressed == ["A"] and masks.brush.isChecked()


def contrast(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two sRGB colours (relative luminance, (L1 + .05) / (L2 + .05))."""
    def luminance(hex_colour: str) -> float:
        channels = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_the_dark_theme_follows_the_scheme_and_keeps_banners_readable(qtbot, tmp_path,
                                                                      monkeypatch):
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QPalette
    from PySide6.QtWidgets import QApplication

    from app.viewmodels.workspace import Settings
    from app.views import theme
    from app.views.main_window import MainWindow

    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    app = QApplication.instance()
    window = MainWindow(Settings())
    window.close_policy = "leave"
    qtbot.addWidget(window)
    try:
        assert theme.apply(app, Qt.ColorScheme.Dark)
        palette = app.palette()
        assert contrast(palette.color(QPalette.ColorRole.Window).name(), "#000000") < 2
        assert contrast(palette.color(QPalette.ColorRole.WindowText).name(),
                        palette.color(QPalette.ColorRole.Window).name()) >= 7
        sheet = window.tour_panel.styleSheet()
        assert theme.COLOURS["tour_bg"][1] in sheet and theme.COLOURS["text"][1] in sheet
        for scheme in (0, 1):      # every banner's and note's text against its background
            for text, background in (("text", "tour_bg"), ("text", "offer_bg"),
                                     ("text", "problem_bg"), ("error", "error_bg"),
                                     ("text", "panel_bg")):
                pair = theme.COLOURS[text][scheme], theme.COLOURS[background][scheme]
                assert contrast(*pair) >= 4.5, (scheme, text, background)
            window_bg = "#2b2d30" if scheme else "#efefef"
            for muted in ("muted", "facts", "stage"):
                assert contrast(theme.COLOURS[muted][scheme], window_bg) >= 4.5, (scheme, muted)
            table_bg = "#1e1f22" if scheme else "#ffffff"       # the ledger's cells
            for state in ("running", "completed", "failed", "stopped", "stopping", "queued"):
                assert contrast(theme.COLOURS[state][scheme], table_bg) >= 4.5, (scheme, state)
        # twin: the light banner's ink on the dark window would not be readable
        assert contrast(theme.COLOURS["muted"][0], "#2b2d30") < 4.5
        assert not theme.apply(app, Qt.ColorScheme.Light)
        assert theme.COLOURS["tour_bg"][0] in window.tour_panel.styleSheet()
        assert contrast(app.palette().color(QPalette.ColorRole.Window).name(), "#000000") > 10
    finally:
        theme.apply(app, Qt.ColorScheme.Light)


def ink_contrast(widget) -> float:
    """The highest contrast of any pixel of the widget's rendering against its most common
    colour (its background): its text's ink (anti-aliased edges are fainter, the glyphs'
    cores are the text colour)."""
    from collections import Counter

    image = widget.grab().toImage()
    pixels = [image.pixelColor(x, y).name() for x in range(image.width())
              for y in range(image.height())]
    background = Counter(pixels).most_common(1)[0][0]
    return max(contrast(pixel, background) for pixel in set(pixels))


def test_a_help_link_is_readable_in_the_dark_theme(qtbot):
    """A "What does this mean?" link made in the light theme takes the dark palette's link
    colour when the theme turns dark (Qt fixes a label's link colour when it parses the text);
    twin: the same label under the dark palette without its text parsed again keeps the light
    theme's dark blue, hard to read on dark grey."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QPalette
    from PySide6.QtWidgets import QApplication

    from app.views import theme
    from app.views.help_link import help_link

    app = QApplication.instance()
    theme.apply(app, Qt.ColorScheme.Light)
    link = help_link("verdicts")
    qtbot.addWidget(link)
    link.show()
    dark_window = theme.dark_palette().color(QPalette.ColorRole.Window)

    def dark_reached_the_label():
        qtbot.waitUntil(lambda: link.palette().color(QPalette.ColorRole.Window) == dark_window)
        qtbot.wait(50)          # and the turns of the loop after it

    qtbot.wait(50)              # the light theme's own re-parse done
    try:
        app.setPalette(theme.dark_palette())    # twin: the dark palette alone, text not parsed
        dark_reached_the_label()
        assert ink_contrast(link) < 4.5
        theme.apply(app, Qt.ColorScheme.Light)
        theme.apply(app, Qt.ColorScheme.Dark)
        dark_reached_the_label()
        assert ink_contrast(link) >= 4.5
    finally:
        theme.apply(app, Qt.ColorScheme.Light)


def test_a_run_with_evaluations_only_shows_them_not_no_metrics(qtbot, tmp_path):
    from app.views.charts import RunCharts

    run = RunDir(tmp_path / "tabular")
    run.create({"recipe": "tabular-classify", "created": 970.0, "config": {"steps": 1}})
    run.log_metric({"step": 1, "split": "val", "loss": 0.429, "accuracy": 0.91,
                    "time": 1001.0})
    run.set_status("completed", step=1, target_steps=1)
    charts = RunCharts()
    qtbot.addWidget(charts)
    charts.set_runs([run.path])
    text = charts.summary.text()
    assert "no metrics yet" not in text
    assert "val loss 0.429 (step 1)" in text and "val accuracy 0.91 (step 1)" in text


def test_file_dialogs_open_in_the_workspace_not_the_checkout(qtbot, tmp_path, monkeypatch):
    """Issue 46, item 9: the model dialog starts in the open workspace, the workspace dialogs
    beside it, the import dialog in the home folder; none in the folder the app started in."""
    from PySide6.QtWidgets import QFileDialog

    from app.viewmodels.workspace import Settings, Workspace, dialog_folder
    from app.views.main_window import MainWindow

    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    asked: list[str] = []
    monkeypatch.setattr(QFileDialog, "getOpenFileName",
                        staticmethod(lambda parent, title, start, *rest: asked.append(start)
                                     or ("", "")))
    monkeypatch.setattr(QFileDialog, "getExistingDirectory",
                        staticmethod(lambda parent, title, start="", *rest: asked.append(start)
                                     or ""))
    workspace = Workspace.create(tmp_path / "projects" / "ws")
    window = MainWindow(Settings())
    window.close_policy = "leave"
    qtbot.addWidget(window)
    window.choose_workspace()
    window.open_workspace(workspace.root)
    window.models.choose_file(link=False)
    window.choose_workspace()
    assert asked == [str(Path.home()), str(workspace.root), str(workspace.root.parent)]
    assert dialog_folder(workspace, "models") == str(workspace.root)     # no models/ yet
    (workspace.root / "models").mkdir()
    assert dialog_folder(workspace, "models") == str(workspace.root / "models")
