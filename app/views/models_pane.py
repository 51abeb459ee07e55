"""The Models pane: the workspace's model library. Add a GGUF file (copied or linked, hashed)
or the installed Gemma package; each model shows its architecture, parameters and bytes per
tensor type, its chat template rendered for a sample conversation, its special tokens, what the
engine supports for it and the memory each mode needs here. Unusable files stay listed with
the reason. Headers are read off the GUI thread (app/viewmodels/models.py). Adding a Hugging
Face folder is an engine job (a conversion): a progress bar with the tensor, bytes and ETA, and
Cancel, which leaves no library entry; the jobs panel lists it and notifies at its end."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import models as vm
from app.viewmodels.workspace import Workspace, dialog_folder
from app.views.background import BackgroundCall
from app.views.job_runner import JobRunner
from app.views.labels import wrap_items
from app.views.serve_panel import ServePanel
from engine.errors import ForgebenchError


class FactsTable(QTableWidget):
    """A short table of facts shown whole: columns sized to their contents, the last one
    taking the rest, each row as tall as its wrapped text, and the table as tall as its rows
    (no inner scroll, no cell ending in "…"); refitted whenever its width changes."""

    def __init__(self, headers: list[str], parent=None):
        super().__init__(0, len(headers), parent)
        self.setHorizontalHeaderLabels(headers)
        self.verticalHeader().hide()
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.horizontalHeader().setStretchLastSection(True)
        self.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)

    def fill(self, rows: list[tuple]) -> None:
        self.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, value in enumerate(row):
                item = QTableWidgetItem(value)
                item.setToolTip(value)
                self.setItem(r, c, item)
        self._fit()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)      # lays the columns out for the new width first
        self._fit()

    def _fit(self) -> None:
        self.resizeRowsToContents()
        self.setFixedHeight(self.horizontalHeader().height() + 2 * self.frameWidth()
                            + sum(self.rowHeight(r) for r in range(self.rowCount())))


class ModelsPane(QWidget):
    message = Signal(str)
    library_changed = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.view: vm.ModelsView | None = None
        self.call = BackgroundCall(self)
        self.call.done.connect(self._loaded)
        self.call.failed.connect(lambda exc: self._problem(exc))
        # adding copies and hashes the file (hundreds of MB): off the GUI thread too
        self.adder = BackgroundCall(self)
        self.adder.done.connect(self._added)
        self.adder.failed.connect(lambda exc: self._problem(exc))

        # an HF folder is converted tensor by tensor in an engine process, with Cancel
        self.folder_job = JobRunner("conversion")
        self.folder_job.finished.connect(self._folder_done)
        self.folder_job.hide()
        self.adding: vm.AddFolderJob | None = None

        self.package = QLabel()
        self.package.setWordWrap(True)
        self.status = QLabel("Open a workspace to see its models.")
        self.status.setWordWrap(True)
        split = QSplitter()
        split.addWidget(self._library_column())
        split.addWidget(self._facts())
        split.setStretchFactor(1, 2)
        split.setSizes([300, 600])
        # The library over the server, the library taller: at 1024×700 the server's boxes at
        # their preferred height left the list two lines and the facts four.
        self.library_split = QSplitter(Qt.Orientation.Vertical)
        self.library_split.addWidget(split)
        self.library_split.addWidget(self._server())
        self.library_split.setChildrenCollapsible(False)
        self.library_split.setSizes([380, 260])
        layout = QVBoxLayout(self)
        layout.addWidget(self.status)
        layout.addWidget(self.package)
        layout.addWidget(self.library_split, 1)

    def _library_column(self) -> QWidget:
        """The add and remove buttons, a conversion's progress, the models."""
        self.list = wrap_items(QListWidget())     # "name — family, size" or the reason, read whole
        self.list.currentRowChanged.connect(self.show_row)
        self.add_copy = QPushButton("Add GGUF (copy)…")
        self.add_link = QPushButton("Add GGUF (link)…")
        self.add_gemma = QPushButton("Add Gemma package")
        self.add_folder = QPushButton("Add HF folder…")   # converted losslessly into models/
        self.add_folder.clicked.connect(self.choose_folder)
        self.remove = QPushButton("Remove")
        self.add_copy.clicked.connect(lambda: self.choose_file(link=False))
        self.add_link.clicked.connect(lambda: self.choose_file(link=True))
        self.add_gemma.clicked.connect(self.add_package)
        self.remove.clicked.connect(self.remove_current)
        left = QWidget()
        column = QVBoxLayout(left)
        column.setContentsMargins(0, 0, 0, 0)
        for row_buttons in ((self.add_copy, self.add_link), (self.add_folder, self.add_gemma),
                            (self.remove,)):
            row = QHBoxLayout()
            for button in row_buttons:
                row.addWidget(button)
            column.addLayout(row)
        column.addWidget(self.folder_job)
        column.addWidget(self.list, 1)
        return left

    def _facts(self) -> QScrollArea:
        """The chosen model's summary, tensor types, memory per mode and chat template. They
        scroll on their own: the add buttons and the list stay in view in a short window
        (every pane works at 1024×700, the first-run banners shown)."""
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.tensors = FactsTable(["type", "tensors", "parameters", "size"])
        self.memory = FactsTable(["mode", "memory", "on this machine"])
        self.template = QPlainTextEdit()
        self.template.setReadOnly(True)
        self.template.setMinimumHeight(150)
        self.template_title = QLabel("<b>Chat template, sample conversation</b>")
        right = QWidget()
        details = QVBoxLayout(right)
        details.setContentsMargins(0, 0, 0, 0)
        for widget in (self.summary, QLabel("<b>Parameters and size per tensor type</b>"),
                       self.tensors, QLabel("<b>Memory each mode needs</b>"), self.memory,
                       self.template_title):
            details.addWidget(widget)
        details.addWidget(self.template, 1)
        facts = QScrollArea()
        facts.setWidget(right)
        facts.setWidgetResizable(True)
        facts.setFrameShape(QFrame.Shape.NoFrame)
        return facts

    def _server(self) -> QScrollArea:
        """The workspace's models over an OpenAI-style API; it scrolls on its own when the
        window is short (the first-run banners)."""
        self.serve = ServePanel()
        self.serve.message.connect(self.message)
        self.serve_scroll = QScrollArea()
        self.serve_scroll.setWidget(self.serve)
        self.serve_scroll.setWidgetResizable(True)
        self.serve_scroll.setFrameShape(QFrame.Shape.NoFrame)
        return self.serve_scroll

    # -- the library ----------------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.view = vm.ModelsView(workspace.root)
        self.serve.set_workspace(workspace.root)
        self.reload()

    def reload(self) -> None:
        if self.view is None:
            return
        self.status.setText("Reading the model headers…")
        view = self.view
        self.call.start(view.load)

    def _loaded(self, rows: list[dict]) -> None:
        keep = self.list.currentItem().data(Qt.ItemDataRole.UserRole) \
            if self.list.currentItem() else None
        self.list.clear()
        for row in rows:
            label = vm.list_label(row)
            item = QListWidgetItem(label)
            item.setData(Qt.ItemDataRole.UserRole, row["name"])
            item.setToolTip(f'{label}\n{row["facts"].get("reason") or row["facts"]["path"]}')
            self.list.addItem(item)
        usable = sum(r["facts"]["usable"] for r in rows)
        self.status.setText(f"{len(rows)} model{'s' * (len(rows) != 1)} in the library, "
                            f"{usable} usable." if rows else
                            "The library is empty: add a GGUF file or the Gemma package.")
        self.package.setText(self.view.package_line())
        names = [r["name"] for r in rows]
        self.list.setCurrentRow(names.index(keep) if keep in names else (0 if rows else -1))
        if not rows:
            self.show_row(-1)

    def show_row(self, index: int) -> None:
        row = self.view.rows[index] if self.view and 0 <= index < len(self.view.rows) else None
        self.remove.setEnabled(row is not None)
        if row is None:
            self.summary.setText("")
            self.tensors.fill([])
            self.memory.fill([])
            self.template.setPlainText("")
            return
        facts = row["facts"]
        head = (f"<b>{row['name']}</b> — {row['mode']}, sha256 {row['sha256'][:16]}…<br>"
                f"source: {row['source']}")
        if (verdict := row.get("export_verdict")) and verdict["usable"]:   # an export's file
            head += (f"<br><span style='background:{verdict['background']}; color:"
                     f"{verdict['colour']}'><b>{verdict['title']}</b>: {verdict['words']}</span>")
        if not facts["usable"]:
            self.summary.setText(f"{head}<br><span style='color:#b71c1c'><b>Not usable:</b> "
                                 f"{facts['reason']}</span>"
                                 + (f"<br>hint: {facts['hint']}" if facts.get("hint") else ""))
            self.tensors.fill(vm.tensor_rows(facts))
            self.memory.fill([])
            self.template_title.setText("<b>Chat template</b>")
            self.template.setPlainText("")
            return
        special = facts["special_tokens"]
        tokens = ", ".join(f"{k} <code>{v['text']}</code> ({v['id']})"
                           for k in ("bos", "eos", "eot", "unk", "pad") if (v := special.get(k)))
        support = facts["support"]
        full = "yes" if support["full_finetune"] else f"no — {support['full_finetune_reason']}"
        self.summary.setText(
            f"{head}<br><b>{facts['family']}</b> ({facts['architecture']}"
            f"{', ' + facts['general_name'] if facts.get('general_name') else ''}): "
            f"{facts['layers']} layers, width {facts['width']}, {facts['heads']} heads / "
            f"{facts['kv_heads']} KV heads (dim {facts['head_dim']}), FFN {facts['ffn']}, "
            f"context {facts['context']:,}, vocabulary {facts['vocab']:,}; "
            f"{facts['params']:,} parameters<br>"
            f"<b>Special tokens:</b> {tokens}; {special['control_tokens']} control tokens<br>"
            f"<b>Engine:</b> generate yes · chat {'yes' if support['chat'] else 'no'} · "
            f"LoRA yes · full fine-tune {full}<br>"
            f"<b>Export types:</b> {', '.join(support['export_types'])}"
            + (f" ({support['export_note']})" if support["export_note"] else ""))
        self.tensors.fill(vm.tensor_rows(facts))
        self.memory.fill(vm.memory_rows(facts))
        template = facts["template"]
        if template["ok"]:
            self.template_title.setText(f"<b>Chat template</b> ({template['origin']}), sample "
                                        f"conversation: {template['sample_tokens']} tokens")
            self.template.setPlainText(template["sample"])
        else:
            self.template_title.setText("<b>Chat template</b>")
            self.template.setPlainText(f"The chat template cannot render: {template['error']}")

    # -- adding and removing ----------------------------------------------------------------
    def choose_file(self, link: bool) -> None:
        start = str(self.view.root) if self.view is not None else dialog_folder(None)
        path, _ = QFileDialog.getOpenFileName(self, "Add a GGUF model", start, "GGUF (*.gguf)")
        if path:
            self.add_file(path, link)

    def choose_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Add a Hugging Face checkpoint folder")
        if path:
            self.add_hf_folder(path)

    def add_hf_folder(self, path: str) -> None:
        """Convert and add a Hugging Face checkpoint folder as a job (vm.AddFolderJob)."""
        if self.view is None or self.folder_job.running:
            return
        job = vm.AddFolderJob(self.view.root, Path(path))
        self.adding = job
        self.folder_job.reader = job.feed
        self.folder_job.describe = lambda ok, _message: job.result(ok, self.folder_job.output)
        self.folder_job.show()
        self.add_folder_button_state()
        self.folder_job.start(job.argv(), job.title)

    def add_folder_button_state(self) -> None:
        self.add_folder.setEnabled(not self.folder_job.running)

    def _folder_done(self, ok: bool, message: str) -> None:
        job, self.adding = self.adding, None
        self.add_folder_button_state()
        if self.folder_job.cancelled and job is not None:
            message = job.result(False, self.folder_job.output, cancelled=True)[1]
            self.folder_job.status.setText(message)
        if ok:
            self.message.emit(message)
            self.library_changed.emit()
            self.reload()
        else:
            self.status.setText(f"<span style='color:#b71c1c'>{message}</span>")

    def add_file(self, path: str, link: bool = False) -> None:
        if Path(path).is_dir():      # a Hugging Face checkpoint folder: a conversion job
            self.add_hf_folder(path)
            return
        self._add(lambda: self.view.add_file(path, link))

    def add_package(self) -> None:
        self._add(self.view.add_package)

    def _add(self, action) -> None:
        if self.view is None or self.adder.running:
            return
        self.status.setText("Adding the model (copying and hashing the file)…")
        self.adder.start(action)

    def _added(self, entry: dict) -> None:
        self.message.emit(f"added {entry['name']} to the model library")
        self.library_changed.emit()
        self.reload()

    @property
    def busy(self) -> bool:
        return self.call.running or self.adder.running or self.folder_job.running

    def remove_current(self) -> None:
        item = self.list.currentItem()
        if self.view is None or item is None:
            return
        try:
            self.view.remove(item.data(Qt.ItemDataRole.UserRole))
        except ForgebenchError as exc:
            self._problem(exc)
            return
        self.library_changed.emit()
        self.reload()

    def _problem(self, exc: ForgebenchError) -> None:
        self.status.setText(f"<span style='color:#b71c1c'>{exc.render()}</span>")
        self.message.emit(exc.render())
