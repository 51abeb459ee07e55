"""Thumbnails decoded on a worker thread, so large image datasets never block the GUI."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, QRunnable, Qt, QThreadPool, Signal
from PySide6.QtGui import QImage, QPixmap


class _Signals(QObject):
    done = Signal(str, QImage)


class _Load(QRunnable):
    def __init__(self, path: str, size: int, signals: _Signals):
        super().__init__()
        self.path, self.size, self.signals = path, size, signals

    def run(self) -> None:
        image = QImage(self.path)  # QImage (unlike QPixmap) is safe off the GUI thread
        if not image.isNull():
            image = image.scaled(self.size, self.size, Qt.AspectRatioMode.KeepAspectRatio,
                                 Qt.TransformationMode.SmoothTransformation)
        self.signals.done.emit(self.path, image)


class ThumbnailCache(QObject):
    """`get(path)` returns a pixmap or None (and starts loading); `ready(path)` fires later."""

    ready = Signal(str)

    def __init__(self, size: int = 96, parent=None):
        super().__init__(parent)
        self.size = size
        self.cache: dict[str, QPixmap] = {}
        self.pending: set[str] = set()
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(2)
        self.signals = _Signals()
        self.signals.done.connect(self._done)

    def get(self, path: str | Path) -> QPixmap | None:
        key = str(path)
        if key in self.cache:
            return self.cache[key]
        if key not in self.pending:
            self.pending.add(key)
            self.pool.start(_Load(key, self.size, self.signals))
        return None

    def _done(self, path: str, image: QImage) -> None:
        self.pending.discard(path)
        self.cache[path] = QPixmap.fromImage(image)
        self.ready.emit(path)

    def clear(self) -> None:
        self.pool.clear()
        self.cache.clear()
        self.pending.clear()
