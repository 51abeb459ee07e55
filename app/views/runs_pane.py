"""Runs pane: the run ledger, a recipe form to start or queue runs, stop/resume, live charts
and the failure report of a failed run.

Work that touches the disk or the engine runs on worker threads (`BackgroundCall`), never on
the GUI thread: reading a config into a form (its schema import and path checks), writing a
new config from a template, writing a launch config and starting the job process."""

from __future__ import annotations

import html
import time
from pathlib import Path

from PySide6.QtCore import (
    QAbstractTableModel,
    QEvent,
    QItemSelectionModel,
    QModelIndex,
    Qt,
    QTimer,
    Signal,
)
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableView,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import jobs
from app.viewmodels.forms import RecipeForm, new_config_from_template, recipe_templates
from app.viewmodels.jobs import BackgroundJob
from app.viewmodels.models import library_files
from app.viewmodels.reports import report_files
from app.viewmodels.runs import (
    BestEval,
    LedgerRow,
    StepPace,
    delete_run,
    example_text,
    extension_plan,
    failure_report,
    ledger_row,
    run_notices,
    stable_order,
    write_notes,
)
from app.viewmodels.workspace import Workspace
from app.views import theme
from app.views.background import BackgroundCall
from app.views.charts import RunCharts
from app.views.combos import refill_keeping_choice
from app.views.engine_process import start_detached
from app.views.form_widget import RecipeFormWidget
from app.views.help_link import help_link
from app.views.jobs_panel import job_center
from app.views.search_box import SearchBox
from engine.errors import ForgebenchError
from engine.rundir import RunDir, pid_alive

COLUMNS = [("name", "Run"), ("state", "Status"), ("progress", "Step"), ("stage_line", "Doing"),
           ("started", "Started"), ("duration", "Duration"), ("question", "Question"),
           ("data_version", "Data"), ("device", "Device"), ("best_metric", "Best metric"),
           ("selected_checkpoint", "Checkpoint"), ("export", "Export"), ("notes", "Notes")]
# The ledger shows these columns so it fits beside the charts in a 1024x700 window without a
# sideways scroll; the selected run's other fields are listed under it, and the header's
# context menu shows any column in the table (Question and Notes are edited there).
SHOWN_COLUMNS = ("name", "state", "progress")
COLUMN_WIDTHS = {"stage_line": 170, "started": 120, "duration": 70}
EDITABLE = ("question", "notes")
LEDGER_PERIOD_S = 1.0
RECIPE_NOTES = {
    "lm-sft": "The Gemma 3 270M package is a base model, not a chat model: its BEFORE answers "
              "are not meant to be good. A handful of training pairs (the pirate set has 5) "
              "is memorised rather than generalised; that is what this demo shows."}
# a state's colour in the ledger (app/views/theme.py: a light and a dark variant each)
STATE_COLOURS = {"running": "running", "completed": "completed", "failed": "failed",
                 "stopped": "stopped", "stopping": "stopping", "queued": "queued",
                 "starting": "queued", "waiting": "queued"}


