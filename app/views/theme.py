"""Light or dark, following the desktop's colour scheme (Qt 6.5+ `styleHints().colorScheme()`),
and again whenever it changes.

- `apply(app, scheme=None)`: the Fusion style with a dark palette for a dark desktop, the
  style's own palette for a light one; `scheme` forces one (tests, screenshots).
- `style(widget, template)`: a widget's style sheet written with the theme's named colours
  (`{muted}`, `{tour_bg}`, …, see `COLOURS`) and written again when the scheme changes, so a
  banner or a note is never dark text on a dark window (or pale text on a white one).
- `colour(name)`: one named colour of the current scheme.
"""

from __future__ import annotations

import weakref

import shiboken6
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QLabel, QStyleFactory, QWidget

# name: (light, dark). Banners keep their hue in both; text on them keeps a 4.5:1 contrast.
COLOURS = {
    "text": ("#212121", "#e8eaed"),
    "muted": ("#455a64", "#b0bec5"),
    "facts": ("#37474f", "#cfd8dc"),
    "stage": ("#1565c0", "#90caf9"),
    "error": ("#b71c1c", "#ffcdd2"),
    "error_bg": ("#ffebee", "#4a1c1f"),
    "error_border": ("#e57373", "#e57373"),
    "tour_bg": ("#e3f2fd", "#102a43"),
    "tour_border": ("#1565c0", "#64b5f6"),
    "offer_bg": ("#f1f8e9", "#1e2d14"),
    "offer_border": ("#558b2f", "#8bc34a"),
    "problem_bg": ("#fff3e0", "#3e2a10"),
    "problem_border": ("#ef6c00", "#ffb74d"),
    "panel_bg": ("#ffffff", "#1e1f22"),
    # a run's state in the ledger
    "running": ("#1565c0", "#90caf9"), "completed": ("#2e7d32", "#a5d6a7"),
    "failed": ("#c62828", "#ef9a9a"), "stopped": ("#6d4c41", "#d7ccc8"),
    "stopping": ("#bf360c", "#ffcc80"), "queued": ("#6a1b9a", "#ce93d8"),
}
DARK_PALETTE = {
    QPalette.ColorRole.Window: "#2b2d30", QPalette.ColorRole.WindowText: "#e8eaed",
    QPalette.ColorRole.Base: "#1e1f22", QPalette.ColorRole.AlternateBase: "#26282b",
    QPalette.ColorRole.Text: "#e8eaed", QPalette.ColorRole.Button: "#34373b",
    QPalette.ColorRole.ButtonText: "#e8eaed", QPalette.ColorRole.ToolTipBase: "#34373b",
    QPalette.ColorRole.ToolTipText: "#e8eaed", QPalette.ColorRole.Highlight: "#3d6fb4",
    QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.Link: "#8ab4f8",
    QPalette.ColorRole.PlaceholderText: "#9aa0a6", QPalette.ColorRole.BrightText: "#ff8a80",
    QPalette.ColorRole.Light: "#4a4d52", QPalette.ColorRole.Midlight: "#3d4045",
    QPalette.ColorRole.Mid: "#2f3135", QPalette.ColorRole.Dark: "#1a1b1e",
    QPalette.ColorRole.Shadow: "#000000",
}
DISABLED_TEXT = "#7f8389"

_dark = False
_styled: "weakref.WeakKeyDictionary[QWidget, str]" = weakref.WeakKeyDictionary()
_light_style: str | None = None


def desktop_is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    return hints.colorScheme() == Qt.ColorScheme.Dark


def is_dark() -> bool:
    return _dark


def colour(name: str) -> str:
    return COLOURS[name][1 if _dark else 0]


def _sheet(template: str) -> str:
    return template.format(**{name: colour(name) for name in COLOURS})


def style(widget: QWidget, template: str) -> None:
    """Set `widget`'s style sheet from `template` (named colours in braces, literal braces
    doubled) now and on every change of scheme."""
    _styled[widget] = template
    widget.setStyleSheet(_sheet(template))


def dark_palette() -> QPalette:
    palette = QPalette()
    for role, value in DARK_PALETTE.items():
        palette.setColor(role, QColor(value))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText,
                 QPalette.ColorRole.ButtonText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, QColor(DISABLED_TEXT))
    return palette


def apply(app: QApplication, scheme: Qt.ColorScheme | None = None) -> bool:
    """Dress the application for `scheme` (else the desktop's); True when dark. The first call
    also follows the desktop's later changes."""
    global _dark, _light_style
    if _light_style is None:
        _light_style = app.style().name()
        QGuiApplication.styleHints().colorSchemeChanged.connect(lambda _: apply(app))
    dark = desktop_is_dark() if scheme is None else scheme == Qt.ColorScheme.Dark
    _dark = dark
    if dark:
        app.setStyle(QStyleFactory.create("Fusion"))
        app.setPalette(dark_palette())
    else:
        app.setStyle(QStyleFactory.create(_light_style) or QStyleFactory.create("Fusion"))
        app.setPalette(app.style().standardPalette())
    for widget, template in list(_styled.items()):
        if shiboken6.isValid(widget):       # a window closed since keeps its Python wrapper
            widget.setStyleSheet(_sheet(template))
        else:
            del _styled[widget]
    for widget in app.allWidgets():     # a styled widget keeps the palette it was polished in
        # restyling one widget can delete another still in this list (a closed window's
        # children): touch only those still alive
        if shiboken6.isValid(widget) and widget.styleSheet() and widget not in _styled:
            widget.setStyleSheet(widget.styleSheet())
    # A label's link takes the palette's link colour when its text is parsed: parsed again
    # once the new palette has reached it, a "What does this mean?" link is not the light
    # theme's dark blue on dark grey.
    QTimer.singleShot(0, lambda: _relink(app))
    return dark


def _relink(app: QApplication) -> None:
    for widget in app.allWidgets():
        if isinstance(widget, QLabel) and "<a " in widget.text():
            text = widget.text()
            widget.setText("")          # the same text again would not be parsed again
            widget.setText(text)
