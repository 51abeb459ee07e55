"""Plain Python calls off the GUI thread: `BackgroundCall` runs a Qt-free function (reading a
GGUF's tensor table, estimating export sizes) on a worker thread and hands its result or its
error back through a signal. Cancel drops the result: the window never waits for it.

Engine *commands* run as subprocesses (`engine_process.py`); this is for the view-models' own
reads, which are file parsing the GUI thread must not do itself.
"""

from __future__ import annotations

from typing import Any, Callable

import shiboken6
from PySide6.QtCore import QObject, QThread, Signal

from engine.errors import ForgebenchError


class _Worker(QThread):
    succeeded = Signal(object)
    failed = Signal(object)

    def __init__(self, function: Callable[[], Any], parent=None):
        super().__init__(parent)
        self.function = function

    def run(self) -> None:
        try:
            result = self.function()
        except ForgebenchError as exc:
            self.failed.emit(exc)
        except (OSError, ValueError, KeyError) as exc:   # a damaged or unreadable file
            self.failed.emit(ForgebenchError(f"{type(exc).__name__}: {exc}"))
        except Exception as exc:    # a bug: said, not left as a call that never ends
            self.failed.emit(ForgebenchError(f"internal error: {type(exc).__name__}: {exc}",
                                             hint="please report it"))
        else:
            self.succeeded.emit(result)


class BackgroundCall(QObject):
    """At most one call at a time per owner; a newer `start` or `cancel` drops the older
    result. `done(result)` or `failed(ForgebenchError)` arrive on the GUI thread."""

    done = Signal(object)
    failed = Signal(object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.worker: _Worker | None = None
        self._workers: set[_Worker] = set()     # kept alive until their thread ends

    @property
    def running(self) -> bool:
        return self.worker is not None

    def start(self, function: Callable[[], Any]) -> None:
        self.cancel()
        worker = _Worker(function)
        self.worker = worker
        self._workers.add(worker)
        worker.succeeded.connect(lambda result: self._finish(worker, result, self.done))
        worker.failed.connect(lambda exc: self._finish(worker, exc, self.failed))
        worker.finished.connect(lambda: self._workers.discard(worker))
        worker.start()

    def cancel(self) -> None:
        self.worker = None

    def wait(self, ms: int = 30_000) -> bool:
        """For tests and shutdown: block until every thread this owner started has ended
        (a thread object destroyed while it runs would abort the process)."""
        return all(worker.wait(ms) for worker in list(self._workers))

    def _finish(self, worker: _Worker, value, signal) -> None:
        # The owner (a dialog, say) may have been closed and deleted while the thread ran:
        # then nobody waits for the result, and Qt's side of this object is gone.
        if worker is self.worker and shiboken6.isValid(self):
            self.worker = None
            signal.emit(value)
