"""Labels that wrap: a long message (an engine error with a path, an explanation) wraps inside
the width it is given and never sets the window's minimum width, so no button is pushed off a
1024-pixel screen."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel


def wrapped_label(text: str = "", selectable: bool = False) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    label.setMinimumWidth(1)
    if selectable:
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label
