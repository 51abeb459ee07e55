"""Gallery tab: a dataset's images as a grid of thumbnails made on a worker thread, or an audio
dataset's clips, each played (at the level of `app.audio`) when activated; activating an image
opens its record. With no sound device the tab says so and everything else keeps working.

Every image item has one fixed size, set up front from the thumbnail size and two caption lines
(`GalleryModel.cell`): the grid's layout never measures an item whose thumbnail has not arrived
yet, so it cannot come out as a thin strip without captions whatever the timing."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QAbstractListModel, QModelIndex, QSize, Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QListView, QPushButton, QVBoxLayout, QWidget

from app.audio import Player
from app.viewmodels.datasets import DatasetTable
from app.viewmodels.samples import waveform
from app.views.thumbnails import ThumbnailCache

THUMBNAIL = 96          # px, the longer side of a thumbnail
CAPTION_LINES = 2       # "id" and "label" under each thumbnail


class GalleryModel(QAbstractListModel):
    """Images (with thumbnails from the worker-thread cache) or clips of a dataset."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.items: list[tuple[str, str, int]] = []  # (label text, media path, row index)
        self.item_of: dict[str, int] = {}
        self.audio = False
        self.cell = QSize()     # an image item's size (GalleryTab sets it from its font)
        self.thumbs = ThumbnailCache(THUMBNAIL, self)
        self.thumbs.ready.connect(self._ready)

    def set_table(self, table: DatasetTable | None) -> None:
        self.beginResetModel()
        self.thumbs.clear()
        self.audio = bool(table and table.clips)
        self.items = (table.clips if self.audio else table.images) if table else []
        self.item_of = {path: i for i, (_, path, _) in enumerate(self.items)}
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return len(self.items)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        caption, path, _ = self.items[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return "▶ " + caption.replace("\n", " · ") if self.audio else caption
        if role == Qt.ItemDataRole.DecorationRole and not self.audio:
            return self.thumbs.get(path)
        if role == Qt.ItemDataRole.ToolTipRole:     # the whole caption, however long
            return f"{caption}\n{Path(path).name}"
        if role == Qt.ItemDataRole.SizeHintRole and not self.audio:
            return self.cell
        return None

    def _ready(self, path: str) -> None:
        if path in self.item_of:
            index = self.index(self.item_of[path])
            self.dataChanged.emit(index, index, [Qt.ItemDataRole.DecorationRole])


class GalleryTab(QWidget):
    jump = Signal(int)          # the record's index in the table

    def __init__(self, parent=None):
        super().__init__(parent)
        self.player: Player | None = None      # opened on the first audio dataset
        self.view = QListView()
        self.gallery = GalleryModel(self)
        self.view.setViewMode(QListView.ViewMode.IconMode)
        self.view.setIconSize(QSize(THUMBNAIL, THUMBNAIL))
        line = self.view.fontMetrics().lineSpacing()
        self.gallery.cell = QSize(THUMBNAIL + 24, THUMBNAIL + CAPTION_LINES * line + 12)
        self.view.setGridSize(self.gallery.cell)
        self.view.setUniformItemSizes(True)
        self.view.setResizeMode(QListView.ResizeMode.Adjust)
        self.view.setLayoutMode(QListView.LayoutMode.Batched)
        self.view.setModel(self.gallery)
        self.view.activated.connect(self._activated)
        self.hint = QLabel()
        self.hint.setWordWrap(True)
        self.hint.setMinimumWidth(1)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(lambda: self.player and self.player.stop())
        row = QHBoxLayout()
        row.addWidget(self.hint, 1)
        row.addWidget(self.stop_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(row)
        layout.addWidget(self.view, 1)
        self._show_hint()

    def set_table(self, table: DatasetTable | None) -> None:
        self.gallery.set_table(table)
        if self.gallery.audio and self.player is None:
            self.player = Player()
        # Clips are a list of whole names; images a grid of thumbnails.
        audio = self.gallery.audio
        self.view.setViewMode(QListView.ViewMode.ListMode if audio
                              else QListView.ViewMode.IconMode)
        self.view.setGridSize(QSize() if audio else self.gallery.cell)
        self._show_hint()

    def _show_hint(self) -> None:
        audio = self.gallery.audio
        self.stop_button.setVisible(audio and bool(self.player and self.player.available))
        self.hint.setVisible(audio)
        if audio:
            self.hint.setText(self.player.problem + " — the clips are listed; play them in "
                              "another program" if self.player.problem else
                              "Double-click a clip (or press Enter) to play it, at a quiet level.")

    def _activated(self, index) -> None:
        caption, path, row = self.gallery.items[index.row()]
        if not self.gallery.audio:
            self.jump.emit(row)
            return
        self.play(index.row())

    def play(self, item: int) -> bool:
        """Play the clip of one gallery item; False (and the reason shown) when it cannot."""
        _, path, _ = self.gallery.items[item]
        try:
            wave, rate = waveform(Path(path))
        except (OSError, RuntimeError) as exc:      # soundfile: a missing or broken file
            self.hint.setText(f"cannot read {Path(path).name}: {exc}")
            return False
        ok = self.player is not None and self.player.play(wave, rate)
        self.hint.setText(f"playing {Path(path).name}" if ok else
                          str(self.player.problem if self.player else "no player"))
        return ok
