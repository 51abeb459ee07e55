"""The import wizard: choose a source → map keys and preview with validation → name,
provenance and rights → import with progress and cancel (copying runs on a worker thread and
stages into a temporary folder, so a cancel leaves nothing behind)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from PySide6.QtCore import Qt, QTextBoundaryFinder, QThread, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QProgressBar,
    QPushButton,
    QStackedWidget,
    QStyle,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import importers as vm
from app.views.labels import wrapped_label
from engine.errors import ForgebenchError

SOURCES = {"images": "Folder of images (a folder per class)",
           "jsonl": "JSONL file (text SFT, corpus, preferences, captioned images)",
           "audio": "Audio CSV (path,label,split,group,source,rights,sha256)",
           "table": "Table CSV with a header (tabular: the schema is inferred from it)"}
ERROR_BG = QColor("#ffcdd2")
NO_KEY = "(none)"
MAX_LISTED = 500
MAPPING_COLUMNS = 3
BACKGROUND_PLAN_BYTES = 1 << 20  # source files above this are read on a worker thread



class _ImportWorker(QThread):
    progressed = Signal(int, int, str)
    succeeded = Signal(str)
    failed = Signal(str)

    def __init__(self, plan: vm.ImportPlan, datasets_dir: Path, name: str, provenance: dict,
                 rights: dict, parent=None):
        super().__init__(parent)
        self.args = (plan, datasets_dir, name)
        self.provenance, self.rights = provenance, rights
        self.cancel = threading.Event()
        self.last_report = 0.0

    def _report(self, done: int, total: int, what: str) -> None:
        """At most ~20 updates a second: 100,000 files must not flood the GUI's queue."""
        now = time.monotonic()
        if now - self.last_report >= 0.05 or done >= total - 2:
            self.last_report = now
            self.progressed.emit(done, total, what)

    def run(self) -> None:
        try:
            path = vm.import_dataset(*self.args, provenance=self.provenance,
                                     rights=self.rights, progress=self._report,
                                     cancelled=self.cancel.is_set)
        except vm.ImportCancelled:
            self.failed.emit("cancelled: nothing was imported")
        except (ForgebenchError, OSError) as exc:
            self.failed.emit(exc.render() if isinstance(exc, ForgebenchError) else str(exc))
        else:
            self.succeeded.emit(str(path))


def _guarded(make, path: Path):
    """A plan that turns an unexpected read failure into a finding instead of a crash."""
    def run() -> vm.ImportPlan:
        try:
            return make()
        except (ForgebenchError, OSError) as exc:
            return vm.unreadable_plan(path, str(exc))
    return run


class _PlanWorker(QThread):
    planned = Signal(object, int)

    def __init__(self, make, request: int, parent=None):
        super().__init__(parent)
        self.make, self.request = make, request

    def run(self) -> None:
        self.planned.emit(self.make(), self.request)


