"""Stats tab: records per label and split as grouped bars, with one legend entry per split."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app.viewmodels.datasets import DatasetTable, stats_bars

COLOURS = ["#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#7f7f7f"]


class StatsTab(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.table: DatasetTable | None = None
        self.plot = pg.PlotWidget(title="Records per label and split")
        self.plot.setBackground("w")
        # One legend for the tab's life. PlotItem adds every named item to it (and removes it
        # on clear); a legend added per fill, or an explicit addItem, would list a split twice.
        self.legend = self.plot.addLegend(offset=(-10, 10))
        self.text = QLabel()
        self.text.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.text)

    def set_table(self, table: DatasetTable | None) -> None:
        """Counted lazily: `fill` runs when the tab is first shown for this table."""
        self.table = table
        self.plot.clear()
        self.legend.clear()
        self.text.clear()

    def fill(self) -> None:
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
