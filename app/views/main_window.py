"""The main window: a sidebar of panes, the workspace menu with recent workspaces, a status bar
with running jobs and the jobs panel, one poll timer that follows every run directory and
watches the workspace (new runs, checkpoints, samples, configs, datasets reach every pane), a
notification when a job ends, a geometry that fits the screen and is remembered, and the close
question.

Panes are built when first needed (shown, or asked for as `window.runs` and so on), so the window
paints before pyqtgraph, numpy-heavy views and the recipe schemas are imported: the first pane is
built at once; after the first paint the other panes' modules are imported on a worker thread
while the user looks at it, and then the Runs pane is built (it follows every job for the status
bar and the close question). A pane built later gets the open workspace when it is built."""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from PySide6.QtCore import QByteArray, QEvent, Qt, QTimer
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QAbstractSpinBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDockWidget,
    QFileDialog,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.tour import Tour
from app.viewmodels.workspace import (
    Settings,
    Workspace,
    WorkspaceWatch,
    dialog_folder,
    install_sample_workspace,
)
from app.views import theme
from app.views.background import BackgroundCall
from app.views.first_tune_panel import FirstTunePanel
from app.views.form_widget import WheelGuard, guard_wheel
from app.views.jobs_panel import JobsPanel, Notifier, job_center
from app.views.tour_panel import TourPanel
from engine.errors import ForgebenchError

PANES = ("Datasets", "Labels && Masks", "Runs", "Samples", "Blind A/B", "Export",
         "Models", "Chat", "Transcripts", "Reports")
# Each pane's attribute on the window and the class that builds it, in sidebar order; the
# modules are imported only when the pane is built (or pre-imported off the GUI thread).
PANE_CLASSES = (("datasets", "app.views.datasets_pane", "DatasetsPane"),
                ("masks", "app.views.masks_pane", "MasksPane"),
                ("runs", "app.views.runs_pane", "RunsPane"),
                ("samples", "app.views.samples_pane", "SamplesPane"),
                ("ab", "app.views.ab_pane", "ABPane"),
                ("export", "app.views.export_wizard", "ExportWizardPane"),
                ("models", "app.views.models_pane", "ModelsPane"),
                ("chat", "app.views.chat_pane", "ChatPane"),
                ("transcripts", "app.views.transcripts_pane", "TranscriptsPane"),
                ("reports", "app.views.reports_pane", "ReportsPane"))
PANE_NAMES = tuple(name for name, _, _ in PANE_CLASSES)
DEFAULT_SIZE = (1440, 900)
MIN_SIZE = (900, 600)
TITLE_BAR_PX = 32           # left for the window manager's title bar on a small screen
WATCH_PERIOD_S = 1.0


class PaneScroll(QScrollArea):
    """A pane's scroll area that gives the pane the viewport's height whenever the pane's
    minimum fits in it. (A resizable QScrollArea sizes a pane with word-wrapped labels by its
    preferred height for the width, so a pane that could shrink to fit scrolled instead, and
    its bottom row — Stop/Resume, Send, a refusal — went below the fold at 1024×700.) A pane
    whose minimum is taller than the window scrolls, as before."""

    def __init__(self):
        super().__init__()
        self.setWidgetResizable(False)
        self.setFrameShape(QFrame.Shape.NoFrame)

    def setWidget(self, widget: QWidget) -> None:       # noqa: N802 (Qt's name)
        super().setWidget(widget)
        widget.installEventFilter(self)
        self.fit()

    def eventFilter(self, watched, event) -> bool:      # noqa: N802 (Qt's name)
        if watched is self.widget() and event.type() == QEvent.Type.LayoutRequest:
            QTimer.singleShot(0, self.fit)
        return False

    def resizeEvent(self, event) -> None:               # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self.fit()

    def needed_height(self, width: int) -> int:
        widget = self.widget()
        layout = widget.layout()
        if layout is not None and layout.hasHeightForWidth():
            needed = layout.minimumHeightForWidth(width)
        else:
            needed = widget.minimumSizeHint().height()
        return max(needed, widget.minimumHeight())

    def fit(self) -> None:
        widget = self.widget()
        if widget is None:
            return
        room = self.maximumViewportSize()
        least = max(widget.minimumSizeHint().width(), widget.minimumWidth())
        width = max(room.width(), least)
        height = self.needed_height(width)
        if height > room.height():      # it scrolls: the vertical bar takes its width
            width = max(room.width() - self.verticalScrollBar().sizeHint().width(), least)
            height = self.needed_height(width)
        widget.resize(width, max(height, room.height()))


