"""The Runs pane's ledger at the size a 1024x700 window gives the pane: no sideways scroll
(the columns after "Step" used to need one), "105 / 100000" on one line and whole, a long run
name elided in the middle with the full name in its tooltip, and the fields the table does
not show listed for the selected run under the ledger, so nothing is lost."""

from __future__ import annotations

from layout_support import fits_one_line, labels_cut_off, shown_at
from PySide6.QtCore import Qt
from test_app_support import write_run

from app.viewmodels.workspace import Workspace
from app.views.runs_ledger import COLUMNS, SHOWN_COLUMNS
from app.views.runs_pane import RunsPane
from engine.fsutil import atomic_write_text

LONG = "lm-pretrain-tiny-20261201-181550-with-a-longer-name"


def ledger_workspace(root) -> Workspace:
    workspace = Workspace.create(root, name="ledger")
    run = write_run(workspace.runs_dir / LONG, steps=12)
    run.set_status("stopped", step=105, target_steps=100_000)
    atomic_write_text(run.path / "notes.json", '{"question": "does a longer warm-up help?", '
                                                '"notes": "baseline for the lr sweep"}')
    for name in ("image-segment-demo", "lm-pretrain-tiny-demo"):
        write_run(workspace.runs_dir / name, steps=40, state="completed")
    return workspace


def test_the_ledger_fits_beside_the_charts_and_loses_nothing(qtbot, tmp_path):
    pane = shown_at(qtbot, RunsPane())
    pane.set_workspace(ledger_workspace(tmp_path / "ws"))
    table, model = pane.table, pane.ledger
    row = model.paths().index(tmp_path / "ws" / "runs" / LONG)
    pane.select_run(model.rows[row].path)
    qtbot.waitUntil(lambda: pane.facts.isVisible())
    assert table.horizontalScrollBar().maximum() == 0
    metrics = table.fontMetrics()
    columns = {key: c for c, (key, _) in enumerate(COLUMNS)}
    for key in SHOWN_COLUMNS[1:]:           # status and step show whole
        for r in range(model.rowCount()):
            text = model.data(model.index(r, columns[key]))
            assert fits_one_line(table, text, columns[key]), (key, text)
    assert model.data(model.index(row, columns["progress"])) == "105 / 100000"
    assert len({table.rowHeight(r) for r in range(model.rowCount())}) == 1    # no wrapped row
    # the long name is elided in the middle; its tooltip holds it
    assert metrics.horizontalAdvance(LONG) > table.columnWidth(columns["name"])
    assert LONG in model.data(model.index(row, columns["name"]), Qt.ItemDataRole.ToolTipRole)
    # every other field of the selected run is listed under the ledger, whole
    facts = pane.facts.text()
    for key in ("started", "duration", "question", "data_version", "device", "best_metric",
                "notes"):
        value = model.data(model.index(row, columns[key]))
        assert table.isColumnHidden(columns[key]) and value in facts, key
    assert "does a longer warm-up help?" in facts and "baseline for the lr sweep" in facts
    qtbot.waitUntil(lambda: labels_cut_off(pane) == [])
    # a column shown from the header's menu leaves the list (the table holds it now)
    pane.ledger_view.show_column(columns["notes"], True)
    assert "baseline for the lr sweep" not in pane.facts.text()
    # twin: every column shown at once needs the sideways scroll the ledger used to have
    for c in range(len(COLUMNS)):
        pane.ledger_view.show_column(c, True)
    qtbot.waitUntil(lambda: table.horizontalScrollBar().maximum() > 0)
    assert pane.facts.isHidden()
