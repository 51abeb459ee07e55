"""A 50,000-record JSONL dataset in the datasets pane: it loads off the GUI thread (validated
in a subprocess, parsed on a worker thread: no record is read on the GUI thread, and the
longest event-loop gap is printed, not asserted), the table shows pages of rows, and filters
and sorts see every record. Expected counts come from the generating loop, not from the app."""

from __future__ import annotations

import json

from app_wait import GuiThreadGuard
from PySide6.QtCore import Qt
from test_app_runs import LoopWatch

from app.views.dataset_tabs.records import RecordsModel
from app.views.datasets_pane import DatasetsPane
from engine.data.dataset import write_manifest

N = 50_000
PLANTED = 31_234  # the line whose split is misspelt


def _big_sft(root):
    root.mkdir()
    lines = []
    for i in range(N):
        record = {"id": f"r{i:05d}", "instruction": f"Say item {i} like a pirate",
                  "response": f"Arr, item {i} it be" + (" ahoy" if i % 7 == 0 else ""),
                  "group": f"g{i // 5}", "split": "val" if i % 10 == 0 else "train"}
        if i + 1 == PLANTED:
            record["split"] = "trian"
        lines.append(json.dumps(record))
    (root / "records.jsonl").write_text("\n".join(lines) + "\n")
    write_manifest(root, "text-sft", "big")
    return root


def test_fifty_thousand_records_stay_responsive(qtbot, tmp_path, monkeypatch):
    guard = GuiThreadGuard(monkeypatch).guard_the_window()
    root = _big_sft(tmp_path / "big")
    pane = DatasetsPane()
    qtbot.addWidget(pane)
    pane.resize(1200, 800)
    pane.show()
    qtbot.wait(50)

    watch = LoopWatch()
    watch.start()
    with qtbot.waitSignal(pane.table_loaded, timeout=120_000):
        pane.open_dataset(root)
        assert pane.loading and "loading" in pane.header.text()
    qtbot.wait(300)  # the first paint of the new table happens inside the window too
    watch.stop()
    print(f"longest event-loop gap while loading {N} records: {watch.max_gap_ms} ms over "
          f"{watch.ticks} ticks")
    assert watch.ticks > 20  # the 10 ms watch timer really ran while the worker parsed
    assert guard.on_gui == [] and "app.viewmodels.datasets.read_raw_records" in guard.off_gui

    # Paged: the view holds one page; scrolling to the end fetches the next.
    records = pane.records_tab
    assert len(pane.table.rows) == N and "1 error(s)" in pane.header.text()
    assert records.proxy.rowCount() == RecordsModel.PAGE
    records.view.scrollToBottom()
    qtbot.waitUntil(lambda: records.proxy.rowCount() > RecordsModel.PAGE, timeout=5000)

    # Filters and sorts see all 50,000 records.
    expected_ahoy = sum(1 for i in range(N) if i % 7 == 0)
    records.filter.setText("ahoy")
    assert records.proxy.rowCount() == expected_ahoy
    assert records.filter_count.text() == f"{expected_ahoy} of {N} match"
    records.filter.setText("split=val ahoy")
    assert records.proxy.rowCount() == sum(1 for i in range(N) if i % 70 == 0)
    records.filter.setText("has:error")
    assert records.proxy.rowCount() == 1
    assert records.proxy.index(0, 0).data() == f"line {PLANTED}"
    records.filter.setText("")
    id_column = records.records.columns.index("id")
    records.view.sortByColumn(id_column, Qt.SortOrder.DescendingOrder)
    assert records.proxy.rowCount() == N
    assert records.proxy.index(0, id_column).data() == f"r{N - 1:05d}"
    assert records.proxy.index(N - 1, id_column).data() == "r00000"
    # Selecting a record under a sort opens that record in the editor.
    records.view.selectRow(2)
    assert json.loads(records.editor.toPlainText())["id"] == f"r{N - 3:05d}"
    # Jumping to the planted record from the findings list, through a filter that hides it.
    records.filter.setText("split=val")
    pane.findings_tab.itemActivated.emit(pane.findings_tab.item(0))
    assert records.current_row() == PLANTED - 1
    assert json.loads(records.editor.toPlainText())["split"] == "trian"
    # Validate again: the verdict arrives when the background load is done.
    with qtbot.waitSignal(pane.message, timeout=120_000) as verdict:
        qtbot.mouseClick(pane.validate_button, Qt.MouseButton.LeftButton)
        assert pane.loading
    assert verdict.args == ["big: 1 error(s)"]
    assert len(pane.table.rows) == N


def test_filter_rows_and_sort_order_match_a_brute_force_reference(tmp_path):
    from app.viewmodels.datasets import DatasetTable

    root = tmp_path / "small"
    root.mkdir()
    records = [{"id": f"r{i:03d}", "instruction": f"Say ITEM {i}", "response": "Arr" +
                (" ahoy" if i % 3 == 0 else ""), "split": "val" if i % 4 == 0 else "train",
                "score": (i * 7) % 11} for i in range(120)]
    records[50]["split"] = "trian"
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_manifest(root, "text-sft", "small")
    table = DatasetTable(root)

    def reference(i: int, text: str) -> bool:
        """Words match anywhere in the record or its "line N" (text is JSON-escaped here)."""
        record = records[i]
        for word in text.split():
            if word == "has:error":
                ok = record["split"] not in ("train", "val")
            elif "=" in word:
                key, value = word.split("=")
                ok = str(record.get(key)) == value
            else:
                ok = word.lower() in f"{json.dumps(record)} line {i + 1}".lower()
            if not ok:
                return False
        return True

    for text in ("ahoy", "item 11", "split=val", "split=val ahoy", "has:error", "score=3",
                 "nothing-matches"):
        assert table.filter_rows(text) == [i for i in range(120) if reference(i, text)], text
    assert table.sort_order("score") == sorted(range(120), key=lambda i: records[i]["score"])
    assert table.sort_order("score", descending=True) == \
        sorted(range(120), key=lambda i: records[i]["score"], reverse=True)
    assert table.sort_order("id", descending=True) == list(range(119, -1, -1))
