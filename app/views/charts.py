"""Live training charts (pyqtgraph): one plot per metric, several runs overlaid.

The legend (run colours, train solid, val dashed) is in the summary beside the plots, never
over a curve; the summary cell scrolls when the shown runs' figures and the key need more
room than a 1024x700 window gives it. Throughput is tokens/s for language-model runs and
samples/s for the others (`RunSeries.throughput`). Axes write thousands as "40k" and space
their x ticks by the width of their labels, so no two labels run together in a ~150 px plot."""

from __future__ import annotations

import html
import math

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.runs import RunSeries, ema, throughput_text
from app.views import theme

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"]
# (metric, title, unit) — loss also draws every eval split.
# Short titles: a plot is ~140 px wide in a 1024-pixel window; the summary explains the styles.
PLOTS = [("loss", "Loss", ""), ("grad_norm", "Grad norm", ""), ("lr", "Learning rate", ""),
         ("throughput", "Throughput", ""), ("peak_rss_mb", "Peak memory", "MB"),
         ("reward", "Reward (ES)", ""), ("reward_margin", "Reward margin (DPO)", ""),
         ("preference_accuracy", "Preference accuracy", ""),
         ("chosen_logp", "Log-prob chosen / rejected", ""),
         ("accuracy", "Val accuracy", ""), ("ece", "Val calibration error (ECE)", ""),
         ("mrr@5", "Val MRR@5 (retrieval)", "")]
PLOT_NAMES = [metric for metric, _, _ in PLOTS]
SUMMARY_CELL = 5              # the grid cell of the summary text (plots fill the others)
# plots shown only while a selected run logs their metric: lm-es's reward, lm-dpo's preferences,
# lm-decision's and tabular-classify's val accuracy and ECE, embed-retrieval's MRR@5
SHOWN_WITH_DATA = ("reward", "reward_margin", "preference_accuracy", "chosen_logp", "accuracy",
                   "ece", "mrr@5")
# plots of evaluation rows (the val split) rather than of training steps
VAL_PLOTS = ("accuracy", "ece", "mrr@5")
# (plot, role, metric, pen style) of the extra curves drawn beside a plot's own metric
EXTRA_CURVES = [("reward", "mean", "reward_mean", Qt.PenStyle.DashLine),
                ("reward", "max", "reward_max", Qt.PenStyle.DotLine),
                ("reward", "min", "reward_min", Qt.PenStyle.DotLine),
                ("grad_norm", "update", "update_norm", Qt.PenStyle.DashLine),
                ("lr", "sigma", "sigma", Qt.PenStyle.DashLine),
                ("chosen_logp", "rejected", "rejected_logp", Qt.PenStyle.DashLine),
                ("ece", "before", "ece_before", Qt.PenStyle.DashLine)]
KEY = ("Loss: train solid, val dashed, test dotted. Grad norm: red dashes the clip threshold, "
       "× a clipped step; dashed: the ES update norm. Learning rate dashed: ES σ. Reward: "
       "centre solid, population mean dashed, max/min dotted. Log-prob: chosen solid, "
       "rejected dashed. ECE: calibrated solid, before calibration dashed. Dotted vertical: "
       "checkpoint saved. Solid grey vertical: resumed (a new invocation). Gradient norms are "
       "before clipping. Loss, wide pink band: the reference trace the run's config names.")
# a reference loss trace ([compare] reference_trace): a wide band under the run's own line, so
# a run that equals it still shows both, and one that drifts shows where
REFERENCE_COLOUR = "#e377c2"
REFERENCE_WIDTH = 6
SI_SUFFIXES = ((1e9, "G"), (1e6, "M"), (1e3, "k"))
TICK_GAP_PX = 10        # the least room between two x tick labels


def _finite(xs: list[float], ys: list[float], log: bool) -> tuple[list[float], list[float]]:
    """Drop points a plot cannot draw (NaN, inf, and non-positive values on a log axis)."""
    keep = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)
            and (not log or y > 0)]
    return [k[0] for k in keep], [k[1] for k in keep]


def fit_flat_line(item: pg.PlotItem, values: list[float]) -> None:
    """A line with one value (a constant learning rate) shown from 0 to 1.25× that value.
    pyqtgraph gives a flat line a ±0.5 band, which with the axis floored at 0 draws a 1e-3
    line on the floor of a 0–1 axis; any other data keeps the automatic range."""
    flat = bool(values) and max(values) == min(values) and max(values) > 0
    if flat:
        item.setYRange(0, 1.25 * values[0], padding=0)
    else:
        item.enableAutoRange(axis="y")


