"""Datasets pane: dataset list; records table with inline findings, filter and record editor;
findings with jump-to-record; image grid or audio list; split/group editor; stats charts."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import (QAbstractListModel, QAbstractProxyModel, QAbstractTableModel,
                            QModelIndex, QProcess, QSize, Qt, QThread, Signal)
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QListView, QListWidget, QListWidgetItem, QMenu,
                               QPlainTextEdit, QPushButton, QSplitter, QTableView,
                               QTableWidget, QTableWidgetItem, QTabWidget, QVBoxLayout,
                               QWidget)

from engine.data import formats as F
from engine.errors import ForgebenchError

from app.viewmodels.datasets import (DatasetTable, list_datasets, records_bytes,
                                     report_from_json)
from app.viewmodels.workspace import Workspace
from app.views.card_form import CardDialog
from app.views.engine_process import run_engine
from app.views.import_wizard import SOURCES, ImportWizard
from app.views.thumbnails import ThumbnailCache

ERROR_BG = QColor("#ffcdd2")
# Records files above this size are validated by a subprocess and parsed on a worker thread.
BACKGROUND_LOAD_BYTES = 1 << 20
COLUMN_SAMPLE_ROWS = 50
MAX_COLUMN_WIDTH = 360
MAX_LISTED_FINDINGS = 2000  # beyond this the findings list says how many more there are
CELL_ROLES = (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.BackgroundRole,
              Qt.ItemDataRole.ToolTipRole)
WARNING_BG = QColor("#fff3cd")


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


class GroupsModel(QAbstractTableModel):
    """(group, split, records) rows of the split/group editor, sorted in Python in one pass."""

    HEADERS = ("group", "split", "records")

    def __init__(self, parent=None):
        super().__init__(parent)
        self.groups: list[tuple[str, str, int]] = []

    def set_groups(self, groups: list[tuple[str, str, int]]) -> None:
        self.beginResetModel()
        self.groups = list(groups)
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.groups)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 3

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return self.HEADERS[section]
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole:
            return self.groups[index.row()][index.column()]
        return None

    def sort(self, column: int, order=Qt.SortOrder.AscendingOrder) -> None:
        self.layoutAboutToBeChanged.emit()
        self.groups.sort(key=lambda g: g[column],
                         reverse=order == Qt.SortOrder.DescendingOrder)
        self.layoutChanged.emit()


class _TableLoader(QThread):
    """Builds a DatasetTable off the GUI thread from the validator's report, which a
    `forgebench data validate` subprocess computes: validating in another process keeps its
    work (and the GIL it would hold) away from the GUI thread."""

    loaded = Signal(object, int)   # DatasetTable, request number
    failed = Signal(str, int)

    def __init__(self, path: Path, request: int, parent=None):
        super().__init__(parent)
        self.path, self.request = path, request
        self.report = None
        self.process = run_engine(self, ["data", "validate", str(path), "--json"],
                                  self._validated)

    def _validated(self, out: str, err: str, _code: int) -> None:
        try:
            self.report = report_from_json(json.loads(out))
        except (json.JSONDecodeError, KeyError, TypeError):
            self.failed.emit(f"the validator failed: {err.strip()[-400:]}", self.request)
            self.deleteLater()
            return
        self.start()

    def run(self) -> None:
        # Building 50,000 rows allocates millions of objects; the collector's full passes
        # over them hold the GIL for a few hundred ms and would freeze the GUI thread.
        # No collection while building; what was built is frozen (it lives long and holds
        # no reference cycles), so later passes skip it too.
        gc.disable()
        try:
            table = DatasetTable(self.path, report=self.report)
        except (ForgebenchError, OSError, ValueError) as exc:
            self.failed.emit(str(exc), self.request)
            return
        finally:
            gc.freeze()
            gc.enable()
        self.loaded.emit(table, self.request)


class GalleryModel(QAbstractListModel):
    """Images of a dataset as a grid; thumbnails come from the worker-thread cache."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.items: list[tuple[str, str, int]] = []  # (label text, image path, row index)
        self.item_of: dict[str, int] = {}
        self.thumbs = ThumbnailCache(96, self)
        self.thumbs.ready.connect(self._ready)

    def set_table(self, table: DatasetTable | None) -> None:
        self.beginResetModel()
        self.thumbs.clear()
        self.items = table.images if table else []
        self.item_of = {path: i for i, (_, path, _) in enumerate(self.items)}
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
        if path in self.item_of:
            index = self.index(self.item_of[path])
            self.dataChanged.emit(index, index, [Qt.ItemDataRole.DecorationRole])


