"""Records tab: the records table (paged, filtered and sorted by the view-model) with findings
marked in their cells, and the record editor that saves an edit as a new dataset version."""

from __future__ import annotations

import json

from PySide6.QtCore import QAbstractProxyModel, QAbstractTableModel, QModelIndex, Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.datasets import DatasetTable
from engine.errors import ForgebenchError

ERROR_BG = QColor("#ffcdd2")
WARNING_BG = QColor("#fff3cd")
COLUMN_SAMPLE_ROWS = 50
MAX_COLUMN_WIDTH = 360
CELL_ROLES = (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.BackgroundRole,
              Qt.ItemDataRole.ToolTipRole)


class RecordsModel(QAbstractTableModel):
    """A dataset's rows, formatted only when a view asks for a cell. Rows are handed to views
    a page at a time (`canFetchMore`/`fetchMore`), so opening 50,000 records costs one page."""

    PAGE = 2000

    def __init__(self, parent=None):
        super().__init__(parent)
        self.table: DatasetTable | None = None
        self.columns: list[str] = []
        self.loaded = 0

    def set_table(self, table: DatasetTable | None) -> None:
        self.beginResetModel()
        self.table = table
        self.columns = ["where"] + (table.columns if table else [])
        self.loaded = min(self.PAGE, len(table.rows)) if table else 0
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else self.loaded

    def columnCount(self, parent=QModelIndex()) -> int:
        return len(self.columns)

    def canFetchMore(self, parent=QModelIndex()) -> bool:
        return not parent.isValid() and self.table is not None and \
            self.loaded < len(self.table.rows)

    def fetchMore(self, parent=QModelIndex(), count: int | None = None) -> None:
        if not self.canFetchMore(parent):
            return
        new = min(len(self.table.rows), self.loaded + (count or self.PAGE))
        self.beginInsertRows(QModelIndex(), self.loaded, new - 1)
        self.loaded = new
        self.endInsertRows()

    def fetch_all(self) -> None:
        """Every row (a filter or a sort must see them all)."""
        if self.table is not None:
            self.fetchMore(count=len(self.table.rows))

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return self.columns[section]
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        return self.cell(index.row(), index.column(), role)

    def cell(self, row_index: int, column_index: int, role):
        if role not in CELL_ROLES:
            return None
        row = self.table.rows[row_index]
        column = self.columns[column_index]
        if role == Qt.ItemDataRole.DisplayRole:
            text = row.where if column == "where" else row.value(column)
            return text if len(text) < 120 else text[:117] + "…"
        if role == Qt.ItemDataRole.BackgroundRole and row.findings:
            fields = {f.field for f in row.findings}
            if column == "where" or column in fields or row.record is None or None in fields:
                return ERROR_BG if row.has_error else WARNING_BG
        if role == Qt.ItemDataRole.ToolTipRole and row.findings:
            return "\n".join(f.render() for f in row.findings)
        return None


