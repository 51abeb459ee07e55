"""Small layout builders the panes' constructors share: a row and a column of widgets, where
an item given as (widget, stretch) takes that stretch factor."""

from __future__ import annotations

from PySide6.QtWidgets import QBoxLayout, QHBoxLayout, QVBoxLayout, QWidget


def _fill(layout: QBoxLayout, items) -> QBoxLayout:
    for item in items:
        widget, stretch = item if isinstance(item, tuple) else (item, 0)
        layout.addWidget(widget, stretch)
    return layout


def row(*items) -> QHBoxLayout:
    """The widgets left to right."""
    return _fill(QHBoxLayout(), items)


def column(*items) -> QWidget:
    """A widget holding the widgets top to bottom, with no margin of its own."""
    box = QWidget()
    layout = _fill(QVBoxLayout(box), items)
    layout.setContentsMargins(0, 0, 0, 0)
    return box
