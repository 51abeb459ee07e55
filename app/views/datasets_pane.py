"""Datasets pane: the dataset list with import and data card, a header with the validator's
verdict, and one tab widget per view of the open dataset (`app/views/dataset_tabs/`): records
with the editor, findings, gallery, splits and groups, stats, leaks and duplicates.

The pane owns loading, and none of it runs on the GUI thread: a dataset's table is built (and
validated by the engine) on a worker thread; a big records file is validated by a
`forgebench data validate` subprocess first, so its work and the GIL it would hold stay in
another process. `loading` is true, and the header says so, until `table_loaded` fires."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QThread, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.datasets import DatasetTable, list_datasets, records_bytes, report_from_json
from app.viewmodels.workspace import Workspace
from app.views import layouts
from app.views.background import BackgroundCall
from app.views.dataset_tabs.findings import FindingsTab
from app.views.dataset_tabs.gallery import GalleryTab
from app.views.dataset_tabs.leaks import LeaksTab
from app.views.dataset_tabs.records import RecordsTab
from app.views.dataset_tabs.splits import SplitsTab
from app.views.dataset_tabs.stats import StatsTab
from app.views.engine_process import run_engine
from app.views.help_link import help_link
from app.views.import_wizard import SOURCES, ImportWizard
from app.views.labels import wrap_items
from engine.errors import ForgebenchError

if TYPE_CHECKING:
    from app.views.card_form import CardDialog

# Records files above this size are validated by a subprocess before the worker thread parses
# them (a thread validating them would hold the GIL for seconds).
BACKGROUND_LOAD_BYTES = 1 << 20


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
        # No collection while building (the window runs with automatic collection off anyway:
        # app/main.py; it is never switched back on from here); what was built is frozen (it
        # lives long and holds no reference cycles), so later passes skip it too.
        automatic = gc.isenabled()
        gc.disable()
        try:
            table = DatasetTable(self.path, report=self.report)
        except (ForgebenchError, OSError, ValueError) as exc:
            self.failed.emit(str(exc), self.request)
            return
        finally:
            gc.freeze()
            if automatic:
                gc.enable()
        self.loaded.emit(table, self.request)


class DatasetsPane(QWidget):
    message = Signal(str)
    table_loaded = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.table: DatasetTable | None = None
        self.entries = []
        self.loading = False
        self._request = 0  # numbers table loads, so a stale background load is dropped
        self._opening: Path | None = None   # the dataset being loaded (kept while loading)
        self.loader = BackgroundCall(self)   # small datasets: table and validation
        self.loader.done.connect(lambda table: self._loaded(table, self._request))
        self.loader.failed.connect(lambda exc: self._load_failed(str(exc), self._request))

        splitter = QSplitter()
        splitter.addWidget(self._dataset_column())
        splitter.addWidget(self._dataset_view())
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([180, 700])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(splitter)

    def _dataset_column(self) -> QWidget:
        """The workspace's datasets, Import and the data card."""
        self.dataset_list = wrap_items(QListWidget())     # "name (dataset name)" read whole
        self.dataset_list.currentRowChanged.connect(self._dataset_chosen)
        self.import_button = QPushButton("&Import…")
        import_menu = QMenu(self.import_button)
        for key, text in SOURCES.items():
            import_menu.addAction(text, lambda k=key: self.open_import(k))
        self.import_button.setMenu(import_menu)
        self.card_button = QPushButton("Data &card…")
        self.card_button.clicked.connect(self.open_card)
        return layouts.column(QLabel("Datasets"), self.dataset_list, self.import_button,
                      self.card_button)

    def _dataset_view(self) -> QWidget:
        """The chosen dataset: its header, Validate, and one tab per view of it."""
        self.header = QLabel("No dataset selected")
        self.header.setWordWrap(True)
        self.header.setMinimumWidth(1)          # wraps; never widens the window
        self.validate_button = QPushButton("&Validate")
        self.validate_button.clicked.connect(self.validate)
        right = QWidget()
        layout = QVBoxLayout(right)
        layout.setContentsMargins(0, 0, 0, 0)
        top = QHBoxLayout()
        top.addWidget(self.header, 1)
        top.addWidget(help_link("findings"))
        top.addWidget(self.validate_button)
        layout.addLayout(top)
        layout.addWidget(self._tabs(), 1)
        return right

    def _tabs(self) -> QTabWidget:
        self.records_tab = RecordsTab()
        self.findings_tab = FindingsTab()
        self.gallery_tab = GalleryTab()
        self.splits_tab = SplitsTab()
        self.stats_tab = StatsTab()
        self.leaks_tab = LeaksTab()
        self.tabs = QTabWidget()
        for widget, title in ((self.records_tab, "Records"), (self.findings_tab, "Findings"),
                              (self.gallery_tab, "Gallery"),
                              (self.splits_tab, "Splits && groups"), (self.stats_tab, "Stats"),
                              (self.leaks_tab, "Leaks && duplicates")):
            self.tabs.addTab(widget, title)
        for tab in (self.findings_tab, self.gallery_tab, self.leaks_tab):
            tab.jump.connect(self.select_row)
        for tab in (self.records_tab, self.splits_tab):
            tab.message.connect(self.message)
            tab.saved.connect(lambda root: self.reload(select=root))
        self._summaries_shown = False
        self.tabs.currentChanged.connect(self._tab_changed)
        return self.tabs

    # -- datasets ------------------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.reload()

    def _fill_list(self) -> None:
        self.entries = list_datasets(self.workspace.dataset_dirs()) if self.workspace else []
        self.dataset_list.blockSignals(True)
        self.dataset_list.clear()
        for entry in self.entries:
            title = entry.path.name + (f" ({entry.name})" if entry.name != entry.path.name
                                       else "")
            text = (f"{title}\n{entry.kind} · {entry.version[:8]}"
                    + (" · edited" if entry.parent else ""))
            item = QListWidgetItem(text)
            item.setToolTip(f"{text}\n{entry.path}")
            self.dataset_list.addItem(item)
        self.dataset_list.blockSignals(False)

    def reload(self, select: Path | None = None) -> None:
        current = select or (self.table.root if self.table else None)
        self._fill_list()
        index = next((i for i, e in enumerate(self.entries) if e.path == current), 0)
        if self.entries:
            if self.dataset_list.currentRow() == index:     # no change signal: open it here
                self._dataset_chosen(index)
            else:
                self.dataset_list.setCurrentRow(index)
        else:
            self.show_table(None)

    def refresh_list(self) -> None:
        """Datasets that appeared or went (an import, another window, a generator): the list
        follows, and the open dataset stays open without being read again."""
        current = self._opening if self.loading else self.table.root if self.table else None
        self._fill_list()
        index = next((i for i, e in enumerate(self.entries) if e.path == current), None)
        if index is None:
            self.reload()
            return
        self.dataset_list.blockSignals(True)
        self.dataset_list.setCurrentRow(index)
        self.dataset_list.blockSignals(False)

    def select_dataset(self, path: Path) -> None:
        for i, entry in enumerate(self.entries):
            if entry.path == Path(path):
                self.dataset_list.setCurrentRow(i)
                return

    def _dataset_chosen(self, index: int) -> None:
        if 0 <= index < len(self.entries):
            self.open_dataset(self.entries[index].path)

    def open_dataset(self, path: Path) -> None:
        """Parse and validate a dataset on a worker thread (a big records file is validated
        by a subprocess first) while the window stays responsive; `table_loaded` fires when
        it is on screen, or when it failed to load."""
        self._request += 1
        self._opening = Path(path)
        self.loader.cancel()
        self.show_table(None)
        self.loading = True
        size = records_bytes(path)
        if size > BACKGROUND_LOAD_BYTES:
            self.header.setText(f"<b>{path.name}</b>: loading and validating "
                                f"{size / 1e6:.1f} MB of records…")
            loader = _TableLoader(Path(path), self._request, self)
            loader.loaded.connect(self._loaded)
            loader.failed.connect(self._load_failed)
            loader.finished.connect(loader.deleteLater)
            return
        self.header.setText(f"<b>{path.name}</b>: loading and validating…")
        self.loader.start(lambda: DatasetTable(path))

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
        for tab in (self.records_tab, self.findings_tab, self.gallery_tab, self.splits_tab,
                    self.stats_tab, self.leaks_tab):
            tab.set_table(table)
        self.card_button.setEnabled(table is not None and table.kind is not None)
        findings = len(table.report.findings) if table else 0
        self.tabs.setTabText(1, f"Findings ({findings})")
        if table is None:
            self.header.setText("No dataset selected")
            return
        report = table.report
        errors, warnings = len(report.errors), len(report.findings) - len(report.errors)
        state = ("<span style='color:#2e7d32'>valid</span>" if report.ok else
                 f"<span style='color:#c62828'>{errors} error(s)</span>")
        self.header.setText(
            f"<b>{table.name}</b> — {table.kind or 'unknown kind'} · version "
            f"{table.version} · {len(table.rows)} records · {state}"
            + (f" · {warnings} warning(s)" if warnings else ""))
        # The groups and stats tabs fill when first shown: opening a table stays short.
        self._summaries_shown = False
        self._tab_changed(self.tabs.currentIndex())

    def _tab_changed(self, index: int) -> None:
        if self.table is not None and not self._summaries_shown and \
                self.tabs.widget(index) in (self.splits_tab, self.stats_tab):
            self._summaries_shown = True
            self.splits_tab.fill()
            self.stats_tab.fill()

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
        # Imported here: the card's schema (pydantic, numpy statistics) is not needed to
        # paint the first pane of the window.
        from app.views.card_form import CardDialog

        if self.table is None:
            return None
        dialog = CardDialog(self.table.root, self)
        dialog.saved.connect(lambda path: self.message.emit(f"wrote {path}"))
        dialog.show()
        return dialog

    # -- navigation ----------------------------------------------------------------------
    def select_row(self, index: int) -> None:
        """Open a record (by its index in the table) in the records tab."""
        self.tabs.setCurrentWidget(self.records_tab)
        self.records_tab.select_row(index)
