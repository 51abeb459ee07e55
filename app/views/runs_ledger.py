"""The Runs pane's ledger: the table of runs (its state is app/viewmodels/runs.py's `Ledger`,
which reads the run folders and announces what changed), the header's column menu, the
selected runs' hidden fields listed under the table ("facts"), and keeping a run just started
in sight while the table is laid out again."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import (
    QAbstractTableModel,
    QEvent,
    QItemSelectionModel,
    QModelIndex,
    QObject,
    Qt,
    QTimer,
    Signal,
)
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QLabel,
    QMenu,
    QTableView,
)

from app.viewmodels.runs import Ledger, LedgerRow, example_text, write_notes
from app.views import theme

COLUMNS = [("name", "Run"), ("state", "Status"), ("progress", "Step"), ("stage_line", "Doing"),
           ("started", "Started"), ("duration", "Duration"), ("question", "Question"),
           ("data_version", "Data"), ("device", "Device"), ("best_metric", "Best metric"),
           ("selected_checkpoint", "Checkpoint"), ("export", "Export"), ("notes", "Notes")]
# The ledger shows these columns so it fits beside the charts in a 1024x700 window without a
# sideways scroll; the selected run's other fields are listed under it, and the header's
# context menu shows any column in the table (Question and Notes are edited there).
SHOWN_COLUMNS = ("name", "state", "progress")
COLUMN_WIDTHS = {"stage_line": 170, "started": 120, "duration": 70}
EDITABLE = ("question", "notes")
# a state's colour in the ledger (app/views/theme.py: a light and a dark variant each)
STATE_COLOURS = {"running": "running", "completed": "completed", "failed": "failed",
                 "stopped": "stopped", "stopping": "stopping", "queued": "queued",
                 "starting": "queued", "waiting": "queued"}


class LedgerModel(QAbstractTableModel):
    """The Qt face of a `Ledger`: its announcements become the model's reset and dataChanged
    signals; the cells are the rows' texts."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.state = Ledger()
        self.state.resetting.connect(self.beginResetModel)
        self.state.reset.connect(self.endResetModel)
        self.state.row_changed.connect(
            lambda i: self.dataChanged.emit(self.index(i, 0), self.index(i, len(COLUMNS) - 1)))

    @property
    def rows(self) -> list[LedgerRow]:
        return self.state.rows

    @property
    def extra(self) -> list[tuple[str, str]]:
        return self.state.extra

    @property
    def own_pids(self) -> set[int]:
        return self.state.own_pids

    def paths(self) -> list[Path]:
        return self.state.paths()

    def row(self, path: Path) -> LedgerRow | None:
        return self.state.row(path)

    def refresh(self, paths: list[Path], extra: list[tuple[str, str]],
                hold_order: bool = False) -> None:
        self.state.refresh(paths, extra, hold_order)

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows) + len(self.extra)

    def columnCount(self, parent=QModelIndex()) -> int:
        return len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section][1]
        return None

    def _value(self, row: LedgerRow, key: str) -> str:
        if key == "progress":
            step = "—" if row.step is None else str(row.step)
            return f"{step} / {row.target_steps}" if row.target_steps else step
        if key == "state" and row.stage and row.state == "failed":
            return f"failed ({row.stage})"
        if key == "state" and row.elsewhere(self.own_pids):
            return f"{row.state} elsewhere" if row.active else f"{row.holder.get('purpose')} " \
                "elsewhere"
        if key == "started":
            return row.started_text()
        if key == "duration":
            return row.duration_text()
        if key == "stage_line":
            return row.stage_line if row.active else ""
        if key == "name" and row.example is not None:
            return f"{row.name} (example)"
        return str(getattr(row, key))

    def _tooltip(self, row: LedgerRow, key: str) -> str:
        if key == "name":
            about = f"\n{example_text(row.example)}" if row.example is not None else ""
            return f"{row.name}\n{row.path}{about}"
        if key == "state" and row.holder is not None:
            return row.holder_text()
        return row.error or self._value(row, key)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        key = COLUMNS[index.column()][0]
        if index.row() >= len(self.rows):
            name, state = self.extra[index.row() - len(self.rows)]
            if role == Qt.ItemDataRole.DisplayRole:
                return {"name": name, "state": state}.get(key, "")
            return None
        row = self.rows[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            return self._value(row, key)
        if role == Qt.ItemDataRole.ForegroundRole and key == "state":
            return QColor(theme.colour(STATE_COLOURS.get(row.state, "text")))
        if role == Qt.ItemDataRole.ForegroundRole and key == "export" and row.export_colour:
            return QColor(row.export_colour)      # the verdict's colour (engine.export.verdict)
        if role == Qt.ItemDataRole.ToolTipRole:
            return self._tooltip(row, key)
        return None

    def flags(self, index):
        base = super().flags(index)
        if index.row() < len(self.rows) and COLUMNS[index.column()][0] in EDITABLE:
            return base | Qt.ItemFlag.ItemIsEditable
        return base

    def setData(self, index, value, role=Qt.ItemDataRole.EditRole):
        row = self.rows[index.row()]
        key = COLUMNS[index.column()][0]
        write_notes(row.path, **{key: str(value)})
        self.state.forget(row.path)
        self.refresh(self.paths(), self.extra)
        return True


def _ledger_table(model: LedgerModel) -> QTableView:
    table = QTableView()
    table.setModel(model)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
    table.setAlternatingRowColors(True)
    # by pixel: a row scrolled to is whole (by item, the last one could stay cut off)
    table.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
    table.verticalHeader().hide()
    table.setWordWrap(False)       # a cell elides (its tooltip holds it), never wraps
    table.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # run names differ at the end
    header = table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
    for column, (key, _) in enumerate(COLUMNS):
        if key == "name":       # the run name takes the width the others leave
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.Stretch)
        elif key in SHOWN_COLUMNS:
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        table.setColumnWidth(column, COLUMN_WIDTHS.get(key, 110))
        table.setColumnHidden(column, key not in SHOWN_COLUMNS)
    header.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
    header.setToolTip("Right-click to choose the columns; the selected run's other fields "
                      "are listed under the ledger")
    return table