class LedgerModel(QAbstractTableModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[LedgerRow] = []
        self._stamps: dict[Path, tuple] = {}
        self._best: dict[Path, BestEval] = {}
        self._pace: dict[Path, StepPace] = {}
        self.extra: list[tuple[str, str]] = []  # (name, state) of launches without a folder yet
        self.own_pids: set[int] = set()     # the jobs this window started (runs, resumes)

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows) + len(self.extra)

    def columnCount(self, parent=QModelIndex()) -> int:
        return len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section][1]
        return None

    def _value(self, row: LedgerRow, key: str) -> str:
        if key == "progress":
            step = "—" if row.step is None else str(row.step)
            return f"{step} / {row.target_steps}" if row.target_steps else step
        if key == "state" and row.stage and row.state == "failed":
            return f"failed ({row.stage})"
        if key == "state" and row.elsewhere(self.own_pids):
            return f"{row.state} elsewhere" if row.active else f"{row.holder.get('purpose')} " \
                "elsewhere"
        if key == "started":
            return row.started_text()
        if key == "duration":
            return row.duration_text()
        if key == "stage_line":
            return row.stage_line if row.active else ""
        if key == "name" and row.example is not None:
            return f"{row.name} (example)"
        return str(getattr(row, key))

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        key = COLUMNS[index.column()][0]
        if index.row() >= len(self.rows):
            name, state = self.extra[index.row() - len(self.rows)]
            if role == Qt.ItemDataRole.DisplayRole:
                return {"name": name, "state": state}.get(key, "")
            return None
        row = self.rows[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            return self._value(row, key)
        if role == Qt.ItemDataRole.ForegroundRole and key == "state":
            return QColor(theme.colour(STATE_COLOURS.get(row.state, "text")))
        if role == Qt.ItemDataRole.ForegroundRole and key == "export" and row.export_colour:
            return QColor(row.export_colour)      # the verdict's colour (engine.export.verdict)
        if role == Qt.ItemDataRole.ToolTipRole:
            if key == "name":
                about = f"\n{example_text(row.example)}" if row.example is not None else ""
                return f"{row.name}\n{row.path}{about}"
            if key == "state" and row.holder is not None:
                return row.holder_text()
            return row.error or self._value(row, key)
        return None

    def flags(self, index):
        base = super().flags(index)
        if index.row() < len(self.rows) and COLUMNS[index.column()][0] in EDITABLE:
            return base | Qt.ItemFlag.ItemIsEditable
        return base

    def row(self, path: Path) -> LedgerRow | None:
        """The ledger line of one run (the sample workspace's example runs share the list)."""
        return next((r for r in self.rows if r.path == path), None)

    def setData(self, index, value, role=Qt.ItemDataRole.EditRole):
        row = self.rows[index.row()]
        key = COLUMNS[index.column()][0]
        write_notes(row.path, **{key: str(value)})
        self._stamps.pop(row.path, None)
        self.refresh(self.paths(), self.extra)
        return True

    def paths(self) -> list[Path]:
        return [r.path for r in self.rows]

    @staticmethod
    def _stamp(path: Path) -> tuple:
        out = []
        for name in ("status.json", "metrics.jsonl", "events.jsonl", "notes.json"):
            try:
                st = (path / name).stat()
                out.append((st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def refresh(self, paths: list[Path], extra: list[tuple[str, str]],
                hold_order: bool = False) -> None:
        """Re-read only the runs whose files changed (a poll costs a few stat calls). Newest
        first; `hold_order` (the pointer is over the ledger) keeps the rows shown in their
        places and puts new ones after them, until the pointer leaves."""
        old = {r.path: r for r in self.rows}
        rows = []
        for path in paths:
            stamp = self._stamp(path)
            row = old.get(path)
            if row is None or self._stamps.get(path) != stamp or row.active:
                row = ledger_row(path, self._best.setdefault(path, BestEval(path)),
                                 self._pace.setdefault(path, StepPace(path)))
                self._stamps[path] = stamp
            rows.append(row)
        rows.sort(key=lambda r: r.created or 0, reverse=True)
        if hold_order:
            where = {r.path: r for r in rows}
            rows = [where[p] for p in stable_order(self.paths(), [r.path for r in rows])]
        if [r.path for r in rows] != self.paths() or extra != self.extra:
            self.beginResetModel()
            self.rows, self.extra = rows, list(extra)
            self.endResetModel()
        else:
            for i, (a, b) in enumerate(zip(self.rows, rows)):
                if a != b:
                    self.rows[i] = b
                    self.dataChanged.emit(self.index(i, 0), self.index(i, len(COLUMNS) - 1))


class RunsPane(QWidget):
    message = Signal(str)
    reports_requested = Signal(object)      # a run folder: show its evaluation reports

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.queue: jobs.JobQueue | None = None
        self.launches: dict[Path, tuple[jobs.PendingRun, int]] = {}  # out -> (pending, pid)
        self.threads: int | None = None  # CPU threads per job (None: the engine's default)
        self._shown_states: list = []  # (run, state) pairs the details box was filled for
        self._ledger_read = 0.0
        self.form_call = BackgroundCall(self)       # a config read into a form
        self.form_call.done.connect(self._form_loaded)
        self.form_call.failed.connect(self._form_failed)
        self.template_call = BackgroundCall(self)   # a new config written from a template
        self.template_call.done.connect(self._config_created)
        self.template_call.failed.connect(lambda exc: self.form_status.setText(exc.render()))
        self.start_calls: set[BackgroundCall] = set()   # launches being written and started

        self.ledger = LedgerModel(self)
        self.table = QTableView()
        self.table.setModel(self.ledger)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.setAlternatingRowColors(True)
        # by pixel: a row scrolled to is whole (by item, the last one could stay cut off)
        self.table.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self._in_sight: Path | None = None      # a run just started, kept in view
        self.table.viewport().installEventFilter(self)
        self.table.verticalScrollBar().actionTriggered.connect(    # the user scrolls: theirs
            lambda _: setattr(self, "_in_sight", None))
        self.table.verticalHeader().hide()
        self.table.setWordWrap(False)       # a cell elides (its tooltip holds it), never wraps
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # run names differ at the end
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        for column, (key, _) in enumerate(COLUMNS):
            if key == "name":       # the run name takes the width the others leave
                header.setSectionResizeMode(column, QHeaderView.ResizeMode.Stretch)
            elif key in SHOWN_COLUMNS:
                header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
            self.table.setColumnWidth(column, COLUMN_WIDTHS.get(key, 110))
            self.table.setColumnHidden(column, key not in SHOWN_COLUMNS)
        header.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        header.customContextMenuRequested.connect(self._column_menu)
        header.setToolTip("Right-click to choose the columns; the selected run's other fields "
                          "are listed under the ledger")
        self.table.selectionModel().selectionChanged.connect(self._selection_changed)
        self.facts = QLabel()       # the selected run's fields the table does not show
        self.facts.setWordWrap(True)
        self.facts.setMinimumWidth(1)
        self.facts.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        theme.style(self.facts, "QLabel {{ color: {facts}; }}")
        self.follow: Path | None = None     # a run just started: select it when it appears
        self.launch_problem = QLabel()      # why the last start was refused, until the next
        self.launch_problem.setWordWrap(True)
        self.launch_problem.setMinimumWidth(1)      # a long line wraps; never widens the pane
        self.launch_problem.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        theme.style(self.launch_problem, "QLabel {{ background: {error_bg}; color: {error}; "
                                          "border: 1px solid {error_border}; padding: 4px; }}")
        self.launch_problem.hide()

        self.stop_button = QPushButton("&Stop")
        self.resume_button = QPushButton("&Resume")
        self.resume_steps = QSpinBox()
        self.resume_steps.setRange(0, 10_000_000)
        self.resume_steps.setSpecialValueText("same target")
        self.resume_steps.setPrefix("to step ")
        self.resume_steps.setToolTip("Resume to this step target (for the selected run only; "
                                     "'same target' finishes the run's own)")
        self._resume_for: list[Path] = []     # the runs the typed target is meant for
        self.extend_dialog = None             # the question before a schedule changes
        self.reports_button = QPushButton("Reports")
        self.reports_button.setToolTip("The selected run's evaluation reports, figures and "
                                       "plots, in the Reports pane")
        self.reports_button.setEnabled(False)
        self.reports_button.clicked.connect(
            lambda: self.reports_requested.emit(self.selected_paths()[0]))
        self.delete_button = QPushButton("Delete…")
        self.delete_button.setToolTip("Delete the selected runs' folders (example runs too)")
        self.stop_button.clicked.connect(self.stop_selected)
        self.resume_button.clicked.connect(self.resume_selected)
        self.delete_button.clicked.connect(self.delete_selected)
        buttons = QHBoxLayout()
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.resume_button)
        buttons.addWidget(self.resume_steps)
        buttons.addStretch(1)
        buttons.addWidget(self.delete_button)

        self.details = QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setPlaceholderText("Select a run: its warnings, why it stopped, and its "
                                        "error and traceback when it failed show here.")
        ledger_box = QWidget()
        lv = QVBoxLayout(ledger_box)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(self.launch_problem)
        lv.addWidget(self.table, 3)
        lv.addWidget(self.facts)
        lv.addLayout(buttons)
        lv.addWidget(self.details, 1)

        self.config_combo = QComboBox()
        self.config_combo.currentIndexChanged.connect(self._config_chosen)
        self.new_config_button = QPushButton("New from recipe ▾")
        self.new_config_button.setToolTip("Copy a recipe's template config into this "
                                          "workspace's configs/ folder")
        templates = QMenu(self.new_config_button)
        for stem in recipe_templates():
            templates.addAction(stem, lambda s=stem: self.ask_new_config(s))
        self.new_config_button.setMenu(templates)
        self.recipe_note = QLabel()
        self.recipe_note.setWordWrap(True)
        theme.style(self.recipe_note, "QLabel {{ color: {muted}; }}")
        self.form_widget = RecipeFormWidget()
        self.form_widget.validity_changed.connect(self._validity_changed)
        self.form_widget.built.connect(self._form_built)
        self.start_when_built: str | None = None   # a config another pane asked to start
        self.start_button = QPushButton("Start")
        self.queue_button = QPushButton("Add to queue")
        self.form_status = QLabel()
        self.form_status.setWordWrap(True)
        self.start_button.clicked.connect(lambda: self.start_from_form(queue=False))
        self.queue_button.clicked.connect(lambda: self.start_from_form(queue=True))
        form_box = QWidget()
        fv = QVBoxLayout(form_box)
        fv.setContentsMargins(0, 0, 0, 0)
        fv.addWidget(QLabel("Config (from the workspace's configs/ folder)"))
        config_row = QHBoxLayout()
        config_row.addWidget(self.config_combo, 1)
        config_row.addWidget(self.new_config_button)
        fv.addLayout(config_row)
        fv.addWidget(self.recipe_note)
        fv.addWidget(self.form_widget, 1)
        fv.addWidget(self.form_status)
        machine = jobs.machine_devices()     # the form's `device` field picks among these
        self.processes = QSpinBox()
        self.processes.setRange(1, max(machine["cpus"], len(machine["gpus"]), 1))
        self.processes.setPrefix("processes: ")
        self.processes.setToolTip("lm-pretrain and lm-sft: train on N processes (torchrun; "
                                  "one per GPU, or CPU threads split among them)")
        self.machine_label = QLabel(jobs.machine_text(machine))
        theme.style(self.machine_label, "QLabel {{ color: {muted}; }}")
        fv.addWidget(self.machine_label)
        row = QHBoxLayout()
        row.addWidget(self.processes)
        row.addWidget(self.start_button)
        row.addWidget(self.queue_button)
        fv.addLayout(row)

        self.left_tabs = QTabWidget()
        self.left_tabs.addTab(ledger_box, "Ledger")
        self.left_tabs.addTab(form_box, "New run")
        self.search_box = SearchBox()       # embed-retrieval runs: ranked documents
        self.left_tabs.addTab(self.search_box, "Search")
        self.charts = RunCharts()
        self.stage_label = QLabel()     # what the selected running job is doing right now
        self.stage_label.setWordWrap(True)
        self.stage_label.setMinimumWidth(1)
        theme.style(self.stage_label, "QLabel {{ color: {stage}; font-weight: bold; }}")
        self.stage_label.hide()
        charts_box = QWidget()
        cv = QVBoxLayout(charts_box)
        cv.setContentsMargins(0, 0, 0, 0)
        cv.addWidget(self.stage_label)
        cv.addWidget(self.charts, 1)
        under_charts = QHBoxLayout()     # (the ledger's button row has no room left at 1024)
        under_charts.addWidget(help_link("metrics", "What do these charts and figures mean?"))
        under_charts.addStretch(1)
        under_charts.addWidget(self.reports_button)
        cv.addLayout(under_charts)
        splitter = QSplitter()
        splitter.addWidget(self.left_tabs)
        splitter.addWidget(charts_box)
        splitter.setSizes([470, 810])
        splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)

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
        self.config_combo.clear()
        self.form_widget.set_datasets(workspace.dataset_dirs())
        self.form_widget.set_models(library_files(workspace.root))
        self.reload_configs()
        self.poll()
        if self.ledger.rows:
            self.table.selectRow(0)

    def reload_configs(self) -> None:
        """The configs/ folder's TOML files; the chosen one stays chosen (and its edits kept)
        when others appear or go."""
        paths = [str(p) for p in self.workspace.config_files()] if self.workspace else []
        if paths == [self.config_combo.itemData(i) for i in range(self.config_combo.count())]:
            return
        if not refill_keeping_choice(self.config_combo, [(Path(p).stem, p) for p in paths]):
            self._config_chosen()

    @property
    def form_loading(self) -> bool:
        return self.form_call.running or self.template_call.running or \
            self.form_widget.building

    def _config_chosen(self) -> None:
        path = self.config_combo.currentData()
        self.start_button.setEnabled(False)
        self.queue_button.setEnabled(False)
        if not path:
            self.form_call.cancel()
            self.form_status.setText("No configs in this workspace's configs/ folder.")
            return
        self.form_status.setText(f"reading {Path(path).name}…")
        self.form_call.start(lambda: RecipeForm.from_file(path))

    def _form_loaded(self, form: RecipeForm) -> None:
        self.form_widget.set_form(form)
        self.recipe_note.setText(RECIPE_NOTES.get(form.recipe, ""))
        self.recipe_note.setVisible(form.recipe in RECIPE_NOTES)

    def _form_failed(self, exc: ForgebenchError) -> None:
        self.form_status.setText(exc.render())

    def ask_new_config(self, template: str) -> None:
        name, ok = QInputDialog.getText(self, "New config", f"Name for the new {template} "
                                        "config:", text=template)
        if ok and name.strip():
            self.new_config(template, name.strip())

    def new_config(self, template: str, name: str) -> None:
        """Copy a recipe template into configs/ (on a worker thread), then open it in the
        form; `form_loading` is true until it is there."""
        source, folder = recipe_templates()[template], self.workspace.configs_dir
        self.form_status.setText(f"writing {name}.toml…")
        self.template_call.start(lambda: new_config_from_template(source, folder, name))

    def _config_created(self, path: Path) -> None:
        self.reload_configs()
        self.config_combo.setCurrentIndex(self.config_combo.findData(str(path)))
        self.message.emit(f"new config {path.name} in configs/")

    def _validity_changed(self, valid: bool) -> None:
        self.start_button.setEnabled(valid)
        self.queue_button.setEnabled(valid)
        self.form_status.setText("" if valid else "Fix the fields marked in red to start.")

    # -- jobs ----------------------------------------------------------------------------
    def active_runs(self) -> list[Path]:
        return [r.path for r in self.ledger.rows if r.active]

    def start_from_form(self, queue: bool = False) -> Path | None:
        """Start (or queue) the form's run; its run folder, known at once, is returned while
        its config is written and its process started on a worker thread."""
        form = self.form_widget.form
        if self.workspace is None or form is None or not form.valid or self.form_loading:
            return None
        stem = Path(self.config_combo.currentData() or form.recipe).stem
        workspace, threads, processes = self.workspace, self.threads, self.processes.value()
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

    def start_config(self, path: Path) -> None:
        """Open a config of configs/ in the form (pre-filled by another pane) and start it once
        the form is read and built (both off the GUI thread's long slices)."""
        self.reload_configs()
        self.config_combo.setCurrentIndex(self.config_combo.findData(str(path)))
        if self.form_loading:
            self.start_when_built = str(path)
        else:
            self.start_from_form()

    def _form_built(self) -> None:
        wanted, self.start_when_built = self.start_when_built, None
        if wanted and wanted == self.config_combo.currentData():
            self.start_from_form()

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
        self.launch_problem.setText(f"<b>{name} did not start.</b><br>"
                                    + html.escape(reason).replace("\n", "<br>"))
        self.launch_problem.show()
        self.details.setPlainText(f"{name} did not start:\n{reason}")
        self.message.emit(f"{name} did not start: {reason.splitlines()[0] if reason else ''}")
        center, key = job_center(), f"run:{self.workspace.runs_dir / name}"
        if key not in center.jobs:
            center.add(BackgroundJob(key, "run", name))
        center.finish(key, False, reason)

    def selected_paths(self) -> list[Path]:
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        return [self.ledger.rows[r].path for r in rows if r < len(self.ledger.rows)]

    def select_run(self, path: Path, add: bool = False) -> None:
        """Select a run's ledger row (add: keep the other selected runs, to overlay them)."""
        for i, row in enumerate(self.ledger.rows):
            if row.path == Path(path):
                flags = QItemSelectionModel.SelectionFlag.Rows | (
                    QItemSelectionModel.SelectionFlag.Select if add
                    else QItemSelectionModel.SelectionFlag.ClearAndSelect)
                self.table.selectionModel().select(self.ledger.index(i, 0), flags)
                return

    def stop_selected(self) -> None:
        for path in self.selected_paths():
            if RunDir(path).request_stop():
                self.message.emit(f"asked {path.name} to checkpoint and stop")
        self.poll(force=True)

    def resume_selected(self) -> None:
        """Resume the selected runs (to the step target typed for them). A larger target whose
        learning-rate schedule would not just continue is asked about first, with the new
        curve (ExtendDialog); the plan is read off the GUI thread."""
        steps = self.resume_steps.value() or None
        for path in self.selected_paths():
            if RunDir(path).is_active():
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

    def _resumed(self, path: Path, pid: int) -> None:
        self.ledger.own_pids.add(pid)
        self.message.emit(f"resuming {path.name} (pid {pid})")
        self.poll(force=True)

    def _sync_jobs(self) -> None:
        """Active runs in the jobs panel with their stage line; a run seen running in this
        session that ends is reported (finished, stopped or failed)."""
        center = job_center()
        for row in self.ledger.rows:
            key = f"run:{row.path}"
            if row.active:
                if key not in center.jobs or center.jobs[key].cancel is None:  # was starting
                    center.add(BackgroundJob(key, "run", row.name, started=row.created or 0,
                                             cancel=lambda p=row.path: self._stop(p)))
                center.update(key, done=row.step or 0, total=row.target_steps or 0,
                              stage=row.stage_line)
            elif key in center.jobs:
                ok = row.state in ("completed", "stopped")
                detail = (f"{row.state} at step {row.step}" if ok
                          else f"failed: {row.error or row.state}")
                center.finish(key, ok, f"{row.name}: {detail}")

    def _stop(self, path: Path) -> None:
        if RunDir(path).request_stop():
            self.message.emit(f"asked {path.name} to checkpoint and stop")
        self.poll(force=True)

    def stop_all(self) -> int:
        return sum(RunDir(p).request_stop() for p in self.active_runs())

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
        self._show_facts()

    def _column_menu(self, position) -> None:
        menu = QMenu(self)
        for column, (key, title) in enumerate(COLUMNS):
            if key == "name":
                continue
            action = menu.addAction(title)
            action.setCheckable(True)
            action.setChecked(not self.table.isColumnHidden(column))
            action.toggled.connect(lambda shown, c=column: self._show_column(c, shown))
        menu.exec(self.table.horizontalHeader().mapToGlobal(position))

    def _show_column(self, column: int, shown: bool) -> None:
        self.table.setColumnHidden(column, not shown)
        self._show_facts()

    def _show_facts(self) -> None:
        """The selected runs' fields whose columns are hidden, as "Field value" pairs."""
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        hidden = [c for c in range(len(COLUMNS)) if self.table.isColumnHidden(c)]
        lines = []
        for row in rows:
            pairs = [(COLUMNS[c][1], self.ledger.data(self.ledger.index(row, c)))
                     for c in hidden]
            facts = " · ".join(f"<b>{html.escape(title)}</b> {html.escape(str(value))}"
                               for title, value in pairs if value not in (None, "", "—"))
            name = self.ledger.data(self.ledger.index(row, 0))
            lines.append(f"{html.escape(str(name))}: {facts}" if len(rows) > 1 else facts)
        self.facts.setText("<br>".join(line for line in lines if line))
        self.facts.setVisible(bool(self.facts.text()))

    def _show_details(self, paths: list[Path]) -> None:
        if not self.launch_problem.isHidden() and not paths:
            return          # keep the refused start's reason until a run is chosen
        texts = []
        for path in paths:
            said = "\n\n".join(t for t in (run_notices(path), failure_report(path)) if t)
            if said:
                texts.append(f"{path.name}\n{said}")
        self.details.setPlainText("\n\n".join(texts))

    def _launch_states(self) -> list[tuple[str, str]]:
        """Launches whose run folder does not exist yet; a refused start shows its log."""
        extra = []
        for out, (pending, pid) in list(self.launches.items()):
            if RunDir(out).exists():
                del self.launches[out]
                continue
            if pid_alive(pid):
                extra.append((out.name, "starting"))
                continue
            del self.launches[out]
            failure = jobs.launch_failure(pending) or "the job exited before creating its run"
            self._refused(out.name, failure)
        for pending in self.queue.items if self.queue else []:
            extra.append((pending.out.name, "waiting"))
        return extra

    def _scroll_to(self) -> None:
        """Bring the run just started into view, and keep it there while the ledger is laid
        out again (the facts under it take height from the table) until another is chosen."""
        if self._in_sight in self.ledger.paths() and \
                self.selected_paths() == [self._in_sight]:
            self.table.doItemsLayout()      # the rows a reset added count in the scroll range
            self.table.scrollTo(self.ledger.index(self.ledger.paths().index(self._in_sight), 0))
        else:
            self._in_sight = None

    def eventFilter(self, watched, event) -> bool:      # noqa: N802 (Qt's name)
        if watched is self.table.viewport() and event.type() == QEvent.Type.Resize and \
                self._in_sight is not None:
            QTimer.singleShot(0, self._scroll_to)
        return super().eventFilter(watched, event)

    def pointer_over_ledger(self) -> bool:
        return self.table.viewport().underMouse()

    def poll(self, force: bool = False) -> None:
        if self.workspace is None:
            return
        if force:
            self._ledger_read = 0.0
        now = time.monotonic()
        if now - self._ledger_read >= LEDGER_PERIOD_S:  # the table needs no faster refresh
            self._ledger_read = now
            extra = self._launch_states()
            selected = self.selected_paths()
            hold = self.pointer_over_ledger()
            offset = self.table.verticalScrollBar().value()
            self.ledger.refresh(self.workspace.run_dirs(), extra, hold_order=hold)
            if hold:    # the rows kept their places: a reset must not scroll them away
                self.table.doItemsLayout()
                self.table.verticalScrollBar().setValue(offset)
            followed = None
            if self.follow is not None and self.follow in self.ledger.paths():
                selected, self.follow = [self.follow], None     # show the new run's charts
                followed = selected[0]
                self.table.clearSelection()
            if self.selected_paths() != selected:
                for path in selected:
                    self.select_run(path, add=True)
            if followed is not None:        # the run just started is selected and in sight
                self._in_sight = followed
            self._sync_jobs()
            self._show_facts()      # a live run's stage, duration and best metric move on
            if self._in_sight is not None:      # (until the user scrolls or chooses)
                QTimer.singleShot(0, self._scroll_to)
        self.charts.refresh()
        shown = [r for r in self.ledger.rows if r.path in self.selected_paths()]
        doing = [f"{r.name}: {r.stage_line}" for r in shown if r.active]
        self.stage_label.setText("\n".join(doing))
        self.stage_label.setVisible(bool(doing))
        states = [(r.path, r.state) for r in shown]
        if states != self._shown_states:
            self._shown_states = states
            self._show_details(self.selected_paths())
        active = self.active_runs()
        pending = self.queue.pop_ready(bool(active or self.launches)) if self.queue else None
        if pending:
            self._launch(pending)
