"""Checks that text in a widget shows whole at the size it is given: list items wrapped, not
run off under a sideways scroll, table cells as tall as their wrapped text (not ending in "…"),
and rich text broken only where the Unicode line-breaking rules allow (Qt breaks a word
anywhere when a table column is squeezed below it)."""

from __future__ import annotations

from PySide6.QtCore import QRect, Qt, QTextBoundaryFinder
from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import QLabel, QListWidget, QStyle, QTableWidget, QWidget

PANE_SIZE = (864, 640)      # a pane's area in a 1024x700 window (sidebar, menu, status bar)


def shown_at(qtbot, widget: QWidget, size: tuple[int, int] = PANE_SIZE) -> QWidget:
    """`widget` shown (and exposed) at `size`, closed with the test."""
    qtbot.addWidget(widget)
    widget.resize(*size)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def items_cut_off(widget: QListWidget) -> list[str]:
    """The items whose text does not fit inside the list's viewport as it is laid out."""
    if widget.horizontalScrollBar().maximum() > 0:
        return [widget.item(row).text() for row in range(widget.count())
                if widget.visualItemRect(widget.item(row)).width() > widget.viewport().width()]
    metrics = widget.fontMetrics()
    cut = []
    for row in range(widget.count()):
        item = widget.item(row)
        shown = widget.visualItemRect(item)
        needed = metrics.boundingRect(QRect(0, 0, shown.width(), 10_000),
                                      Qt.TextFlag.TextWordWrap, item.text())
        if shown.height() < needed.height():
            cut.append(item.text())
    return cut


CELL_MARGIN_PX = 6          # the padding a table cell keeps around its text
FIELD_MARGIN_PX = {"line edit": 16, "combo box": 40}    # frame and margins; a combo's arrow


def fits_one_line(table: QTableWidget, text: str, column: int) -> bool:
    """`text` fits on one line in `column` of a table that elides rather than wraps."""
    return table.fontMetrics().horizontalAdvance(text) + CELL_MARGIN_PX <= \
        table.columnWidth(column)


def field_text_fits(field) -> bool:
    """A QLineEdit's text, or a QComboBox's current text, fits the field's width."""
    combo = hasattr(field, "currentText")
    text = field.currentText() if combo else field.text()
    room = field.width() - FIELD_MARGIN_PX["combo box" if combo else "line edit"]
    return field.fontMetrics().horizontalAdvance(text) <= room


def cells_cut_off(table: QTableWidget) -> list[str]:
    """The texts of the cells that do not fit their cell, wrapped at its width (less the
    margins the item delegate leaves either side), as the table is laid out."""
    margin = table.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, table) + 1
    metrics = table.fontMetrics()
    cut = []
    for row in range(table.rowCount()):
        for column in range(table.columnCount()):
            item = table.item(row, column)
            if item is None or not item.text():
                continue
            shown = table.visualItemRect(item)
            needed = metrics.boundingRect(QRect(0, 0, shown.width() - 2 * margin, 10_000),
                                          Qt.TextFlag.TextWordWrap, item.text())
            if needed.height() > shown.height() or needed.width() > shown.width() - 2 * margin:
                cut.append(item.text())
    return cut


def forced_breaks(document: QTextDocument) -> list[tuple[str, str]]:
    """(before, after) for every line break of the laid-out `document` that falls where the
    line-breaking rules give no break opportunity: inside a word."""
    breaks = []
    block = document.begin()
    while block.isValid():
        text, layout = block.text(), block.layout()
        finder = QTextBoundaryFinder(QTextBoundaryFinder.BoundaryType.Line, text)
        for line in range(1, layout.lineCount()):
            start = layout.lineAt(line).textStart()
            finder.setPosition(start)
            if not finder.isAtBoundary():
                breaks.append((text[:start], text[start:]))
        block = block.next()
    return breaks


def labels_cut_off(widget: QWidget) -> list[str]:
    """The visible word-wrapped labels under `widget` that are shorter than their text."""
    return [label.text() for label in widget.findChildren(QLabel)
            if label.isVisible() and label.wordWrap() and label.text()
            and label.height() < label.heightForWidth(label.width())]
