"""The export wizard pane: run and checkpoint → base → quantization with sizes → export and
verify (the equivalence report as pass/fail rows, llama.cpp's answers) → the bundle's model
card and rights checklist. Long steps run as `forgebench` jobs with progress and cancel; the
reads that prepare a step (the base's tensor table, the size estimates) run on a worker thread
behind a busy bar with Cancel, and Next waits for them, so no click lands on the wrong page."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QStackedWidget,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import export_wizard as vm
from app.viewmodels.models import library_files
from app.viewmodels.runs import run_label
from app.viewmodels.workspace import Workspace, dialog_folder
from app.views.background import BackgroundCall
from app.views.combos import refill_keeping_choice
from app.views.help_link import help_link
from app.views.job_runner import JobRunner
from app.views.labels import wrapped_label
from engine.errors import ForgebenchError

STEPS = ("1. Run and checkpoint", "2. Base model", "3. Quantization", "4. Export and verify",
         "5. Bundle")
VERDICT_COLOURS = {"match": "#c8e6c9", "changed": "#ffe0b2", "FAIL": "#ffcdd2"}
VERDICT_TIPS = {"match": "nothing changed: every top-1 token and greedy answer (or every "
                         "output value) is the checkpoint's",
                "changed": "above the engine's bar, but some tokens, answers or output values "
                           "differ",
                "FAIL": "below this stage's bar against the training checkpoint (detail for "
                        "diagnosis: the export's verdict is the banner above)"}


def _page(*widgets) -> QWidget:
    page = QWidget()
    layout = QVBoxLayout(page)
    # no side margins: the pane has its own, and the verify table needs every pixel of the
    # width once the page scrolls (its scroll bar takes some)
    layout.setContentsMargins(0, 0, 4, 0)
    for widget in widgets:
        if isinstance(widget, QHBoxLayout):
            layout.addLayout(widget)
        else:
            layout.addWidget(widget)
    layout.addStretch(1)
    return page


def stacked(title: str) -> str:
    """A column title on two lines, broken at the space nearest its middle ("top-1
    agreement"), so the verification table's columns are as wide as their numbers."""
    spaces = [i for i, ch in enumerate(title) if ch == " "]
    if not spaces:
        return title
    cut = min(spaces, key=lambda i: abs(2 * i - len(title)))
    return f"{title[:cut]}\n{title[cut + 1:]}"


def _label(text: str = "") -> QLabel:
    """A wrapped, selectable label: a long error line (a path, a command) wraps instead of
    pushing the buttons off-screen."""
    return wrapped_label(text, selectable=True)


class PageMessage(QLabel):
    """A wrapped, selectable message on a wizard page (a verdict, a refusal, "saved"): set,
    it is scrolled into view, where the user looks after the click that made it."""

    def __init__(self):
        super().__init__()
        self.setWordWrap(True)
        self.setMinimumWidth(1)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

    def setText(self, text: str) -> None:       # noqa: N802 (Qt's name)
        super().setText(text)
        scroll = self.parentWidget()
        while scroll is not None and not isinstance(scroll, PageScroll):
            scroll = scroll.parentWidget()
        if text and scroll is not None:
            scroll.show_whole(self)


def verdict_html(verdict, out: Path | None) -> str:
    """The export's one verdict (engine.export.verdict) as the final page's banner: the same
    title, words and colour as the report, the card and the notification."""
    where = f"<br><small>{html.escape(str(out))}</small>" if out else ""
    return (f"<div style='background:{verdict.background}; color:{verdict.colour}; "
            f"padding:4px'><b>{html.escape(verdict.title)}</b>: "
            f"{html.escape(verdict.words)}{where}</div>")


def questions_html(result: dict) -> str:
    """The two questions, the validation answers side by side and the picker's table."""
    parts = []
    if result.get("questions"):
        parts.append("<pre style='white-space:pre-wrap'>"
                     + html.escape("\n".join(result["questions"])) + "</pre>")
    return "".join(parts)


def error_html(heading: str, text: str) -> str:
    """An engine message as wrapped HTML (a <pre> block would not wrap)."""
    return (f"<b style='color:#b71c1c'>{html.escape(heading)}</b><br>"
            + html.escape(text).replace("\n", "<br>"))


class CurrentPageStack(QStackedWidget):
    """The wizard's pages, as tall as the page shown. (A stacked layout's height for a width
    is its tallest page's: after an export, the verify page's report made the short bundle
    page scroll its Save button below the fold.)"""

    def sizeHint(self) -> QSize:        # noqa: N802 (Qt's name)
        page = self.currentWidget()
        return page.sizeHint() if page else super().sizeHint()

    def minimumSizeHint(self) -> QSize:     # noqa: N802 (Qt's name)
        page = self.currentWidget()
        return page.minimumSizeHint() if page else super().minimumSizeHint()

    def heightForWidth(self, width: int) -> int:    # noqa: N802 (Qt's name)
        page = self.currentWidget()
        if page is None:
            return super().heightForWidth(width)
        return page.heightForWidth(width) if page.hasHeightForWidth() else \
            page.sizeHint().height()


class PageScroll(QScrollArea):
    """The wizard's pages scroll up and down inside the pane, under a fixed row of messages
    and Back/Next: at 1024×700 with the first-run banners shown the tallest page needs more
    than the pane has, and Next must not scroll away with it. As wide as the widest page
    needs (no sideways scroll)."""

    def __init__(self, content: QWidget):
        super().__init__()
        self.setWidget(content)
        self.setWidgetResizable(True)
        self.setFrameShape(QScrollArea.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)

    def minimumSizeHint(self) -> QSize:      # noqa: N802 (Qt's name)
        width = self.widget().minimumSizeHint().width() + \
            self.verticalScrollBar().sizeHint().width()
        return QSize(width, super().minimumSizeHint().height())

    def show_whole(self, widget: QWidget) -> None:
        """Scroll so a message just set on a page is in view, once the page has laid it
        out."""
        QTimer.singleShot(0, lambda: self.ensureWidgetVisible(widget))


def _stages_table() -> QTableWidget:
    """The verification's stages. Fits the page of a 1024x700 window without a sideways
    scroll: two-line titles, columns as wide as their cells, the file name (last) eliding in
    the middle; every cell's tooltip holds its whole text."""
    stages = QTableWidget(0, len(vm.LLM_COLUMNS))
    stages.setHorizontalHeaderLabels([stacked(t) for t in vm.LLM_COLUMNS])
    stages.verticalHeader().hide()
    stages.setWordWrap(False)
    stages.setTextElideMode(Qt.TextElideMode.ElideMiddle)
    stages.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    stages.horizontalHeader().setStretchLastSection(True)
    return stages


class ExportWizardPane(QWidget):
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.runs: list[vm.ExportableRun] = []
        self.base: vm.BaseInfo | None = None
        self.out: Path | None = None
        self.checklist: list[dict] = []
        self._pick_out: Path | None = None
        self._hf_export = False            # the running/last export is a merged HF folder

        self.steps = QListWidget()
        self.steps.addItems(STEPS)
        self.steps.setFixedWidth(150)     # "1. Run and checkpoint" whole; the rest to the page
        self.steps.currentRowChanged.connect(self.go)
        self.pages = CurrentPageStack()
        for page in (self._run_page(), self._base_page(), self._types_page(),
                     self._export_page(), self._bundle_page()):
            self.pages.addWidget(page)
        # Preparing a step off the GUI thread: a busy bar and Cancel under the page.
        self.call = BackgroundCall(self)
        self.call.done.connect(self._prepared)
        self.call.failed.connect(self._prepare_failed)
        self._preparing: tuple[int, object] | None = None     # (step, what the call is for)
        self.step_error = _label()
        self.page_scroll = PageScroll(self.pages)
        right = QVBoxLayout()
        right.addWidget(self.page_scroll, 1)
        right.addWidget(self.step_error)
        right.addWidget(self._busy_row())
        right.addLayout(self._nav_row())
        layout = QHBoxLayout(self)
        layout.addWidget(self.steps)
        layout.addLayout(right, 1)
        self.steps.setCurrentRow(0)

    def _run_page(self) -> QWidget:
        """1. run and checkpoint"""
        self.run_combo = QComboBox()
        self.run_combo.currentIndexChanged.connect(self._run_chosen)
        self.checkpoint = QComboBox()
        self.checkpoint.currentIndexChanged.connect(self._clear_results)
        form = QFormLayout()
        form.addRow("Run", self.run_combo)
        form.addRow("Checkpoint", self.checkpoint)
        box = QWidget()
        box.setLayout(form)
        return _page(_label(
            "Language-model runs (lm-pretrain, lm-sft, lm-dpo, lm-es) export as GGUF for "
            "llama.cpp. Image and sound generators (image-generate, audio-generate) export "
            "as a verified bundle: the weights, model.json and one reference output per "
            "class."), box)

    def _base_page(self) -> QWidget:
        """2. base"""
        self.base_text = _label()
        self.base_path = QLineEdit()
        self.base_path.setPlaceholderText("the run's own base (recorded in run.json)")
        self.base_browse = QPushButton("Choose another base…")
        self.base_browse.clicked.connect(self._browse_base)
        self.base_library = QPushButton("Library ▾")
        self.base_library.setToolTip("Pick the base from the workspace's model library")
        self.base_library.setMenu(QMenu(self.base_library))
        self.base_library.menu().aboutToShow.connect(self._fill_library_menu)
        self.dense_button = QPushButton("Write a dense f16 copy of the base and use it")
        self.dense_button.clicked.connect(self.make_dense_base)
        self.convert_job = JobRunner("conversion")
        self.convert_job.finished.connect(self._dense_done)
        self.convert_job.cancel_button.clicked.connect(self._update_nav)
        row = QHBoxLayout()
        row.addWidget(self.base_path, 1)
        row.addWidget(self.base_browse)
        row.addWidget(self.base_library)
        return _page(self.base_text, row, self.dense_button, self.convert_job)

    def _types_page(self) -> QWidget:
        """3. quantization, and the picker: what each type keeps of the fine-tune's gain"""
        self.sizes = QTableWidget(0, 3)
        self.sizes.setHorizontalHeaderLabels(["type", "estimated tensor data",
                                              "keeps of the fine-tune's gain"])
        self.sizes.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.sizes.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.sizes.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
        self.pick_button = QPushButton("Measure what each type keeps (a minute or more)")
        self.pick_button.setToolTip("Quantizes the merged model to " + ", ".join(vm.PICKER_TYPES)
                                    + " (ptqtp: two ternary planes, the engine runs it, not "
                                    "llama.cpp) and scores each on the run's validation data")
        self.pick_button.clicked.connect(self.measure_types)
        self.pick_job = JobRunner("quantization picker")
        self.pick_job.finished.connect(self._measured)
        self.pick_text = PageMessage()
        page = _page(_label("Choose the file type. Sizes count the weights (metadata and "
                            "vocabulary add a little)."),
                     self.sizes, self.pick_button, self.pick_job, self.pick_text)
        page.layout().setStretchFactor(self.sizes, 3)      # every type in view, not 6 of them
        return page

    def _export_page(self) -> QWidget:
        """4. export and verify"""
        self.out_name = QLineEdit()
        self.export_button = QPushButton("Export and verify")
        self.export_button.clicked.connect(self.export)
        self.export_job = JobRunner("export")
        # the notification says the export's verdict (a defect is a failure, never "done")
        self.export_job.describe = lambda ok, message: (
            vm.hf_notification if self._hf_export else vm.notification)(self.out, ok, message)
        self.export_job.finished.connect(self._exported)
        self.hf_reason = _label()
        self.verdict = PageMessage()
        self.stages = _stages_table()
        self.answers = _label()
        row = QHBoxLayout()
        row.addWidget(QLabel("Export folder (in exports/)"))
        row.addWidget(self.out_name, 1)
        row.addWidget(self.export_button)
        return _page(self._formats_row(), self.hf_reason, row, self.export_job, self.verdict,
                     help_link("verdicts"), self.stages, self.answers)

    def _formats_row(self) -> QHBoxLayout:
        """The format: step 3's GGUF/adapter type, or a merged Hugging Face folder."""
        self.format = QComboBox()
        for key, label in vm.FORMATS.items():
            self.format.addItem(label, key)
        self.format.currentIndexChanged.connect(self._format_chosen)
        self.hf_source = QLineEdit()
        self.hf_source.setPlaceholderText("HF source: the base's folder, from the library")
        self.hf_source.editingFinished.connect(self._format_chosen)
        self.hf_browse = QPushButton("Choose…")
        self.hf_browse.clicked.connect(self._browse_hf_source)
        formats = QHBoxLayout()
        formats.addWidget(QLabel("Format"))
        formats.addWidget(self.format)
        formats.addWidget(self.hf_source, 1)
        formats.addWidget(self.hf_browse)
        return formats

    def _bundle_page(self) -> QWidget:
        """5. bundle"""
        self.card = QPlainTextEdit()
        self.rights = QListWidget()
        self.finish_button = QPushButton("Save model card and checklist into the bundle")
        self.finish_button.clicked.connect(self.finish)
        self.finish_status = PageMessage()
        page = _page(_label("Edit the model card; confirm each right the data card states."),
                     self.card, QLabel("Rights checklist (from the data card)"), self.rights,
                     self.finish_button, self.finish_status)
        page.layout().setStretchFactor(self.card, 3)
        return page

    def _busy_row(self) -> QWidget:
        self.busy_text = _label()
        self.busy_bar = QProgressBar()
        self.busy_bar.setRange(0, 0)
        self.busy_cancel = QPushButton("Cancel")
        self.busy_cancel.clicked.connect(self.cancel_prepare)
        self.busy = QWidget()
        busy = QHBoxLayout(self.busy)
        busy.setContentsMargins(0, 0, 0, 0)
        busy.addWidget(self.busy_text, 2)
        busy.addWidget(self.busy_bar, 1)
        busy.addWidget(self.busy_cancel)
        self.busy.hide()
        return self.busy

    def _nav_row(self) -> QHBoxLayout:
        self.back_button = QPushButton("< Back")
        self.next_button = QPushButton("Next >")
        self.back_button.clicked.connect(lambda: self.go(self.pages.currentIndex() - 1))
        self.next_button.clicked.connect(lambda: self.go(self.pages.currentIndex() + 1))
        nav = QHBoxLayout()
        nav.addStretch(1)
        nav.addWidget(self.back_button)
        nav.addWidget(self.next_button)
        return nav

    # -- navigation ----------------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.reload()

    def reload(self) -> None:
        self.runs = vm.exportable_runs(self.workspace.run_dirs() if self.workspace else [])
        self.run_combo.blockSignals(True)
        self.run_combo.clear()
        for run in self.runs:
            self.run_combo.addItem(run_label(run.path, run.recipe), str(run.path))
        self.run_combo.blockSignals(False)
        self._run_chosen()

    def refresh_runs(self) -> None:
        """New exportable runs and checkpoints appear; the run being exported, its
        checkpoint and every later choice stay as they are."""
        runs = vm.exportable_runs(self.workspace.run_dirs() if self.workspace else [])
        if runs == self.runs:
            return
        self.runs = runs
        if not refill_keeping_choice(self.run_combo, [(run_label(r.path, r.recipe), str(r.path))
                                                      for r in runs]):
            self._run_chosen()
            return
        refill_keeping_choice(self.checkpoint, [(c, c) for c in reversed(self.run.checkpoints)])

    def select_run(self, path: Path, checkpoint: str | None = None) -> None:
        self.run_combo.setCurrentIndex(self.run_combo.findData(str(path)))
        if checkpoint:
            self.checkpoint.setCurrentText(checkpoint)

    @property
    def run(self) -> vm.ExportableRun | None:
        index = self.run_combo.currentIndex()
        return self.runs[index] if 0 <= index < len(self.runs) else None

    def _run_chosen(self, *_) -> None:
        self.checkpoint.blockSignals(True)
        self.checkpoint.clear()
        if self.run:
            self.checkpoint.addItems(list(reversed(self.run.checkpoints)))
            self.out_name.setText(f"{self.run.path.name}-export")
        self.checkpoint.blockSignals(False)
        self.base_path.clear()
        self.base = None
        self.sizes.setRowCount(0)
        self._clear_results()
        self._format_chosen()

    def _clear_results(self, *_) -> None:
        """A new run or checkpoint: the previous export's verdict, table and card go."""
        self.out = None
        self.stages.setRowCount(0)
        self.verdict.setText("")
        self.answers.setText("")
        self.card.clear()
        self.rights.clear()
        self.checklist = []
        self.finish_status.setText("")

    def go(self, index: int) -> None:
        """Show a step. Steps 2 and 3 are prepared on a worker thread from the choices made
        so far; the page shows at once with a busy bar, and Next waits until it is ready."""
        index = max(0, min(index, len(STEPS) - 1))
        self.step_error.setText("")
        if index == 3:
            self._format_chosen()      # the library may have learnt the base's HF folder
        if index == 1:
            self._prepare(1, "Reading the base model's tensor table…", self._base_call())
        elif index == 2:
            self._prepare(2, "Estimating the file size of each type…", self._sizes_call())
        else:
            self.cancel_prepare()
        self.pages.setCurrentIndex(index)
        self.pages.updateGeometry()             # the page scrolls by its own height only
        self.steps.blockSignals(True)
        self.steps.setCurrentRow(index)
        self.steps.blockSignals(False)
        self._update_nav()

    def _update_nav(self) -> None:
        index = self.pages.currentIndex()
        busy = self.call.running or self.convert_job.running or self.pick_job.running
        self.back_button.setEnabled(index > 0 and not self.convert_job.running)
        self.next_button.setEnabled(index < len(STEPS) - 1 and not busy)
        self.steps.setEnabled(not busy)

    def _prepare(self, step: int, what: str, call) -> None:
        if call is None:
            self.cancel_prepare()
            return
        self._preparing = (step, call)
        self.busy_text.setText(what)
        self.busy.show()
        self.call.start(call)

    def cancel_prepare(self) -> None:
        if self.call.running:
            self.call.cancel()
            self.step_error.setText("Cancelled. Go back, or press Next again to retry.")
        self._preparing = None
        self.busy.hide()
        self._update_nav()

    def _prepared(self, result) -> None:
        step = self._preparing[0] if self._preparing else None
        self._preparing = None
        self.busy.hide()
        if step == 1:
            self._show_base(result)
        elif step == 2:
            self._show_sizes(result)
        self._update_nav()

    def _prepare_failed(self, exc: ForgebenchError) -> None:
        self._preparing = None
        self.busy.hide()
        self.message.emit(exc.render())
        self.step_error.setText(error_html("This step cannot be prepared.", exc.render()))
        self._update_nav()

    # -- 2. base -------------------------------------------------------------------------
    def chosen_base(self) -> Path | None:
        return Path(self.base_path.text()) if self.base_path.text().strip() else None

    def _base_call(self):
        if self.run is None:
            return None
        run, chosen = self.run.path, self.chosen_base()
        return lambda: vm.base_info(run, chosen)

    def _show_base(self, base: vm.BaseInfo) -> None:
        self.base = base
        self.base_text.setText(self.base.explanation())
        self.dense_button.setVisible(self.base.quantized)
        for widget in (self.base_path, self.base_browse, self.base_library):
            widget.setEnabled(self.run.recipe in vm.GGUF_BASE_RECIPES)

    def _fill_library_menu(self) -> None:
        menu = self.base_library.menu()
        menu.clear()
        models = library_files(self.workspace.root) if self.workspace else []
        for name, path in models:
            menu.addAction(name, lambda p=path: self.choose_base(p))
        if not models:
            menu.addAction("(no models in the library: add one in the Models pane)"
                           ).setEnabled(False)

    def choose_base(self, path: Path) -> None:
        self.base_path.setText(str(path))
        self.go(1)

    def _browse_base(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Base model", dialog_folder(
            self.workspace, "models"), "GGUF (*.gguf)")
        if path:
            self.choose_base(Path(path))

    def make_dense_base(self) -> None:
        if self.base is None or self.base.path is None:
            return
        out = self.workspace.root / "exports" / f"{self.base.path.stem}-dense-f16.gguf"
        self._dense_out = out
        if out.is_file():           # made earlier: reuse it
            self._dense_done(True, "done")
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        self.convert_job.start(vm.convert_argv(self.base.path, out, "f16"),
                               "writing a dense copy of the base")
        self._update_nav()      # no step change while the copy is written

    def _dense_done(self, ok: bool, message: str) -> None:
        self._update_nav()
        if ok:
            self.base_path.setText(str(self._dense_out))
            self.go(1)
        else:
            self.message.emit(message)
            self.step_error.setText(error_html("The dense copy was not written.", message))

    # -- 3. sizes ------------------------------------------------------------------------
    def _sizes_call(self):
        if self.run is None:
            return None
        run, checkpoint, base = self.run, self.checkpoint.currentText(), self.chosen_base()
        return lambda: vm.size_estimates(run, checkpoint, base)

    def _show_sizes(self, sizes: dict[str, int]) -> None:
        self.pick_button.setVisible(self.run is not None and self.run.recipe == "lm-sft")
        chosen = self.dtype()
        self.sizes.setRowCount(len(sizes))
        for r, (dtype, size) in enumerate(sizes.items()):
            self.sizes.setItem(r, 0, QTableWidgetItem(dtype))
            self.sizes.setItem(r, 1, QTableWidgetItem(f"{size / 1e6:.2f} MB"))
        self.set_dtype(chosen if chosen in sizes else "q8_0" if "q8_0" in sizes
                       else next(iter(sizes)))

    def measure_types(self) -> None:
        """Run the picker (`forgebench export --compare-only`) as a job; its rows fill the
        table's third column and the smallest type keeping >= 90% of the gain is selected."""
        if self.run is None or self.workspace is None or self.pick_job.running:
            return
        if self.run.recipe != "lm-sft":
            self.pick_text.setText("The picker measures lm-sft runs (it needs the fine-tune's "
                                   "validation answers and a base to compare with).")
            return
        self._pick_out = vm.picker_folder(self.workspace.root, self.run.path)
        self.pick_text.setText("")
        self.pick_job.start(vm.picker_argv(self.run.path, self.checkpoint.currentText(),
                                           self._pick_out, self.chosen_base()),
                            f"measuring {', '.join(vm.PICKER_TYPES)}")
        self._update_nav()

    def _measured(self, ok: bool, message: str) -> None:
        self._update_nav()
        if not ok or self._pick_out is None:
            self.pick_text.setText(error_html("The picker did not finish.", message))
            return
        self.show_picker(vm.read_picker(self._pick_out))

    def show_picker(self, picker: dict) -> None:
        by_type = {row["dtype"]: row for row in picker["rows"]}
        for r in range(self.sizes.rowCount()):
            row = by_type.get(self.sizes.item(r, 0).text())
            text = vm.kept_text(row) if row else ""
            self.sizes.setItem(r, 2, QTableWidgetItem(text))
        if picker["recommended"]:
            self.set_dtype(picker["recommended"])
        self.pick_text.setText(html.escape(vm.picker_summary(picker)))

    def dtype(self) -> str | None:
        row = self.sizes.currentRow()
        return self.sizes.item(row, 0).text() if row >= 0 and self.sizes.item(row, 0) else None

    def set_dtype(self, dtype: str) -> None:
        for r in range(self.sizes.rowCount()):
            if self.sizes.item(r, 0).text() == dtype:
                self.sizes.selectRow(r)

    # -- 4. export and verify ------------------------------------------------------------
    def export_format(self) -> str:
        return self.format.currentData()

    def chosen_hf_source(self) -> Path | None:
        text = self.hf_source.text().strip()
        return Path(text).expanduser() if text else None

    def _format_chosen(self, *_) -> None:
        """A merged HF folder: the source folder row, and the engine's refusal up front."""
        hf = self.export_format() == "hf"
        self.hf_source.setVisible(hf)
        self.hf_browse.setVisible(hf)
        reason = vm.hf_export_refusal(self.run, self.chosen_hf_source()) \
            if hf and self.run is not None else None
        self.hf_reason.setText(error_html("Cannot export as a Hugging Face folder.", reason)
                               if reason else "")
        self.export_button.setEnabled(reason is None and not self.export_job.running)

    def _browse_hf_source(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "The base model's Hugging Face folder",
                                                dialog_folder(self.workspace))
        if path:
            self.hf_source.setText(path)
            self._format_chosen()

    def export_hf(self) -> None:
        """`forgebench export RUN --format hf` as a job (refused here with the engine's reason
        when the run has no HF source)."""
        reason = vm.hf_export_refusal(self.run, self.chosen_hf_source())
        if reason:
            self.verdict.setText(error_html("Cannot export as a Hugging Face folder.", reason))
            return
        out = self.workspace.root / "exports" / self.out_name.text().strip()
        self._clear_results()
        self.out, self._hf_export = out, True
        self.export_button.setEnabled(False)
        self.export_job.start(vm.hf_export_argv(self.run.path, self.checkpoint.currentText(),
                                                out, self.chosen_base(), self.chosen_hf_source()),
                              f"exporting {self.run.path.name} as a Hugging Face folder")

    def export(self) -> None:
        if self.run is not None and self.export_format() == "hf":
            self.export_hf()
            return
        self._hf_export = False
        if self.run is None or self.dtype() is None:
            self.message.emit("choose a run, a checkpoint and a quantization type first")
            return
        out = self.workspace.root / "exports" / self.out_name.text().strip()
        try:
            argv = vm.export_argv(self.run.path, self.checkpoint.currentText(), self.dtype(),
                                  out, self.chosen_base())
        except ForgebenchError as exc:
            self.verdict.setText(error_html("Cannot export.", exc.render()))
            return
        self._clear_results()
        self.out = out
        self.export_button.setEnabled(False)
        self.export_job.start(argv, f"exporting {self.run.path.name} as {self.dtype()}")

    def _exported(self, ok: bool, message: str) -> None:
        self.export_button.setEnabled(True)
        if self._hf_export:
            if not ok or self.out is None:
                self.verdict.setText(error_html("The export failed.", message))
                return
            rows = "".join(f"<tr><td>{html.escape(name)}</td><td align=right>{size / 1e6:.2f} MB"
                           "</td></tr>" for name, size in vm.hf_export_written(self.out))
            self.verdict.setText(f"<b>{html.escape(message)}</b><br>Written to "
                                 f"{html.escape(str(self.out))}:<table>{rows}</table>")
            return
        bundle = vm.finished_bundle(self.out)
        if bundle is None:
            self.verdict.setText(error_html("The export failed.", message))
            return
        report, card = bundle
        self.show_report(report)
        self.card.setPlainText(card)
        self.checklist = vm.rights_checklist(self.run.path)
        self.rights.clear()
        for entry in self.checklist:
            item = QListWidgetItem(f"{entry['label']} — data card: {entry['stated']}")
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Checked if entry["confirmed"]
                               else Qt.CheckState.Unchecked)
            self.rights.addItem(item)

    def show_report(self, report: dict) -> None:
        result = vm.verification(report)
        self.stages.setColumnCount(len(result["columns"]))
        self.stages.setHorizontalHeaderLabels([stacked(t) for t in result["columns"]])
        last = len(result["columns"]) - 1
        self.stages.horizontalHeader().setSectionResizeMode(
            last, QHeaderView.ResizeMode.Stretch)
        self.stages.setRowCount(len(result["rows"]))
        for r, row in enumerate(result["rows"]):
            for c, value in enumerate(vm.cells(row, result["kind"])):
                item = QTableWidgetItem(value)
                item.setToolTip(value)
                if c == 1 and row.verdict in VERDICT_COLOURS:
                    item.setBackground(QColor(VERDICT_COLOURS[row.verdict]))
                    item.setToolTip(f"{value}: {VERDICT_TIPS[row.verdict]}")
                self.stages.setItem(r, c, item)
        self.verdict.setText(verdict_html(result["verdict"], self.out)
                             + questions_html(result)
                             + (f"<br><small>{html.escape(result['numerics'])}</small>"
                                if result["numerics"] else ""))
        if result["kind"] == "generator":
            self.answers.setText(
                f"Bar: {html.escape(result['bar'])}. Reference outputs drawn by the bundle "
                f"alone (fixed seed), in the bundle: " + ", ".join(
                    html.escape(name) for name in result["references"]))
            return
        cpp = result["llamacpp"]
        if cpp["available"]:
            amber = " style='background:#ffe0b2'"      # an answer that differs
            lines = [f"<tr{amber if ours != theirs else ''}>"
                     f"<td>{html.escape(p)}</td><td>{html.escape(str(ours))}</td>"
                     f"<td>{html.escape(str(theirs))}</td></tr>" for p, ours, theirs in
                     sorted(cpp["answers"], key=lambda a: a[1] == a[2])]
            note = f"<br><small>{html.escape(cpp['note'])}</small>" if cpp.get("note") else ""
            self.answers.setText("<b>llama.cpp's answers</b><table border=1 cellpadding=3>"
                                 "<tr><th>prompt</th><th>checkpoint</th><th>llama.cpp</th></tr>"
                                 + "".join(lines) + "</table>" + note)
        else:
            self.answers.setText(f"llama.cpp was not run: {html.escape(str(cpp['reason']))}")

    # -- 5. bundle -----------------------------------------------------------------------
    def finish(self) -> None:
        if self.out is None:
            return
        for i, entry in enumerate(self.checklist):
            entry["confirmed"] = self.rights.item(i).checkState() == Qt.CheckState.Checked
        try:
            vm.finish_bundle(self.out, self.card.toPlainText(), self.checklist)
        except ForgebenchError as exc:
            self.finish_status.setText(error_html("Not saved.", exc.render()))
            return
        self.finish_status.setText(f"Bundle saved: {self.out} (SHA256SUMS updated)")
        self.message.emit(f"bundle saved: {self.out}")
