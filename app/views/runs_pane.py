"""Runs pane: the run ledger (app/views/runs_ledger.py), the "New run" form
(app/views/run_form.py) and what is said about the selected runs (app/views/run_details.py)
beside live charts; this module starts, queues, stops, resumes and deletes runs, and polls.

Work that touches the disk or the engine runs on worker threads (`BackgroundCall`), never on
the GUI thread: reading a config into a form, writing a new config from a template, writing a
launch config and starting the job process. The ledger's view-model announces a run that
ended (`Ledger.settled`); the jobs panel is told from there."""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QMessageBox,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import jobs
from app.viewmodels.jobs import BackgroundJob
from app.viewmodels.reports import report_files
from app.viewmodels.runs import (
    LedgerRow,
    delete_run,
    extension_plan,
    is_running,
    launch_state,
    request_stop,
)
from app.viewmodels.workspace import Workspace
from app.views.background import BackgroundCall
from app.views.charts import RunCharts
from app.views.engine_process import start_detached
from app.views.help_link import help_link
from app.views.jobs_panel import job_center
from app.views.run_details import RefusedStart, RunDetails, StageLine
from app.views.run_form import RunForm
from app.views.runs_ledger import LedgerView
from app.views.search_box import SearchBox
from engine.errors import ForgebenchError

LEDGER_PERIOD_S = 1.0


