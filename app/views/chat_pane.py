"""The Chat pane: talk to a library model, a run checkpoint or an exported GGUF, or to two of
them side by side. The engine side is one `forgebench serve-local` process (started through
engine_process.py) that keeps the chosen models loaded between turns; its JSON lines arrive
through Qt signals, so the GUI thread never waits, and the columns repaint at most every
REPAINT_MS while tokens stream. State and logic: app/viewmodels/chat.py."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import QProcess, QTimer, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import chat as vm
from app.viewmodels.jobs import forgebench_argv
from app.viewmodels.workspace import Workspace
from app.views import layouts
from app.views.engine_process import engine_process
from engine.errors import ForgebenchError

REPAINT_MS = 50
RENDER_DELAY_MS = 400
COLORS = {"user": "#1565c0", "assistant": "#2e7d32", "system": "#6a1b9a", "error": "#b71c1c",
          "tool": "#ef6c00"}


def _escaped(text: str) -> str:
    return html.escape(text).replace("\n", "<br>")


def tool_html(segment: dict, streaming: bool) -> str:
    """A calculator call inside a reply, set apart from the model's text."""
    expr = "" if segment["expr"] is None else _escaped(segment["expr"])
    result = segment["result"]
    shown = "…" if result is None and streaming else "no result" if result is None \
        else _escaped(result)
    return (f"<span style='color:{COLORS['tool']}; background:#fff3e0; "
            f"font-family:monospace'>&nbsp;calculator: {expr} → <b>{shown}</b>&nbsp;</span>")


def reply_html(text: str, streaming: bool = False) -> str:
    """An assistant reply: its text, with each calculator call (a nanochat model's) as a
    chip of its own (app/viewmodels/chat.py's reply_segments)."""
    segments = vm.reply_segments(text)
    return "".join(_escaped(s["text"]) if s["kind"] == "text" else
                   tool_html(s, streaming and i == len(segments) - 1)
                   for i, s in enumerate(segments))


def transcript_html(messages: list[dict], label: str) -> str:
    parts = []
    for m in messages:
        role = m["role"]
        who = {"user": "you", "assistant": label, "system": "system prompt", "error": "error",
               "tool": f"{m.get('name') or 'tool'} result"}[role]   # chat --calculator
        text = reply_html(m["content"], bool(m.get("streaming"))) if role == "assistant" \
            else _escaped(m["content"])
        tail = " ▌" if m.get("streaming") else ""
        if role == "assistant" and m.get("stop_reason") == "cancelled":
            tail = " <i>(stopped)</i>"
        parts.append(f"<p><b style='color:{COLORS[role]}'>{html.escape(who)}:</b> "
                     f"{text}{tail}</p>")
    return "".join(parts)


