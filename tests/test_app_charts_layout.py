"""The Runs charts at the size a 1024x700 window gives them: no two tick labels of an axis run
together ("0 200400600800" was seen under the throughput plot of a 900-step run), thousands
read "40k", and the summary cell's figures and key show whole (they were clipped at the
bottom of the cell): the cell scrolls."""

from __future__ import annotations

import pyqtgraph as pg
import pytest
from layout_support import labels_cut_off, shown_at
from PySide6.QtGui import QImage, QPainter

from app.viewmodels.workspace import BUNDLED_SAMPLE
from app.views.charts import KEY, RunCharts

CHARTS_SIZE = (396, 600)    # the charts' area beside the ledger in a 1024x700 window
SPACE_PX = 8                # about a digit's width: closer labels read as one number
SHOWN = ("loss", "grad_norm", "lr", "throughput", "peak_rss_mb")     # the plots a run of it has
RUN = BUNDLED_SAMPLE / "runs" / "where-demo"        # 900 steps, tokens/s in the thousands


def tick_labels(axis: pg.AxisItem) -> list[tuple]:
    """(rect, text) of every tick label the axis draws at its present size."""
    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        _, _, texts = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return [(rect, text) for rect, _, text in texts]


def overlapping(labels: list[tuple]) -> list[tuple[str, str]]:
    """Pairs of labels that overlap or stand closer than `SPACE_PX`."""
    return [(a, b) for i, (ra, a) in enumerate(labels) for rb, b in labels[i + 1:]
            if ra.adjusted(-SPACE_PX / 2, 0, SPACE_PX / 2, 0).intersects(rb)]


def shown_charts(qtbot) -> RunCharts:
    charts = shown_at(qtbot, RunCharts(), CHARTS_SIZE)
    charts.set_runs([RUN])
    charts.redraw()
    qtbot.waitUntil(lambda: not charts.unbuilt and all(      # the view ranges follow the data
        charts.plots[m].getAxis("bottom").range[1] >= 900 for m in SHOWN))
    return charts


def test_tick_labels_stay_apart_and_thousands_are_short(qtbot):
    charts = shown_charts(qtbot)
    plot = charts.plot_widgets["throughput"]
    qtbot.waitUntil(lambda: plot.width() < 220)         # two plots a row beside the ledger
    for metric in SHOWN:
        for side in ("bottom", "left"):
            assert overlapping(tick_labels(charts.plots[metric].getAxis(side))) == [], \
                (metric, side)
    left = [text for _, text in tick_labels(charts.plots["throughput"].getAxis("left"))]
    assert any(text.endswith("k") for text in left) and all(len(text) <= 4 for text in left)
    bottom = [text for _, text in tick_labels(charts.plots["throughput"].getAxis("bottom"))]
    assert bottom[0] == "0" and all(float(t) <= 900 for t in bottom)
    # twin: pyqtgraph's own axes on the same data at the same size run their labels together
    series = charts.series[str(RUN)]
    xs, ys = series.xy(series.throughput[0])
    plain = pg.PlotWidget()
    plain.getPlotItem().setLabel("left", "tokens/s")
    plain.plot(xs, ys)
    shown_at(qtbot, plain, (plot.width(), plot.height()))
    qtbot.waitUntil(lambda: bool(overlapping(tick_labels(plain.getPlotItem().getAxis("bottom")))))
    # ... and write thousands in full ("2000" where ours writes "2k"; how many thousand tokens/s
    # depends on the machine that made the example)
    assert any(len(text) >= 4 and text.isdigit()
               for _, text in tick_labels(plain.getPlotItem().getAxis("left")))


def test_the_summary_and_key_show_whole_and_scroll(qtbot):
    charts = shown_charts(qtbot)
    text = charts.summary.text()
    assert "where-demo" in text and "train loss" in text and KEY in text
    scroll = charts.summary_scroll
    qtbot.waitUntil(lambda: scroll.verticalScrollBar().maximum() > 0)  # more than the cell
    assert labels_cut_off(charts) == []
    assert charts.summary.height() >= charts.summary.heightForWidth(charts.summary.width())
    # twin: the same label at the height of its cell is cut off
    charts.summary.setFixedHeight(scroll.viewport().height())
    qtbot.waitUntil(lambda: charts.summary.height() == scroll.viewport().height())
    assert labels_cut_off(charts) == [text]



def test_a_constant_learning_rate_is_drawn_inside_its_axis_not_on_its_floor(qtbot):
    """sfx-generator trains at a constant lr of 1e-3: its plot spans 0 to 1.25e-3 (it was
    0-1, the line on the floor). The twin, where-demo's warm-up to 1e-2, keeps pyqtgraph's
    automatic range."""
    for run, flat in (("sfx-generator", True), ("where-demo", False)):
        charts = shown_at(qtbot, RunCharts(), CHARTS_SIZE)
        charts.set_runs([BUNDLED_SAMPLE / "runs" / run])
        charts.redraw()
        qtbot.waitUntil(lambda charts=charts: "lr" in charts.plots
                        and charts.plots["lr"].viewRange()[1][1] < 0.5)    # the data's range
        low, high = charts.plots["lr"].viewRange()[1]
        if flat:
            assert (low, high) == pytest.approx((0.0, 1.25e-3))
        else:
            assert charts.plots["lr"].getViewBox().autoRangeEnabled()[1]
            assert low < 0.006 and 0.01 <= high < 0.02
