"""Refilling a combo box while the workspace changes under it, without losing the user's
choice or firing a spurious "chosen" signal."""

from __future__ import annotations

from PySide6.QtWidgets import QComboBox


def refill_keeping_choice(combo: QComboBox, items: list[tuple[str, object]]) -> bool:
    """Replace the (text, data) items; the chosen data stays chosen when it is still there.
    True when it was kept (no signal fires); False when the first item is chosen instead
    (the caller treats that as a new choice)."""
    current = combo.currentData()
    combo.blockSignals(True)
    combo.clear()
    for text, data in items:
        combo.addItem(text, data)
    index = combo.findData(current) if current is not None else -1
    combo.setCurrentIndex(max(index, 0))
    combo.blockSignals(False)
    return index >= 0
