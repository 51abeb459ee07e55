"""Leaks and duplicates tab: runs `forgebench data leaks` on the open dataset as a subprocess
(it decodes media: never on the GUI thread) and lists its findings; double-clicking record A
or B opens it. Choosing another dataset clears the report, so a report always belongs to the
dataset on screen."""

from __future__ import annotations

import json

from PySide6.QtCore import QProcess, Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.datasets import DatasetTable, leak_rows
from app.views.engine_process import run_engine

LEAK_BG = QColor("#ffcdd2")
EXPLANATION = ("Runs the engine's leak check on this dataset: same ids, same groups, "
               "identical files and near-duplicates across splits (leaks) and within a split "
               "(duplicates).")


class LeaksTab(QWidget):
    jump = Signal(int)          # the record's index in the table

    def __init__(self, parent=None):
        super().__init__(parent)
        self.table: DatasetTable | None = None
        self.process: QProcess | None = None
        self._request = 0       # a report that arrives for a dataset no longer shown is dropped
        self.button = QPushButton("Check leaks and duplicates")
        self.button.clicked.connect(self.check)
        self.status = QLabel(EXPLANATION)
        self.status.setWordWrap(True)
        self.leaks = QTableWidget(0, 5)
        self.leaks.setHorizontalHeaderLabels(["severity", "kind", "record A", "record B",
                                              "evidence"])
        self.leaks.horizontalHeader().setStretchLastSection(True)
        self.leaks.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.leaks.cellDoubleClicked.connect(self._jump_to_leak)
        layout = QVBoxLayout(self)
        row = QHBoxLayout()
        row.addWidget(self.button)
        row.addWidget(self.status, 1)
        layout.addLayout(row)
        layout.addWidget(self.leaks, 1)
        layout.addWidget(QLabel("Double-click record A or record B to open it."))

    def set_table(self, table: DatasetTable | None) -> None:
        if table is not None and self.table is not None and table.root == self.table.root:
            self.table = table      # the same dataset re-read: its report still holds
            return
        self.table = table
        self._request += 1
        self.leaks.setRowCount(0)
        self.status.setText(EXPLANATION + ("" if table is None
                                           else f" Not yet checked: {table.name}."))

    def check(self) -> None:
        if self.table is None or self.process is not None:
            return
        self.button.setEnabled(False)
        self.status.setText(f"checking {self.table.name}…")
        request = self._request
        self.process = run_engine(self, ["data", "leaks", str(self.table.root), "--json"],
                                  lambda out, err, code: self._done(out, err, request))

    def _done(self, out: str, err: str, request: int) -> None:
        self.process = None
        self.button.setEnabled(True)
        if request != self._request:
            return
        try:
            rows, summary = leak_rows(json.loads(out))
        except json.JSONDecodeError:
            self.status.setText(f"the leak check failed:\n{err.strip()[-600:]}")
            return
        self.leaks.setRowCount(len(rows))
        for i, row in enumerate(rows):
            for j, value in enumerate(row.cells):
                item = QTableWidgetItem(value)
                if j in (2, 3):
                    item.setData(Qt.ItemDataRole.UserRole, row.a_id if j == 2 else row.b_id)
                if row.leak:
                    item.setBackground(LEAK_BG)
                self.leaks.setItem(i, j, item)
        self.status.setText(summary)

    def _jump_to_leak(self, row: int, column: int) -> None:
        item = self.leaks.item(row, column)
        record_id = item.data(Qt.ItemDataRole.UserRole) if item else None
        index = self.table.row_of(str(record_id).split(":")[-1]) if record_id else None
        if index is not None:
            self.jump.emit(index)
