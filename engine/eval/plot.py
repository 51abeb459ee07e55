"""Small unit-square line charts as PNG bytes, drawn with Pillow (no plotting library needed).

`unit_plot(series, title, x_label, y_label)` draws each series — (label, xs, ys, colour,
markers) — on axes from 0 to 1 with a grid at tenths and a legend; it serves the PR curve of
`tabular-classify` and the risk-coverage curve of `lm-decision`. `reliability_plot` draws
reliability bins (engine.eval.binary.reliability) against the diagonal, for both.
"""

from __future__ import annotations

import io
from typing import Sequence

from PIL import Image, ImageDraw

WIDTH, HEIGHT, MARGIN = 520, 420, 56
Series = tuple[str, Sequence[float], Sequence[float], str, bool]


def unit_plot(series: list[Series], title: str, x_label: str, y_label: str) -> bytes:
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = MARGIN, 36, WIDTH - 16, HEIGHT - MARGIN

    def at(x: float, y: float) -> tuple[float, float]:
        return left + x * (right - left), bottom - y * (bottom - top)

    for tick in range(11):
        value = tick / 10
        draw.line([at(value, 0), at(value, 1)], fill="#e6e6e6")
        draw.line([at(0, value), at(1, value)], fill="#e6e6e6")
        if tick % 2 == 0:
            x, y = at(value, 0)
            draw.text((x - 8, y + 6), f"{value:.1f}", fill="black")
            x, y = at(0, value)
            draw.text((x - 30, y - 6), f"{value:.1f}", fill="black")
    draw.rectangle([left, top, right, bottom], outline="black")
    draw.text(((left + right) / 2 - 3 * len(title), 4), title, fill="black")
    draw.text(((left + right) / 2 - 3 * len(x_label), bottom + 26), x_label, fill="black")
    draw.text((4, top - 14), y_label, fill="black")
    for index, (label, xs, ys, colour, markers) in enumerate(series):
        points = [at(x, y) for x, y in zip(xs, ys)]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        if markers:
            for x, y in points:
                draw.ellipse([x - 3, y - 3, x + 3, y + 3], outline=colour, fill=colour)
        legend_y = top + 8 + 14 * index
        draw.line([(right - 150, legend_y + 6), (right - 130, legend_y + 6)], fill=colour, width=2)
        draw.text((right - 124, legend_y), label, fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


RELIABILITY_COLOURS = ("#bf3f1f", "#1f5fbf")   # e.g. before and after calibration


def reliability_plot(reliabilities: dict[str, list[dict]], title: str, x_label: str,
                     y_label: str) -> bytes:
    """Each labelled set of reliability bins as points (mean probability, observed fraction)
    over the ideal diagonal; empty bins are left out."""
    series: list[Series] = [("ideal", [0, 1], [0, 1], "#999999", False)]
    for colour, (label, rows) in zip(RELIABILITY_COLOURS, reliabilities.items()):
        full = [r for r in rows if r["count"]]
        series.append((label, [r["mean_probability"] for r in full],
                       [r["positive_fraction"] for r in full], colour, True))
    return unit_plot(series, title, x_label, y_label)