class ChatPane(QWidget):
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.session: vm.ChatSession | None = None
        self.sources: list[vm.Source] = []
        self.workers: dict[str, QProcess] = {}     # one serve-local process per side
        self._buffers: dict[str, bytes] = {}
        self.rendered = QPlainTextEdit()
        self.rendered.setReadOnly(True)
        self.rendered.setMaximumHeight(90)
        self.rendered.setMinimumHeight(36)     # the pane fits a 1024×700 window, banners shown
        self.rendered_title = QLabel("Rendered prompt")
        self.status = QLabel("Open a workspace to chat.")
        self.status.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addLayout(self._pick_form())
        layout.addLayout(self._sampling_row())
        layout.addWidget(self._columns(), 1)
        layout.addWidget(self.rendered_title)
        layout.addWidget(self.rendered)
        layout.addLayout(self._send_row())
        layout.addLayout(self._files_row())
        layout.addWidget(self.status)
        self.repaint_timer = QTimer(self, singleShot=True, interval=REPAINT_MS)
        self.repaint_timer.timeout.connect(self.repaint_columns)
        self.render_timer = QTimer(self, singleShot=True, interval=RENDER_DELAY_MS)
        self.render_timer.timeout.connect(self.request_render)
        self.column_boxes["B"].hide()

    def _pick_form(self) -> QFormLayout:
        """What each side chats with, the numerics of GGUF models and the system prompt."""
        self.source = {side: QComboBox() for side in vm.SIDES}
        for side, combo in self.source.items():
            combo.setMinimumContentsLength(24)
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.activated.connect(lambda _=0, s=side: self.choose(s))
        self.refresh = QPushButton("Refresh")
        self.refresh.clicked.connect(self.refresh_sources)
        self.numerics = QComboBox()
        self.numerics.addItem("llama.cpp numerics", "llamacpp")
        self.numerics.addItem("f32 (as runs train)", "f32")
        self.numerics.setToolTip("How GGUF models compute: llama.cpp's arithmetic (what a "
                                 "llama.cpp server answers) or plain f32 (what a run's "
                                 "checkpoint uses); changing it reloads them")
        self.numerics.activated.connect(self.numerics_changed)
        self.system_prompt = QLineEdit()
        self.system_prompt.setPlaceholderText("System prompt (optional; applies to a new chat)")
        pick = QFormLayout()
        row_a = QHBoxLayout()
        row_a.addWidget(self.source["A"], 1)
        row_a.addWidget(self.refresh)
        pick.addRow("Chat with", row_a)
        row_b = QHBoxLayout()
        row_b.addWidget(self.source["B"], 1)
        row_b.addWidget(self.numerics)
        pick.addRow("Side by side with", row_b)
        # the seed and the reply's length sit beside the system prompt: the sampling row below
        # is full at 1024 pixels
        self.seed = QSpinBox(maximum=2**31 - 1)
        self.max_tokens = QSpinBox(minimum=1, maximum=8192)
        self.max_tokens.setValue(128)
        row_c = QHBoxLayout()
        row_c.addWidget(self.system_prompt, 1)
        for label, widget in (("seed", self.seed), ("max tokens", self.max_tokens)):
            row_c.addWidget(QLabel(label))
            row_c.addWidget(widget)
        pick.addRow("System prompt", row_c)
        return pick

    def _sampling_row(self) -> QHBoxLayout:
        """The sampling settings, starting from the engine's chat default (the view-model's)."""
        self.temperature = QDoubleSpinBox(decimals=2, maximum=5.0, singleStep=0.1)
        self.top_k = QSpinBox(maximum=100_000)
        self.top_p = QDoubleSpinBox(decimals=2, minimum=0.01, maximum=1.0, singleStep=0.05)
        self.repetition = QDoubleSpinBox(decimals=2, minimum=0.5, maximum=3.0, singleStep=0.05)
        self.repetition.setToolTip("Repetition penalty: > 1 discourages tokens seen in the "
                                   "last n tokens, so a small model does not loop; 1 = off")
        # a window up to 4096 tokens (llama.cpp's penalty_last_n is usually 64), or all of them
        self.repetition_last_n = QSpinBox(minimum=-1, maximum=4096, specialValueText="all")
        self.repetition_last_n.setToolTip("How many recent tokens the repetition penalty "
                                          "looks at (all = the whole conversation)")
        self.dry = QDoubleSpinBox(decimals=2, minimum=0.0, maximum=5.0, singleStep=0.1)
        self.dry.setToolTip("DRY: penalises a token that would continue a sequence already "
                            "written earlier (catches loops longer than the window); 0 = off")
        defaults = vm.DEFAULT_SETTINGS
        self.temperature.setValue(defaults["temperature"])
        self.top_k.setValue(defaults["top_k"])
        self.top_p.setValue(defaults["top_p"])
        self.repetition.setValue(defaults["repetition_penalty"])
        self.repetition_last_n.setValue(defaults["repetition_last_n"])
        self.dry.setValue(defaults["dry_multiplier"])
        sampling = QHBoxLayout()
        self.temperature.setToolTip("Temperature: 0 = greedy (always the likeliest token)")
        # short labels: the row fits a 1024-pixel window with the sidebar
        for label, widget in (("temp", self.temperature), ("top-k", self.top_k),
                              ("top-p", self.top_p), ("repetition", self.repetition),
                              ("last", self.repetition_last_n), ("DRY", self.dry)):
            sampling.addWidget(QLabel(label))
            sampling.addWidget(widget)
        sampling.addStretch(1)
        return sampling

    def _columns(self) -> QSplitter:
        """One transcript column per side (B's shows once B chats)."""
        self.columns = {side: QTextBrowser() for side in vm.SIDES}
        self.titles = {side: QLabel() for side in vm.SIDES}
        self.column_boxes = {}
        columns = QSplitter()
        for side in vm.SIDES:
            box = QWidget()
            column = QVBoxLayout(box)
            column.setContentsMargins(0, 0, 0, 0)
            self.titles[side].setWordWrap(True)
            column.addWidget(self.titles[side])
            column.addWidget(self.columns[side], 1)
            columns.addWidget(box)
            self.column_boxes[side] = box
        return columns

    def _send_row(self) -> QHBoxLayout:
        self.prompt = QLineEdit()
        self.prompt.setPlaceholderText("Message — Enter sends")
        self.prompt.returnPressed.connect(self.send)
        self.prompt.textChanged.connect(lambda _: self.render_timer.start())
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        return layouts.row((self.prompt, 1), self.send_button, self.stop_button)

    def _files_row(self) -> QHBoxLayout:
        """New chat, the saved conversations, pairing to A/B and exporting SFT records."""
        self.new_chat = QPushButton("New chat")
        self.new_chat.clicked.connect(self.start_new_chat)
        self.saved = QComboBox()
        self.saved.setMinimumContentsLength(18)
        self.saved.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.open_saved = QPushButton("Reopen")
        self.open_saved.clicked.connect(self.reopen)
        self.to_ab = QPushButton("Pair to blind A/B")
        self.to_ab.setToolTip("Send the last prompt's two answers to a new blind A/B session")
        self.to_ab.clicked.connect(self.send_pair_to_ab)
        self.dataset_name = QLineEdit("chat-sft")
        # the name stays readable at 1024 px (the row squeezed it to "t-sft")
        self.dataset_name.setMinimumWidth(
            self.dataset_name.fontMetrics().horizontalAdvance("chat-sft-0000") + 16)
        self.export = QPushButton("Export as SFT records")
        self.export.clicked.connect(self.export_sft)
        files = QHBoxLayout()
        for widget in (self.new_chat, self.saved, self.open_saved, self.to_ab,
                       self.dataset_name, self.export):
            files.addWidget(widget)
        files.addStretch(1)
        return files

    # -- workspace and sources ------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.session = vm.ChatSession(workspace.root)
        self.refresh_sources()
        self.repaint_columns()
        self.status.setText("Choose what to chat with.")

    def refresh_sources(self) -> None:
        if self.workspace is None:
            return
        try:
            self.sources = vm.sources(self.workspace.root)
        except ForgebenchError as exc:
            self._problem(exc)
            return
        for side, combo in self.source.items():
            current = combo.currentText()
            combo.clear()
            combo.addItem("(none)" if side == "B" else "(choose)", None)
            for source in self.sources:
                text = source.label if source.usable else f"⚠ {source.label} — {source.reason}"
                combo.addItem(text, source)
            index = combo.findText(current)
            combo.setCurrentIndex(max(index, 0))
        self.saved.clear()
        for path in vm.saved_conversations(self.workspace.root):
            self.saved.addItem(path.stem, str(path))

    def open_run(self, run_dir: Path) -> None:
        """Chat with a run's latest checkpoint on side A (another pane's "Chat with it")."""
        self.refresh_sources()
        combo = self.source["A"]
        for index in reversed(range(combo.count())):
            source = combo.itemData(index)
            if source is not None and source.kind == "run" and source.load and \
                    Path(source.load["run"]) == Path(run_dir):
                combo.setCurrentIndex(index)
                self.choose("A")
                return
        self.status.setText(f"{Path(run_dir).name} has no checkpoint to chat with.")

    def choose(self, side: str) -> None:
        if self.session is None:
            return
        source = self.source[side].currentData()
        self._apply_settings()        # the choice moves settings still at their defaults
        try:
            lines = self.session.choose(side, source)
        except ForgebenchError as exc:
            self._problem(exc)
            return
        self.repetition.setValue(self.session.settings["repetition_penalty"])
        self.dry.setValue(self.session.settings["dry_multiplier"])
        self.column_boxes["B"].setVisible("B" in self.session.loads)
        self._write(lines)
        if source is not None:
            self.status.setText(f"Loading {source.label}…")
        self.repaint_columns()

    def numerics_changed(self) -> None:
        if self.session is None:
            return
        self.session.numerics = self.numerics.currentData()
        for side in self.session.sides:
            source = self.source[side].currentData()
            if source is not None and source.kind != "run":
                self.choose(side)

    # -- the workers ------------------------------------------------------------------------
    @property
    def process(self) -> QProcess | None:
        """Side A's worker (the one a single-column chat uses)."""
        return self.workers.get(vm.SIDES[0])

    def _ensure_worker(self, side: str) -> QProcess:
        process = self.workers.get(side)
        if process is not None and process.state() != QProcess.ProcessState.NotRunning:
            return process
        process = engine_process(self, forgebench_argv() + ["serve-local"])
        process.readyReadStandardOutput.connect(lambda s=side: self._read(s))
        process.finished.connect(lambda code, status, s=side: self._worker_ended(s, code))
        self.workers[side], self._buffers[side] = process, b""
        process.start()
        return process

    def _write(self, lines: list[str]) -> None:
        for line in lines:
            side = vm.worker_side(self.session, line)
            if side not in self.workers and '"op": "unload"' in line:
                continue        # nothing loaded there: no worker to start for it
            self._ensure_worker(side).write(line.encode("utf-8"))

    def _read(self, side: str) -> None:
        buffer = self._buffers.get(side, b"") + bytes(
            self.workers[side].readAllStandardOutput())
        *complete, self._buffers[side] = buffer.split(b"\n")
        for raw in complete:
            if raw.strip():
                self._handle(raw.decode("utf-8", "replace"))

    def _handle(self, raw: str) -> None:
        try:
            what, side = self.session.feed(raw)
        except (ValueError, KeyError) as exc:
            self.status.setText(f"unexpected line from the engine: {exc}")
            return
        if what == "loaded":
            info = self.session.loaded[side]
            self.status.setText(f"{self.session.labels[side]} loaded "
                                f"({info.get('numerics')} numerics, {info.get('template')}, "
                                f"{info.get('load_s', 0):.1f} s)")
            self.request_render()
        elif what == "load_error":
            self.status.setText(f"<span style='color:{COLORS['error']}'>Cannot load "
                                f"{html.escape(self.session.labels.get(side, side))}: "
                                f"{html.escape(self.session.load_errors[side])}</span>")
        elif what == "rendered":
            text, tokens = self.session.rendered[side]
            self.rendered_title.setText(f"Rendered prompt ({self.session.labels[side]}): "
                                        f"{tokens} tokens")
            self.rendered.setPlainText(text)
        elif what in ("token", "done", "error"):
            if not self.repaint_timer.isActive():
                self.repaint_timer.start()
            if what != "token" and not self.session.busy():
                self._finished_turn()

    def _worker_ended(self, side: str, code: int) -> None:
        err = bytes(self.workers[side].readAllStandardError()).decode("utf-8", "replace")
        if code:
            self.status.setText(f"The engine worker stopped (exit {code}): {err[-300:]}")
        if self.session is not None:
            self.session.loaded.pop(side, None)

    # -- a turn ---------------------------------------------------------------------------
    def _apply_settings(self) -> None:
        s = self.session
        s.settings = {**vm.DEFAULT_SETTINGS,
                      "temperature": self.temperature.value(), "top_k": self.top_k.value(),
                      "top_p": self.top_p.value(),
                      "repetition_penalty": self.repetition.value(),
                      "repetition_last_n": self.repetition_last_n.value(),
                      "dry_multiplier": self.dry.value()}
        s.seed, s.max_tokens = self.seed.value(), self.max_tokens.value()
        if s.conversation is None:
            s.system_prompt = self.system_prompt.text()

    def send(self) -> None:
        if self.session is None:
            return
        self._apply_settings()
        try:
            lines = self.session.send(self.prompt.text())
        except ForgebenchError as exc:
            self._problem(exc)
            return
        self.prompt.clear()
        self._write(lines)
        self.stop_button.setEnabled(True)
        self.send_button.setEnabled(False)
        self.status.setText("Streaming…")
        self.repaint_columns()

    def stop(self) -> None:
        if self.session is not None:
            self._write(self.session.stop())

    def _finished_turn(self) -> None:
        self.stop_button.setEnabled(False)
        self.send_button.setEnabled(True)
        replies = [r for r in self.session.replies.values() if r.done]
        if replies:
            last = replies[-1]
            timing = last.done.get("timings", {})
            rate = timing.get("decode_tokens_per_s")
            self.status.setText(
                f"{last.tokens} tokens ({last.stop_reason}); first token after "
                f"{last.first_token_s or 0:.2f} s"
                + (f", {rate:.1f} tokens/s" if rate else "")
                + f" — saved to {self.session.conversation.path.name}")
        self.repaint_columns()
        self.refresh_saved()
        self.request_render()          # the next prompt's template now holds this turn

    def refresh_saved(self) -> None:
        if self.workspace is None:
            return
        current = self.saved.currentData()
        self.saved.clear()
        for path in vm.saved_conversations(self.workspace.root):
            self.saved.addItem(path.stem, str(path))
        index = self.saved.findData(current)
        self.saved.setCurrentIndex(max(index, 0))

    def request_render(self) -> None:
        if self.session is not None and self.session.sides:
            self._apply_settings()
            self._write(self.session.render_lines(self.prompt.text()))

    def repaint_columns(self) -> None:
        if self.session is None:
            return
        for side in vm.SIDES:
            label = self.session.labels.get(side, "")
            self.titles[side].setText(f"<b>{side}: {html.escape(label)}</b>" if label else
                                      f"<b>{side}</b>: choose a model")
            browser = self.columns[side]
            browser.setHtml(transcript_html(self.session.transcript(side), label or side))
            bar = browser.verticalScrollBar()
            bar.setValue(bar.maximum())

    # -- conversations ----------------------------------------------------------------------
    def start_new_chat(self) -> None:
        if self.session is None:
            return
        self.session.conversation = None
        self.session.replies.clear()
        self.status.setText("New chat: the next message starts a new conversation file.")
        self.repaint_columns()

    def reopen(self) -> None:
        path = self.saved.currentData()
        if self.session is None or not path:
            return
        try:
            conversation = self.session.open(path)
        except ForgebenchError as exc:
            self._problem(exc)
            return
        self.session.replies.clear()
        self.system_prompt.setText(self.session.system_prompt)
        self.column_boxes["B"].setVisible("B" in self.session.loads)
        self._write(self.session.reload_lines())
        self.status.setText(f"Reopened {conversation.path.name}; loading its systems…")
        self.repaint_columns()

    def send_pair_to_ab(self) -> None:
        try:
            path = self.session.send_pair_to_ab()
        except ForgebenchError as exc:
            self._problem(exc)
            return
        self.status.setText(f"Blind A/B session {path.stem} created: rate it in the Blind A/B "
                            "pane.")
        self.message.emit(f"A/B session {path.stem} created")

    def export_sft(self) -> None:
        try:
            folder = self.session.export_sft(self.dataset_name.text().strip())
        except ForgebenchError as exc:
            self._problem(exc)
            return
        self.status.setText(f"Exported SFT records to datasets/{folder.name}")
        self.message.emit(f"SFT records exported to {folder.name}")

    def _problem(self, exc: ForgebenchError) -> None:
        self.status.setText(f"<span style='color:{COLORS['error']}'>"
                            f"{html.escape(exc.render())}</span>")
        self.message.emit(exc.render())

    def shutdown(self) -> None:
        """Close the workers (the window is closing): asked first, all at once, then waited
        for; one that does not end is killed."""
        running = [p for p in self.workers.values()
                   if p.state() != QProcess.ProcessState.NotRunning]
        for process in running:
            process.write(b'{"op": "shutdown"}\n')
            process.closeWriteChannel()
        for process in running:
            if not process.waitForFinished(3000):
                process.kill()
                process.waitForFinished(1000)
