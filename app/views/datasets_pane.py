"""Datasets pane: dataset list; records table with inline findings, filter and record editor;
findings with jump-to-record; image grid or audio list; split/group editor; stats charts."""

from __future__ import annotations

import json
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import (QAbstractListModel, QAbstractTableModel, QModelIndex, QProcess,
                            QSortFilterProxyModel, QSize, Qt, Signal)
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QListView, QListWidget, QListWidgetItem,
                               QPlainTextEdit, QPushButton, QSplitter, QTableView,
                               QTableWidget, QTableWidgetItem, QTabWidget, QVBoxLayout,
                               QWidget)

from engine.data import formats as F
from engine.errors import ForgebenchError

from app.viewmodels.datasets import DatasetTable, list_datasets
from app.viewmodels.workspace import Workspace
from app.views.engine_process import run_engine
from app.views.thumbnails import ThumbnailCache

ERROR_BG = QColor("#ffcdd2")
SORT_ROLE = Qt.ItemDataRole.UserRole + 1
WARNING_BG = QColor("#fff3cd")


class RecordsModel(QAbstractTableModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.table: DatasetTable | None = None
        self.columns: list[str] = []

    def set_table(self, table: DatasetTable | None) -> None:
        self.beginResetModel()
        self.table = table
        self.columns = ["where"] + (table.columns if table else [])
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() or not self.table else len(self.table.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return len(self.columns)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return self.columns[section]
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        row = self.table.rows[index.row()]
        column = self.columns[index.column()]
        if role == Qt.ItemDataRole.DisplayRole:
            text = row.where if column == "where" else row.value(column)
            return text if len(text) < 120 else text[:117] + "…"
        if role == SORT_ROLE:
            return int(row.where.split()[1]) if column == "where" and \
                row.where.startswith("line ") else row.value(column) if column != "where" else 0
        if role == Qt.ItemDataRole.BackgroundRole and row.findings:
            fields = {f.field for f in row.findings}
            if column == "where" or column in fields or row.record is None or None in fields:
                return ERROR_BG if row.has_error else WARNING_BG
        if role == Qt.ItemDataRole.ToolTipRole and row.findings:
            return "\n".join(f.render() for f in row.findings)
        return None


class RecordsFilter(QSortFilterProxyModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.text = ""

    def set_text(self, text: str) -> None:
        self.beginFilterChange()
        self.text = text
        self.endFilterChange(QSortFilterProxyModel.Direction.Rows)

    def filterAcceptsRow(self, source_row, source_parent) -> bool:
        table = self.sourceModel().table
        return table is None or not self.text or table.matches(table.rows[source_row], self.text)


class GalleryModel(QAbstractListModel):
    """Images of a dataset as a grid; thumbnails come from the worker-thread cache."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.items: list[tuple[str, str, int]] = []  # (label text, image path, row index)
        self.thumbs = ThumbnailCache(96, self)
        self.thumbs.ready.connect(self._ready)

    def set_table(self, table: DatasetTable | None) -> None:
        self.beginResetModel()
        self.thumbs.clear()
        self.items = []
        for i, row in enumerate(table.rows if table else []):
            record = row.record or {}
            rel = record.get("image") or record.get("file_name")
            if isinstance(rel, str):
                caption = f"{record.get('id', rel)}\n{record.get('label', '')}"
                self.items.append((caption, str(table.root / rel), i))
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return len(self.items)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        caption, path, _ = self.items[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return caption
        if role == Qt.ItemDataRole.DecorationRole:
            return self.thumbs.get(path)
        return None

    def _ready(self, path: str) -> None:
        for i, (_, p, _) in enumerate(self.items):
            if p == path:
                index = self.index(i)
                self.dataChanged.emit(index, index, [Qt.ItemDataRole.DecorationRole])


class DatasetsPane(QWidget):
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.table: DatasetTable | None = None

        self.dataset_list = QListWidget()
        self.dataset_list.currentRowChanged.connect(self._dataset_chosen)
        self.header = QLabel("No dataset selected")
        self.header.setWordWrap(True)
        self.validate_button = QPushButton("&Validate")
        self.validate_button.clicked.connect(self.validate)

        # Records tab
        self.records = RecordsModel(self)
        self.proxy = RecordsFilter(self)
        self.proxy.setSourceModel(self.records)
        self.proxy.setSortRole(SORT_ROLE)
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter: words, field=value, has:error")
        self.filter.textChanged.connect(self.proxy.set_text)
        self.view = QTableView()
        self.view.setModel(self.proxy)
        self.view.setSortingEnabled(True)
        self.view.sortByColumn(0, Qt.SortOrder.AscendingOrder)
        self.view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        self.view.horizontalHeader().setStretchLastSection(True)
        self.view.verticalHeader().hide()
        self.view.selectionModel().currentRowChanged.connect(self._record_chosen)
        self.editor = QPlainTextEdit()
        self.editor.setPlaceholderText("Select a record to edit it as JSON")
        self.editor.textChanged.connect(self._check_edit)
        self.edit_status = QLabel()
        self.edit_status.setWordWrap(True)
        self.save_record_button = QPushButton("Save record as new version")
        self.save_record_button.setEnabled(False)
        self.save_record_button.clicked.connect(self.save_record)
        editor_box = QWidget()
        ev = QVBoxLayout(editor_box)
        ev.setContentsMargins(0, 0, 0, 0)
        ev.addWidget(QLabel("Record editor"))
        ev.addWidget(self.editor, 1)
        ev.addWidget(self.edit_status)
        ev.addWidget(self.save_record_button)
        records_split = QSplitter()
        table_box = QWidget()
        tv = QVBoxLayout(table_box)
        tv.setContentsMargins(0, 0, 0, 0)
        tv.addWidget(self.filter)
        tv.addWidget(self.view)
        records_split.addWidget(table_box)
        records_split.addWidget(editor_box)
        records_split.setStretchFactor(0, 3)
        records_split.setStretchFactor(1, 1)

        # Findings tab
        self.findings = QListWidget()
        self.findings.itemActivated.connect(self._jump_to_finding)
        self.findings.itemDoubleClicked.connect(self._jump_to_finding)

        # Gallery tab
        self.gallery = GalleryModel(self)
        self.gallery_view = QListView()
        self.gallery_view.setViewMode(QListView.ViewMode.IconMode)
        self.gallery_view.setIconSize(QSize(96, 96))
        self.gallery_view.setGridSize(QSize(120, 140))
        self.gallery_view.setUniformItemSizes(True)
        self.gallery_view.setResizeMode(QListView.ResizeMode.Adjust)
        self.gallery_view.setLayoutMode(QListView.LayoutMode.Batched)
        self.gallery_view.setModel(self.gallery)
        self.gallery_view.activated.connect(self._gallery_jump)

        # Splits tab
        self.groups = QTableWidget(0, 3)
        self.groups.setHorizontalHeaderLabels(["group", "split", "records"])
        self.groups.horizontalHeader().setStretchLastSection(True)
        self.groups.setSortingEnabled(True)
        self.move_to = QComboBox()
        self.move_to.addItems(list(F.SPLITS))
        self.move_button = QPushButton("Move selected groups → and save as new version")
        self.move_button.clicked.connect(self.move_groups)
        splits_box = QWidget()
        sv = QVBoxLayout(splits_box)
        sv.addWidget(QLabel("Records of one group always share a split, so leaks between "
                            "near-duplicates cannot happen by accident."))
        sv.addWidget(self.groups, 1)
        row = QHBoxLayout()
        row.addWidget(self.move_to)
        row.addWidget(self.move_button)
        row.addStretch(1)
        sv.addLayout(row)

        # Stats tab
        self.stats_plot = pg.PlotWidget(title="Records per label and split")
        self.stats_plot.setBackground("w")
        self.stats_text = QLabel()
        stats_box = QWidget()
        stv = QVBoxLayout(stats_box)
        stv.addWidget(self.stats_plot, 1)
        stv.addWidget(self.stats_text)

        self.tabs = QTabWidget()
        self.tabs.addTab(records_split, "Records")
        self.tabs.addTab(self.findings, "Findings")
        self.tabs.addTab(self.gallery_view, "Gallery")
        self.tabs.addTab(splits_box, "Splits && groups")
        self.tabs.addTab(stats_box, "Stats")
        self.tabs.addTab(self._build_leaks(), "Leaks && duplicates")

        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(0, 0, 0, 0)
        top = QHBoxLayout()
        top.addWidget(self.header, 1)
        top.addWidget(self.validate_button)
        rv.addLayout(top)
        rv.addWidget(self.tabs, 1)
        splitter = QSplitter()
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(QLabel("Datasets"))
        lv.addWidget(self.dataset_list)
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setSizes([220, 1060])
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)

    # -- datasets ------------------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.reload()

    def reload(self, select: Path | None = None) -> None:
        current = select or (self.table.root if self.table else None)
        self.entries = list_datasets(self.workspace.dataset_dirs()) if self.workspace else []
        self.dataset_list.blockSignals(True)
        self.dataset_list.clear()
        for entry in self.entries:
            title = entry.path.name + (f" ({entry.name})" if entry.name != entry.path.name
                                       else "")
            item = QListWidgetItem(f"{title}\n{entry.kind} · {entry.version[:8]}"
                                   + (" · edited" if entry.parent else ""))
            item.setToolTip(str(entry.path))
            self.dataset_list.addItem(item)
        self.dataset_list.blockSignals(False)
        index = next((i for i, e in enumerate(self.entries) if e.path == current), 0)
        if self.entries:
            self.dataset_list.setCurrentRow(index)
            self._dataset_chosen(index)
        else:
            self.show_table(None)

    def select_dataset(self, path: Path) -> None:
        for i, entry in enumerate(self.entries):
            if entry.path == Path(path):
                self.dataset_list.setCurrentRow(i)
                return

    def _dataset_chosen(self, index: int) -> None:
        if 0 <= index < len(self.entries):
            self.open_dataset(self.entries[index].path)

    def open_dataset(self, path: Path) -> None:
        try:
            table = DatasetTable(path)
        except (ForgebenchError, OSError, ValueError) as exc:
            self.show_table(None)
            self.header.setText(f"<b>{path.name}</b>: cannot be read — {exc}")
            return
        self.show_table(table)

    def validate(self) -> None:
        if self.table:
            self.open_dataset(self.table.root)
            errors = len(self.table.report.errors)
            self.message.emit(f"{self.table.name}: {errors} error(s)" if errors
                              else f"{self.table.name} is valid")

    def show_table(self, table: DatasetTable | None) -> None:
        self.table = table
        self.records.set_table(table)
        self.gallery.set_table(table)
        self.findings.clear()
        self.editor.blockSignals(True)
        self.editor.clear()
        self.editor.blockSignals(False)
        self.edit_status.clear()
        self.save_record_button.setEnabled(False)
        if table is None:
            self.header.setText("No dataset selected")
            return
        report = table.report
        errors, warnings = len(report.errors), len(report.findings) - len(report.errors)
        state = ("<span style='color:#2e7d32'>valid</span>" if report.ok else
                 f"<span style='color:#c62828'>{errors} error(s)</span>")
        self.header.setText(
            f"<b>{table.name}</b> — {table.kind or 'unknown kind'} · version "
            f"{table.manifest.get('version', '?')} · {len(table.rows)} records · {state}"
            + (f" · {warnings} warning(s)" if warnings else ""))
        for finding in report.findings:
            item = QListWidgetItem(finding.render())
            item.setData(Qt.ItemDataRole.UserRole, finding.where or "")
            item.setForeground(QColor("#c62828" if finding.severity == "error" else "#8d6e00"))
            self.findings.addItem(item)
        self.view.resizeColumnsToContents()
        self._fill_groups()
        self._fill_stats()
        self.tabs.setTabText(1, f"Findings ({len(report.findings)})")

    # -- navigation ----------------------------------------------------------------------
    def select_row(self, index: int) -> None:
        """Select a record by its index in the table, clearing a filter that hides it."""
        source = self.records.index(index, 0)
        proxy = self.proxy.mapFromSource(source)
        if not proxy.isValid():
            self.filter.clear()
            proxy = self.proxy.mapFromSource(source)
        self.tabs.setCurrentIndex(0)
        self.view.selectRow(proxy.row())
        self.view.scrollTo(proxy)

    def current_row(self) -> int | None:
        index = self.view.selectionModel().currentIndex()
        return self.proxy.mapToSource(index).row() if index.isValid() else None

    def _jump_to_finding(self, item: QListWidgetItem) -> None:
        where = item.data(Qt.ItemDataRole.UserRole)
        for i, row in enumerate(self.table.rows):
            if where and where.startswith(row.where) and \
                    where[len(row.where):len(row.where) + 1] in ("", " "):
                self.select_row(i)
                return

    def _gallery_jump(self, index) -> None:
        self.select_row(self.gallery.items[index.row()][2])

    # -- record editor -------------------------------------------------------------------
    def _record_chosen(self, current, _previous) -> None:
        row_index = self.proxy.mapToSource(current).row() if current.isValid() else None
        self.editor.blockSignals(True)
        if row_index is None or self.table.rows[row_index].record is None:
            self.editor.setPlainText(self.table.rows[row_index].raw if row_index is not None
                                     else "")
        else:
            self.editor.setPlainText(json.dumps(self.table.rows[row_index].record, indent=2))
        self.editor.blockSignals(False)
        self._check_edit()

    def edited_record(self) -> tuple[dict | None, str | None]:
        try:
            record = json.loads(self.editor.toPlainText())
        except json.JSONDecodeError as exc:
            return None, f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        if not isinstance(record, dict):
            return None, "a record is a JSON object"
        problems = self.table.check_record(record)
        if problems:
            return record, "; ".join(f"field {n!r}: {r}" if n else r for n, r in problems)
        return record, None

    def _check_edit(self) -> None:
        row = self.current_row()
        if self.table is None or row is None or not self.table.kind:
            self.save_record_button.setEnabled(False)
            self.edit_status.clear()
            return
        record, problem = self.edited_record()
        original = self.table.rows[row].record
        changed = record is not None and record != original
        self.edit_status.setStyleSheet("color: #c62828;" if problem else "color: #2e7d32;")
        self.edit_status.setText(problem or ("valid — unsaved changes" if changed else "valid"))
        self.save_record_button.setEnabled(changed and problem is None)

    def save_record(self) -> None:
        row = self.current_row()
        record, problem = self.edited_record()
        if row is None or record is None or problem:
            return
        try:
            saved = self.table.save_record(row, record)
        except ForgebenchError as exc:
            self.edit_status.setText(exc.render())
            return
        self.message.emit(f"saved a new version: {saved.root.name}")
        self.reload(select=saved.root)

    # -- leaks and duplicates ------------------------------------------------------------
    def _build_leaks(self) -> QWidget:
        self.leak_button = QPushButton("Check leaks and duplicates")
        self.leak_button.clicked.connect(self.check_leaks)
        self.leak_status = QLabel("Runs `forgebench data leaks` on this dataset: same ids, "
                                  "same groups, identical files and near-duplicates across "
                                  "splits (leaks) and within a split (duplicates).")
        self.leak_status.setWordWrap(True)
        self.leaks = QTableWidget(0, 5)
        self.leaks.setHorizontalHeaderLabels(["severity", "kind", "record A", "record B",
                                              "evidence"])
        self.leaks.horizontalHeader().setStretchLastSection(True)
        self.leaks.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.leaks.cellDoubleClicked.connect(self._jump_to_leak)
        self.leak_process: QProcess | None = None
        box = QWidget()
        layout = QVBoxLayout(box)
        row = QHBoxLayout()
        row.addWidget(self.leak_button)
        row.addWidget(self.leak_status, 1)
        layout.addLayout(row)
        layout.addWidget(self.leaks, 1)
        layout.addWidget(QLabel("Double-click record A or record B to open it."))
        return box

    def check_leaks(self) -> None:
        """Run the engine's leak check as a subprocess (it decodes media: never on the GUI
        thread) and show its findings when it finishes."""
        if self.table is None or self.leak_process is not None:
            return
        self.leak_button.setEnabled(False)
        self.leak_status.setText("checking…")
        self.leak_process = run_engine(self, ["data", "leaks", str(self.table.root), "--json"],
                                       self._leaks_done)

    def _leaks_done(self, out: str, err: str, _code: int) -> None:
        self.leak_process = None
        self.leak_button.setEnabled(True)
        try:
            report = json.loads(out)
        except json.JSONDecodeError:
            self.leak_status.setText(f"the leak check failed:\n{err.strip()[-600:]}")
            return
        findings = report.get("findings", [])
        self.leaks.setRowCount(len(findings))
        for i, f in enumerate(findings):
            values = ["LEAK" if f.get("severity") == "error" else "duplicate", f.get("kind", ""),
                      f"{f.get('a')} ({f.get('split_a')})", f"{f.get('b')} ({f.get('split_b')})",
                      ", ".join(f"{k} {v}" for k, v in (f.get("evidence") or {}).items())]
            for j, value in enumerate(values):
                item = QTableWidgetItem(str(value))
                if j in (2, 3):
                    item.setData(Qt.ItemDataRole.UserRole, f.get("a" if j == 2 else "b"))
                if f.get("severity") == "error":
                    item.setBackground(ERROR_BG)
                self.leaks.setItem(i, j, item)
        self.leak_status.setText(f"{report.get('records')} records checked "
                                 f"({', '.join(report.get('checks', []))}): "
                                 f"{report.get('leaks')} leak(s) across splits, "
                                 f"{report.get('duplicates')} duplicate(s) within a split")

    def _jump_to_leak(self, row: int, column: int) -> None:
        item = self.leaks.item(row, column)
        record_id = item.data(Qt.ItemDataRole.UserRole) if item else None
        index = self.table.row_of(str(record_id).split(":")[-1]) if record_id else None
        if index is not None:
            self.select_row(index)

    # -- splits and stats ----------------------------------------------------------------
    def _fill_groups(self) -> None:
        self.groups.setSortingEnabled(False)
        groups = self.table.groups()
        self.groups.setRowCount(len(groups))
        for i, (group, split, count) in enumerate(groups):
            self.groups.setItem(i, 0, QTableWidgetItem(group))
            self.groups.setItem(i, 1, QTableWidgetItem(split))
            count_item = QTableWidgetItem()
            count_item.setData(Qt.ItemDataRole.DisplayRole, count)
            self.groups.setItem(i, 2, count_item)
        self.groups.setSortingEnabled(True)

    def move_groups(self) -> None:
        rows = sorted({i.row() for i in self.groups.selectedIndexes()})
        if not rows or self.table is None:
            return
        target = self.move_to.currentText()
        moves = {self.groups.item(r, 0).text(): target for r in rows}
        try:
            saved = self.table.save_group_splits(moves)
        except ForgebenchError as exc:
            self.message.emit(exc.render())
            return
        self.message.emit(f"moved {len(moves)} group(s) to {target}: {saved.root.name}")
        self.reload(select=saved.root)

    def _fill_stats(self) -> None:
        self.stats_plot.clear()
        counts = self.table.split_counts()
        labels = sorted({label for c in counts.values() for label in c})
        splits = [s for s in (*F.SPLITS, "unassigned") if s in counts]
        width = 0.8 / max(len(splits), 1)
        colours = ["#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#7f7f7f"]
        legend = self.stats_plot.addLegend()
        for j, split in enumerate(splits):
            xs = [i + j * width for i in range(len(labels))]
            heights = [counts[split].get(label, 0) for label in labels]
            bars = pg.BarGraphItem(x=xs, height=heights, width=width * 0.9,
                                   brush=colours[j % len(colours)], name=split)
            self.stats_plot.addItem(bars)
            legend.addItem(bars, split)
        axis = self.stats_plot.getAxis("bottom")
        axis.setTicks([[(i + 0.4 - width / 2, label) for i, label in enumerate(labels)]])
        totals = {s: sum(c.values()) for s, c in counts.items()}
        self.stats_text.setText("  ·  ".join(f"{s}: {n}" for s, n in totals.items()))
