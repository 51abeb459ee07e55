"""Labels and lists that wrap: a long message (an engine error with a path, an explanation) or
list item wraps inside the width it is given and never sets the window's minimum width or
hides behind a sideways scroll, so nothing is cut off on a 1024-pixel screen; and pictures that
take the size the layout gives them."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import QLabel, QListWidget, QSizePolicy


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


class FittedPicture(QLabel):
    """A picture drawn as large as the label allows, keeping its aspect ratio: `crisp`
    (nearest-neighbour) for a small image whose pixels are the content (a 64x64 mask), smooth
    for a rendered plot."""

    def __init__(self, text: str = "", parent=None, crisp: bool = False):
        super().__init__(text, parent)
        self.source = QPixmap()
        self.transformation = (Qt.TransformationMode.FastTransformation if crisp
                               else Qt.TransformationMode.SmoothTransformation)
        self.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.setMinimumSize(96, 96)
        # The layout gives the size; the pixmap follows it (never the reverse, or each
        # rescale would ask for more room).
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Ignored)

    def set_source(self, pixmap: QPixmap) -> None:
        self.source = pixmap
        self._rescale()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._rescale()

    def _rescale(self) -> None:
        if not self.source.isNull():
            self.setPixmap(self.source.scaled(self.contentsRect().size(),
                                              Qt.AspectRatioMode.KeepAspectRatio,
                                              self.transformation))
