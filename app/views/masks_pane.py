"""Labels & masks pane: an image with its mask overlaid (opacity, colour), the box derived from
the mask, contours and holes, brush/eraser editing with undo/redo, saved as a new version; a
segmentation run's per-image scores with each image's panels; an lm-sft run's supervised tokens.

At 1024x700 everything shows whole: record names wrap in their column, the evaluation picker
spans the tab above the table, the score table sizes its columns to their contents, and the
panels are drawn square (a mask's pixels stay square), as large as their cell allows."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QImage, QKeySequence, QPainter, QPen, QPixmap, QShortcut
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QColorDialog,
    QComboBox,
    QFormLayout,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QRadioButton,
    QSlider,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.masks import (
    MaskEditor,
    count_regions,
    mask_datasets,
    masked_records,
    open_mask_dataset,
    read_mask,
    read_per_image,
    read_rgb,
    save_mask_version,
    segmentation_evals,
)
from app.viewmodels.sft import parse_inspect_report
from app.viewmodels.workspace import Workspace, file_stamp
from app.views import layouts
from app.views.background import BackgroundCall
from app.views.combos import refill_keeping_choice
from app.views.engine_process import run_engine
from app.views.labels import FittedPicture, wrap_items
from engine.errors import ForgebenchError


def _qimage(rgba: np.ndarray) -> QImage:
    rgba = np.ascontiguousarray(rgba)
    h, w = rgba.shape[:2]
    return QImage(rgba.data, w, h, 4 * w, QImage.Format.Format_RGBA8888).copy()


class MaskCanvas(QWidget):
    """Draws image + overlay scaled to fit; mouse strokes edit the mask."""

    edited = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setMinimumSize(320, 320)
        self.image: np.ndarray | None = None
        self.editor: MaskEditor | None = None
        self.colour = QColor("#ff1744")
        self.opacity = 0.5
        self.show_contour = True
        self.show_holes = True
        self.show_box = True
        self.radius = 3
        self.erase = False
        self.setMouseTracking(False)

    def set_content(self, image: np.ndarray | None, editor: MaskEditor | None) -> None:
        self.image, self.editor = image, editor
        self.update()

    def _geometry(self) -> tuple[float, float, float]:
        h, w = self.editor.shape
        scale = min(self.width() / w, self.height() / h)
        return scale, (self.width() - w * scale) / 2, (self.height() - h * scale) / 2

    def to_image(self, pos: QPointF) -> tuple[float, float]:
        scale, ox, oy = self._geometry()
        return (pos.x() - ox) / scale - 0.5, (pos.y() - oy) / scale - 0.5

    def overlay(self) -> np.ndarray:
        """RGBA [H, W, 4]: mask fill, contour, holes (what the canvas draws over the image)."""
        mask = self.editor.mask
        rgba = np.zeros(mask.shape + (4,), np.uint8)
        rgba[mask] = (self.colour.red(), self.colour.green(), self.colour.blue(),
                      int(255 * self.opacity))
        if self.show_holes:
            rgba[self.editor.holes()] = (255, 214, 0, 200)
        if self.show_contour:
            rgba[self.editor.contour()] = (255, 255, 255, 255)
        return rgba

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor("#263238"))
        if self.image is None or self.editor is None:
            painter.setPen(QColor("#eceff1"))
            painter.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "No image")
            return
        scale, ox, oy = self._geometry()
        h, w = self.editor.shape
        target = QRectF(ox, oy, w * scale, h * scale)
        rgb = self.image
        rgba = np.concatenate([rgb, np.full(rgb.shape[:2] + (1,), 255, np.uint8)], axis=2)
        painter.drawImage(target, _qimage(rgba))
        painter.drawImage(target, _qimage(self.overlay()))
        box = self.editor.box()
        if self.show_box and box is not None:
            pen = QPen(QColor("#00e676"), 2)
            painter.setPen(pen)
            painter.drawRect(QRectF(ox + box[0] * w * scale, oy + box[1] * h * scale,
                                    (box[2] - box[0]) * w * scale, (box[3] - box[1]) * h * scale))

    def mousePressEvent(self, event) -> None:
        if self.editor is None:
            return
        self.editor.begin_stroke()
        self.mouseMoveEvent(event)

    def mouseMoveEvent(self, event) -> None:
        if self.editor is None:
            return
        x, y = self.to_image(event.position())
        self.editor.paint(x, y, self.radius, not self.erase)
        self.update()

    def mouseReleaseEvent(self, _event) -> None:
        if self.editor is None:
            return
        self.editor.end_stroke()
        self.edited.emit()


class PredictionsView(QWidget):
    """A segmentation run's eval: per-image IoU and boundary F1 in a sortable table (worst
    first), and the selected image's prediction next to its target."""

    PANELS = ("input", "prediction", "target", "probability")

    def __init__(self, parent=None):
        super().__init__(parent)
        self.source = QComboBox()
        self.source.currentIndexChanged.connect(self._source_chosen)
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["id", "label", "IoU", "boundary F1"])
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(
            QHeaderView.ResizeMode.ResizeToContents)
        self.table.currentCellChanged.connect(lambda row, *_: self._show(row))
        self.images = {name: FittedPicture(name, crisp=True) for name in self.PANELS}
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        grid = QGridLayout()          # two by two: each panel gets half the width, not a
        for k, (name, label) in enumerate(self.images.items()):    # quarter
            box = QVBoxLayout()
            box.addWidget(QLabel(name), 0, Qt.AlignmentFlag.AlignHCenter)
            box.addWidget(label, 1)
            grid.addLayout(box, k // 2, k % 2)
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.addLayout(grid, 1)
        rv.addWidget(self.summary)
        chooser = QHBoxLayout()
        chooser.addWidget(QLabel("Evaluation (run · split-checkpoint)"))
        chooser.addWidget(self.source, 1)
        splitter = QSplitter()
        splitter.addWidget(self.table)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setCollapsible(0, False)
        layout = QVBoxLayout(self)
        layout.addLayout(chooser)
        layout.addWidget(splitter, 1)
        self.rows: list[dict] = []
        self.workspace: Workspace | None = None
        self.loaded: tuple | None = None          # file_stamp of the table on show

    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.source.blockSignals(True)
        self.source.clear()          # a new workspace: its first evaluation is chosen
        self.source.blockSignals(False)
        self.refresh_runs()

    def refresh_runs(self) -> None:
        """New evaluations appear; the chosen one stays chosen, and is read again when its
        table was written again (a re-run `forgebench eval`)."""
        evals = segmentation_evals(self.workspace.run_dirs()) if self.workspace else []
        kept = refill_keeping_choice(self.source, [(label, str(f)) for label, f in evals])
        if not kept or self.loaded != file_stamp(self._table()):
            self._source_chosen()

    def _table(self) -> Path | None:
        folder = self.source.currentData()
        return Path(folder) / "per_image.jsonl" if folder else None

    def _source_chosen(self) -> None:
        folder = self.source.currentData()
        self.loaded = file_stamp(self._table())
        self.rows = read_per_image(Path(folder)) if folder else []
        self.table.setSortingEnabled(False)
        self.table.setRowCount(len(self.rows))
        for i, row in enumerate(self.rows):
            self.table.setItem(i, 0, QTableWidgetItem(str(row.get("id"))))
            self.table.setItem(i, 1, QTableWidgetItem(str(row.get("label", ""))))
            for column, key in ((2, "iou"), (3, "boundary_f1")):
                item = QTableWidgetItem()
                item.setData(Qt.ItemDataRole.DisplayRole, round(float(row.get(key, 0.0)), 4))
                item.setData(Qt.ItemDataRole.UserRole, i)
                self.table.setItem(i, column, item)
            self.table.item(i, 0).setData(Qt.ItemDataRole.UserRole, i)
        self.table.setSortingEnabled(True)
        self.table.sortItems(2, Qt.SortOrder.AscendingOrder)
        self._fit_table()
        self.summary.setText(f"{len(self.rows)} images; sorted by IoU, worst first. Click a "
                             "column header to sort by another score." if self.rows else
                             "No segmentation evaluations yet: run `forgebench eval` on an "
                             "image-segment run (its evals hold per-image scores).")
        if self.rows:
            self.table.selectRow(0)
            self._show(0)

    def _fit_table(self) -> None:
        """The score table is as wide as its columns: every score is in sight, none behind a
        sideways scroll; the panels take the rest."""
        header = self.table.horizontalHeader()
        columns = sum(max(self.table.sizeHintForColumn(c), header.sectionSizeHint(c))
                      for c in range(self.table.columnCount()))
        self.table.setMinimumWidth(columns + self.table.verticalScrollBar().sizeHint().width()
                                   + 2 * self.table.frameWidth())

    def shown_row(self) -> dict | None:
        row = self.table.currentRow()
        item = self.table.item(row, 0) if row >= 0 else None
        return self.rows[item.data(Qt.ItemDataRole.UserRole)] if item else None

    def _show(self, table_row: int) -> None:
        item = self.table.item(table_row, 0) if table_row >= 0 else None
        if item is None:
            return
        row = self.rows[item.data(Qt.ItemDataRole.UserRole)]
        for name, label in self.images.items():
            path = row["panels"].get(name)
            pixmap = QPixmap(str(path)) if path else QPixmap()
            if pixmap.isNull():
                label.set_source(pixmap)
                label.setText(f"{name}: no panel")
            else:
                label.set_source(pixmap)
        self.summary.setText(f"{row.get('id')}: IoU {row.get('iou', 0):.4f}, boundary F1 "
                             f"{row.get('boundary_f1', 0):.4f}")


class SftTokensView(QWidget):
    """What an lm-sft run will train on: each rendered sample with supervised tokens on green
    and masked (prompt, template) tokens in grey, truncated samples flagged."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.config = QComboBox()
        self.count = QSpinBox()
        self.count.setRange(1, 200)
        self.count.setValue(12)
        self.inspect_button = QPushButton("Inspect")
        self.inspect_button.clicked.connect(self.inspect)
        self.status = QLabel("Renders the samples with the base model's tokenizer and chat "
                             "template (`forgebench inspect-sft`).")
        self.status.setWordWrap(True)
        self.text = QTextBrowser()
        self.process = None
        self.samples: list = []
        row = QHBoxLayout()
        row.addWidget(QLabel("lm-sft config"))
        row.addWidget(self.config, 1)
        row.addWidget(QLabel("samples"))
        row.addWidget(self.count)
        row.addWidget(self.inspect_button)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.status)
        layout.addWidget(self.text, 1)

    def set_workspace(self, workspace: Workspace) -> None:
        self.config.clear()
        for path in workspace.config_files():
            if 'recipe = "lm-sft"' in path.read_text(encoding="utf-8", errors="replace"):
                self.config.addItem(path.stem, str(path))
        self.inspect_button.setEnabled(self.config.count() > 0)

    def inspect(self) -> None:
        path = self.config.currentData()
        if not path or self.process is not None:
            return
        self.inspect_button.setEnabled(False)
        self.status.setText("rendering samples…")
        self.process = run_engine(self, ["inspect-sft", path, "-n", str(self.count.value()),
                                         "--json"], self._done)

    def _done(self, out: str, err: str, _code: int) -> None:
        self.process = None
        self.inspect_button.setEnabled(True)
        try:
            self.samples, summary = parse_inspect_report(out)
        except (ValueError, AttributeError):
            self.samples = []
            self.status.setText("inspect-sft failed:\n" + err.strip()[-800:])
            self.text.clear()
            return
        self.status.setText(
            f"{summary.get('examples')} examples: {summary.get('kept')} kept, "
            f"{summary.get('truncated')} truncated, {summary.get('dropped')} dropped; "
            f"{summary.get('supervised_tokens')} of {summary.get('input_tokens')} tokens "
            "supervised. Green: supervised (the loss is computed there); grey: masked.")
        self.text.setHtml("".join(self._sample_html(s) for s in self.samples))

    @staticmethod
    def _sample_html(sample) -> str:
        badge = (" <span style='background:#c62828;color:white;'>&nbsp;TRUNCATED&nbsp;</span>"
                 if sample.truncated else "")
        body = "".join(
            f"<span style='background:#c8e6c9;color:#1b5e20'>{html.escape(text)}</span>"
            if supervised else f"<span style='color:#757575'>{html.escape(text)}</span>"
            for text, supervised in sample.spans)
        return (f"<p><b>line {sample.line}</b>: {sample.input_tokens} tokens, "
                f"{sample.supervised_tokens} supervised{badge}</p>"
                f"<pre style='white-space:pre-wrap'>{body}</pre><hr>")


class MasksPane(QWidget):
    message = Signal(str)
    dataset_saved = Signal(object)  # Path of the new version
    dataset_loaded = Signal()       # the chosen dataset is loaded (or refused) and shown

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.dataset = None             # the chosen dataset once loaded (open_mask_dataset)
        self.record: dict | None = None
        self.editor: MaskEditor | None = None
        self.loader = BackgroundCall(self)
        self.loader.done.connect(self._dataset_loaded)
        self.loader.failed.connect(self._dataset_failed)

        self.canvas = MaskCanvas()
        self.canvas.edited.connect(self._refresh_info)
        splitter = QSplitter()
        splitter.addWidget(self._dataset_column())
        splitter.addWidget(self.canvas)
        splitter.addWidget(self._controls())
        splitter.setSizes([230, 760, 290])
        self.predictions = PredictionsView()
        self.tabs = QTabWidget()
        self.tabs.addTab(splitter, "Mask editor")
        self.tabs.addTab(self.predictions, "Segmentation predictions")
        self.sft = SftTokensView()
        self.tabs.addTab(self.sft, "SFT tokens")
        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs)
        self._refresh_info()

    def _dataset_column(self) -> QWidget:
        self.dataset_combo = QComboBox()
        self.dataset_combo.currentIndexChanged.connect(self._dataset_chosen)
        self.record_list = wrap_items(QListWidget())      # "id  (label, split)" read whole
        self.record_list.currentRowChanged.connect(self._record_chosen)
        return layouts.column(QLabel("Mask dataset"), self.dataset_combo, (self.record_list, 1))

    def _tools(self) -> QHBoxLayout:
        """Brush or eraser (B / E) and how the canvas draws the mask."""
        self.brush = QRadioButton("&Brush")
        self.eraser = QRadioButton("&Eraser")
        self.brush.setChecked(True)
        tools = QButtonGroup(self)
        tools.addButton(self.brush)
        tools.addButton(self.eraser)
        self.eraser.toggled.connect(lambda on: setattr(self.canvas, "erase", on))
        QShortcut(QKeySequence("B"), self, lambda: self.brush.setChecked(True))
        QShortcut(QKeySequence("E"), self, lambda: self.eraser.setChecked(True))
        self.radius = QSpinBox()
        self.radius.setRange(1, 64)
        self.radius.setValue(3)
        self.radius.valueChanged.connect(lambda v: setattr(self.canvas, "radius", v))
        self.opacity = QSlider(Qt.Orientation.Horizontal)
        self.opacity.setRange(0, 100)
        self.opacity.setValue(50)
        self.opacity.valueChanged.connect(self._opacity_changed)
        self.colour_button = QPushButton("Overlay colour…")
        self.colour_button.clicked.connect(self._pick_colour)
        self.contour_box = QCheckBox("Contour")
        self.holes_box = QCheckBox("Holes")
        self.box_box = QCheckBox("Box from mask")
        for box, attr in ((self.contour_box, "show_contour"), (self.holes_box, "show_holes"),
                          (self.box_box, "show_box")):
            box.setChecked(True)
            box.toggled.connect(lambda on, a=attr: (setattr(self.canvas, a, on),
                                                    self.canvas.update()))
        row = QHBoxLayout()
        row.addWidget(self.brush)
        row.addWidget(self.eraser)
        return row

    def _controls(self) -> QWidget:
        tool_row = self._tools()
        self.undo_button = QPushButton("Undo")
        self.redo_button = QPushButton("Redo")
        self.save_button = QPushButton("Save as new dataset version")
        self.undo_button.clicked.connect(self.undo)
        self.redo_button.clicked.connect(self.redo)
        self.save_button.clicked.connect(self.save)
        QShortcut(QKeySequence.StandardKey.Undo, self, self.undo)
        QShortcut(QKeySequence.StandardKey.Redo, self, self.redo)
        self.info = QLabel()
        self.info.setWordWrap(True)
        controls = QWidget()
        form = QFormLayout(controls)
        form.addRow("Tool (B / E)", tool_row)
        form.addRow("Radius (px)", self.radius)
        form.addRow("Opacity", self.opacity)
        for widget in (self.colour_button, self.contour_box, self.holes_box, self.box_box):
            form.addRow(widget)
        history = QHBoxLayout()
        history.addWidget(self.undo_button)
        history.addWidget(self.redo_button)
        form.addRow(history)
        form.addRow(self.save_button)
        form.addRow(self.info)
        return controls

    def refresh_runs(self) -> None:
        """A run wrote a segmentation evaluation: the predictions tab shows it."""
        self.predictions.refresh_runs()

    def set_workspace(self, workspace: Workspace, select: Path | None = None) -> None:
        self.workspace = workspace
        self.predictions.set_workspace(workspace)
        self.sft.set_workspace(workspace)
        paths = mask_datasets(workspace.dataset_dirs())
        self.dataset_combo.blockSignals(True)
        self.dataset_combo.clear()
        for path in paths:
            self.dataset_combo.addItem(path.name, str(path))
        self.dataset_combo.blockSignals(False)
        index = next((i for i, p in enumerate(paths) if p == select), 0)
        if paths:
            self.dataset_combo.setCurrentIndex(index)
        self._dataset_chosen()

    def _dataset_chosen(self) -> None:
        """Load and validate the chosen dataset on a worker thread (it decodes every image
        and mask: seconds on the GUI thread); `dataset_loaded` fires when it is shown."""
        path = self.dataset_combo.currentData()
        self.record_list.clear()
        self.dataset = None
        self._show(None)
        if not path:
            self.loader.cancel()
            return
        self.info.setText(f"Loading and validating {Path(path).name}…")
        self.loader.start(lambda: open_mask_dataset(path))

    def _dataset_failed(self, exc: ForgebenchError) -> None:
        self.info.setText(f"This dataset does not validate:\n{exc.render()}")
        self.dataset_loaded.emit()

    def _dataset_loaded(self, dataset) -> None:
        self.dataset = dataset
        self._refresh_info()
        for label, record in masked_records(dataset):
            item = QListWidgetItem(label)
            item.setData(Qt.ItemDataRole.UserRole, record)
            self.record_list.addItem(item)
        if self.record_list.count():
            self.record_list.setCurrentRow(0)
        self.dataset_loaded.emit()

    def select_record(self, record_id: str) -> None:
        for i in range(self.record_list.count()):
            if self.record_list.item(i).data(Qt.ItemDataRole.UserRole)["id"] == record_id:
                self.record_list.setCurrentRow(i)
                return

    def _record_chosen(self, row: int) -> None:
        if row < 0:
            self._show(None)
            return
        self._show(self.record_list.item(row).data(Qt.ItemDataRole.UserRole))

    def _show(self, record: dict | None) -> None:
        self.record = record
        self.editor = None
        image = None
        if record is not None:
            try:
                image = read_rgb(record["image"])
                self.editor = MaskEditor(read_mask(record["mask"]))
            except ForgebenchError as exc:
                self.info.setText(exc.render())
                image = None
        self.canvas.set_content(image, self.editor)
        self._refresh_info()

    def _opacity_changed(self, value: int) -> None:
        self.canvas.opacity = value / 100
        self.canvas.update()

    def _pick_colour(self) -> None:
        colour = QColorDialog.getColor(self.canvas.colour, self, "Overlay colour")
        if colour.isValid():
            self.set_colour(colour)

    def set_colour(self, colour: QColor) -> None:
        self.canvas.colour = colour
        self.canvas.update()

    def undo(self) -> None:
        if self.editor:
            self.editor.undo()
            self.canvas.update()
            self._refresh_info()

    def redo(self) -> None:
        if self.editor:
            self.editor.redo()
            self.canvas.update()
            self._refresh_info()

    def _refresh_info(self) -> None:
        editor = self.editor
        self.undo_button.setEnabled(bool(editor and editor.can_undo))
        self.redo_button.setEnabled(bool(editor and editor.can_redo))
        self.save_button.setEnabled(bool(editor and editor.dirty))
        if editor is None:
            return
        box = editor.box()
        box_text = "none (empty mask)" if box is None else \
            "[" + ", ".join(f"{v:.3f}" for v in box) + "]"
        h, w = editor.shape
        self.info.setText(
            f"{self.record['id']} · {w}×{h}\n"
            f"foreground: {int(editor.mask.sum())} px\n"
            f"regions: {count_regions(editor.mask)} · holes: {count_regions(editor.holes())}\n"
            f"box (xyxy): {box_text}\n" + ("unsaved edits" if editor.dirty else "saved"))

    def save(self) -> Path | None:
        if not (self.editor and self.editor.dirty and self.dataset):
            return None
        try:
            saved = save_mask_version(self.dataset, self.record, self.editor)
        except ForgebenchError as exc:
            self.info.setText(exc.render())
            return None
        record_id = self.record["id"]
        self.message.emit(f"saved the edited mask as a new dataset version: {saved.root.name}")
        self.set_workspace(self.workspace, select=saved.root)
        self.select_record(record_id)
        self.dataset_saved.emit(saved.root)
        return saved.root
