"""Splits and groups tab: every group with its split and size; moving groups to another split
saves a new dataset version, and "Auto-split" gives every unassigned group a split through the
engine (`forgebench data split`: group-aware, seed-deterministic, a new version; the folder on
screen is never changed)."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.datasets import SPLITS, DatasetTable
from app.viewmodels.jobs import forgebench_argv
from app.views.job_runner import JobRunner
from engine.errors import ForgebenchError


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


class SplitsTab(QWidget):
    message = Signal(str)
    saved = Signal(object)          # the new dataset version's root (Path)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.table: DatasetTable | None = None
        self.groups_model = GroupsModel(self)
        self.groups = QTableView()
        self.groups.setModel(self.groups_model)
        self.groups.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.groups.horizontalHeader().setStretchLastSection(True)
        self.groups.verticalHeader().hide()
        self.groups.setSortingEnabled(True)
        self.move_to = QComboBox()
        self.move_to.addItems(list(SPLITS))
        self.move_button = QPushButton("Move selected groups → and save as new version")
        self.move_button.clicked.connect(self.move_groups)
        note = QLabel("Records of one group always share a split, so leaks between "
                      "near-duplicates cannot happen by accident.")
        note.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(note)
        layout.addWidget(self.groups, 1)
        row = QHBoxLayout()
        row.addWidget(self.move_to)
        row.addWidget(self.move_button)
        row.addStretch(1)
        layout.addLayout(row)
        self.auto_button = QPushButton("Auto-split unassigned groups (train 80 / val 10 / "
                                       "test 10, new version)")
        self.auto_button.setToolTip("forgebench data split: each group placed by a hash of "
                                    "the seed and its name; assigned groups never move")
        self.auto_button.clicked.connect(self.auto_split)
        self.auto_job = JobRunner("split")
        self.auto_job.finished.connect(self._auto_split_done)
        layout.addWidget(self.auto_button)
        layout.addWidget(self.auto_job)
        self.auto_button.setEnabled(False)

    def set_table(self, table: DatasetTable | None) -> None:
        """Counted lazily: `fill` runs when the tab is first shown for this table."""
        self.table = table
        self.groups_model.set_groups([])
        unassigned = table.unassigned_groups if table else 0
        self.auto_button.setEnabled(bool(unassigned) and not self.auto_job.running)
        self.auto_button.setText(f"Auto-split {unassigned} unassigned group(s) (train 80 / val "
                                 "10 / test 10, new version)" if unassigned else
                                 "Auto-split: every group has a split")

    def auto_split(self) -> None:
        if self.table is None or self.auto_job.running:
            return
        self.auto_button.setEnabled(False)
        self.auto_job.start(forgebench_argv() + ["data", "split", str(self.table.root),
                                                 "--json"], f"splitting {self.table.name}")

    def _auto_split_done(self, ok: bool, message: str) -> None:
        if not ok:
            self.message.emit(message)
            self.set_table(self.table)
            return
        output = self.auto_job.output
        result = json.loads(output[output.index("{"):output.rindex("}") + 1])
        counts = ", ".join(f"{k} {v}" for k, v in result["counts"].items() if v)
        self.message.emit(f"assigned {result['assigned']} group(s) to splits: "
                          f"{Path(result['path']).name} ({counts})")
        self.saved.emit(Path(result["path"]))

    def fill(self) -> None:
        self.groups_model.set_groups(self.table.groups() if self.table else [])
        header = self.groups.horizontalHeader()
        self.groups_model.sort(header.sortIndicatorSection(), header.sortIndicatorOrder())
        self.groups.resizeColumnToContents(0)     # whole group names (Qt samples 1,000 rows)

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
        self.saved.emit(saved.root)