class RecordsProxy(QAbstractProxyModel):
    """Filter and sort over RecordsModel. The view-model computes the visible rows in one pass
    over precomputed strings (`DatasetTable.filter_rows` / `sort_order`); Qt's
    QSortFilterProxyModel would instead call back into Python once per row or comparison,
    which blocks the GUI for seconds at 50,000 records."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.text = ""
        self.order: list[int] | None = None  # None: file order
        self.rows: list[int] = []            # visible source rows, in display order
        self.position: list[int] = []        # source row -> proxy row, or -1

    def setSourceModel(self, model: RecordsModel) -> None:
        super().setSourceModel(model)
        model.modelReset.connect(self._source_reset)
        model.rowsInserted.connect(self._source_rows_added)

    def _source_reset(self) -> None:
        self.beginResetModel()
        self.order = None
        self._compute()
        self.endResetModel()

    def _identity(self) -> bool:
        return self.order is None and not self.text.strip()

    def _compute(self) -> None:
        model = self.sourceModel()
        table = model.table
        if table is None:
            self.rows = []
        elif self._identity():
            self.rows = list(range(model.loaded))
        else:
            model.fetch_all()
            self.rows = table.filter_rows(self.text, self.order)
        self.position = [-1] * (model.loaded)
        for proxy_row, source_row in enumerate(self.rows):
            self.position[source_row] = proxy_row

    def _source_rows_added(self, _parent, first: int, last: int) -> None:
        if not self._identity():
            return  # _compute fetched every row itself and places them
        self.beginInsertRows(QModelIndex(), len(self.rows), len(self.rows) + last - first)
        self.rows += range(first, last + 1)
        self.position += range(first, last + 1)
        self.endInsertRows()

    def set_text(self, text: str) -> None:
        self.beginResetModel()
        self.text = text
        self._compute()
        self.endResetModel()

    def sort(self, column: int, order=Qt.SortOrder.AscendingOrder) -> None:
        model = self.sourceModel()
        if model.table is None or not 0 <= column < len(model.columns):
            return
        descending = order == Qt.SortOrder.DescendingOrder
        file_order = column == 0 and not descending
        if not file_order:
            model.fetch_all()  # inserted before the layout change, not during it
        self.layoutAboutToBeChanged.emit()
        persistent = self.persistentIndexList()
        sources = [self.mapToSource(i) for i in persistent]
        self.order = None if file_order else \
            model.table.sort_order(model.columns[column], descending)
        self._compute()
        self.changePersistentIndexList(persistent, [self.mapFromSource(s) for s in sources])
        self.layoutChanged.emit()

    # -- QAbstractProxyModel --------------------------------------------------------------
    def mapToSource(self, index):
        if not index.isValid() or index.row() >= len(self.rows):
            return QModelIndex()
        return self.sourceModel().index(self.rows[index.row()], index.column())

    def mapFromSource(self, index):
        if not index.isValid() or index.row() >= len(self.position) or \
                self.position[index.row()] < 0:
            return QModelIndex()
        return self.index(self.position[index.row()], index.column())

    def index(self, row, column, parent=QModelIndex()):
        if parent.isValid() or not (0 <= row < len(self.rows)) or \
                not 0 <= column < self.columnCount():
            return QModelIndex()
        return self.createIndex(row, column)

    def parent(self, _index=QModelIndex()):
        return QModelIndex()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() or self.sourceModel() is None else \
            self.sourceModel().columnCount()

    def hasChildren(self, parent=QModelIndex()) -> bool:
        return not parent.isValid() and bool(self.rows)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        return self.sourceModel().headerData(section, orientation, role)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        # One Python call per painted cell and role instead of three (map, index, data).
        return self.sourceModel().cell(self.rows[index.row()], index.column(), role)

    def canFetchMore(self, parent=QModelIndex()) -> bool:
        return self._identity() and self.sourceModel().canFetchMore(QModelIndex())

    def fetchMore(self, parent=QModelIndex()) -> None:
        self.sourceModel().fetchMore(QModelIndex())


class RecordsTab(QSplitter):
    """The table with its filter on the left, the JSON record editor on the right."""

    message = Signal(str)
    saved = Signal(object)          # the new dataset version's root (Path)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.table: DatasetTable | None = None
        self.records = RecordsModel(self)
        self.proxy = RecordsProxy(self)
        self.proxy.setSourceModel(self.records)
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter: words, field=value, has:error")
        self.filter.textChanged.connect(self.proxy.set_text)
        self.filter_count = QLabel()
        self.proxy.modelReset.connect(self._count_shown)
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
        table_box = QWidget()
        tv = QVBoxLayout(table_box)
        tv.setContentsMargins(0, 0, 0, 0)
        filter_row = QHBoxLayout()
        filter_row.addWidget(self.filter, 1)
        filter_row.addWidget(self.filter_count)
        tv.addLayout(filter_row)
        tv.addWidget(self.view)
        self.addWidget(table_box)
        self.addWidget(editor_box)
        self.setStretchFactor(0, 3)
        self.setStretchFactor(1, 1)

    def set_table(self, table: DatasetTable | None) -> None:
        self.table = table
        self.records.set_table(table)
        self.editor.blockSignals(True)
        self.editor.clear()
        self.editor.blockSignals(False)
        self.edit_status.clear()
        self.save_record_button.setEnabled(False)
        if table is not None:
            header = self.view.horizontalHeader()
            self.proxy.sort(header.sortIndicatorSection(), header.sortIndicatorOrder())
            self._size_columns()

    def _size_columns(self) -> None:
        """Column widths from the first rows' texts (Qt's resizeColumnsToContents asks the
        model for hundreds of cells, too slow for the GUI thread on big tables)."""
        metrics = self.view.fontMetrics()
        sample = self.table.rows[:COLUMN_SAMPLE_ROWS]
        for column, name in enumerate(self.records.columns):
            texts = [name] + [row.where if name == "where" else row.value(name)[:60]
                              for row in sample]
            width = metrics.horizontalAdvance(max(texts, key=len)) + 24
            self.view.setColumnWidth(column, min(width, MAX_COLUMN_WIDTH))

    def _count_shown(self) -> None:
        total = len(self.table.rows) if self.table else 0
        self.filter_count.setText(f"{self.proxy.rowCount()} of {total} match"
                                  if self.proxy.text.strip() else f"{total} records")

    # -- navigation ----------------------------------------------------------------------
    def select_row(self, index: int) -> None:
        """Select a record by its index in the table, clearing a filter that hides it."""
        if index >= self.records.loaded:
            self.records.fetchMore(count=index + 1 - self.records.loaded)
        source = self.records.index(index, 0)
        proxy = self.proxy.mapFromSource(source)
        if not proxy.isValid():
            self.filter.clear()
            proxy = self.proxy.mapFromSource(source)
        self.view.selectRow(proxy.row())
        self.view.scrollTo(proxy)

    def current_row(self) -> int | None:
        index = self.view.selectionModel().currentIndex()
        return self.proxy.mapToSource(index).row() if index.isValid() else None

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
        self.saved.emit(saved.root)
