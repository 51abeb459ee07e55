"""The Reports pane: a run's evaluation reports, one at a time. The summary column holds the
headline, the before/after table (a calibration's effect, with what the split can resolve),
the confusion matrix in counts and every figure of the report; the pictures it names (a
precision-recall curve, a reliability plot, a risk-coverage curve) fill the other column. The
reading lives in app/viewmodels/reports.py."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import (
    QHeaderView,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import reports as vm
from app.viewmodels.workspace import Workspace
from app.views.combos import RunFilePicker
from app.views.labels import FittedPicture, wrapped_label
from engine.errors import ForgebenchError

NO_RUN = ("Choose a run with evaluation reports: tabular-classify writes its selection report "
          "when it trains, and `forgebench eval RUN --split val` writes one for any recipe.")


class ReportsPane(QWidget):
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.report: vm.Report | None = None
        self.picker = RunFilePicker(
            "Report", vm.report_runs,
            lambda run: [(path.stem, str(path)) for path in vm.report_files(run)])
        self.picker.chosen.connect(self._report_chosen)
        self.run_combo, self.report_combo = self.picker.run_combo, self.picker.file_combo
        self.summary = wrapped_label(NO_RUN, selectable=True)
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.figures = QTableWidget(0, 2)
        self.figures.setHorizontalHeaderLabels(["figure", "value"])
        self.figures.verticalHeader().hide()
        self.figures.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.figures.setWordWrap(True)
        header = self.figures.horizontalHeader()
        # paths are short words joined by dots; a value (a file name, a policy) may be long and
        # wraps in what is left
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.figures.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.pictures_box = QWidget()
        self.pictures_layout = QVBoxLayout(self.pictures_box)
        self.pictures_layout.setContentsMargins(0, 0, 0, 0)
        self.pictures: list[FittedPicture] = []

        left = QWidget()
        column = QVBoxLayout(left)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.summary)
        column.addWidget(self.figures, 1)
        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(self.pictures_box)
        splitter.setSizes([400, 460])
        layout = QVBoxLayout(self)
        layout.addWidget(self.picker)
        layout.addWidget(splitter, 1)

    def set_workspace(self, workspace: Workspace) -> None:
        self.picker.set_workspace(workspace)

    def refresh_runs(self) -> None:
        """New runs and reports appear; the chosen run and report stay chosen, and the report
        on screen is read again when its file was written again."""
        self.picker.refresh()

    def show_run(self, run_dir) -> None:
        """Choose `run_dir` (the Runs pane's "Reports" button), listed or not yet."""
        self.refresh_runs()
        index = self.run_combo.findData(str(run_dir))
        if index >= 0:
            self.run_combo.setCurrentIndex(index)

    def _report_chosen(self, path: str | None, _rewritten: bool) -> None:
        self.report, problem = None, None
        if path:
            try:
                self.report = vm.read_report(path)
            except ForgebenchError as exc:
                problem = exc.render()
        self._show(problem)

    def _show(self, problem: str | None = None) -> None:
        report = self.report
        self.summary.setText(vm.summary_html(report) if report else
                             html.escape(problem).replace("\n", "<br>") if problem
                             else NO_RUN)
        figures = report.figures() if report else []
        self.figures.setRowCount(len(figures))
        for row, (path, value) in enumerate(figures):
            self.figures.setItem(row, 0, QTableWidgetItem(path))
            self.figures.setItem(row, 1, QTableWidgetItem(value))
        self.figures.resizeRowsToContents()
        for picture in self.pictures:
            picture.setParent(None)         # off the layout and the screen now, not later
        self.pictures = []
        for path in report.pictures() if report else []:
            picture = FittedPicture(path.name)
            picture.setToolTip(str(path))
            picture.set_source(QPixmap(str(path)))
            self.pictures_layout.addWidget(picture, 1)
            self.pictures.append(picture)
        self.pictures_box.setVisible(bool(self.pictures))     # else the figures take the width
