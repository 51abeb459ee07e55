"""One engine command as a child process with a progress bar fed by its tqdm output, a Cancel
button (SIGTERM: the engine stops between steps and writes nothing half-done), and the
engine's own error message when it fails. Each running command is listed in the jobs panel."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from PySide6.QtCore import QProcess, Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from app.viewmodels.jobs import BackgroundJob, job_error, parse_progress
from app.views.engine_process import engine_process
from app.views.jobs_panel import job_center
from engine.errors import ForgebenchError

_KEYS = itertools.count(1)


class JobRunner(QWidget):
    finished = Signal(bool, str)        # ok, message

    def __init__(self, kind: str = "job", parent=None):
        super().__init__(parent)
        self.kind = kind
        self.process: QProcess | None = None
        self.output = ""
        self.cancelled = False
        self.key = ""
        # (ok, message) -> (ok, message): what the job's owner says about the result
        self.describe: Callable[[bool, str], tuple[bool, str]] | None = None
        # chunk -> (done, total, stage line) or None: for a job whose progress is not a tqdm
        # bar (e.g. the JSON lines of `models add --progress-json`)
        self.reader: Callable[[str], tuple[int, int, str] | None] | None = None
        self.bar = QProgressBar()
        self.bar.setTextVisible(True)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.bar, 1)
        row.addWidget(self.cancel_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(row)
        layout.addWidget(self.status)

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, argv: list[str], what: str) -> None:
        if self.running:
            raise ForgebenchError("a job is already running here", hint="wait or cancel it")
        self.output, self.cancelled = "", False
        self.bar.setRange(0, 0)
        self.status.setText(f"{what}…")
        process = engine_process(self, argv)
        process.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        process.readyReadStandardOutput.connect(self._read)
        process.finished.connect(self._done)
        self.process = process
        self.cancel_button.setEnabled(True)
        self.key = f"{self.kind}-{next(_KEYS)}"
        job_center().add(BackgroundJob(self.key, self.kind, what, cancel=self.cancel))
        process.start()

    def cancel(self) -> None:
        if self.process is not None:
            self.cancelled = True
            self.process.terminate()

    def wait(self, ms: int) -> bool:
        return self.process is None or self.process.waitForFinished(ms)

    def _read(self) -> None:
        chunk = bytes(self.process.readAllStandardOutput()).decode("utf-8", "replace")
        self.output += chunk
        if self.reader is not None:
            read = self.reader(chunk)
            if read:
                done, total, stage = read
                self.bar.setRange(0, total)
                self.bar.setValue(done)
                self.status.setText(stage)
                job_center().update(self.key, done=done, total=total, stage=stage)
            return
        progress = parse_progress(chunk)
        if progress:
            done, total = progress
            self.bar.setRange(0, total)
            self.bar.setValue(done)
            job_center().update(self.key, done=done, total=total)

    def _done(self, code: int, _status) -> None:
        self._read()
        self.process.deleteLater()
        self.process = None
        self.cancel_button.setEnabled(False)
        self.bar.setRange(0, 1)
        ok = code == 0 and not self.cancelled
        self.bar.setValue(1 if ok else 0)
        message = ("done" if ok else "cancelled: nothing was written" if self.cancelled
                   else job_error(self.output))
        if self.describe is not None and not self.cancelled:
            ok, message = self.describe(ok, message)    # e.g. an export's verdict
        self.status.setText(message)
        if self.cancelled:
            job_center().drop(self.key)
        else:
            job_center().finish(self.key, ok, message)
        self.finished.emit(ok, message)
