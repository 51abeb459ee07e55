"""The Models pane's Serve switch: starts `forgebench serve` for the workspace as a background
engine process (app/views/engine_process.py), shows its URL, key and models, a live request
log with tokens/s, and copyable `curl` and Python snippets. The server stops when the switch
is turned off, the workspace changes or the app quits.

What it shows comes from app/viewmodels/serve.py, which reads the server's own JSON lines.
"""

from __future__ import annotations

from PySide6.QtCore import QCoreApplication, QProcess, Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
)

from app.viewmodels.jobs import forgebench_argv
from app.viewmodels.serve import ServeSession
from app.views.engine_process import engine_process


class ServePanel(QGroupBox):
    message = Signal(str)
    logged = Signal(str)          # one request line, as the log shows it

    def __init__(self, parent=None):
        super().__init__("Serve over an OpenAI-compatible API", parent)
        self.session: ServeSession | None = None
        self.process: QProcess | None = None
        self._pending = b""

        self.url = QLabel("not serving")
        self.url.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.key = QLabel("")
        self.key.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.models = QLabel("")
        self.models.setWordWrap(True)
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(500)
        self.log.setPlaceholderText("requests appear here with their tokens and tokens/s")
        facts = QHBoxLayout()
        facts.addWidget(self.url, 1)
        facts.addWidget(self.key, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(self._switch_row())
        layout.addLayout(facts)
        layout.addWidget(self.models)
        layout.addWidget(self.log, 1)
        layout.addLayout(self._snippets())
        app = QCoreApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self.stop)      # the server never outlives the app

    def _switch_row(self) -> QHBoxLayout:
        """Serve on/off, and the address and port it listens on."""
        self.switch = QPushButton("Serve: off")
        self.switch.setCheckable(True)
        self.switch.setEnabled(False)
        self.switch.toggled.connect(self.toggle)
        self.host = QLineEdit("127.0.0.1")
        self.host.setToolTip("127.0.0.1 keeps the server on this machine; any other address "
                             "gets a generated API key")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setValue(8080)
        self.port.setToolTip("0: any free port")
        top = QHBoxLayout()
        top.addWidget(self.switch)
        top.addWidget(QLabel("address"))
        top.addWidget(self.host)
        top.addWidget(QLabel("port"))
        top.addWidget(self.port)
        top.addStretch(1)
        return top

    def _snippets(self) -> QHBoxLayout:
        """How to call the server (curl, Python), each with a Copy button."""
        self.curl = QPlainTextEdit()
        self.curl.setReadOnly(True)
        self.python = QPlainTextEdit()
        self.python.setReadOnly(True)
        copy_curl, copy_python = QPushButton("Copy curl"), QPushButton("Copy Python")
        copy_curl.clicked.connect(lambda: self._copy(self.curl.toPlainText(), "curl"))
        copy_python.clicked.connect(lambda: self._copy(self.python.toPlainText(), "Python"))
        snippets = QHBoxLayout()
        for box, button in ((self.curl, copy_curl), (self.python, copy_python)):
            column = QVBoxLayout()
            column.addWidget(box)
            column.addWidget(button)
            snippets.addLayout(column)
        return snippets

    def set_workspace(self, root) -> None:
        self.stop()
        self.session = ServeSession(root)
        self.switch.setEnabled(True)
        self._show()

    # -- the server process -------------------------------------------------------------
    def toggle(self, on: bool) -> None:
        if on:
            self.start()
        else:
            self.stop()

    def start(self) -> None:
        if self.session is None or self.running():
            return
        self.session.host, self.session.port = self.host.text().strip(), self.port.value()
        self.session.reset()
        self.process = engine_process(self, forgebench_argv() + self.session.args())
        self.process.readyReadStandardOutput.connect(self._read)
        self.process.finished.connect(self._ended)
        self._pending = b""
        self.process.start()
        self.switch.setText("Serve: starting…")

    def running(self) -> bool:
        return self.process is not None and \
            self.process.state() != QProcess.ProcessState.NotRunning

    def stop(self) -> None:
        if self.running():
            self.process.terminate()
            if not self.process.waitForFinished(5000):
                self.process.kill()
                self.process.waitForFinished(2000)
        if self.switch.isChecked():
            self.switch.blockSignals(True)
            self.switch.setChecked(False)
            self.switch.blockSignals(False)
        self.switch.setText("Serve: off")

    def _read(self) -> None:
        self._pending += bytes(self.process.readAllStandardOutput())
        *lines, self._pending = self._pending.split(b"\n")
        for raw in lines:
            entry = self.session.feed(raw.decode("utf-8", "replace"))
            if entry is not None:
                text = self.session.row(entry)
                self.log.appendPlainText(text)
                self.logged.emit(text)
        self._show()

    def _ended(self, code: int, _status) -> None:
        error = bytes(self.process.readAllStandardError()).decode("utf-8", "replace").strip()
        if code not in (0, 15, -15) and error:
            self.message.emit(error.splitlines()[-1])
            self.url.setText(f"stopped: {error.splitlines()[-1]}")
        if self.session is not None:
            self.session.reset()
        self.stop()
        self._show()

    def _show(self) -> None:
        session = self.session
        if session is None:
            return
        if session.running:
            self.switch.setText("Serve: on")
            self.url.setText(f"URL: {session.url}")
            self.key.setText(f"API key: {session.key_text()}")
            self.models.setText("Models: " + ", ".join(session.models))
        elif not self.running():
            self.url.setText(self.url.text() if self.url.text().startswith("stopped")
                             else "not serving")
            self.key.setText("")
            self.models.setText("")
        self.curl.setPlainText(session.curl_snippet())
        self.python.setPlainText(session.python_snippet())

    def _copy(self, text: str, what: str) -> None:
        QGuiApplication.clipboard().setText(text)
        self.message.emit(f"{what} snippet copied")
