"""The Runs pane's Search tab: a question box over the selected embed-retrieval run, showing
its ranked documents with scores (state and the engine call: app/viewmodels/search.py; the
call runs off the GUI thread through BackgroundCall)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import search as vm
from app.views.background import BackgroundCall
from engine.errors import ForgebenchError


class SearchBox(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.run: Path | None = None
        self.call = BackgroundCall(self)
        self.call.done.connect(self._answered)
        self.call.failed.connect(self._failed)
        self.query = QLineEdit()
        self.query.setPlaceholderText("a support question, e.g. In Iris, I need to stop "
                                      "future renewals.")
        self.query.returnPressed.connect(self.search)
        self.k = QSpinBox()
        self.k.setRange(1, 50)
        self.k.setValue(5)
        self.k.setPrefix("top ")
        self.button = QPushButton("&Search")
        self.button.clicked.connect(self.search)
        row = QHBoxLayout()
        row.addWidget(self.query, 1)
        row.addWidget(self.k)
        row.addWidget(self.button)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.results = QTableWidget(0, 4)
        self.results.setHorizontalHeaderLabels(["#", "score", "document", "text"])
        self.results.verticalHeader().hide()
        self.results.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.results.horizontalHeader().setStretchLastSection(True)
        self.results.horizontalHeader().setSectionResizeMode(
            QHeaderView.ResizeMode.ResizeToContents)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(row)
        layout.addWidget(self.status)
        layout.addWidget(self.results, 1)
        self.set_run(None)

    def set_run(self, path: Path | None) -> None:
        _, reason = vm.searchable(path)
        if path != self.run:
            self.call.cancel()
            self.results.setRowCount(0)
        self.run = path
        self.button.setEnabled(path is not None)
        self.status.setText(reason)

    def search(self) -> None:
        ok, reason = vm.searchable(self.run)    # again: the index may have appeared since
        if not ok:
            self.status.setText(reason)
            return
        run, query, k = self.run, self.query.text(), self.k.value()
        self.status.setText(f"searching {run.name} …")
        self.button.setEnabled(False)
        self.call.start(lambda: vm.search_run(run, query, k))

    def _answered(self, answer: vm.SearchAnswer) -> None:
        self.button.setEnabled(True)
        self.status.setText(answer.summary)
        self.results.setRowCount(len(answer.hits))
        for row, hit in enumerate(answer.hits):
            for column, value in enumerate((str(hit.rank), f"{hit.score:.4f}", hit.doc_id,
                                            hit.text)):
                self.results.setItem(row, column, QTableWidgetItem(value))

    def _failed(self, exc: ForgebenchError) -> None:
        self.button.setEnabled(True)
        self.results.setRowCount(0)
        self.status.setText(exc.render())
