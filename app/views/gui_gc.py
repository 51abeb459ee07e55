"""Cyclic garbage collected on the GUI thread only.

Python's collector runs on whichever thread happens to allocate past its threshold. In a Qt
program that can be a worker thread (a BackgroundCall, a dataset loader), and then any widget in
the garbage is destroyed there: ~QObject takes Qt's connection lock and waits for the GIL,
while the GUI thread may hold the GIL and wait for that lock (seen: the test suite hung so, with
a worker inside ~QWidget and the GUI thread inside QObject::connect). `collect_on_gui_thread`
turns automatic collection off and collects from a timer on the GUI thread instead, generation
by generation at the collector's own thresholds (as pyqtgraph's GarbageCollector does; not
imported from there because pyqtgraph loads only with the first chart, after the window paints).
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer


class GuiThreadCollector(QObject):
    def __init__(self, interval_ms: int = 1000, parent: QObject | None = None):
        super().__init__(parent)
        self.thresholds = gc.get_threshold()
        gc.disable()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.check)
        self.timer.start(interval_ms)

    def check(self) -> None:
        """Collect each generation whose count has passed the collector's own threshold."""
        counts = gc.get_count()
        generation = -1
        for g in range(3):
            if counts[g] <= self.thresholds[g]:
                break
            generation = g
        if generation >= 0:
            gc.collect(generation)

    def stop(self) -> None:
        self.timer.stop()
