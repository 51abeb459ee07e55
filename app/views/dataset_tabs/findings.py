"""Findings tab: every validator finding, coloured by severity; activating one opens its
record in the records tab."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QListWidget, QListWidgetItem

from app.viewmodels.datasets import DatasetTable, finding_rows, row_of_place
from app.views.labels import wrap_items

COLOURS = {"error": "#c62828", "warning": "#8d6e00", "more": "#555"}


class FindingsTab(QListWidget):
    jump = Signal(int)          # the record's index in the table

    def __init__(self, parent=None):
        super().__init__(parent)
        self.table: DatasetTable | None = None
        wrap_items(self)            # a finding names its file and reason whole
        self.itemActivated.connect(self._jump_to_finding)
        self.itemDoubleClicked.connect(self._jump_to_finding)

    def set_table(self, table: DatasetTable | None) -> None:
        self.table = table
        self.clear()
        for row in finding_rows(table.report) if table else []:
            item = QListWidgetItem(row.text)
            item.setData(Qt.ItemDataRole.UserRole, row.where)
            item.setForeground(QColor(COLOURS.get(row.severity, "#333")))
            self.addItem(item)

    def _jump_to_finding(self, item: QListWidgetItem) -> None:
        index = row_of_place(self.table.rows, item.data(Qt.ItemDataRole.UserRole) or "") \
            if self.table else None
        if index is not None:
            self.jump.emit(index)
