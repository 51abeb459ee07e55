"""The Reports pane: a run's evaluation reports, one at a time. The summary column holds the
headline, the before/after table (a calibration's effect, with what the split can resolve),
the confusion matrix in counts and every figure of the report; the pictures it names (a
precision-recall curve, a reliability plot, a risk-coverage curve) fill the other column. An
lm-cartridge run's held-out comparison shows instead as its three conditions side by side, a
table with a bar in every cell and the best of each column in bold, and the same figures per
question underneath. The reading lives in app/viewmodels/reports.py."""

from __future__ import annotations

import html

from PySide6.QtCore import QModelIndex, QRect, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QPainter, QPixmap
from PySide6.QtWidgets import (
    QHeaderView,
    QSizePolicy,
    QSplitter,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import reports as vm
from app.viewmodels.workspace import Workspace
from app.views import theme
from app.views.combos import RunFilePicker
from app.views.labels import FittedPicture, wrapped_label
from engine.errors import ForgebenchError

NO_RUN = ("Choose a run with evaluation reports: tabular-classify writes its selection report "
          "when it trains, and `forgebench eval RUN --split val` writes one for any recipe.")


BAR_ROLE = Qt.ItemDataRole.UserRole + 1      # a cell's bar length, 0..1


class BarDelegate(QStyledItemDelegate):
    """A cell's bar (its BAR_ROLE share of the width) under its text."""

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex):
        share = index.data(BAR_ROLE)
        if isinstance(share, float) and share > 0:
            rect = option.rect.adjusted(2, 3, -2, -3)
            colour = QColor(theme.colour("stage"))
            colour.setAlpha(70)
            painter.fillRect(QRect(rect.left(), rect.top(), round(rect.width() * min(share, 1)),
                                   rect.height()), colour)
        super().paint(painter, option, index)


def _table(columns: list[str], kind=None) -> QTableWidget:
    table = kind(columns) if kind else QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(columns)
    table.verticalHeader().hide()
    table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    table.setWordWrap(True)
    table.setItemDelegate(BarDelegate(table))
    table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
    rows = table.verticalHeader()          # rows follow their wrapped text as columns resize
    rows.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    rows.setMinimumSectionSize(table.fontMetrics().height() * 2)    # room for a bar
    return table


def _cell(text: str, bar: float | None = None, bold: bool = False,
          tip: str | None = None) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    if bar is not None:
        item.setData(BAR_ROLE, float(bar))
    if bold:
        font = QFont(item.font())
        font.setBold(True)
        item.setFont(font)
    if tip:
        item.setToolTip(tip)
    return item


class FittedTable(QTableWidget):
    """A table as tall as its rows (wrapped to the width it has), never scrolled."""

    def __init__(self, columns: list[str], parent=None):
        super().__init__(0, len(columns), parent)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.verticalHeader().sectionResized.connect(lambda *_: self.updateGeometry())

    def sizeHint(self) -> QSize:
        height = (self.horizontalHeader().sizeHint().height() + 2 * self.frameWidth()
                  + sum(self.rowHeight(r) for r in range(self.rowCount())))
        return QSize(super().sizeHint().width(), height)

    def minimumSizeHint(self) -> QSize:
        return self.sizeHint()


class CartridgeView(QWidget):
    """An lm-cartridge comparison: the conditions side by side, then per question."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.headline = wrapped_label("", selectable=True)
        self.table = _table(["condition"] + [
            f"{m.label} {'↑' if m.higher_is_better else '↓'}" for m in vm.MEASURES],
            FittedTable)
        self.meaning = wrapped_label(vm.MEANING)
        theme.style(self.meaning, "QLabel {{ color: {muted}; }}")
        self.per_question_title = wrapped_label("Per question (the reference answer's "
                                                "log-likelihood per token and the answer's F1; "
                                                "point at a cell for the answer):")
        self.per_question = _table(["question", *vm.CONDITIONS])
        column = QVBoxLayout(self)
        column.setContentsMargins(0, 0, 0, 0)
        for widget in (self.headline, self.table, self.meaning, self.per_question_title):
            column.addWidget(widget)
        column.addWidget(self.per_question, 1)

    def show_comparison(self, comparison: vm.CartridgeComparison) -> None:
        self.headline.setText(comparison.headline())
        self.table.setRowCount(len(vm.CONDITIONS))
        for row, condition in enumerate(vm.CONDITIONS):
            self.table.setItem(row, 0, _cell(condition))
            for column, measure in enumerate(vm.MEASURES, 1):
                self.table.setItem(row, column, _cell(
                    comparison.text(condition, measure.key),
                    comparison.bar(condition, measure.key),
                    comparison.winner(measure.key) == condition))
        self.per_question.setRowCount(len(comparison.questions))
        for row, question in enumerate(comparison.questions):
            self.per_question.setItem(row, 0, _cell(
                vm.short_question(question.question),
                tip=f"{question.question}\n({question.source}; reference: {question.reference})"))
            for column, condition in enumerate(vm.CONDITIONS, 1):
                self.per_question.setItem(row, column, _cell(
                    vm.question_cell(question, condition), vm.question_bar(question, condition),
                    tip=question.figures[condition]["answer"].strip() or "(no answer)"))


class ReportsPane(QWidget):
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.report: vm.Report | None = None
        self.comparison: vm.CartridgeComparison | None = None
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
        self.cartridge = CartridgeView()
        self.cartridge.hide()

        left = QWidget()
        column = QVBoxLayout(left)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.summary)
        column.addWidget(self.cartridge, 1)
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
        self.report, self.comparison, problem = None, None, None
        if path:
            try:
                self.report = vm.read_report(path)
                self.comparison = vm.cartridge_comparison(self.report)
            except ForgebenchError as exc:
                self.report, problem = None, exc.render()
        self._show(problem)

    def _show(self, problem: str | None = None) -> None:
        report = self.report
        if self.comparison is not None:
            self.cartridge.show_comparison(self.comparison)
        self.cartridge.setVisible(self.comparison is not None)
        self.figures.setVisible(self.comparison is None)    # the comparison holds every figure
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
