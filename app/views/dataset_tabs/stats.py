"""Stats tab: records per label and split as grouped bars, with one legend entry per split;
for a tabular dataset also a table of per-column statistics (role, filled, missing, mean,
std, min, max, groups).

The chart (pyqtgraph) is built when the tab is first filled, so the Datasets pane, the first
one the window shows, is built without importing pyqtgraph."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

from app.viewmodels.datasets import DatasetTable, column_stats, stats_bars

COLOURS = ["#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#7f7f7f"]
COLUMN_HEADERS = ["column", "role", "filled", "missing", "mean", "std", "min", "max", "groups"]


class StatsTab(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.table: DatasetTable | None = None
        self.plot = None            # the chart, built by the first fill
        self.legend = None
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.columns = QTableWidget(0, len(COLUMN_HEADERS))
        self.columns.setHorizontalHeaderLabels(COLUMN_HEADERS)
        self.columns.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.columns.hide()
        layout = QVBoxLayout(self)
        layout.addWidget(self.text)
        layout.addWidget(self.columns, 1)

    def set_table(self, table: DatasetTable | None) -> None:
        """Counted lazily: `fill` runs when the tab is first shown for this table."""
        self.table = table
        if self.plot is not None:
            self.plot.clear()
            self.legend.clear()
        self.text.clear()
        self.columns.setRowCount(0)
        self.columns.hide()

    def _build_plot(self, pg) -> None:
        self.plot = pg.PlotWidget(title="Records per label and split")
        self.plot.setBackground("w")
        # One legend for the tab's life. PlotItem adds every named item to it (and removes it
        # on clear); a legend added per fill, or an explicit addItem, would list a split twice.
        self.legend = self.plot.addLegend(offset=(-10, 10))
        self.layout().insertWidget(0, self.plot, 1)

    def fill(self) -> None:
        import pyqtgraph as pg  # here, not at the top: see the module docstring

        if self.plot is None:
            self._build_plot(pg)
        self.plot.clear()
        self.legend.clear()
        if self.table is None:
            return
        bars = stats_bars(self.table.split_counts())
        width = 0.8 / max(len(bars.splits), 1)
        for j, split in enumerate(bars.splits):
            xs = [i + j * width for i in range(len(bars.labels))]
            item = pg.BarGraphItem(x=xs, height=bars.heights[split], width=width * 0.9,
                                   brush=COLOURS[j % len(COLOURS)], name=split)
            self.plot.addItem(item)
        axis = self.plot.getAxis("bottom")
        axis.setTicks([[(i + 0.4 - width / 2, label) for i, label in enumerate(bars.labels)]])
        self.text.setText("  ·  ".join(f"{s}: {n}" for s, n in bars.totals.items()))
        self.fill_columns()

    def fill_columns(self) -> None:
        stats = column_stats(self.table)
        self.columns.setRowCount(len(stats))
        for i, stat in enumerate(stats):
            cells = [stat.column, stat.role, stat.filled, stat.missing, stat.mean, stat.std,
                     stat.minimum, stat.maximum, stat.distinct]
            for j, value in enumerate(cells):
                text = "" if value is None else (f"{value:.4g}" if isinstance(value, float)
                                                 else str(value))
                self.columns.setItem(i, j, QTableWidgetItem(text))
        self.columns.setVisible(bool(stats))
