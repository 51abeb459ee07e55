"""Labels and lists that wrap: a long message (an engine error with a path, an explanation) or
list item wraps inside the width it is given and never sets the window's minimum width or
hides behind a sideways scroll, so nothing is cut off on a 1024-pixel screen."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QListWidget


def wrapped_label(text: str = "", selectable: bool = False) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    label.setMinimumWidth(1)
    if selectable:
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


def wrap_items(widget: QListWidget) -> QListWidget:
    """`widget`, its items made to wrap inside its width (each item as tall as its text needs)
    instead of running off under a sideways scroll: a long name is read whole in a narrow
    column."""
    widget.setWordWrap(True)
    widget.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    widget.setResizeMode(QListWidget.ResizeMode.Adjust)
    return widget