class ProblemBanner(QFrame):
    """Shown instead of a modal error when a workspace cannot be opened: says why, offers ways
    out (open another, create one, open the sample, forget the entry)."""

    def __init__(self, window: "MainWindow"):
        super().__init__()
        theme.style(self, "ProblemBanner {{ background: {problem_bg}; border: 1px solid "
                          "{problem_border}; }} ProblemBanner QLabel {{ color: {text}; }}")
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.open_other = QPushButton("Open another workspace…")
        self.create_new = QPushButton("Create a new workspace…")
        self.open_sample = QPushButton("Open the sample workspace")
        self.forget = QPushButton("Remove from recent")
        self.open_other.clicked.connect(window.choose_workspace)
        self.create_new.clicked.connect(window.choose_new_workspace)
        self.open_sample.clicked.connect(window.open_sample)
        self.forget.clicked.connect(window.forget_failed)
        row = QHBoxLayout()
        for button in (self.open_other, self.create_new, self.open_sample, self.forget):
            row.addWidget(button)
        row.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.text)
        layout.addLayout(row)
        self.hide()


class SettingsDialog(QDialog):
    def __init__(self, settings: Settings, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.settings = settings
        self.poll_ms = QSpinBox()
        self.poll_ms.setRange(100, 10_000)
        self.poll_ms.setSuffix(" ms")
        self.poll_ms.setValue(int(settings.get("poll_ms", 500)))
        self.threads = QSpinBox()
        self.threads.setRange(0, 256)
        self.threads.setSpecialValueText("engine default")
        self.threads.setValue(int(settings.get("threads", 0)))
        form = QFormLayout(self)
        form.addRow("Refresh run charts every", self.poll_ms)
        form.addRow("CPU threads per job", self.threads)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def accept(self) -> None:
        self.settings.set("poll_ms", self.poll_ms.value())
        self.settings.set("threads", self.threads.value())
        super().accept()


class MainWindow(QMainWindow):
    # What closing does while jobs run: "ask" shows a question; tests set "stop" or "leave".
    close_policy = "ask"

    def __init__(self, settings: Settings | None = None):
        super().__init__()
        self._painted = False       # the first paint starts the panes' background preload
        self.settings = settings or Settings()
        self.workspace: Workspace | None = None
        self.failed_path: str | None = None
        self.setWindowTitle("Forgebench")
        self.watch: WorkspaceWatch | None = None
        self._watched = 0.0
        self.watch_call = BackgroundCall(self)   # the workspace's listings, read off the GUI
        self.watch_call.done.connect(self.refresh_panes)

        self._panes: dict[str, QWidget] = {}
        self._build_sidebar_and_stack()
        self.preload_call = BackgroundCall(self)    # the other panes' modules, off the GUI
        self._build_central()
        self._build_status_and_jobs()
        self._build_menus()
        self._restore_geometry()

        self.timer = QTimer(self)
        self.timer.setInterval(int(self.settings.get("poll_ms", 500)))
        self.timer.timeout.connect(self.poll)
        self.timer.start()

    def _build_sidebar_and_stack(self) -> None:
        self.sidebar = QListWidget()
        self.sidebar.addItems([p.replace("&&", "&") for p in PANES])
        self.sidebar.setFixedWidth(150)
        self.sidebar.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.sidebar.setStyleSheet("QListWidget { font-size: 14px; } "
                                   "QListWidget::item { padding: 10px 8px; }")
        self.stack = QStackedWidget()
        for _ in PANE_CLASSES:
            # A pane that needs more room than the window has scrolls; it never makes the
            # window bigger than the screen (DESIGN: every pane works at 1024×700).
            self.stack.addWidget(PaneScroll())
        # Scrolling a pane never edits a combo box or spin box the user did not click into.
        self.wheel_guard = WheelGuard(self)
        self.sidebar.currentRowChanged.connect(self._show_row)
        self.sidebar.setCurrentRow(0)

    def _build_central(self) -> None:
        """The banners (a problem, the tour, the first fine-tune) over the sidebar and pane."""
        self.banner = ProblemBanner(self)
        self.tour_panel = TourPanel(Tour(self.settings))
        self.tour_panel.show_pane.connect(self.show_pane)
        self.first_tune = FirstTunePanel(self.settings)
        self.first_tune.started.connect(self.follow_run)
        self.first_tune.open_chat.connect(self.chat_with_run)
        self.first_tune.open_export.connect(self.export_run)
        central = QWidget()
        body = QHBoxLayout()
        body.setContentsMargins(0, 0, 0, 0)
        body.addWidget(self.sidebar)
        body.addWidget(self.stack, 1)
        outer = QVBoxLayout(central)
        outer.setContentsMargins(4, 4, 4, 4)
        outer.addWidget(self.banner)
        outer.addWidget(self.tour_panel)
        outer.addWidget(self.first_tune)
        outer.addLayout(body, 1)
        self.setCentralWidget(central)

    def _build_status_and_jobs(self) -> None:
        """The status bar (workspace, jobs button), the jobs dock and the notifications."""
        self.workspace_label = QLabel("no workspace")
        self.workspace_label.setMinimumWidth(1)     # a long path elides, never widens the window
        self.jobs_button = QPushButton("no jobs running")
        self.jobs_button.setFlat(True)
        self.jobs_button.setToolTip("Show or hide the jobs panel")
        self.statusBar().addWidget(self.workspace_label, 1)
        self.statusBar().addPermanentWidget(self.jobs_button)
        self.jobs = job_center()
        self.jobs.reset()
        self.jobs_panel = JobsPanel(self.jobs)
        self.jobs_dock = QDockWidget("Jobs", self)
        self.jobs_dock.setObjectName("jobs")
        self.jobs_dock.setWidget(self.jobs_panel)
        self.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, self.jobs_dock)
        self.jobs_dock.hide()
        self.jobs_button.clicked.connect(
            lambda: self.jobs_dock.setVisible(not self.jobs_dock.isVisible()))
        self.jobs.changed.connect(self._jobs_changed)
        self.notifier = Notifier(self)
        self.jobs.finished.connect(self.notifier.notify)

    # -- panes ---------------------------------------------------------------------------
    def pane(self, name: str) -> QWidget:
        """The pane called `name` (see PANE_CLASSES), built on first use."""
        built = self._panes.get(name)
        if built is not None:
            return built
        index = PANE_NAMES.index(name)
        _, module, cls = PANE_CLASSES[index]
        built = getattr(importlib.import_module(module), cls)()
        self._panes[name] = built
        built.message.connect(self.show_message)
        if name == "runs":
            built.threads = int(self.settings.get("threads", 0)) or None
            built.reports_requested.connect(self.show_reports)
        elif name == "masks":
            built.dataset_saved.connect(self._dataset_saved)
        elif name == "models":
            built.library_changed.connect(self._library_changed)
        elif name == "ab":
            built.train_requested.connect(self.train_preferences)
        self.stack.widget(index).setWidget(built)
        for widget in built.findChildren(QComboBox) + built.findChildren(QAbstractSpinBox):
            guard_wheel(widget, self.wheel_guard)
        if self.workspace is not None:
            built.set_workspace(self.workspace)
        return built

    def built_panes(self) -> list[QWidget]:
        return [self._panes[name] for name in PANE_NAMES if name in self._panes]

    def _built(self, name: str) -> QWidget | None:
        return self._panes.get(name)

    datasets = property(lambda self: self.pane("datasets"))
    masks = property(lambda self: self.pane("masks"))
    runs = property(lambda self: self.pane("runs"))
    samples = property(lambda self: self.pane("samples"))
    ab = property(lambda self: self.pane("ab"))
    export = property(lambda self: self.pane("export"))
    models = property(lambda self: self.pane("models"))
    chat = property(lambda self: self.pane("chat"))
    transcripts = property(lambda self: self.pane("transcripts"))
    reports = property(lambda self: self.pane("reports"))

    def _show_row(self, row: int) -> None:
        if 0 <= row < len(PANE_NAMES):
            self.pane(PANE_NAMES[row])
        self.stack.setCurrentIndex(row)

    def event(self, event) -> bool:
        if not self._painted and event.type() == QEvent.Type.Paint:
            self._painted = True
            QTimer.singleShot(0, self._after_first_paint)
        return super().event(event)

    def _after_first_paint(self) -> None:
        """The other panes' modules are imported on a worker thread (the window answers
        input meanwhile), then the Runs pane is built: it follows the workspace's jobs for
        the status bar, the notifications and the close question."""
        if not self.isVisible():        # closed already: no thread may outlive the window
            return
        modules = [module for name, module, _ in PANE_CLASSES if name not in self._panes]
        self.preload_call.done.connect(lambda _: self.pane("runs"))
        self.preload_call.failed.connect(lambda exc: self.show_message(exc.render()))
        self.preload_call.start(lambda: [importlib.import_module(m) for m in modules])

    def _dataset_saved(self, path) -> None:
        if self._built("datasets") is not None:
            self.datasets.reload(path)

    def _library_changed(self) -> None:
        if self._built("chat") is not None:
            self.chat.refresh_sources()
        if self.first_tune.tune is not None and self.first_tune.isVisible():
            self.first_tune.refresh()       # a model added: the strip may offer it now

    # -- menus ---------------------------------------------------------------------------
    def _build_menus(self) -> None:
        menu = self.menuBar().addMenu("&Workspace")
        for text, shortcut, slot in (
                ("&Open…", QKeySequence.StandardKey.Open, self.choose_workspace),
                ("&New…", QKeySequence.StandardKey.New, self.choose_new_workspace),
                ("Open &sample workspace", None, self.open_sample)):
            action = QAction(text, self)
            if shortcut:
                action.setShortcut(shortcut)
            action.triggered.connect(slot)
            menu.addAction(action)
        self.recent_menu = menu.addMenu("&Recent")
        menu.addSeparator()
        settings = QAction("S&ettings…", self)
        settings.setShortcut(QKeySequence("Ctrl+,"))
        settings.triggered.connect(self.edit_settings)
        menu.addAction(settings)
        quit_action = QAction("&Quit", self)
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        menu.addAction(quit_action)
        view = self.menuBar().addMenu("&View")
        view.addAction(self.jobs_dock.toggleViewAction())
        for i, name in enumerate(PANES):
            action = QAction(name, self)
            action.setShortcut(QKeySequence(f"Ctrl+{i + 1}"))
            action.triggered.connect(lambda _=False, i=i: self.sidebar.setCurrentRow(i))
            view.addAction(action)
        help_menu = self.menuBar().addMenu("&Help")
        tour = QAction("&Tour of the workbench", self)
        tour.triggered.connect(self.tour_panel.restart)
        help_menu.addAction(tour)
        self._fill_recent()

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        for path in self.settings.recent:
            action = QAction(path, self)
            action.triggered.connect(lambda _=False, p=path: self.open_workspace(p))
            self.recent_menu.addAction(action)
        self.recent_menu.setEnabled(bool(self.settings.recent))

    # -- workspaces ----------------------------------------------------------------------
    def open_workspace(self, path: str | Path) -> bool:
        try:
            workspace = Workspace.open(path)
        except ForgebenchError as exc:
            self.report_problem(str(path), exc)
            return False
        self.banner.hide()
        self.failed_path = None
        self.workspace = workspace
        self.watch_call.cancel()        # a look at the previous workspace
        self.watch = WorkspaceWatch(workspace)
        self.settings.add_recent(workspace.root)
        self._fill_recent()
        self.setWindowTitle(f"Forgebench — {workspace.name}")
        self.workspace_label.setText(f"Workspace: {workspace.root}")
        for pane in self.built_panes():
            pane.set_workspace(workspace)
        self.first_tune.set_workspace(workspace, int(self.settings.get("threads", 0)) or None)
        return True

    def report_problem(self, path: str, exc: ForgebenchError) -> None:
        self.failed_path = path
        self.banner.text.setText(f"<b>Could not open the workspace.</b><br>{exc.render()}")
        self.banner.forget.setVisible(path in self.settings.recent)
        self.banner.show()

    def forget_failed(self) -> None:
        if self.failed_path:
            self.settings.forget(self.failed_path)
            self._fill_recent()
            self.banner.forget.hide()

    def choose_workspace(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open workspace", self._dialog_start())
        if path:
            self.open_workspace(path)

    def choose_new_workspace(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Create a workspace in an empty folder",
                                                self._dialog_start())
        if path:
            try:
                Workspace.create(path)
            except ForgebenchError as exc:
                self.report_problem(path, exc)
                return
            self.open_workspace(path)

    def _dialog_start(self) -> str:
        """Workspace dialogs open beside the open workspace (else in the home folder)."""
        if self.workspace is None:
            return dialog_folder(None)
        return str(self.workspace.root.parent)

    def open_sample(self) -> None:
        try:
            self.open_workspace(install_sample_workspace())
        except ForgebenchError as exc:
            self.report_problem("sample workspace", exc)

    def edit_settings(self) -> None:
        if SettingsDialog(self.settings, self).exec():
            self.timer.setInterval(int(self.settings.get("poll_ms", 500)))
            if self._built("runs") is not None:
                self.runs.threads = int(self.settings.get("threads", 0)) or None

    # -- status --------------------------------------------------------------------------
    def poll(self) -> None:
        if self._built("runs") is not None:
            self.runs.poll()
        now = time.monotonic()
        if self.watch is not None and not self.watch_call.running and \
                now - self._watched >= WATCH_PERIOD_S:
            self._watched = now
            self.watch_call.start(self.watch.changes)

    def refresh_panes(self, changes: set[str]) -> None:
        """Bring every pane up to date with what changed on disk, keeping the user's choices."""
        built = self._built
        if "configs" in changes and built("runs"):
            self.runs.form.reload_configs()
        if "runs" in changes:
            for name in ("samples", "export", "transcripts", "masks", "reports"):
                if built(name):
                    built(name).refresh_runs()
        if changes & {"runs", "ratings"} and built("ab"):
            self.ab.reload()
        if "runs" in changes and built("chat"):
            self.chat.refresh_sources()
        if "datasets" in changes:
            if built("datasets"):
                self.datasets.refresh_list()
            if built("runs"):
                self.runs.form_widget.set_datasets(self.workspace.dataset_dirs())

    def train_preferences(self, config: str) -> None:
        """The Blind A/B pane's "Train on these preferences": the Runs pane starts the lm-dpo
        config it wrote, and is shown with the new run's charts."""
        self.runs.form.start_config(Path(config))
        self.sidebar.setCurrentRow(PANE_NAMES.index("runs"))

    def show_reports(self, run_dir: Path) -> None:
        """The Reports pane on `run_dir` (the Runs pane's "Reports" button)."""
        self.show_pane("Reports")
        self.reports.show_run(run_dir)

    def follow_run(self, run_dir: Path) -> None:
        """The Runs pane, showing a run another pane started once its folder appears."""
        self.runs.follow = Path(run_dir)
        self.show_pane("Runs")

    def chat_with_run(self, run_dir: Path) -> None:
        self.chat.open_run(run_dir)
        self.show_pane("Chat")

    def export_run(self, run_dir: Path) -> None:
        self.export.refresh_runs()
        self.export.select_run(run_dir)
        self.show_pane("Export")

    def show_pane(self, name: str) -> None:
        """Select a pane by its sidebar name (the tour's steps name panes)."""
        self.sidebar.setCurrentRow([p.replace("&&", "&") for p in PANES].index(name))

    def show_message(self, text: str) -> None:
        """The first line in the status bar, elided in the middle to the room it has (the
        jobs button keeps the right end): a long path never runs under it."""
        line = text.splitlines()[0] if text else ""
        room = self.statusBar().width() - self.jobs_button.width() - 40
        line = self.statusBar().fontMetrics().elidedText(line, Qt.TextElideMode.ElideMiddle,
                                                         max(room, 100))
        self.statusBar().showMessage(line, 8000)

    def _jobs_changed(self) -> None:
        count = len(self.jobs.jobs)
        self.jobs_button.setText(f"{count} job{'s' * (count != 1)} running ▴" if count
                                 else "no jobs running")

    # -- geometry ------------------------------------------------------------------------
    def _restore_geometry(self) -> None:
        """The last geometry, else a default that fits the screen (a 1366×768 laptop gets a
        window inside its work area, status bar included)."""
        self.setMinimumSize(*MIN_SIZE)
        saved = self.settings.get("geometry")
        if saved and self.restoreGeometry(QByteArray.fromHex(saved.encode())):
            return
        screen = QGuiApplication.primaryScreen()
        width, height = DEFAULT_SIZE
        if screen is not None:
            area = screen.availableGeometry()
            # A screen smaller than the default gets all of its width and its height less a
            # title bar (a 1024×700 screen: 1024×668, where every pane works); a bigger one
            # keeps a margin around the window.
            width = min(width, area.width() if area.width() < width
                        else int(area.width() * 0.95))
            height = min(height, area.height() - TITLE_BAR_PX if area.height() < height
                         else int(area.height() * 0.92))
            self.resize(max(width, MIN_SIZE[0]), max(height, MIN_SIZE[1]))
            frame = self.frameGeometry()
            frame.moveCenter(area.center())
            self.move(frame.topLeft())
        else:
            self.resize(width, height)

    def closeEvent(self, event) -> None:
        active = self.runs.active_runs() if self._built("runs") else []
        if active:
            choice = self.close_policy
            if choice == "ask":
                box = QMessageBox(self)
                box.setWindowTitle("Jobs are running")
                box.setText(f"{len(active)} training job(s) are running.")
                box.setInformativeText("Leave them running (reopen Forgebench to follow them) "
                                       "or ask them to checkpoint and stop?")
                leave = box.addButton("Leave running", QMessageBox.ButtonRole.AcceptRole)
                stop = box.addButton("Stop jobs", QMessageBox.ButtonRole.DestructiveRole)
                box.addButton(QMessageBox.StandardButton.Cancel)
                box.exec()
                clicked = box.clickedButton()
                choice = "leave" if clicked is leave else "stop" if clicked is stop else "cancel"
            if choice == "cancel":
                event.ignore()
                return
            if choice == "stop":
                self.runs.stop_all()
        self.timer.stop()
        if self._built("chat") is not None:
            self.chat.shutdown()
        for call in self.findChildren(BackgroundCall):     # every pane's worker threads
            call.cancel()
            call.wait()
        self.settings.set("geometry", bytes(self.saveGeometry().toHex()).decode())
        event.accept()
