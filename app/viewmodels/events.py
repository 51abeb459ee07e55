"""Announcements from a view-model to whoever listens, without Qt: a plain observer list.

A view-model owns one `Listeners` per event it announces (`ledger.settled`, ...); a view
connects its slot (`ledger.settled.connect(self._run_settled)`) and a test connects a list's
`append`. Callbacks run synchronously, in connection order, on the thread that emits: the views
emit from the GUI thread (their polls run there), so a slot may touch widgets.
"""

from __future__ import annotations

from typing import Callable


class Listeners:
    """The callbacks connected to one event."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[..., None]] = []

    def connect(self, callback: Callable[..., None]) -> None:
        self._callbacks.append(callback)

    def disconnect(self, callback: Callable[..., None]) -> None:
        self._callbacks.remove(callback)

    def emit(self, *args) -> None:
        for callback in list(self._callbacks):      # a slot may disconnect itself
            callback(*args)
