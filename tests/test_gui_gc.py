"""The window's garbage policy (app/views/gui_gc.py): automatic collection off, cycles collected
from a timer on the GUI thread, so no widget is ever destroyed on a worker thread."""

from __future__ import annotations

import gc
import threading

from app.views.gui_gc import GuiThreadCollector


class Cycle:
    """An object in a reference cycle that records the thread it is finalised on."""

    finalised_on: list[int] = []

    def __init__(self):
        self.me = self

    def __del__(self):
        Cycle.finalised_on.append(threading.get_ident())


def test_cycles_made_on_a_worker_are_collected_on_the_gui_thread(qtbot):
    collector = GuiThreadCollector(interval_ms=50)
    try:
        assert not gc.isenabled()
        Cycle.finalised_on.clear()

        def churn():             # past every generation's threshold, on a worker thread
            for _ in range(50 * gc.get_threshold()[0]):
                Cycle()
        worker = threading.Thread(target=churn)
        worker.start()
        worker.join()
        assert Cycle.finalised_on == []          # nothing collected where they were made
        qtbot.waitUntil(lambda: len(Cycle.finalised_on) > 0, timeout=5000)
        assert set(Cycle.finalised_on) == {threading.get_ident()}
    finally:
        collector.stop()


def test_nothing_is_collected_below_the_thresholds(qtbot):
    """The twin: the timer collects only past a threshold, so a lone cycle stays until then."""
    collector = GuiThreadCollector(interval_ms=10_000)
    try:
        gc.collect()
        Cycle.finalised_on.clear()
        Cycle()
        collector.check()
        assert Cycle.finalised_on == []
        gc.collect()
        assert Cycle.finalised_on == [threading.get_ident()]
    finally:
        collector.stop()
