"""The data-side panes at the size a 1024x700 window gives them: the dataset, mask-record and
model lists wrap their long names (they were cut at "help-articles (help-articles-ha",
"(squa"); the gallery's thumbnails keep their cell and captions whether or not they have
arrived; the segmentation tab's evaluation picker, score table and square panels show whole;
the Models memory table and the import preview grow their rows instead of ending in "…"."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from chat_support import tiny_model
from layout_support import cells_cut_off, items_cut_off
from PIL import Image
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPixmap

from app.viewmodels import importers
from app.viewmodels.datasets import DatasetTable
from app.viewmodels.workspace import Workspace
from app.views.dataset_tabs.gallery import CAPTION_LINES, THUMBNAIL, GalleryTab
from app.views.datasets_pane import DatasetsPane
from app.views.masks_pane import MasksPane
from app.views.models_pane import ModelsPane
from engine.data.generators.records import generate_records
from engine.data.generators.shapes import generate_shapes

PANE_SIZE = (864, 640)      # the pane's area in a 1024x700 window (sidebar, menu, status bar)


def shown(qtbot, widget, size=PANE_SIZE):
    qtbot.addWidget(widget)
    widget.resize(*size)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def test_dataset_names_wrap_whole_in_the_list(qtbot, tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    planted = generate_shapes(workspace.datasets_dir / "shapes-with-an-error", n=4)
    records = planted / "records.jsonl"
    lines = records.read_text().splitlines()
    lines[1] = lines[1].replace('"label": "', '"label": "hexagon-', 1)   # an unknown label
    records.write_text("\n".join(lines) + "\n")
    generate_records(workspace.datasets_dir / "help-articles-handbook", n=20)
    pane = shown(qtbot, DatasetsPane())
    with qtbot.waitSignal(pane.table_loaded, timeout=60_000):
        pane.set_workspace(workspace)
    listing = pane.dataset_list
    texts = [listing.item(i).text() for i in range(listing.count())]
    assert texts[1].startswith("shapes-with-an-error (shapes)\nimage-masks · ")
    qtbot.waitUntil(lambda: listing.horizontalScrollBar().maximum() == 0)
    assert items_cut_off(listing) == []
    assert all(listing.item(i).toolTip().startswith(texts[i]) for i in range(len(texts)))
    # twin: the long first line is wider than the column, so it did need to wrap
    metrics = listing.fontMetrics()
    assert metrics.horizontalAdvance("shapes-with-an-error (shapes)") > \
        listing.viewport().width()
    # The planted error's findings (a changed file, an unknown label) wrap in their tab.
    with qtbot.waitSignal(pane.table_loaded, timeout=60_000):
        listing.setCurrentRow(1)
    pane.tabs.setCurrentWidget(pane.findings_tab)
    findings = pane.findings_tab
    texts = [findings.item(i).text() for i in range(findings.count())]
    assert any("unknown label 'hexagon-" in t for t in texts)
    qtbot.waitUntil(lambda: findings.horizontalScrollBar().maximum() == 0)
    assert items_cut_off(findings) == []
    assert max(map(metrics.horizontalAdvance, texts)) > findings.viewport().width()   # twin


def test_gallery_items_hold_thumbnail_and_caption_before_and_after_thumbnails(qtbot, tmp_path):
    table = DatasetTable(generate_shapes(tmp_path / "shapes", n=6))
    tab = shown(qtbot, GalleryTab())
    line = tab.view.fontMetrics().lineSpacing()

    def rects() -> list:
        return [tab.view.visualRect(tab.gallery.index(i)) for i in range(len(table.images))]

    def hold(rect) -> bool:
        return rect.width() >= THUMBNAIL and rect.height() >= THUMBNAIL + CAPTION_LINES * line

    tab.set_table(table)
    # No event has run since: no thumbnail can have arrived (they come by queued signal),
    # and visualRect lays the items out now, as the first paint would.
    assert not tab.gallery.thumbs.cache
    before = rects()
    assert all(map(hold, before)), before
    qtbot.waitUntil(lambda: len(tab.gallery.thumbs.cache) == len(table.images), timeout=30_000)
    after = rects()
    assert [r.size() for r in after] == [r.size() for r in before]
    assert all(map(hold, after))
    assert f"{table.images[0][0]}\n" in tab.gallery.data(tab.gallery.index(0),
                                                         Qt.ItemDataRole.ToolTipRole)
    # twin: with no size set up front, the items are measured without their thumbnails
    # and come out as a thin strip (what 2 of 4 renders showed)
    tab.gallery.cell = QSize()
    tab.set_table(DatasetTable(generate_shapes(tmp_path / "other", n=6, seed=1)))
    assert not any(map(hold, rects()))


def write_eval(folder: Path, n: int = 12) -> None:
    """A per-image segmentation eval with 64x64 mask panels, as image-segment writes it."""
    (folder / "panels").mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for k in range(n):
        panels = {}
        for name in ("input", "prediction", "target", "probability"):
            panels[name] = f"panels/shape-{k:05d}-{name}.png"
            mask = np.zeros((64, 64), np.uint8)
            mask[8 + k:40, 10:50 - k] = 255
            pixels = rng.integers(0, 255, (64, 64, 3), np.uint8) if name == "input" else mask
            Image.fromarray(pixels).save(folder / panels[name])
        lines.append(json.dumps({"id": f"shape-{k:05d}", "label": "triangle",
                                 "iou": 0.1 * k, "boundary_f1": 0.05 * k, "panels": panels}))
    (folder / "per_image.jsonl").write_text("\n".join(lines) + "\n")


def test_masks_records_picker_scores_and_square_panels_show_whole(qtbot, tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    generate_shapes(workspace.datasets_dir / "shapes", n=6)
    run = workspace.runs_dir / "image-segment-demo"
    run.mkdir()
    (run / "run.json").write_text('{"recipe": "image-segment"}')
    write_eval(run / "evals" / "val-step-000120")
    pane = shown(qtbot, MasksPane())
    with qtbot.waitSignal(pane.dataset_loaded, timeout=60_000):
        pane.set_workspace(workspace)
    records = pane.record_list
    assert records.item(0).text().startswith("shape-00000  (")
    assert records.horizontalScrollBar().maximum() == 0
    assert items_cut_off(records) == []

    pane.tabs.setCurrentWidget(pane.predictions)
    view = pane.predictions
    qtbot.waitUntil(lambda: view.table.isVisible())
    assert view.source.currentText() == "image-segment-demo · val-step-000120"
    assert view.source.width() >= view.source.sizeHint().width()       # the whole name
    assert view.table.horizontalScrollBar().maximum() == 0               # every score column
    assert cells_cut_off(view.table) == []
    for name, panel in view.images.items():
        pixmap = panel.pixmap()
        area = panel.contentsRect()
        assert pixmap.width() == pixmap.height(), name                   # 64x64 stays square
        assert pixmap.width() <= area.width() and pixmap.height() <= area.height(), name
        assert pixmap.width() >= min(area.width(), area.height()) - 1, name  # as big as fits
        assert pixmap.width() > 64, name
    # Nearest-neighbour: the scaled mask holds only the mask's own two values.
    target = view.images["target"].pixmap().toImage()
    values = {target.pixelColor(x, y).value() for x in range(0, target.width(), 3)
              for y in range(0, target.height(), 3)}
    assert values == {0, 255}
    # twin: a smooth rescale of the same mask (what the check would see) has grey edges
    smooth = QPixmap(str(run / "evals" / "val-step-000120" / "panels" /
                         f"{view.shown_row()['id']}-target.png")).scaled(
        target.width(), target.height(), Qt.AspectRatioMode.KeepAspectRatio,
        Qt.TransformationMode.SmoothTransformation).toImage()
    assert {smooth.pixelColor(x, y).value() for x in range(smooth.width())
            for y in range(smooth.height())} - {0, 255}


def test_models_list_and_memory_table_show_whole(qtbot, tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    source = tiny_model(tmp_path / "src", "gemma3-270m-q4-k-m-long-name-for-a-library.gguf")
    damaged = tmp_path / "damaged-download.gguf"
    damaged.write_bytes(source.read_bytes()[:5000])
    pane = shown(qtbot, ModelsPane())
    pane.set_workspace(workspace)
    qtbot.waitUntil(lambda: not pane.busy)
    for path in (source, damaged):
        pane.add_file(str(path))
        qtbot.waitUntil(lambda: not pane.busy, timeout=30_000)
    assert pane.list.count() == 2
    pane.list.setCurrentRow(0)
    assert pane.list.horizontalScrollBar().maximum() == 0
    assert items_cut_off(pane.list) == []
    assert all(pane.list.item(i).toolTip().startswith(pane.list.item(i).text())
               for i in range(2))
    memory = pane.memory
    reason = memory.item(3, 2).text()
    assert reason.startswith("full fine-tuning needs a dense base")
    qtbot.waitUntil(lambda: memory.rowHeight(3) > memory.rowHeight(0))   # wrapped, grown
    assert cells_cut_off(memory) == [] and cells_cut_off(pane.tensors) == []
    assert memory.height() >= memory.horizontalHeader().height() + sum(
        memory.rowHeight(r) for r in range(memory.rowCount()))         # no row hidden
    # twin: a row held at one line's height (as before) cuts the reason
    memory.setRowHeight(3, memory.rowHeight(0))
    assert cells_cut_off(memory) == [reason]


def test_import_preview_rows_grow_so_the_mask_column_is_whole(qtbot, tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    source = tmp_path / "shape-photos"
    for label in ("circle", "triangle"):      # enough rows for a vertical scroll bar
        (source / label).mkdir(parents=True)
        for i in range(16):
            name = f"{label}/shape-{i:05d}"
            Image.fromarray(np.full((64, 64, 3), 15 * i, np.uint8)).save(source / f"{name}.png")
            Image.fromarray(np.zeros((64, 64), np.uint8)).save(
                source / f"{name}{importers.MASK_SUFFIX}")
    pane = shown(qtbot, DatasetsPane())
    pane.set_workspace(workspace)
    wizard = pane.open_import("images")
    shown(qtbot, wizard, (1024, 700))
    wizard.with_masks.setChecked(True)
    wizard.source_path.setText(str(source))
    with qtbot.waitSignal(wizard.plan_ready, timeout=60_000):
        qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    preview = wizard.preview
    columns = [preview.horizontalHeaderItem(c).text() for c in range(preview.columnCount())]
    assert columns[-1] == "mask" and preview.item(0, len(columns) - 1).text() == \
        "masks/circle/shape-00000.png"
    # the rows overflow: once the vertical scroll bar takes its share of the width
    qtbot.waitUntil(lambda: preview.verticalScrollBar().isVisible())
    assert cells_cut_off(preview) == []
    assert preview.item(0, 0).toolTip() == preview.item(0, 0).text()
    # twin: squeezed to one line's height, the wrapped mask path is cut again
    preview.verticalHeader().setSectionResizeMode(preview.verticalHeader().ResizeMode.Interactive)
    preview.setRowHeight(0, preview.fontMetrics().height())
    preview.setColumnWidth(len(columns) - 1, preview.fontMetrics().horizontalAdvance("masks/"))
    assert cells_cut_off(preview)
    wizard.close()
