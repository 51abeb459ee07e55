"""Live training charts (pyqtgraph): one plot per metric, several runs overlaid."""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.runs import RunSeries, throughput_text

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"]
# (metric, title, unit) — loss also draws every eval split.
PLOTS = [("loss", "Loss: train, val (dashed)", ""),
         ("grad_norm", "Grad norm (red: clip, ×)", ""),
         ("lr", "Learning rate", ""), ("tokens_per_s", "Throughput", "tokens/s"),
         ("peak_rss_mb", "Peak memory", "MB")]


def _finite(xs: list[float], ys: list[float], log: bool) -> tuple[list[float], list[float]]:
    """Drop points a plot cannot draw (NaN, inf, and non-positive values on a log axis)."""
    keep = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)
            and (not log or y > 0)]
    return [k[0] for k in keep], [k[1] for k in keep]


class ChartControls(QWidget):
    changed = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.log_scale = QCheckBox("&Log scale")
        self.x_axis = QComboBox()
        self.x_axis.addItem("x: step", "step")
        self.x_axis.addItem("x: time (s)", "time")
        self.smoothing = QSlider(Qt.Orientation.Horizontal)
        self.smoothing.setRange(0, 99)
        self.smoothing.setFixedWidth(140)
        self.smoothing_label = QLabel()
        layout.addWidget(self.log_scale)
        layout.addWidget(self.x_axis)
        layout.addWidget(QLabel("Smoothing"))
        layout.addWidget(self.smoothing)
        layout.addWidget(self.smoothing_label)
        layout.addStretch(1)
        self.log_scale.toggled.connect(self.changed)
        self.x_axis.currentIndexChanged.connect(self.changed)
        self.smoothing.valueChanged.connect(self._smoothing_moved)
        self._smoothing_moved()

    def _smoothing_moved(self) -> None:
        self.smoothing_label.setText(f"{self.weight:.2f}")
        self.changed.emit()

    @property
    def weight(self) -> float:
        return self.smoothing.value() / 100

    @property
    def x(self) -> str:
        return self.x_axis.currentData()


