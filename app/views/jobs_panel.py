"""Every background job in one place: the `JobCenter` (the window's one list of jobs), the
jobs panel that shows them with progress, stage and Cancel, and the notification when a job
the user started finishes or fails (the desktop's tray message where there is one, else an
in-app toast).

Jobs register themselves: `JobRunner` (sampling, exports, conversions, generation) on start,
the Runs pane for every active training run on each poll.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSystemTrayIcon,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.jobs import BackgroundJob

TOAST_MS = 6000


class JobCenter(QObject):
    """The jobs running now, by key. `finished(title, ok, message)` fires once per job."""

    changed = Signal()
    finished = Signal(str, bool, str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.jobs: dict[str, BackgroundJob] = {}

    def add(self, job: BackgroundJob) -> BackgroundJob:
        self.jobs[job.key] = job
        self.changed.emit()
        return job

    def update(self, key: str, **fields) -> None:
        job = self.jobs.get(key)
        if job is not None:
            for name, value in fields.items():
                setattr(job, name, value)
            self.changed.emit()

    def finish(self, key: str, ok: bool, message: str) -> None:
        job = self.jobs.pop(key, None)
        if job is not None:
            self.changed.emit()
            self.finished.emit(job.title, ok, message)

    def reset(self) -> None:
        """Forget every job (a new main window starts with its own list)."""
        self.jobs.clear()
        self.changed.emit()

    def drop(self, key: str) -> None:
        """Forget a job without a notification (it was never the user's to watch)."""
        if self.jobs.pop(key, None) is not None:
            self.changed.emit()


_CENTER: JobCenter | None = None


def job_center() -> JobCenter:
    """The window's job list (one per application)."""
    global _CENTER
    if _CENTER is None:
        _CENTER = JobCenter()
    return _CENTER


class JobsPanel(QWidget):
    """A table of the running jobs: what, progress, stage or ETA, and Cancel."""

    def __init__(self, center: JobCenter, parent=None):
        super().__init__(parent)
        self.center = center
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["Job", "Progress", "Stage", ""])
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.table.setColumnWidth(1, 140)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.empty = QLabel("No background jobs. Runs, exports, sampling and generation show "
                            "here while they work.")
        self.empty.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.empty)
        layout.addWidget(self.table)
        center.changed.connect(self.refresh)
        self._tick = QTimer(self)           # ETAs move even when no job reports
        self._tick.setInterval(1000)
        self._tick.timeout.connect(self._refresh_times)
        self._tick.start()
        self.refresh()

    def refresh(self) -> None:
        jobs = list(self.center.jobs.values())
        self.empty.setVisible(not jobs)
        self.table.setVisible(bool(jobs))
        self.table.setRowCount(len(jobs))
        now = time.time()
        for row, job in enumerate(jobs):
            title = self.table.item(row, 0)
            identity = [job.key, job.cancel is not None]
            if title is None or title.data(Qt.ItemDataRole.UserRole) != identity:
                self._fill_row(row, job)
            self.table.item(row, 0).setText(f"{job.kind}: {job.title}")
            self.table.item(row, 0).setToolTip(job.title)
            bar = self.table.cellWidget(row, 1)
            bar.setRange(0, job.total or 0)
            bar.setValue(min(job.done, job.total) if job.total else 0)
            self.table.item(row, 2).setText(job.progress_text(now))

    def _fill_row(self, row: int, job: BackgroundJob) -> None:
        title = QTableWidgetItem()
        title.setData(Qt.ItemDataRole.UserRole, [job.key, job.cancel is not None])
        self.table.setItem(row, 0, title)
        self.table.setItem(row, 2, QTableWidgetItem())
        bar = QProgressBar()
        bar.setTextVisible(False)
        self.table.setCellWidget(row, 1, bar)
        cancel = QPushButton("Stop" if job.kind == "run" else "Cancel")
        cancel.setEnabled(job.cancel is not None)
        if job.cancel is not None:
            cancel.clicked.connect(lambda _=False, stop=job.cancel: stop())
        self.table.setCellWidget(row, 3, cancel)

    def _refresh_times(self) -> None:
        if self.center.jobs and self.isVisible():
            self.refresh()


class Toast(QFrame):
    """A short message over the window's top-right corner that hides itself."""

    def __init__(self, parent: QWidget):
        super().__init__(parent)
        self.setStyleSheet("Toast { background: #263238; border-radius: 6px; } "
                           "QLabel { color: white; }")
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.text.setMaximumWidth(360)
        layout = QHBoxLayout(self)
        layout.addWidget(self.text)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.hide)
        self.hide()

    def show_message(self, title: str, text: str) -> None:
        self.text.setText(f"<b>{title}</b><br>{text}".replace("\n", "<br>"))
        self.adjustSize()
        parent = self.parentWidget()
        # Top right, under the menu bar: the wizard's Back/Next sit at the bottom right.
        self.move(parent.width() - self.width() - 16, 36)
        self.raise_()
        self.show()
        self._timer.start(TOAST_MS)


class Notifier(QObject):
    """Says when a job finished or failed, replacing rather than stacking: one toast in the
    window, whose text becomes "3 jobs ended: …" when jobs end while it shows; and, while the
    user is in another window, a desktop (tray) message, at most one per TOAST_MS: endings in
    between are gathered into the next one."""

    def __init__(self, window: QWidget, icon: QIcon | None = None):
        super().__init__(window)
        self.window = window
        self.toast = Toast(window)
        self.tray: QSystemTrayIcon | None = None
        if QSystemTrayIcon.isSystemTrayAvailable():
            self.tray = QSystemTrayIcon(icon or window.windowIcon(), self)
            self.tray.show()
        self.last: tuple[str, str] | None = None
        self.shown: list[tuple[str, str, bool]] = []     # the endings the toast shows
        self.waiting: list[tuple[str, str, bool]] = []   # for the next desktop message
        self.quiet = QTimer(self)
        self.quiet.setSingleShot(True)
        self.quiet.setInterval(TOAST_MS)
        self.quiet.timeout.connect(self._send_waiting)

    def user_away(self) -> bool:
        return not self.window.isActiveWindow()

    def notify(self, title: str, ok: bool, message: str) -> None:
        heading = f"{title} {'finished' if ok else 'failed'}"
        self.last = (heading, message)
        ending = (heading, message, ok)
        self.shown = (self.shown if self.toast.isVisible() else []) + [ending]
        self.toast.show_message(*endings_text(self.shown))
        if self.tray is None or not QSystemTrayIcon.supportsMessages() or not self.user_away():
            return
        self.waiting.append(ending)
        if not self.quiet.isActive():
            self._send_waiting()

    def _send_waiting(self) -> None:
        if not self.waiting:
            return
        heading, text = endings_text(self.waiting)
        icon = QSystemTrayIcon.MessageIcon.Information if all(ok for *_, ok in self.waiting) \
            else QSystemTrayIcon.MessageIcon.Warning
        self.tray.showMessage(heading, text[:300], icon, TOAST_MS)
        self.waiting = []
        self.quiet.start()


def endings_text(endings: list[tuple[str, str, bool]]) -> tuple[str, str]:
    """(heading, text) of one message for jobs that ended: the job's own for one, else how
    many ended and a line each."""
    if len(endings) == 1:
        heading, message, _ = endings[0]
        return heading, message[:300]
    lines = [f"{heading}: {message.splitlines()[0] if message else ''}".rstrip(": ")
             for heading, message, _ in endings]
    return f"{len(endings)} jobs ended", "\n".join(lines)