class RunsPane(QWidget):
    message = Signal(str)
    reports_requested = Signal(object)      # a run folder: show its evaluation reports

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.queue: jobs.JobQueue | None = None
        self.launches: dict[Path, tuple[jobs.PendingRun, int]] = {}  # out -> (pending, pid)
        self.threads: int | None = None  # CPU threads per job (None: the engine's default)
        self._ledger_read = 0.0
        self.start_calls: set[BackgroundCall] = set()   # launches being written and started
        self._resume_for: list[Path] = []     # the runs the typed step target is meant for
        self.extend_dialog = None             # the question before a schedule changes

        self.ledger_view = LedgerView(self)
        self.ledger_view.selection_changed.connect(self._selection_changed)
        self.ledger_view.model.state.settled.connect(self._run_settled)
        self.form = RunForm()
        self.form.start_requested.connect(lambda queue: self.start_from_form(queue=queue))
        self.form.message.connect(self.message)
        self.launch_problem = RefusedStart()
        self.details = RunDetails()
        self.stage_label = StageLine()
        self.search_box = SearchBox()       # embed-retrieval runs: ranked documents
        self.charts = RunCharts()
        # the parts other panes, the screenshots and the tests reach through the pane
        self.ledger, self.table = self.ledger_view.model, self.ledger_view.table
        self.facts = self.ledger_view.facts
        self.config_combo, self.form_widget = self.form.config_combo, self.form.form_widget
        self.start_button, self.queue_button = self.form.start_button, self.form.queue_button
        self.form_status = self.form.form_status

        self.left_tabs = QTabWidget()
        self.left_tabs.addTab(self._ledger_tab(), "Ledger")
        self.left_tabs.addTab(self.form, "New run")
        self.left_tabs.addTab(self.search_box, "Search")
        splitter = QSplitter()
        splitter.addWidget(self.left_tabs)
        splitter.addWidget(self._charts_box())
        splitter.setSizes([470, 810])
        splitter.setStretchFactor(1, 1)
        QVBoxLayout(self).addWidget(splitter)

    def _ledger_tab(self) -> QWidget:
        self.stop_button = QPushButton("&Stop")
        self.resume_button = QPushButton("&Resume")
        self.resume_steps = QSpinBox()
        self.resume_steps.setRange(0, 10_000_000)
        self.resume_steps.setSpecialValueText("same target")
        self.resume_steps.setPrefix("to step ")
        self.resume_steps.setToolTip("Resume to this step target (for the selected run only; "
                                     "'same target' finishes the run's own)")
        self.delete_button = QPushButton("Delete…")
        self.delete_button.setToolTip("Delete the selected runs' folders (example runs too)")
        self.stop_button.clicked.connect(self.stop_selected)
        self.resume_button.clicked.connect(self.resume_selected)
        self.delete_button.clicked.connect(self.delete_selected)
        buttons = QHBoxLayout()
        for widget in (self.stop_button, self.resume_button, self.resume_steps):
            buttons.addWidget(widget)
        buttons.addStretch(1)
        buttons.addWidget(self.delete_button)
        box = QWidget()
        layout = QVBoxLayout(box)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.launch_problem)
        layout.addWidget(self.table, 3)
        layout.addWidget(self.facts)
        layout.addLayout(buttons)
        layout.addWidget(self.details, 1)
        return box

    def _charts_box(self) -> QWidget:
        self.reports_button = QPushButton("Reports")
        self.reports_button.setToolTip("The selected run's evaluation reports, figures and "
                                       "plots, in the Reports pane")
        self.reports_button.setEnabled(False)
        self.reports_button.clicked.connect(
            lambda: self.reports_requested.emit(self.selected_paths()[0]))
        box = QWidget()
        layout = QVBoxLayout(box)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.stage_label)
        layout.addWidget(self.charts, 1)
        under_charts = QHBoxLayout()     # (the ledger's button row has no room left at 1024)
        under_charts.addWidget(help_link("metrics", "What do these charts and figures mean?"))
        under_charts.addStretch(1)
        under_charts.addWidget(self.reports_button)
        layout.addLayout(under_charts)
        return box

    # -- workspace -----------------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.queue = jobs.JobQueue(workspace)
        self.launches.clear()
        for key in [k for k in job_center().jobs if k.startswith("run:")]:
            job_center().drop(key)      # the runs of the workspace that was open before
        self.follow = None
        self.launch_problem.hide()
        self.charts.set_runs([])
        self.form.set_workspace(workspace)
        self.poll()
        if self.ledger.rows:
            self.table.selectRow(0)

    @property
    def follow(self) -> Path | None:
        """A run just started: the ledger selects it when it appears."""
        return self.ledger_view.follow

    @follow.setter
    def follow(self, path: Path | None) -> None:
        self.ledger_view.follow = path

    # -- jobs ----------------------------------------------------------------------------
    def active_runs(self) -> list[Path]:
        return self.ledger.state.active_paths()

    def start_from_form(self, queue: bool = False) -> Path | None:
        """Start (or queue) the form's run; its run folder, known at once, is returned while
        its config is written and its process started on a worker thread."""
        form = self.form.form
        if self.workspace is None or form is None or not form.valid or self.form.loading:
            return None
        stem = self.form.config_stem()
        workspace, threads, processes = self.workspace, self.threads, self.form.processes.value()
        out = workspace.new_run_dir(stem)
        self.launch_problem.hide()
        self.follow = out
        queued = queue and bool(self.active_runs() or self.launches or self.queue.items)

        def write_and_start():
            pending = jobs.prepare_run(workspace, form, stem, threads, processes, out=out)
            return pending, None if queued else start_detached(pending.argv(), pending.log)

        self._in_background(write_and_start, self._started, out.name)
        self.left_tabs.setCurrentIndex(0)
        return out

    def _in_background(self, work, done, name: str) -> None:
        """Run a launch step on its own worker thread; a refusal shows as a refused start."""
        call = BackgroundCall(self)
        self.start_calls.add(call)

        def finish(handler, value):
            self.start_calls.discard(call)
            call.deleteLater()
            handler(value)

        call.done.connect(lambda value: finish(done, value))
        call.failed.connect(lambda exc: finish(lambda e: self._refused(name, e.render()), exc))
        call.start(work)

    def _started(self, launched: tuple[jobs.PendingRun, int | None]) -> None:
        pending, pid = launched
        if pid is None:
            self.queue.push(pending)
            self.message.emit(f"queued {pending.out.name}")
        else:
            self._launched(pending, pid)
        self.poll(force=True)

    def _launch(self, pending: jobs.PendingRun) -> None:
        """Start a queued run (its config is already written)."""
        self._in_background(lambda: (pending, start_detached(pending.argv(), pending.log)),
                            self._started, pending.out.name)

    def _launched(self, pending: jobs.PendingRun, pid: int) -> None:
        self.launches[pending.out] = (pending, pid)
        self.ledger.own_pids.add(pid)
        job_center().add(BackgroundJob(f"run:{pending.out}", "run", pending.out.name,
                                       stage="starting"))
        self.message.emit(f"started {pending.out.name} (pid {pid})")

    def _refused(self, name: str, reason: str) -> None:
        """A start the engine refused: the reason stays above the ledger, where the user
        looks after pressing Start, until the next start."""
        self.launch_problem.refuse(name, reason)
        self.details.setPlainText(f"{name} did not start:\n{reason}")
        self.message.emit(f"{name} did not start: {reason.splitlines()[0] if reason else ''}")
        center, key = job_center(), f"run:{self.workspace.runs_dir / name}"
        if key not in center.jobs:
            center.add(BackgroundJob(key, "run", name))
        center.finish(key, False, reason)

    def selected_paths(self) -> list[Path]:
        return self.ledger_view.selected_paths()

    def select_run(self, path: Path, add: bool = False) -> None:
        """Select a run's ledger row (add: keep the other selected runs, to overlay them)."""
        self.ledger_view.select_run(path, add)

    def stop_selected(self) -> None:
        for path in self.selected_paths():
            if request_stop(path):
                self.message.emit(f"asked {path.name} to checkpoint and stop")
        self.poll(force=True)

    def resume_selected(self) -> None:
        """Resume the selected runs (to the step target typed for them). A larger target whose
        learning-rate schedule would not just continue is asked about first, with the new
        curve (ExtendDialog); the plan is read off the GUI thread."""
        steps = self.resume_steps.value() or None
        for path in self.selected_paths():
            if is_running(path):
                self.message.emit(f"{path.name} is still running")
                continue
            self._in_background(lambda p=path: extension_plan(p, steps) if steps else None,
                                lambda plan, p=path: self._confirm_resume(p, steps, plan),
                                path.name)

    def _confirm_resume(self, path: Path, steps: int | None, plan) -> None:
        if plan is None:
            self._start_resume(path, steps)
            return
        from app.views.extend_dialog import ExtendDialog

        dialog = ExtendDialog(plan, self)
        self.extend_dialog = dialog
        dialog.accepted.connect(lambda: self._start_resume(path, steps))
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()

    def _start_resume(self, path: Path, steps: int | None) -> None:
        argv = jobs.resume_argv(path, steps, self.threads)
        log = jobs.resume_log(self.workspace, path)
        self._in_background(lambda: start_detached(argv, log),
                            lambda pid: self._resumed(path, pid), path.name)

    def _resumed(self, path: Path, pid: int) -> None:
        self.ledger.own_pids.add(pid)
        self.message.emit(f"resuming {path.name} (pid {pid})")
        self.poll(force=True)

    def delete_selected(self, confirm: bool = True) -> None:
        """Delete the selected runs after one confirmation; a run a job holds is kept."""
        paths = self.selected_paths()
        if not paths:
            return
        names = ", ".join(p.name for p in paths)
        if confirm and QMessageBox.question(
                self, "Delete runs", f"Delete {names}? Its folder, checkpoints and samples are "
                "removed from the workspace.") != QMessageBox.StandardButton.Yes:
            return
        for path in paths:
            try:
                delete_run(path)
                self.message.emit(f"deleted {path.name}")
            except ForgebenchError as exc:
                self.message.emit(exc.render())
        self.poll(force=True)

    def _follow_active_jobs(self) -> None:
        """Active runs in the jobs panel with their stage line and progress."""
        center = job_center()
        for row in self.ledger.rows:
            key = f"run:{row.path}"
            if row.active:
                if key not in center.jobs or center.jobs[key].cancel is None:  # was starting
                    center.add(BackgroundJob(key, "run", row.name, started=row.created or 0,
                                             cancel=lambda p=row.path: self._stop(p)))
                center.update(key, done=row.step or 0, total=row.target_steps or 0,
                              stage=row.stage_line)

    def _run_settled(self, row: LedgerRow) -> None:
        """The ledger announced a run no job trains: a run this session followed (running,
        or starting) is reported as finished, stopped or failed."""
        key = f"run:{row.path}"
        if key in job_center().jobs:
            ok = row.state in ("completed", "stopped")
            detail = (f"{row.state} at step {row.step}" if ok
                      else f"failed: {row.error or row.state}")
            job_center().finish(key, ok, f"{row.name}: {detail}")

    def _stop(self, path: Path) -> None:
        if request_stop(path):
            self.message.emit(f"asked {path.name} to checkpoint and stop")
        self.poll(force=True)

    def stop_all(self) -> int:
        return sum(request_stop(p) for p in self.active_runs())

    # -- polling -------------------------------------------------------------------------
    def _selection_changed(self) -> None:
        paths = self.selected_paths()
        if paths and paths != self._resume_for:
            # a step target typed for one run is never carried over to another
            self._resume_for = paths
            self.resume_steps.setValue(0)
        self.charts.set_runs(paths)
        self.search_box.set_run(paths[0] if len(paths) == 1 else None)
        self.reports_button.setEnabled(len(paths) == 1 and bool(report_files(paths[0])))
        self._show_details(paths)

    def _show_details(self, paths: list[Path]) -> None:
        if not self.launch_problem.isHidden() and not paths:
            return          # keep the refused start's reason until a run is chosen
        self.details.show_runs(paths)

    def _launch_states(self) -> list[tuple[str, str]]:
        """Launches whose run folder does not exist yet; a refused start shows its log."""
        extra = []
        for out, (pending, pid) in list(self.launches.items()):
            state = launch_state(out, pid)
            if state == "starting":
                extra.append((out.name, "starting"))
                continue
            del self.launches[out]
            if state == "gone":
                failure = jobs.launch_failure(pending) or \
                    "the job exited before creating its run"
                self._refused(out.name, failure)
        for pending in self.queue.items if self.queue else []:
            extra.append((pending.out.name, "waiting"))
        return extra

    def poll(self, force: bool = False) -> None:
        if self.workspace is None:
            return
        if force:
            self._ledger_read = 0.0
        now = time.monotonic()
        if now - self._ledger_read >= LEDGER_PERIOD_S:  # the table needs no faster refresh
            self._ledger_read = now
            self.ledger_view.refresh(self.workspace.run_dirs(), self._launch_states())
            self._follow_active_jobs()
        self.charts.refresh()
        selected = self.selected_paths()
        shown = [r for r in self.ledger.rows if r.path in selected]
        self.stage_label.show_rows(shown)
        if self.details.states_moved(shown):
            self._show_details(selected)
        pending = self.queue.pop_ready(bool(self.active_runs() or self.launches)) \
            if self.queue else None
        if pending:
            self._launch(pending)