class LedgerView(QObject):
    """The ledger table and the facts label under it (the pane lays the two out, with its
    buttons between the facts and the details). `refresh` re-reads the runs keeping the
    selection (and the rows in place while the pointer is over them); `follow` is a run just
    started: it is selected and kept in sight once it appears."""

    selection_changed = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.model = LedgerModel(self)
        self.table = _ledger_table(self.model)
        self.table.horizontalHeader().customContextMenuRequested.connect(self._column_menu)
        self.table.selectionModel().selectionChanged.connect(self._selection_changed)
        self._in_sight: Path | None = None      # a run just started, kept in view
        self.follow: Path | None = None     # a run just started: select it when it appears
        self.table.viewport().installEventFilter(self)
        self.table.verticalScrollBar().actionTriggered.connect(    # the user scrolls: theirs
            lambda _: setattr(self, "_in_sight", None))
        self.facts = QLabel()       # the selected run's fields the table does not show
        self.facts.setWordWrap(True)
        self.facts.setMinimumWidth(1)
        self.facts.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        theme.style(self.facts, "QLabel {{ color: {facts}; }}")

    # -- selection -----------------------------------------------------------------------
    def selected_paths(self) -> list[Path]:
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        return [self.model.rows[r].path for r in rows if r < len(self.model.rows)]

    def select_run(self, path: Path, add: bool = False) -> None:
        """Select a run's row (add: keep the other selected runs, to overlay them)."""
        for i, row in enumerate(self.model.rows):
            if row.path == Path(path):
                flags = QItemSelectionModel.SelectionFlag.Rows | (
                    QItemSelectionModel.SelectionFlag.Select if add
                    else QItemSelectionModel.SelectionFlag.ClearAndSelect)
                self.table.selectionModel().select(self.model.index(i, 0), flags)
                return

    def _selection_changed(self) -> None:
        self.show_facts()
        self.selection_changed.emit()

    # -- columns and facts ---------------------------------------------------------------
    def _column_menu(self, position) -> None:
        menu = QMenu(self.table)
        for column, (key, title) in enumerate(COLUMNS):
            if key == "name":
                continue
            action = menu.addAction(title)
            action.setCheckable(True)
            action.setChecked(not self.table.isColumnHidden(column))
            action.toggled.connect(lambda shown, c=column: self.show_column(c, shown))
        menu.exec(self.table.horizontalHeader().mapToGlobal(position))

    def show_column(self, column: int, shown: bool) -> None:
        self.table.setColumnHidden(column, not shown)
        self.show_facts()

    def show_facts(self) -> None:
        """The selected runs' fields whose columns are hidden, as "Field value" pairs."""
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        hidden = [c for c in range(len(COLUMNS)) if self.table.isColumnHidden(c)]
        lines = []
        for row in rows:
            pairs = [(COLUMNS[c][1], self.model.data(self.model.index(row, c)))
                     for c in hidden]
            facts = " · ".join(f"<b>{html.escape(title)}</b> {html.escape(str(value))}"
                               for title, value in pairs if value not in (None, "", "—"))
            name = self.model.data(self.model.index(row, 0))
            lines.append(f"{html.escape(str(name))}: {facts}" if len(rows) > 1 else facts)
        self.facts.setText("<br>".join(line for line in lines if line))
        self.facts.setVisible(bool(self.facts.text()))

    # -- reading the runs ----------------------------------------------------------------
    def pointer_over_ledger(self) -> bool:
        return self.table.viewport().underMouse()

    def refresh(self, paths: list[Path], extra: list[tuple[str, str]]) -> None:
        """Read the runs again, keeping the selection; the run followed is selected (and kept
        in sight, until the user scrolls or chooses) once it appears."""
        selected = self.selected_paths()
        hold = self.pointer_over_ledger()
        offset = self.table.verticalScrollBar().value()
        self.model.refresh(paths, extra, hold_order=hold)
        if hold:    # the rows kept their places: a reset must not scroll them away
            self.table.doItemsLayout()
            self.table.verticalScrollBar().setValue(offset)
        followed = None
        if self.follow is not None and self.follow in self.model.paths():
            selected, self.follow = [self.follow], None     # show the new run's charts
            followed = selected[0]
            self.table.clearSelection()
        if self.selected_paths() != selected:
            for path in selected:
                self.select_run(path, add=True)
        if followed is not None:        # the run just started is selected and in sight
            self._in_sight = followed
        self.show_facts()      # a live run's stage, duration and best metric move on
        if self._in_sight is not None:
            QTimer.singleShot(0, self._scroll_to)

    def _scroll_to(self) -> None:
        """Bring the run just started into view, and keep it there while the ledger is laid
        out again (the facts under it take height from the table) until another is chosen."""
        if self._in_sight in self.model.paths() and \
                self.selected_paths() == [self._in_sight]:
            self.table.doItemsLayout()      # the rows a reset added count in the scroll range
            self.table.scrollTo(self.model.index(self.model.paths().index(self._in_sight), 0))
        else:
            self._in_sight = None

    def eventFilter(self, watched, event) -> bool:      # noqa: N802 (Qt's name)
        if watched is self.table.viewport() and event.type() == QEvent.Type.Resize and \
                self._in_sight is not None:
            QTimer.singleShot(0, self._scroll_to)
        return super().eventFilter(watched, event)