def use_plot_style() -> None:
    """The plots' look (white with dark ink, or the dark theme's panel with light ink), set
    before a pane builds its first plot: the panes are built when first shown, in whatever
    order the user opens them."""
    pg.setConfigOptions(antialias=False, background=theme.colour("panel_bg"),
                        foreground=theme.colour("text"))


class CompactAxis(pg.AxisItem):
    """An axis whose labels stay apart in a small plot: thousands as "40k" (a throughput axis
    of "40000"s took a third of the plot's width) and x ticks no closer than their labels'
    width ("0 200400600800" was seen)."""

    def tickStrings(self, values: list[float], scale: float, spacing: float) -> list[str]:
        biggest = max((abs(v * scale) for v in values), default=0.0)
        if self.logMode or biggest < 1e3:
            return super().tickStrings(values, scale, spacing)
        factor, suffix = next((f, x) for f, x in SI_SUFFIXES if biggest >= f)
        return [text if text == "0" else text + suffix for text in
                super().tickStrings(values, scale / factor, spacing)]

    def tickSpacing(self, minVal: float, maxVal: float, size: float) -> list[tuple]:
        levels = super().tickSpacing(minVal, maxVal, size)
        if self.orientation not in ("top", "bottom") or not levels or size <= 0:
            return levels
        major = levels[0][0]
        while self._labels_width(minVal, maxVal, major) > size:
            major = _coarser(major)
        if major == levels[0][0]:
            return levels
        return [(major, 0), *[level for level in levels if level[0] < major][:1]]

    def _labels_width(self, low: float, high: float, spacing: float) -> float:
        """The pixels the major labels at `spacing` take, each with its gap."""
        values = [math.ceil(low / spacing) * spacing + k * spacing
                  for k in range(int((high - low) // spacing) + 1)]
        values = [v for v in values if v <= high] or [low]
        metrics = QFontMetrics(self.style["tickFont"] or self.font())
        widest = max(metrics.horizontalAdvance(t) for t in self.tickStrings(values, 1, spacing))
        return len(values) * (widest + TICK_GAP_PX)


def _coarser(spacing: float) -> float:
    """The next tick spacing of the 1, 2, 5 × 10^n series above `spacing`."""
    power = 10 ** math.floor(math.log10(spacing))
    step = next(m for m in (2, 5, 10, 20) if m * power > spacing * (1 + 1e-9))
    return step * power


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
        self.smoothing.setFixedWidth(100)
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
        use_plot_style()
        self.controls = ChartControls()
        self.controls.changed.connect(self.redraw)
        self.grid = grid = QGridLayout()
        # The plots are built one per timer tick (a PlotWidget costs ~15-40 ms on 2 cores; all
        # of them at once were the Runs pane's longest GUI slice), or when first drawn.
        self.plots: dict[str, pg.PlotItem] = {}
        self.plot_widgets: dict[str, pg.PlotWidget] = {}
        self.unbuilt = [metric for metric, _, _ in PLOTS]
        self.builder = QTimer(self)
        self.builder.setInterval(0)
        self.builder.timeout.connect(self._build_next)
        self.builder.start()
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        theme.style(self.summary, "QLabel {{ background: {panel_bg}; color: {text}; "
                                  "padding: 8px; }}")
        # The figures of several runs and the key outgrow a plot-sized cell: it scrolls.
        self.summary_scroll = QScrollArea()
        self.summary_scroll.setWidget(self.summary)
        self.summary_scroll.setWidgetResizable(True)
        self.summary_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.summary_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        grid.addWidget(self.summary_scroll, SUMMARY_CELL // 2, SUMMARY_CELL % 2)
        # The plots scroll inside their own area: a short window keeps the chart controls,
        # and the ledger and its buttons beside them, in view (every pane works at 1024×700).
        plots = QWidget()
        plots.setLayout(grid)
        self.plots_scroll = QScrollArea()
        self.plots_scroll.setWidget(plots)
        self.plots_scroll.setWidgetResizable(True)
        self.plots_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.plots_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.plots_scroll.setMinimumHeight(160)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.controls)
        layout.addWidget(self.plots_scroll, 1)
        self.series: dict[str, RunSeries] = {}
        self.curves: dict[tuple, pg.PlotDataItem] = {}
        # Plots waiting to be redrawn: one per timer tick, so no event-loop slice repaints
        # all of them at once while a job streams metrics.
        self.pending: list[str] = []
        self.stagger = QTimer(self)
        self.stagger.setInterval(40)
        self.stagger.timeout.connect(self._draw_next)

    def _build_next(self) -> None:
        if self.unbuilt:
            self._plot(self.unbuilt[0])
        else:
            self.builder.stop()

    def _plot(self, metric: str) -> pg.PlotItem:
        """The plot of `metric`, built in its grid cell on first use."""
        if metric in self.plots:
            return self.plots[metric]
        i = PLOT_NAMES.index(metric)
        _, title, unit = PLOTS[i]
        widget = pg.PlotWidget(axisItems={side: CompactAxis(side) for side in ("left", "bottom")})
        widget.setMinimumHeight(150)
        item = widget.getPlotItem()
        item.setTitle(title, size="9pt")
        item.setLabel("left", unit)
        item.setDownsampling(auto=True, mode="peak")
        if metric in ("lr", "throughput"):
            item.setLimits(yMin=0)      # a constant lr is not centred on a negative axis
        self.plots[metric] = item
        self.plot_widgets[metric] = widget
        self.unbuilt.remove(metric)
        widget.setVisible(metric not in SHOWN_WITH_DATA)
        cell = i + (i >= SUMMARY_CELL)
        self.grid.addWidget(widget, cell // 2, cell % 2)  # two columns: each plot stays readable
        return item

    def set_runs(self, paths: list) -> None:
        """Show these runs (overlaid); series already read are kept."""
        wanted = {str(p): p for p in paths}
        if list(wanted) != list(self.series):
            self._clear()
        self.series = {k: self.series.get(k) or RunSeries(p) for k, p in wanted.items()}
        for series in self.series.values():
            series.poll()
        self.pending = list(PLOT_NAMES)     # drawn one plot per tick: no long GUI slice
        self._summarize()
        self.stagger.start()

    def refresh(self) -> bool:
        """Read new metric lines; the plots are redrawn one by one on later timer ticks."""
        changed = False
        for series in self.series.values():
            changed |= series.poll()
        if changed:
            self.pending += [m for m in PLOT_NAMES if m not in self.pending]
            self.stagger.start()
            # the figures beside the plots follow every read, not the last staggered redraw
            # (new lines each poll kept that from ever coming: "no metrics yet" beside curves)
            self._summarize()
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
            curve = self.curves[key] = self._plot(metric).plot([], [], **style)
        return curve

    def redraw(self) -> None:
        """Redraw every plot now (a new selection or a changed chart control)."""
        self.pending.clear()
        for metric in PLOT_NAMES:
            self._draw_metric(metric)
        self._summarize()

    def _summarize(self) -> None:
        """The latest numbers of each shown run, beside the charts."""
        parts = []
        for index, series in enumerate(self.series.values()):
            swatch = f"<span style='color:{PALETTE[index % len(PALETTE)]}'>━━</span> "
            train = series.train
            if not train.steps:
                # a run that logs evaluations only (a one-step tabular fit) still has figures
                evals = [f"{split} {name} {values[-1]:.4g} (step {ev.steps[-1]})"
                         for split, ev in series.evals.items() if ev.steps
                         for name, values in ev.values.items()
                         if values and values[-1] == values[-1]]
                parts.append(f"{swatch}<b>{series.name}</b><br>"
                             + ("<br>".join(evals) if evals else "no metrics yet"))
                continue
            last = {k: v[-1] for k, v in train.values.items() if v}
            metric, unit = series.throughput
            val = series.evals.get("val")
            lines = [f"{swatch}<b>{series.name}</b>", f"step {train.steps[-1]}",
                     f"train loss {last.get('loss', float('nan')):.4f}"]
            if val and val.values.get("loss"):
                lines.append(f"val loss {val.values['loss'][-1]:.4f} (step {val.steps[-1]})")
            lines += self._reference_lines(series)      # beside the losses it is about
            lines += [f"lr {last.get('lr', float('nan')):.3g}",
                      throughput_text(train, metric, unit)]
            per_rank = last.get("rank_tokens_per_s", float("nan"))
            if per_rank == per_rank:          # logged by multi-process runs only
                lines.append(f"per rank {per_rank:.0f} tokens/s × "
                             f"{last.get('world_size', 0):.0f} processes")
            lines += [f"peak memory {max(train.values.get('peak_rss_mb', [0])):.0f} MB",
                      f"checkpoints {len(series.checkpoint_steps)}, "
                      f"invocations {len(series.invocation_steps)}"]
            parts.append("<br>".join(lines))
        if not parts:
            parts.append("Select runs in the ledger to chart them (several overlay).")
        parts.append(f"<small>{KEY}</small>")
        self.summary.setText("<br><br>".join(parts))

    @staticmethod
    def _reference_lines(series: RunSeries) -> list[str]:
        """The reference trace's key and its |Δ loss| readout, under the run's figures."""
        if series.reference_error:
            return [f"<i>{html.escape(series.reference_error, quote=False)}</i>"]
        overlay = series.loss_overlay()
        if overlay is None:
            return []
        swatch = f"<span style='color:{REFERENCE_COLOUR}'><b>━━</b></span> "
        return [swatch + html.escape(overlay.label, quote=False),
                html.escape(overlay.readout(), quote=False)]

    def _draw_reference(self, key: str, series: RunSeries, x: str, use_log: bool) -> None:
        """The run's reference loss trace (smoothed as its loss is; on a time axis at the
        run's own times of its steps)."""
        overlay = series.loss_overlay()
        if overlay is None:
            return
        points = [(series.x_of_step(s, x), v) for s, v in zip(overlay.steps, overlay.loss)]
        points = [(a, b) for a, b in points if a is not None]
        ys = ema([b for _, b in points], self.controls.weight)
        rx, ry = _finite([a for a, _ in points], ys, use_log)
        curve = self._curve((key, "loss", "reference"), "loss",
                            pen=pg.mkPen(REFERENCE_COLOUR, width=REFERENCE_WIDTH))
        curve.setZValue(-1)
        curve.setData(rx, ry)

    def _draw_metric(self, metric: str) -> None:
        log, x = self.controls.log_scale.isChecked(), self.controls.x
        item = self._plot(metric)
        item.setLogMode(False, log and metric != "lr")
        item.setLabel("bottom", "step" if x == "step" else "seconds")
        if metric == "throughput":
            item.setLabel("left", " / ".join(sorted({s.throughput[1] for s in
                                                      self.series.values()})))
        drawn: list[float] = []
        for index, (key, series) in enumerate(self.series.items()):
            drawn += self._draw_series(metric, key, series, PALETTE[index % len(PALETTE)])
        if metric == "lr":
            fit_flat_line(item, drawn)
        if metric in SHOWN_WITH_DATA:     # rows of other recipes hold NaN here
            split = "val" if metric in VAL_PLOTS else "train"
            self.plot_widgets[metric].setVisible(any(
                _finite(*s.xy(metric, split=split, x=x), False)[0]
                for s in self.series.values()))
        self.redrawn.emit(metric)

    def _draw_series(self, metric: str, key: str, series: RunSeries, colour: str) -> list[float]:
        """One run's curves on one plot (its val and test losses, extra curves, clipped
        steps and the clip threshold, checkpoints and resumes); the values drawn."""
        log, x, weight = self.controls.log_scale.isChecked(), self.controls.x, \
            self.controls.weight
        use_log = log and metric != "lr"
        smooth = weight if metric in ("loss", "grad_norm") else 0.0
        source = series.throughput[0] if metric == "throughput" else metric
        split = "val" if metric in VAL_PLOTS else "train"
        xs, ys = _finite(*series.xy(source, split=split, x=x, smoothing=smooth), use_log)
        self._curve((key, metric), metric, pen=pg.mkPen(colour, width=2), symbol=(
            "o" if split == "val" else None), symbolSize=6,
            symbolBrush=colour).setData(xs, ys)
        if metric == "loss":
            self._draw_reference(key, series, x, use_log)
            for other, style in (("val", Qt.PenStyle.DashLine), ("test", Qt.PenStyle.DotLine)):
                vx, vy = _finite(*series.xy("loss", split=other, x=x), use_log)
                if vx or (key, metric, other) in self.curves:
                    self._curve((key, metric, other), metric,
                                pen=pg.mkPen(colour, width=2, style=style), symbol="o",
                                symbolSize=6, symbolBrush=colour).setData(vx, vy)
        for plot, role, extra, style in EXTRA_CURVES:
            if plot == metric:
                ex, ey = _finite(*series.xy(extra, split=split, x=x), use_log)
                if ex or (key, metric, role) in self.curves:
                    self._curve((key, metric, role), metric, pen=pg.mkPen(
                        colour, width=1, style=style)).setData(ex, ey)
        if metric == "grad_norm":
            self._draw_clipping(key, series, xs, use_log)
        self._markers(key, metric, series, x, (min(ys), max(ys)) if ys else None, colour)
        return ys

    def _draw_clipping(self, key: str, series: RunSeries, xs: list[float],
                       use_log: bool) -> None:
        """The clipped steps as crosses and the clip threshold as a dashed line."""
        cx, cy = _finite(*series.clipped_points(x=self.controls.x), use_log)
        self._curve((key, "grad_norm", "clipped"), "grad_norm", pen=None, symbol="x",
                    symbolSize=9, symbolPen=pg.mkPen("#a00", width=2)).setData(cx, cy)
        clip = series.clip_threshold
        self._curve((key, "grad_norm", "clip"), "grad_norm", pen=pg.mkPen(
            "#a00", width=1, style=Qt.PenStyle.DashLine)).setData(
            [min(xs), max(xs)] if clip and xs else [], [clip, clip] if clip and xs else [])

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
