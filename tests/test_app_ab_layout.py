"""The Blind A/B pane at the size a 1024x700 window gives it: the revealed results never break
a word ("tie s", "image-generat e-demo" were seen), and long "run/checkpoint" system names
wrap in the setup column instead of hiding their checkpoint behind a sideways scroll."""

from __future__ import annotations

from layout_support import field_text_fits, forced_breaks, items_cut_off, shown_at
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QListWidgetItem

from app.views.ab_pane import ABPane, results_html

A, B, C = ("image-generate-demo/step-000020", "image-generate-demo/step-000040",
           "lm-pretrain-tiny-20261201-175439/step-000100")


def pair(a, b, wins_a, wins_b, ties, rate, low, high):
    return {"a": a, "b": b, "wins_a": wins_a, "wins_b": wins_b, "ties": ties, "win_rate_a": rate,
            "ci_low": low, "ci_high": high}


RESULTS = {
    "systems": [A, B, C], "answered": 10, "planned": 10, "raters": ["me"],
    "pairs": [pair(A, B, 6, 2, 1, 0.722, 0.402, 0.910), pair(A, C, 1, 0, 0, 1.0, 0.207, 1.0),
              pair(B, C, 0, 0, 1, 0.5, 0.095, 0.905)],
    "bradley_terry": {A: 1.7, B: 0.6, C: 0.7},
    "items": [{"item": "class circle, seed7, sample 1", "answers": 2, "wins": {A: 1, B: 1},
               "ties": 0, "skips": 0}],
    "agreement": {"pairs": 0}, "recorded_differences": []}


def shown_pane(qtbot) -> ABPane:
    return shown_at(qtbot, ABPane())


def test_revealed_results_break_no_word_at_1024x700(qtbot):
    pane = shown_pane(qtbot)
    pane.results.setHtml(results_html(RESULTS, reveal=True))
    document = pane.results.document()
    assert document.textWidth() <= pane.results.viewport().width() + 1
    text = pane.results.toPlainText()
    assert all(name in text for name in (A, B, C)) and "[0.402, 0.910]" in text
    assert forced_breaks(document) == []
    # twin: the same check finds a word Qt had to break, in a column squeezed below it
    pane.results.setHtml(f"<table border=1><tr><td>{'x' * 80}</td><td>{'y' * 80}</td>"
                         f"<td>{'z' * 80}</td></tr></table>")
    assert forced_breaks(pane.results.document())


def test_long_system_names_wrap_in_the_setup_column(qtbot):
    pane = shown_pane(qtbot)
    for name in (A, B, C, "shapes-generator/step-001000"):
        item = QListWidgetItem(name)
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
        item.setCheckState(Qt.CheckState.Unchecked)
        pane.systems.addItem(item)
    qtbot.waitUntil(lambda: pane.systems.visualItemRect(pane.systems.item(2)).height()
                    > pane.systems.visualItemRect(pane.systems.item(0)).height())
    assert pane.systems.horizontalScrollBar().maximum() == 0
    assert items_cut_off(pane.systems) == []
    # twin: the longest name is wider than the column, so it did need to wrap
    metrics = pane.systems.fontMetrics()
    assert metrics.horizontalAdvance(C) > pane.systems.viewport().width()


def test_session_names_show_whole_in_the_setup_column(qtbot):
    """A shipped example's session name was shown as "ample-sound-checkpoints", and the earlier
    sessions picker cut it to "example-sound-check"."""
    pane = shown_pane(qtbot)
    name = "example-sound-checkpoints"
    pane.name.setText(name)
    pane.sessions.addItem(name)
    qtbot.waitUntil(lambda: pane.name.width() > 0)
    assert field_text_fits(pane.name) and field_text_fits(pane.sessions)
    # twin: a field as narrow as the old label-beside-field row cannot hold it
    pane.name.setFixedWidth(150)
    pane.sessions.setFixedWidth(150)
    assert not field_text_fits(pane.name) and not field_text_fits(pane.sessions)
