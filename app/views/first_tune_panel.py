"""The "first real fine-tune" strip (state in app/viewmodels/first_tune.py), under the tour: the
offer line with its measured estimate (or how to install the model), "Use MODEL" where the
config's base file is missing and the library has a model of its own to train on (it points the
config at that file), Measure (a short probe job) and Start (the pirate LoRA run, followed in
the Runs pane). When the run completes, the
strip shows its BEFORE/AFTER answers with "Chat with it" and "Export it", which open those
panes on the run. Engine jobs run through the JobRunner; the offer's reads (the CPU model, the
config's hash) and the samples are read on a BackgroundCall, never on the GUI thread."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout

from app.viewmodels.first_tune import FirstTune, run_argv, run_outcome
from app.viewmodels.jobs import job_error
from app.viewmodels.workspace import Settings, Workspace
from app.views import layouts, theme
from app.views.background import BackgroundCall
from app.views.engine_process import start_detached
from app.views.job_runner import JobRunner

POLL_MS = 1000      # how often the strip looks at its run's status


class FirstTunePanel(QFrame):
    started = Signal(Path)          # the run folder the Runs pane should follow
    open_chat = Signal(Path)
    open_export = Signal(Path)

    def __init__(self, settings: Settings, parent=None):
        super().__init__(parent)
        self.settings = settings
        self.tune: FirstTune | None = None
        self.workspace: Workspace | None = None
        self.run_dir: Path | None = None
        self.pid: int | None = None     # the run's process and its log
        self.log: Path | None = None
        theme.style(self, "FirstTunePanel {{ background: {offer_bg}; border: 1px solid "
                          "{offer_border}; }} FirstTunePanel QLabel {{ color: {text}; }}")
        self.candidate: str | None = None
        self.runner = JobRunner("first fine-tune probe")
        self.runner.finished.connect(self._probed)
        self.runner.hide()          # shown while a probe runs, and with its error if it fails
        self.run_status = QLabel()
        self.run_status.setWordWrap(True)
        self.run_status.hide()
        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self.poll)
        self._background_calls()
        row, done_row = self._offer_row(), self._done_row()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 4)     # compact: the panes keep the height
        layout.setSpacing(2)
        layout.addLayout(row)
        layout.addWidget(self.runner)
        layout.addWidget(self.run_status)
        layout.addLayout(done_row)
        self._set_done_buttons(False)
        self.hide()

    def _offer_row(self) -> QHBoxLayout:
        """The offer with its estimate; Use, Measure, Start and Hide."""
        self.offer = QLabel()
        self.offer.setWordWrap(True)
        self.measure_button = QPushButton("Measure")
        self.measure_button.setToolTip("Time a short probe of the run on this machine")
        self.start_button = QPushButton("Start")
        self.use_button = QPushButton("Use")     # "Use NAME": the library model offered
        self.use_button.setToolTip("Point the config's base model at this model of your "
                                   "library")
        self.use_button.hide()
        self.close_button = QPushButton("Hide")
        self.measure_button.clicked.connect(self.measure)
        self.start_button.clicked.connect(self.start)
        self.close_button.clicked.connect(self.hide)
        self.use_button.clicked.connect(self.use_candidate)
        row = QHBoxLayout()
        row.addWidget(self.offer, 1)
        for button in (self.use_button, self.measure_button, self.start_button,
                       self.close_button):
            row.addWidget(button)
        return row

    def _done_row(self) -> QHBoxLayout:
        """The finished run's BEFORE/AFTER answers, "Chat with it" and "Export it"."""
        self.result = QLabel()
        self.result.setWordWrap(True)
        self.result.hide()
        self.chat_button = QPushButton("Chat with it")
        self.export_button = QPushButton("Export it")
        self.chat_button.clicked.connect(lambda: self.open_chat.emit(self.run_dir))
        self.export_button.clicked.connect(lambda: self.open_export.emit(self.run_dir))
        return layouts.row((self.result, 1), self.chat_button, self.export_button)

    def _background_calls(self) -> None:
        """The reads and writes that run off the GUI thread, each with where its answer goes."""
        self.offer_call = BackgroundCall(self)
        self.offer_call.done.connect(self._show_offer)
        self.offer_call.failed.connect(lambda exc: self._show_offer(
            (exc.render(), self.tune.installed(), False, None)))
        self.prepare_call = BackgroundCall(self)     # the probe's command, once prepared
        self.prepare_call.done.connect(self._probe)
        self.prepare_call.failed.connect(lambda exc: self._show_offer(
            (exc.render(), self.tune.installed(), False, None)))
        self.use_call = BackgroundCall(self)     # the config pointed at a library model
        self.use_call.done.connect(lambda _: self.refresh())
        self.use_call.failed.connect(lambda exc: self._show_offer(
            (exc.render(), False, False, self.candidate)))
        self.start_call = BackgroundCall(self)
        self.start_call.done.connect(self._launched)
        self.start_call.failed.connect(self._refused)
        self.samples_call = BackgroundCall(self)
        self.samples_call.done.connect(self._show_result)
        self.samples_call.failed.connect(lambda exc: self.result.setText(exc.render()))

    def set_workspace(self, workspace: Workspace, threads: int | None) -> None:
        """Offer the run where the workspace has the pirate config (the sample workspace)."""
        self.workspace = workspace
        self.tune = FirstTune(workspace.root, self.settings, threads)
        self.run_dir = None
        self.result.hide()
        self._set_done_buttons(False)
        self.setVisible(self.tune.available)
        if self.tune.available:
            self.refresh()

    def refresh(self, probe_ok: bool | None = None) -> None:
        """Read the offer off the GUI thread; after a probe, store its measurement first."""
        tune = self.tune
        self.offer.setText("Checking this machine…")

        def read():
            if probe_ok is not None:
                tune.finish_probe(probe_ok)
            ready = tune.ready()
            found = [] if ready else tune.candidates()
            return (tune.offer(), ready, ready and tune.cached() is not None,
                    found[0]["name"] if found else None)

        self.offer_call.start(read)

    def _show_offer(self, value: tuple[str, bool, bool, str | None]) -> None:
        text, ready, measured, candidate = value
        self.offer.setText(text)
        idle = not (self.runner.running or self.prepare_call.running or self.start_call.running
                    or self.use_call.running or self.timer.isActive())
        self.candidate = candidate
        self.use_button.setText(f"Use {candidate}" if candidate else "Use")
        self.use_button.setVisible(bool(candidate) and not ready)
        self.use_button.setEnabled(idle)
        self.measure_button.setVisible(ready and not measured)
        self.measure_button.setEnabled(idle)
        self.start_button.setVisible(ready)
        self.start_button.setEnabled(idle)

    def use_candidate(self) -> None:
        """Point the config at the library model offered (its file is written off the GUI
        thread), then read the offer again: Measure and Start appear."""
        tune, name = self.tune, self.candidate
        if not name:
            return
        self.use_button.setEnabled(False)
        self.offer.setText(f"Pointing {tune.config.name} at {name}…")
        self.use_call.start(lambda: tune.use_library_model(name))

    def measure(self) -> None:
        tune = self.tune
        self.measure_button.setEnabled(False)
        self.start_button.setEnabled(False)
        self.offer.setText("Preparing the probe…")
        self.prepare_call.start(lambda: (tune.prepare(), tune.start_probe())[1])

    def _probe(self, argv: list[str]) -> None:
        self.runner.show()
        self.runner.start(argv, "measuring: a 2-step probe of the run")

    def _probed(self, ok: bool, _message: str) -> None:
        self.runner.setVisible(not ok)
        self.refresh(probe_ok=ok)

    def start(self) -> None:
        """The run itself, detached like the Runs pane's (it outlives the window; the
        ledger follows it by its folder), started on a worker thread; this strip then
        watches its status for the end."""
        workspace, tune = self.workspace, self.tune
        self.run_dir = run_dir = workspace.new_run_dir(tune.config.stem)
        self.log = log = workspace.launch_dir / f"{run_dir.name}.log"
        self.result.hide()
        self._set_done_buttons(False)
        self.measure_button.setEnabled(False)
        self.start_button.setEnabled(False)
        self.run_status.setText(f"starting {run_dir.name}…")
        self.run_status.show()

        def launch() -> int:
            tune.prepare()
            log.parent.mkdir(parents=True, exist_ok=True)
            return start_detached(run_argv(tune.config, run_dir, tune.threads), log)

        self.start_call.start(launch)

    def _launched(self, pid: int) -> None:
        self.pid = pid
        self.run_status.setText(f"training {self.run_dir.name}: follow it in Runs…")
        self.timer.start()
        self.started.emit(self.run_dir)

    def _refused(self, exc) -> None:
        self.run_status.setText(f"{self.run_dir.name} did not start: {exc.render()}")
        self.refresh()

    def poll(self) -> None:
        state = run_outcome(self.run_dir, self.pid)
        if state is None:
            return
        self.timer.stop()
        self.refresh()
        if state != "completed":
            log = self.log.read_text(errors="replace") if self.log.is_file() else ""
            ended = "did not start" if state in ("starting", "unknown") else f"ended {state}"
            self.run_status.setText(f"{self.run_dir.name} {ended}: "
                                    f"{job_error(log) or 'see it in Runs'}")
            return
        from app.viewmodels.samples import before_after

        self.run_status.hide()
        run_dir = self.run_dir
        self.samples_call.start(lambda: before_after(run_dir))

    def _show_result(self, rows: list[tuple[str, str, str]]) -> None:
        cells = "".join(f"<tr><td>{html.escape(p)}</td><td>{html.escape(b)}</td>"
                        f"<td>{html.escape(a)}</td></tr>" for p, b, a in rows)
        self.result.setText(f"<b>{html.escape(self.run_dir.name)} is done.</b>"
                            "<table cellspacing=6><tr><th>prompt</th><th>BEFORE</th>"
                            f"<th>AFTER</th></tr>{cells}</table>")
        self.result.show()
        self._set_done_buttons(True)

    def _set_done_buttons(self, shown: bool) -> None:
        self.chat_button.setVisible(shown)
        self.export_button.setVisible(shown)