class RunCharts(QWidget):
    """Charts of the selected runs; `refresh()` reads new metric lines and redraws.

    Each curve is one long-lived PlotDataItem updated with setData, so a poll during a live
    job costs a few array copies, not a rebuild of the scene.
    """

    redrawn = Signal(str)  # the metric whose plot was just redrawn

    def __init__(self, parent=None):
        super().__init__(parent)
        pg.setConfigOptions(antialias=False, background="w", foreground="#333")
        self.controls = ChartControls()
        self.controls.changed.connect(self.redraw)
        grid = QGridLayout()
        self.plots: dict[str, pg.PlotItem] = {}
        for i, (metric, title, unit) in enumerate(PLOTS):
            widget = pg.PlotWidget(title=title)
            widget.setMinimumHeight(150)
            item = widget.getPlotItem()
            item.setLabel("left", unit)
            item.setDownsampling(auto=True, mode="peak")
            if metric == "loss":
                item.addLegend(offset=(-10, 10))
            if metric in ("lr", "tokens_per_s"):
                item.setLimits(yMin=0)      # a constant lr is not centred on a negative axis
            self.plots[metric] = item
            grid.addWidget(widget, i // 3, i % 3)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.summary.setStyleSheet("QLabel { background: white; padding: 8px; }")
        grid.addWidget(self.summary, 1, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.controls)
        layout.addLayout(grid, 1)
        legend = QLabel("Dotted vertical: checkpoint saved. Solid grey vertical: resumed "
                        "(a new invocation). Gradient norms are before clipping.")
        legend.setWordWrap(True)
        layout.addWidget(legend)
        self.series: dict[str, RunSeries] = {}
        self.curves: dict[tuple, pg.PlotDataItem] = {}
        # Plots waiting to be redrawn: one per timer tick, so no event-loop slice repaints
        # all of them at once while a job streams metrics.
        self.pending: list[str] = []
        self.stagger = QTimer(self)
        self.stagger.setInterval(40)
        self.stagger.timeout.connect(self._draw_next)

    def set_runs(self, paths: list) -> None:
        """Show these runs (overlaid); series already read are kept."""
        wanted = {str(p): p for p in paths}
        if list(wanted) != list(self.series):
            self._clear()
        self.series = {k: self.series.get(k) or RunSeries(p) for k, p in wanted.items()}
        for series in self.series.values():
            series.poll()
        self.redraw()

    def refresh(self) -> bool:
        """Read new metric lines; the plots are redrawn one by one on later timer ticks."""
        changed = False
        for series in self.series.values():
            changed |= series.poll()
        if changed:
            self.pending += [m for m in self.plots if m not in self.pending]
            self.stagger.start()
        return changed

    def _draw_next(self) -> None:
        if not self.pending:
            self.stagger.stop()
            self._summarize()
            return
        self._draw_metric(self.pending.pop(0))

    def point_count(self, metric: str = "loss") -> int:
        return sum(len(s.xy(metric)[0]) for s in self.series.values())

    def _clear(self) -> None:
        for item in self.plots.values():
            item.clear()
        self.curves.clear()

    def _curve(self, key: tuple, metric: str, **style) -> pg.PlotDataItem:
        """The curve for (run, metric, role), created on first use."""
        curve = self.curves.get(key)
        if curve is None:
            curve = self.curves[key] = self.plots[metric].plot([], [], **style)
        return curve

    def redraw(self) -> None:
        """Redraw every plot now (a new selection or a changed chart control)."""
        self.pending.clear()
        for metric in self.plots:
            self._draw_metric(metric)
        self._summarize()

    def _summarize(self) -> None:
        """The latest numbers of each shown run, beside the charts."""
        parts = []
        for series in self.series.values():
            train = series.train
            if not train.steps:
                parts.append(f"<b>{series.name}</b><br>no metrics yet")
                continue
            last = {k: v[-1] for k, v in train.values.items() if v}
            val = series.evals.get("val")
            lines = [f"<b>{series.name}</b>", f"step {train.steps[-1]}",
                     f"train loss {last.get('loss', float('nan')):.4f}"]
            if val and val.values.get("loss"):
                lines.append(f"val loss {val.values['loss'][-1]:.4f} (step {val.steps[-1]})")
            lines += [f"lr {last.get('lr', float('nan')):.3g}",
                      throughput_text(train),
                      f"peak memory {max(train.values.get('peak_rss_mb', [0])):.0f} MB",
                      f"checkpoints {len(series.checkpoint_steps)}, "
                      f"invocations {len(series.invocation_steps)}"]
            parts.append("<br>".join(lines))
        self.summary.setText("<br><br>".join(parts) or "Select runs in the ledger to chart "
                                                        "them (several overlay).")

    def _draw_metric(self, metric: str) -> None:
        log, x, weight = self.controls.log_scale.isChecked(), self.controls.x, \
            self.controls.weight
        item = self.plots[metric]
        item.setLogMode(False, log and metric != "lr")
        item.setLabel("bottom", "step" if x == "step" else "seconds")
        for index, (key, series) in enumerate(self.series.items()):
            colour = PALETTE[index % len(PALETTE)]
            use_log = log and metric != "lr"
            smooth = weight if metric in ("loss", "grad_norm") else 0.0
            xs, ys = _finite(*series.xy(metric, x=x, smoothing=smooth), use_log)
            self._curve((key, metric), metric, pen=pg.mkPen(colour, width=2),
                        name=series.name if metric == "loss" else None).setData(xs, ys)
            if metric == "loss":
                for split, style in (("val", Qt.PenStyle.DashLine),
                                     ("test", Qt.PenStyle.DotLine)):
                    vx, vy = _finite(*series.xy("loss", split=split, x=x), use_log)
                    if vx or (key, metric, split) in self.curves:
                        self._curve((key, metric, split), metric,
                                    pen=pg.mkPen(colour, width=2, style=style), symbol="o",
                                    symbolSize=6, symbolBrush=colour,
                                    name=f"{series.name} ({split})").setData(vx, vy)
            if metric == "grad_norm":
                cx, cy = _finite(*series.clipped_points(x=x), use_log)
                self._curve((key, metric, "clipped"), metric, pen=None, symbol="x",
                            symbolSize=9, symbolPen=pg.mkPen("#a00", width=2)).setData(cx, cy)
                clip = series.clip_threshold
                self._curve((key, metric, "clip"), metric, pen=pg.mkPen(
                    "#a00", width=1, style=Qt.PenStyle.DashLine)).setData(
                    [min(xs), max(xs)] if clip and xs else [], [clip, clip] if clip and xs else [])
            self._markers(key, metric, series, x, (min(ys), max(ys)) if ys else None, colour)
        self.redrawn.emit(metric)

    def _markers(self, key: str, metric: str, series: RunSeries, x: str,
                 span: tuple[float, float] | None, colour: str) -> None:
        """Vertical segments at checkpoints (dotted) and resumes (solid grey) over the data."""
        for role, steps, pen in (
                ("checkpoints", series.checkpoint_steps,
                 pg.mkPen(colour, width=1, style=Qt.PenStyle.DotLine)),
                ("resumes", series.invocation_steps[1:], pg.mkPen("#555", width=2))):
            positions = [p for p in (series.x_of_step(s, x) for s in steps) if p is not None]
            if not span:
                positions = []
            self._curve((key, metric, role), metric, pen=pen, connect="pairs").setData(
                [p for p in positions for _ in (0, 1)],
                [v for _ in positions for v in (span or ())])
