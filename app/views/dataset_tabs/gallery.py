"""Gallery tab: a dataset's images as a grid of thumbnails made on a worker thread;
activating one opens its record."""

from __future__ import annotations

from PySide6.QtCore import QAbstractListModel, QModelIndex, QSize, Qt, Signal
from PySide6.QtWidgets import QListView

from app.viewmodels.datasets import DatasetTable
from app.views.thumbnails import ThumbnailCache


class GalleryModel(QAbstractListModel):
    """Images of a dataset as a grid; thumbnails come from the worker-thread cache."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.items: list[tuple[str, str, int]] = []  # (label text, image path, row index)
        self.item_of: dict[str, int] = {}
        self.thumbs = ThumbnailCache(96, self)
        self.thumbs.ready.connect(self._ready)

    def set_table(self, table: DatasetTable | None) -> None:
        self.beginResetModel()
        self.thumbs.clear()
        self.items = table.images if table else []
        self.item_of = {path: i for i, (_, path, _) in enumerate(self.items)}
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return len(self.items)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        caption, path, _ = self.items[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return caption
        if role == Qt.ItemDataRole.DecorationRole:
            return self.thumbs.get(path)
        return None

    def _ready(self, path: str) -> None:
        if path in self.item_of:
            index = self.index(self.item_of[path])
            self.dataChanged.emit(index, index, [Qt.ItemDataRole.DecorationRole])


class GalleryTab(QListView):
    jump = Signal(int)          # the record's index in the table

    def __init__(self, parent=None):
        super().__init__(parent)
        self.gallery = GalleryModel(self)
        self.setViewMode(QListView.ViewMode.IconMode)
        self.setIconSize(QSize(96, 96))
        self.setGridSize(QSize(120, 140))
        self.setUniformItemSizes(True)
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setLayoutMode(QListView.LayoutMode.Batched)
        self.setModel(self.gallery)
        self.activated.connect(lambda index: self.jump.emit(self.gallery.items[index.row()][2]))

    def set_table(self, table: DatasetTable | None) -> None:
        self.gallery.set_table(table)
