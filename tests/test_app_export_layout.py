"""The export wizard's verification table at the size a 1024x700 window gives the pane: every
column in view without a sideways scroll (the tokenizer and file columns needed one), titles
on two lines, each cell whole or, for a genuinely long file name, elided with its tooltip
holding it."""

from __future__ import annotations

from layout_support import CELL_MARGIN_PX, PANE_SIZE, fits_one_line, shown_at
from PySide6.QtCore import Qt

from app.viewmodels import export_wizard as vm
from app.views.export_wizard import ExportWizardPane, stacked
from engine.export.equivalence import MIN_TOP1_DENSE, MIN_TOP1_QUANTIZED, Report, verdict


def stage(name: str, file: str, top1: float) -> dict:
    found = {"name": name, "description": name, "file": file, "tokenizer_matches": True,
             "vs_checkpoint": {"top1_agreement": top1, "max_abs_logit_diff": 0.05681,
                               "mean_abs_logit_diff": 0.00648, "kl_mean": 4.36e-05},
             "greedy_vs_checkpoint": {"matches": [True] * 6}}
    return {**found, **verdict(found, MIN_TOP1_QUANTIZED if "q" in file else MIN_TOP1_DENSE)}


def report() -> dict:
    """A Q4_K_M export's report as the engine assembles it, llama.cpp's row included."""
    built = Report([{"prompt": "Record item", "answer": "0000? is in is"}],
                   [{"name": "checkpoint", "description": "ref", "positions": 10},
                    stage("dense", "lm-pretrain-tiny-demo-f16.gguf", 1.0),
                    stage("quantized", "lm-pretrain-tiny-demo-q4_k_m.gguf", 1.0)],
                   {"available": True, "answers": ["0000? is in is"],
                    **stage("llama.cpp", "lm-pretrain-tiny-demo-q4_k_m.gguf", 1.0)}).as_dict()
    built["export"] = {"dtype": "q4_k_m"}
    return built


def test_the_verification_table_fits_the_page_at_1024x700(qtbot):
    pane = shown_at(qtbot, ExportWizardPane())
    pane.pages.setCurrentIndex(3)
    pane.show_report(report())
    table = pane.stages
    qtbot.waitUntil(lambda: table.columnWidth(0) > 0 and table.isVisible())
    assert table.columnCount() == len(vm.LLM_COLUMNS)
    assert table.horizontalScrollBar().maximum() == 0
    header, metrics = table.horizontalHeader(), table.fontMetrics()
    for c, title in enumerate(vm.LLM_COLUMNS):
        assert header.sectionViewportPosition(c) + header.sectionSize(c) <= \
            table.viewport().width(), title                  # in view
        assert table.horizontalHeaderItem(c).text() == stacked(title)
        assert max(metrics.horizontalAdvance(line) for line in stacked(title).split("\n")) \
            + CELL_MARGIN_PX <= table.columnWidth(c), title
    last = len(vm.LLM_COLUMNS) - 1
    for r in range(table.rowCount()):
        for c in range(last):                               # whole
            text = table.item(r, c).text()
            assert fits_one_line(table, text, c), (r, c, text)
        file = table.item(r, last)                          # elided when it must be: tooltip
        assert file.toolTip() == file.text()
    assert table.item(1, 1).text() == "match (≥ 99%)" and "match (≥ 99%)" in \
        table.item(1, 1).data(Qt.ItemDataRole.ToolTipRole)
    # twin: the same table with its titles on one line needs the sideways scroll again
    table.setHorizontalHeaderLabels(list(vm.LLM_COLUMNS))
    qtbot.waitUntil(lambda: table.horizontalScrollBar().maximum() > 0)


def changed_report() -> dict:
    """The report of the screenshots' Q8_0 export: quantized stages "changed", the dense
    stage's file an intermediate with a long name (the widest verdict and file cells)."""
    built = Report([{"prompt": "Record item", "answer": "0000? is in is"}],
                   [{"name": "checkpoint", "description": "ref", "positions": 10},
                    stage("dense", "(intermediate)/lm-pretrain-tiny-demo-f32.gguf", 1.0),
                    stage("quantized", "model.gguf", 0.9949)],
                   {"available": True, "answers": ["0000? is in is"],
                    **stage("llama.cpp", "model.gguf", 0.9949)}).as_dict()
    built["export"] = {"dtype": "q8_0"}
    return built


def test_the_table_fits_when_the_page_scrolls_under_the_first_run_banners(qtbot):
    """With both first-run banners shown the pane is ~420 px tall: the verify page scrolls up
    and down inside the pane (its scroll bar takes width from the table), Back/Next stay
    below it, and the table still needs no sideways scroll."""
    pane = shown_at(qtbot, ExportWizardPane(), (PANE_SIZE[0], 420))
    pane.go(3)
    pane.show_report(changed_report())
    table = pane.stages
    qtbot.waitUntil(lambda: pane.page_scroll.verticalScrollBar().maximum() > 0)
    qtbot.waitUntil(lambda: table.columnWidth(0) > 0 and table.isVisible())
    qtbot.wait(50)
    assert table.horizontalScrollBar().maximum() == 0
    assert pane.next_button.geometry().bottom() <= pane.height()
    assert "changed" in table.item(2, 1).text()
    # twin: the steps list as wide as before leaves the table too little: a sideways scroll
    pane.steps.setFixedWidth(170)
    qtbot.waitUntil(lambda: table.horizontalScrollBar().maximum() > 0)


def test_the_bundle_page_keeps_save_in_view_after_a_tall_report(qtbot):
    """Each page scrolls by its own height: after an export's report fills the verify page
    (taller than the room: it scrolls), the short bundle page shows its Save button without
    scrolling (a stacked widget's height is its tallest page's)."""
    pane = shown_at(qtbot, ExportWizardPane(), (PANE_SIZE[0], 560))
    pane.go(3)
    pane.show_report(changed_report())
    pane.answers.setText(pane.answers.text() + "<br>" * 20)     # a long list of answers
    bar = pane.page_scroll.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0)                  # twin: the tall page scrolls
    pane.go(4)
    qtbot.waitUntil(lambda: bar.maximum() == 0)
    button = pane.finish_button
    top = button.mapTo(pane.page_scroll.viewport(), button.rect().topLeft()).y()
    assert button.isVisible() and top + button.height() <= pane.page_scroll.viewport().height()