class PreviewTable(QTableWidget):
    """The preview's table, fitted to its width: columns as wide as their text when they fit,
    the widest capped and their long paths wrapped at their break opportunities when not
    (`vm.preview_column_widths`), rows as tall as their cells; refitted when the width
    changes. Only a word longer than a fifth of the width (a sha256) is elided, in the
    middle, with the whole text in the cell's tooltip."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.horizontalHeader().setStretchLastSection(True)
        self.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)

    def fit_columns(self) -> None:
        header, metrics = self.horizontalHeader(), self.fontMetrics()
        # the item delegate's text margins either side, and a pixel or two for rounding
        margin = 2 * (self.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None,
                                               self) + 1) + 3
        available = self.viewport().width()
        wanted, least = [], []        # every row counts, not only those scrolled into view
        for column in range(self.columnCount()):
            title = self.horizontalHeaderItem(column)      # None while the table is refilled
            texts = [item.text() for row in range(self.rowCount())
                     if (item := self.item(row, column))]
            wanted.append(max([header.sectionSizeHint(column)] +
                              [metrics.horizontalAdvance(t) + margin for t in texts]))
            words = [title.text() if title else ""] + [w for t in texts for w in _unbreakable(t)]
            least.append(min(wanted[-1], max(metrics.horizontalAdvance(w) for w in words)
                             + margin, available // 5))
        for column, width in enumerate(vm.preview_column_widths(wanted, least, available)):
            header.resizeSection(column, width)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.fit_columns()


def _unbreakable(text: str) -> list[str]:
    """The pieces of `text` between its line-break opportunities (Unicode's rules)."""
    finder = QTextBoundaryFinder(QTextBoundaryFinder.BoundaryType.Line, text)
    pieces, start = [], 0
    while (end := finder.toNextBoundary()) != -1:
        pieces.append(text[start:end].rstrip())
        start = end
    return pieces


class ImportWizard(QDialog):
    """Emits `imported(path)` when a new dataset is in place, `plan_ready` when a preview
    is shown."""

    imported = Signal(str)
    plan_ready = Signal()

    def __init__(self, datasets_dir: Path, source: str = "images", parent=None):
        super().__init__(parent)
        self.setWindowTitle("Import a dataset")
        self.resize(1100, 720)
        self.datasets_dir = Path(datasets_dir)
        self.plan: vm.ImportPlan | None = None
        self._plan_request = 0
        self.worker: _ImportWorker | None = None
        self.jsonl_keys: list[str] = []
        self.left_out: list[str] = []        # table columns the user unticked as features
        self.result_path: Path | None = None

        self.steps = QLabel()
        self.pages = QStackedWidget()
        self.pages.addWidget(self._source_page())
        self.pages.addWidget(self._preview_page())
        self.pages.addWidget(self._name_page())
        self.pages.addWidget(self._import_page())
        self.back_button = QPushButton("< Back")
        self.back_button.clicked.connect(lambda: self.go(self.pages.currentIndex() - 1))
        self.next_button = QPushButton("Next >")
        self.next_button.clicked.connect(self.next)
        self.close_button = QPushButton("Close")
        self.close_button.clicked.connect(self.reject)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for button in (self.back_button, self.next_button, self.close_button):
            buttons.addWidget(button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.steps)
        layout.addWidget(self.pages, 1)
        layout.addLayout(buttons)
        self.source_kind.setCurrentIndex(list(SOURCES).index(source))
        self._source_kind_changed()
        self.go(0)

    # -- pages ---------------------------------------------------------------------------
    def _source_page(self) -> QWidget:
        self.source_kind = QComboBox()
        for key, text in SOURCES.items():
            self.source_kind.addItem(text, key)
        self.source_kind.currentIndexChanged.connect(self._source_kind_changed)
        self.source_path = QLineEdit()
        self.source_path.setPlaceholderText("a folder or file")
        self.source_path.textChanged.connect(self._update_next)
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        path_row = QHBoxLayout()
        path_row.addWidget(self.source_path, 1)
        path_row.addWidget(browse)
        self.with_masks = QCheckBox(f"masks beside the images (<name>{vm.MASK_SUFFIX}): "
                                    "import as image-masks")
        self.jsonl_kind = QComboBox()
        self.jsonl_kind.addItems(list(vm.JSONL_KINDS))
        self.source_help = QLabel()
        self.source_help.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Source", self.source_kind)
        form.addRow("Path", path_row)
        form.addRow("", self.with_masks)
        form.addRow("Dataset kind", self.jsonl_kind)
        page = QWidget()
        v = QVBoxLayout(page)
        v.addLayout(form)
        v.addWidget(self.source_help)
        v.addStretch(1)
        return page

    def _preview_page(self) -> QWidget:
        self.mapping_box = QWidget()
        self.mapping_grid = QGridLayout(self.mapping_box)
        self.mapping_grid.setContentsMargins(0, 0, 0, 0)
        self.mapping: dict[str, QComboBox] = {}
        self.schema_box = self._schema_box()
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.preview = PreviewTable()
        self.problems = QListWidget()
        self.problems.setMaximumHeight(140)
        self.full_plan: vm.ImportPlan | None = None     # before bad records are skipped
        self.corrections: dict[int, str] = {}           # line -> the text it was fixed to
        self.skip_bad = QCheckBox("Skip the records that have errors (they are listed in "
                                  "the dataset's provenance)")
        self.skip_bad.toggled.connect(self._apply_skip)
        self.fix_button = QPushButton("Fix the selected line…")
        self.fix_button.setToolTip("Edit a JSONL line here; the source file is not changed")
        self.fix_button.clicked.connect(self.ask_fix)
        self.preview.itemSelectionChanged.connect(self._update_fix)
        page = QWidget()
        v = QVBoxLayout(page)
        v.addWidget(wrapped_label("Map the file's keys to the dataset's fields (JSONL only); the "
                           f"first {vm.PREVIEW_ROWS} records are previewed with every "
                           "problem marked. Every file is checked again when imported."))
        v.addWidget(self.mapping_box)
        v.addWidget(self.schema_box)
        v.addWidget(self.summary)
        v.addWidget(self.preview, 1)
        v.addWidget(QLabel("Problems (file: line: field: reason)"))
        v.addWidget(self.problems)
        fixes = QHBoxLayout()
        fixes.addWidget(self.skip_bad, 1)
        fixes.addWidget(self.fix_button)
        v.addLayout(fixes)
        self._update_fix()
        return page

    def _schema_box(self) -> QWidget:
        """A table's inferred schema, to confirm or change before anything is written: every
        column's type, missing cells and role (with why), the target and group to choose."""
        box = QWidget()
        self.target_column = QComboBox()
        self.group_column = QComboBox()
        self.target_column.activated.connect(self._replan_table)
        self.group_column.activated.connect(self._replan_table)
        self.schema_table = QTableWidget()
        self.schema_table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.schema_table.itemChanged.connect(self._feature_toggled)
        self.schema_table.horizontalHeader().setStretchLastSection(True)
        self.schema_table.verticalHeader().setVisible(False)
        self.schema_table.verticalHeader().setDefaultSectionSize(
            self.schema_table.fontMetrics().height() + 6)
        self.schema_table.setMaximumHeight(220)
        self.target_reason = QLabel()          # why this column is the target
        self.target_reason.setWordWrap(True)
        choose = QHBoxLayout()
        choose.addWidget(QLabel("Predict (target)"))
        choose.addWidget(self.target_column, 1)
        choose.addWidget(QLabel("Keep together (group)"))
        choose.addWidget(self.group_column, 1)
        v = QVBoxLayout(box)
        v.setContentsMargins(0, 0, 0, 0)
        v.addWidget(wrapped_label("The schema was inferred from the header and the values. "
                                  "Check each column's type and role; choose another target "
                                  "or a group column if the guess is wrong, and untick a "
                                  "feature the model must not learn from (a leak, an id)."))
        v.addLayout(choose)
        v.addWidget(self.target_reason)
        v.addWidget(self.schema_table)
        return box

    def _show_schema(self) -> None:
        plan = self.plan
        table = plan.manifest_fields.get("table") if plan else None
        names = [g.name for g in plan.schema] if plan else []
        for combo, current, extra in ((self.target_column, table and table["target"], []),
                                      (self.group_column, table and table.get("group"),
                                       [NO_KEY])):
            combo.blockSignals(True)
            combo.clear()
            combo.addItems(extra + names)
            combo.setCurrentText(current or (extra[0] if extra else ""))
            combo.blockSignals(False)
        target = next((g for g in plan.schema if g.role == "target"), None) if plan else None
        self.target_reason.setText(
            f"Predicts <b>{target.name}</b> ({target.reason}); "
            f"{len(table['features'])} features, "
            f"{sum(g.missing for g in plan.schema if g.role == 'feature')} missing cells in "
            "them (the recipe handles them; never read as zero)." if target and table else "")
        headers = ["column", "type", "missing", "distinct", "role", "why"]
        self.schema_table.blockSignals(True)
        self.schema_table.clear()
        self.schema_table.setColumnCount(len(headers))
        self.schema_table.setHorizontalHeaderLabels(headers)
        self.schema_table.setRowCount(len(names))
        for i, guess in enumerate(plan.schema if plan else []):
            for j, value in enumerate((guess.name, guess.type, guess.missing, guess.distinct,
                                       guess.role, guess.reason)):
                self.schema_table.setItem(i, j, QTableWidgetItem(str(value)))
            chosen = guess.name in self.left_out
            if guess.role == "feature" or chosen:     # a feature can be left out, and back
                item = self.schema_table.item(i, 0)
                item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
                item.setCheckState(Qt.CheckState.Unchecked if chosen else
                                   Qt.CheckState.Checked)
        self.schema_table.blockSignals(False)
        self.schema_table.resizeColumnsToContents()

    def _feature_toggled(self, item: QTableWidgetItem) -> None:
        if item.column() != 0 or not item.flags() & Qt.ItemFlag.ItemIsUserCheckable:
            return
        self.set_feature_used(item.text(), item.checkState() == Qt.CheckState.Checked)

    def set_feature_used(self, column: str, used: bool) -> None:
        """Keep a column as a feature or leave it out, as the user would (tests, scripts)."""
        self.left_out = [c for c in self.left_out if c != column] + ([] if used else [column])
        self._replan_table()

    def set_table_roles(self, target: str | None = None, group: str | None = None) -> None:
        """Choose the target and group columns as the user would (tests, scripts)."""
        if target is not None:
            self.target_column.setCurrentText(target)
        if group is not None:
            self.group_column.setCurrentText(group or NO_KEY)
        self._replan_table()

    def _replan_table(self) -> None:
        path = Path(self.source_path.text().strip()).expanduser()
        target = self.target_column.currentText() or None
        group = self.group_column.currentText()
        group = None if group in ("", NO_KEY) else group
        left_out = tuple(self.left_out)
        self._plan(lambda: vm.plan_table_csv(path, target=target, group=group,
                                             leave_out=left_out), path)

    # -- skipping and fixing bad lines ---------------------------------------------------
    def _selected_line(self) -> int | None:
        rows = {i.row() for i in self.preview.selectedIndexes()}
        if len(rows) != 1 or self.source_kind.currentData() != "jsonl":
            return None
        item = self.preview.item(rows.pop(), 0)
        match = re.match(r"line (\d+)$", item.text() if item else "")
        return int(match.group(1)) if match else None

    def _update_fix(self) -> None:
        self.fix_button.setEnabled(self._selected_line() is not None)

    def ask_fix(self) -> None:
        number = self._selected_line()
        if number is None:
            return
        path = Path(self.source_path.text().strip()).expanduser()
        current = self.corrections.get(number, vm.source_line(path, number))
        text, ok = QInputDialog.getMultiLineText(self, f"Fix line {number}",
                                                 f"Line {number} of {path.name}:", current)
        if ok:
            self.fix_line(number, text)

    def fix_line(self, number: int, text: str) -> None:
        """Use `text` for line `number` of a JSONL source (the file is left as it is)."""
        self.corrections[number] = text
        self._remap()

    def _apply_skip(self) -> None:
        if self.full_plan is not None:
            self.plan = self.full_plan.skipping_errors() if self.skip_bad.isChecked() \
                else self.full_plan
            self._show_plan()

    def _name_page(self) -> QWidget:
        self.name = QLineEdit()
        self.name.textChanged.connect(self._check_name)
        self.name_error = QLabel()
        self.name_error.setStyleSheet("color: #c62828;")
        self.provenance = QLineEdit()
        self.provenance.setPlaceholderText("where the data comes from (who made it, how)")
        self.collected = QLineEdit()
        self.collected.setPlaceholderText("e.g. 2024-03 to 2024-05")
        self.rights: dict[str, QComboBox] = {}
        form = QFormLayout()
        form.addRow("Dataset name *", self.name)
        form.addRow("", self.name_error)
        form.addRow("Source / provenance", self.provenance)
        form.addRow("Collection dates", self.collected)
        for key, label in (("train", "Train on it"), ("publish_data", "Publish the data"),
                           ("publish_weights", "Publish trained weights"),
                           ("commercial", "Commercial use")):
            combo = QComboBox()
            combo.addItems(list(vm.RIGHT_ANSWERS))
            self.rights[key] = combo
            form.addRow(label, combo)
        self.basis = QLineEdit()
        self.basis.setPlaceholderText("licence, permission or terms that support the answers")
        self.consent = QLineEdit()
        self.consent.setPlaceholderText("consent of recorded or depicted people, if any")
        form.addRow("Basis", self.basis)
        form.addRow("Consent", self.consent)
        page = QWidget()
        v = QVBoxLayout(page)
        v.addWidget(wrapped_label("Each right is answered separately: permission to train is not "
                           "permission to publish the data, the weights, or to sell."))
        v.addLayout(form)
        v.addStretch(1)
        return page

    def _import_page(self) -> QWidget:
        self.progress = QProgressBar()
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.import_button = QPushButton("Import")
        self.import_button.clicked.connect(self.start_import)
        self.cancel_button = QPushButton("Cancel import")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel_import)
        row = QHBoxLayout()
        row.addWidget(self.import_button)
        row.addWidget(self.cancel_button)
        row.addStretch(1)
        page = QWidget()
        v = QVBoxLayout(page)
        v.addWidget(wrapped_label("Files are copied into a staging folder, dataset.json is written "
                           "with every file's SHA-256, the result is validated, and only "
                           "then does the dataset appear in the workspace."))
        v.addLayout(row)
        v.addWidget(self.progress)
        v.addWidget(self.status)
        v.addStretch(1)
        return page

    # -- navigation ----------------------------------------------------------------------
    def go(self, index: int) -> None:
        index = max(0, min(index, self.pages.count() - 1))
        self.pages.setCurrentIndex(index)
        names = ("1. Source", "2. Map and preview", "3. Name and rights", "4. Import")
        self.steps.setText("  ›  ".join(f"<b>{n}</b>" if i == index else n
                                        for i, n in enumerate(names)))
        busy = self.worker is not None
        self.back_button.setEnabled(0 < index and not busy and self.result_path is None)
        self.next_button.setVisible(index < self.pages.count() - 1)
        self._update_next()

    def _update_next(self) -> None:
        index = self.pages.currentIndex()
        allowed = {0: bool(self.source_path.text().strip()),
                   1: self.plan is not None and self.plan.ok,
                   2: self._name_problem() is None}.get(index, False)
        self.next_button.setEnabled(allowed)

    def next(self) -> None:
        index = self.pages.currentIndex()
        if index == 0:
            self.make_plan()
        if index == 2:
            self.progress.setValue(0)
            self.status.setText(f"Ready to import {self.plan.summary()} into "
                                f"{self.datasets_dir / self.name.text().strip()}")
        self.go(index + 1)

    def _source_kind_changed(self) -> None:
        key = self.source_kind.currentData()
        self.with_masks.setVisible(key == "images")
        self.jsonl_kind.setVisible(key == "jsonl")
        self.schema_box.setVisible(key == "table")
        self.source_help.setText({
            "images": "Each sub-folder is a class: cats/a.png, dogs/b.jpg … With masks, "
                      f"every image has a binary PNG mask beside it: cats/a{vm.MASK_SUFFIX}.",
            "jsonl": "One JSON object per line. You map its keys to the fields of the kind "
                     "on the next page; captioned images are copied from beside the file.",
            "audio": "A CSV with the header path,label,split,group,source,rights,sha256; "
                     "paths are relative to the CSV. Clips must be mono 16 kHz PCM16 WAV.",
            "table": "A CSV whose first line names the columns. Each column's type, its "
                     "missing cells and the column to predict are inferred; you confirm or "
                     "change them on the next page. No column names to type.",
        }[key])

    def _browse(self) -> None:
        key = self.source_kind.currentData()
        if key == "images":
            path = QFileDialog.getExistingDirectory(self, "Folder of class folders",
                                                    str(Path.home()))
        else:
            path, _ = QFileDialog.getOpenFileName(
                self, "Source file", str(Path.home()), "JSONL (*.jsonl *.json)" if key == "jsonl"
                else "CSV (*.csv)")
        if path:
            self.source_path.setText(path)

    # -- plan and preview ----------------------------------------------------------------
    def make_plan(self) -> None:
        key = self.source_kind.currentData()
        path = Path(self.source_path.text().strip()).expanduser()
        if getattr(self, "_fixed_source", None) != path:     # fixes belong to one source file
            self.corrections.clear()
            self._fixed_source = path
        self._fill_mapping(key, path)
        if not self.name.text():
            self.name.setText(path.stem if key != "images" else path.name)
        if key == "images":
            masks = self.with_masks.isChecked()
            self._plan(lambda: vm.plan_image_folder(path, masks=masks), path)
        elif key == "audio":
            self._plan(lambda: vm.plan_audio_csv(path), path)
        elif key == "table":
            self.left_out = []
            self._plan(lambda: vm.plan_table_csv(path), path)
        else:
            self._remap()

    def _plan(self, make, path: Path) -> None:
        """A small file is planned at once; a big file or a folder (it may hold 100,000
        images) is read on a worker thread while the preview says so (a later request
        replaces an earlier one). `plan_ready` fires either way."""
        self.plan = None
        self._plan_request += 1
        make = _guarded(make, path)
        if not path.is_dir() and vm.source_bytes(path) <= BACKGROUND_PLAN_BYTES:
            self._planned(make(), self._plan_request)
            return
        size = f" ({vm.source_bytes(path) / 1e6:.1f} MB)" if path.is_file() else ""
        self.summary.setText(f"reading {path.name}{size}…")
        self.preview.setRowCount(0)
        self.problems.clear()
        self._update_next()
        worker = _PlanWorker(make, self._plan_request, self)
        worker.planned.connect(self._planned)
        worker.finished.connect(worker.deleteLater)
        worker.start()

    def _planned(self, plan: vm.ImportPlan, request: int) -> None:
        if request == self._plan_request:
            self.full_plan = plan
            self.plan = plan.skipping_errors() if self.skip_bad.isChecked() else plan
            self._show_plan()
            self.plan_ready.emit()

    def _fill_mapping(self, key: str, path: Path) -> None:
        while self.mapping_grid.count():
            item = self.mapping_grid.takeAt(0)
            if item.widget():
                item.widget().deleteLater()
        self.mapping.clear()
        self.mapping_box.setVisible(key == "jsonl")
        if key != "jsonl":
            return
        self.jsonl_keys = vm.source_keys(path)
        kind = self.jsonl_kind.currentText()
        for i, (field, source_key) in enumerate(vm.default_mapping(kind,
                                                                     self.jsonl_keys).items()):
            combo = QComboBox()
            combo.addItems([NO_KEY] + self.jsonl_keys)
            combo.setCurrentText(source_key or NO_KEY)
            combo.currentTextChanged.connect(self._remap)
            self.mapping[field] = combo
            row, column = divmod(i, MAPPING_COLUMNS)
            self.mapping_grid.addWidget(QLabel(f"{field} ←"), row, 2 * column)
            self.mapping_grid.addWidget(combo, row, 2 * column + 1)

    def current_mapping(self) -> dict[str, str | None]:
        return {f: (c.currentText() if c.currentText() != NO_KEY else None)
                for f, c in self.mapping.items()}

    def set_mapping(self, field: str, key: str | None) -> None:
        """Choose the source key for a field as the user would (tests, scripts)."""
        self.mapping[field].setCurrentText(key or NO_KEY)

    def _remap(self) -> None:
        path = Path(self.source_path.text().strip()).expanduser()
        kind, mapping = self.jsonl_kind.currentText(), self.current_mapping()
        corrections = dict(self.corrections)
        self._plan(lambda: vm.plan_jsonl(path, kind, mapping, corrections), path)

    def _show_plan(self) -> None:
        plan = self.plan
        if self.source_kind.currentData() == "table":
            self._show_schema()
        shown = vm.preview_rows(plan)
        columns = ["where", "problems", "format"] + plan.columns()
        self.preview.clear()
        self.preview.setColumnCount(len(columns))
        self.preview.setHorizontalHeaderLabels(columns)
        self.preview.setRowCount(len(shown))
        for i, planned in enumerate(shown):
            fields = {f.field for f in planned.findings}
            for j, column in enumerate(columns):
                if column == "where":
                    text = planned.where
                elif column == "format":
                    text = planned.info
                elif column == "problems":
                    text = "; ".join((f"{f.field}: " if f.field else "") + f.reason
                                     for f in planned.findings)
                else:
                    value = planned.record.get(column, "")
                    text = value if isinstance(value, str) else str(value)
                item = QTableWidgetItem(text[:200])
                item.setToolTip(text[:1000])
                if planned.findings and (column in ("where", "problems") or column in fields
                                         or None in fields):
                    item.setBackground(ERROR_BG)
                self.preview.setItem(i, j, item)
        self.preview.fit_columns()
        self.problems.clear()
        findings = plan.findings
        for finding in findings[:MAX_LISTED]:
            self.problems.addItem(finding.render())
        if len(findings) > MAX_LISTED:
            self.problems.addItem(f"… and {len(findings) - MAX_LISTED} more")
        colour = "#2e7d32" if plan.ok else "#c62828"
        self.summary.setText(f"<span style='color:{colour}'>{plan.kind}: "
                             f"{plan.summary()}</span>")
        self._update_next()

    # -- name ----------------------------------------------------------------------------
    def _name_problem(self) -> str | None:
        return vm.check_name(self.datasets_dir, self.name.text().strip())

    def _check_name(self) -> None:
        problem = self._name_problem()
        self.name_error.setText(problem or "")
        self.name.setStyleSheet("border: 2px solid #c62828;" if problem else "")
        self._update_next()

    # -- import --------------------------------------------------------------------------
    def start_import(self) -> None:
        if self.worker is not None or self.plan is None:
            return
        provenance = {"description": self.provenance.text().strip() or "not stated"}
        if self.plan.skipped:
            provenance["skipped_source_records"] = list(self.plan.skipped)
        if self.corrections:
            provenance["lines_fixed_at_import"] = {str(n): t for n, t in
                                                   sorted(self.corrections.items())}
        if self.collected.text().strip():
            provenance["collection_dates"] = self.collected.text().strip()
        rights = vm.rights_statement({k: c.currentText() for k, c in self.rights.items()},
                                     self.basis.text(), self.consent.text())
        self.worker = _ImportWorker(self.plan, self.datasets_dir, self.name.text().strip(),
                                    provenance, rights, self)
        self.worker.progressed.connect(self._progressed)
        self.worker.succeeded.connect(self._succeeded)
        self.worker.failed.connect(self._failed)
        self.import_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.close_button.setEnabled(False)
        self.go(3)
        self.worker.start()

    def cancel_import(self) -> None:
        if self.worker is not None:
            self.worker.cancel.set()
            self.status.setText("cancelling…")

    def _progressed(self, done: int, total: int, what: str) -> None:
        self.progress.setMaximum(total)
        self.progress.setValue(done)
        self.status.setText(what)

    def _finished(self) -> None:
        self.worker.wait()
        self.worker = None
        self.cancel_button.setEnabled(False)
        self.close_button.setEnabled(True)
        self.go(self.pages.currentIndex())

    def _succeeded(self, path: str) -> None:
        self.result_path = Path(path)
        self._finished()
        self.status.setStyleSheet("color: #2e7d32;")
        self.status.setText(f"imported {len(self.plan.records)} records and "
                            f"{len(self.plan.copies())} files into {path}")
        self.imported.emit(path)

    def _failed(self, text: str) -> None:
        self._finished()
        self.import_button.setEnabled(True)
        self.status.setStyleSheet("color: #c62828;")
        self.status.setText(text)

    def reject(self) -> None:
        if self.worker is None:  # never close under a running copy
            super().reject()