class DatasetsPane(QWidget):
    message = Signal(str)
    table_loaded = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.table: DatasetTable | None = None
        self.loading = False
        self._request = 0  # numbers table loads, so a stale background load is dropped

        self.dataset_list = QListWidget()
        self.dataset_list.currentRowChanged.connect(self._dataset_chosen)
        self.header = QLabel("No dataset selected")
        self.header.setWordWrap(True)
        self.validate_button = QPushButton("&Validate")
        self.validate_button.clicked.connect(self.validate)

        # Records tab
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
        records_split = QSplitter()
        table_box = QWidget()
        tv = QVBoxLayout(table_box)
        tv.setContentsMargins(0, 0, 0, 0)
        filter_row = QHBoxLayout()
        filter_row.addWidget(self.filter, 1)
        filter_row.addWidget(self.filter_count)
        tv.addLayout(filter_row)
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
        self.groups_model = GroupsModel(self)
        self.groups = QTableView()
        self.groups.setModel(self.groups_model)
        self.groups.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.groups.horizontalHeader().setStretchLastSection(True)
        self.groups.verticalHeader().hide()
        self.groups.setSortingEnabled(True)
        self.move_to = QComboBox()
        self.move_to.addItems(list(F.SPLITS))
        self.move_button = QPushButton("Move selected groups → and save as new version")
        self.move_button.clicked.connect(self.move_groups)
        splits_box = self.splits_tab = QWidget()
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
        stats_box = self.stats_tab = QWidget()
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
        self._summaries_shown = False
        self.tabs.currentChanged.connect(self._tab_changed)

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
        self.import_button = QPushButton("&Import…")
        import_menu = QMenu(self.import_button)
        for key, text in SOURCES.items():
            import_menu.addAction(text, lambda k=key: self.open_import(k))
        self.import_button.setMenu(import_menu)
        self.card_button = QPushButton("Data &card…")
        self.card_button.clicked.connect(self.open_card)
        lv.addWidget(self.import_button)
        lv.addWidget(self.card_button)
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
        """Small datasets open at once; a big records file is parsed and validated on a
        worker thread while the window stays responsive (`table_loaded` fires either way)."""
        self._request += 1
        self._opening = Path(path)
        size = records_bytes(path)
        if size > BACKGROUND_LOAD_BYTES:
            self.show_table(None)
            self.loading = True
            self.header.setText(f"<b>{path.name}</b>: loading and validating "
                                f"{size / 1e6:.1f} MB of records…")
            loader = _TableLoader(Path(path), self._request, self)
            loader.loaded.connect(self._loaded)
            loader.failed.connect(self._load_failed)
            loader.finished.connect(loader.deleteLater)
            return
        try:
            table = DatasetTable(path)
        except (ForgebenchError, OSError, ValueError) as exc:
            self._load_failed(str(exc), self._request)
            return
        self._loaded(table, self._request)

    def _loaded(self, table: DatasetTable, request: int) -> None:
        if request == self._request:  # a later choice replaced this one
            self.loading = False
            self.show_table(table)
            self.table_loaded.emit()

    def _load_failed(self, text: str, request: int) -> None:
        if request == self._request:
            self.loading = False
            self.show_table(None)
            self.header.setText(f"<b>{self._opening.name}</b>: cannot be read — {text}")
            self.table_loaded.emit()

    def validate(self) -> None:
        """Re-read and re-validate the dataset; the verdict goes to the status bar when the
        (possibly background) load is done."""
        if self.table and not self.loading:
            self.table_loaded.connect(self._announce_validation)
            self.open_dataset(self.table.root)

    def _announce_validation(self) -> None:
        self.table_loaded.disconnect(self._announce_validation)
        if self.table is not None:
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
        self.card_button.setEnabled(table is not None and table.kind is not None)
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
        for finding in report.findings[:MAX_LISTED_FINDINGS]:
            item = QListWidgetItem(finding.render())
            item.setData(Qt.ItemDataRole.UserRole, finding.where or "")
            item.setForeground(QColor("#c62828" if finding.severity == "error" else "#8d6e00"))
            self.findings.addItem(item)
        if len(report.findings) > MAX_LISTED_FINDINGS:
            self.findings.addItem(f"… and {len(report.findings) - MAX_LISTED_FINDINGS} more "
                                  "(filter the records with has:error to see them all)")
        header = self.view.horizontalHeader()
        self.proxy.sort(header.sortIndicatorSection(), header.sortIndicatorOrder())
        self._size_columns()
        # The groups and stats tabs fill when first shown: opening a table stays short.
        self._summaries_shown = False
        self._tab_changed(self.tabs.currentIndex())
        self.tabs.setTabText(1, f"Findings ({len(report.findings)})")

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

    # -- import and card -----------------------------------------------------------------
    def open_import(self, source: str = "images") -> ImportWizard | None:
        if self.workspace is None:
            return None
        wizard = ImportWizard(self.workspace.datasets_dir, source, self)
        wizard.imported.connect(self._imported)
        wizard.show()
        return wizard

    def _imported(self, path: str) -> None:
        self.message.emit(f"imported a new dataset: {Path(path).name}")
        self.reload(select=Path(path))

    def open_card(self) -> CardDialog | None:
        if self.table is None:
            return None
        dialog = CardDialog(self.table.root, self)
        dialog.saved.connect(lambda path: self.message.emit(f"wrote {path}"))
        dialog.show()
        return dialog

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
    def _tab_changed(self, index: int) -> None:
        if self.table is not None and not self._summaries_shown and \
                self.tabs.widget(index) in (self.splits_tab, self.stats_tab):
            self._summaries_shown = True
            self._fill_groups()
            self._fill_stats()

    def _fill_groups(self) -> None:
        self.groups_model.set_groups(self.table.groups())
        header = self.groups.horizontalHeader()
        self.groups_model.sort(header.sortIndicatorSection(), header.sortIndicatorOrder())

    def move_groups(self) -> None:
        rows = sorted({i.row() for i in self.groups.selectionModel().selectedRows()})
        if not rows or self.table is None:
            return
        target = self.move_to.currentText()
        moves = {self.groups_model.groups[r][0]: target for r in rows}
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
