"""Refilling a combo box while the workspace changes under it, without losing the user's
choice or firing a spurious "chosen" signal; and the run-and-file picker the Transcripts and
Reports panes share."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QWidget

from app.viewmodels.workspace import file_stamp


def refill_keeping_choice(combo: QComboBox, items: list[tuple[str, object]]) -> bool:
    """Replace the (text, data) items; the chosen data stays chosen when it is still there.
    True when it was kept (no signal fires); False when the first item is chosen instead
    (the caller treats that as a new choice)."""
    current = combo.currentData()
    combo.blockSignals(True)
    combo.clear()
    for text, data in items:
        combo.addItem(text, data)
    index = combo.findData(current) if current is not None else -1
    combo.setCurrentIndex(max(index, 0))
    combo.blockSignals(False)
    return index >= 0


class RunFilePicker(QWidget):
    """A run of the workspace and one of its files (an evaluation, a report) in two labelled
    combos, refilled as the workspace changes: `refresh()` keeps both choices where they still
    exist, and `chosen(path, rewritten)` fires when the chosen file changes (`rewritten` False)
    or was written again since it was shown (True: the pane keeps its place in it)."""

    chosen = Signal(object, bool)

    def __init__(self, file_label: str, runs_of, files_of, parent=None):
        """`runs_of(run folders)` picks the (label, run path) choices among the workspace's
        runs; `files_of(run path)` gives a run's (label, file path) choices."""
        super().__init__(parent)
        self.workspace = None
        self.runs_of, self.files_of = runs_of, files_of
        self.loaded: tuple | None = None       # file_stamp of the file the pane shows
        self.run_combo = QComboBox()
        self.file_combo = QComboBox()
        for combo in (self.run_combo, self.file_combo):
            combo.setMinimumContentsLength(20)
        self.run_combo.currentIndexChanged.connect(self._run_chosen)
        self.file_combo.currentIndexChanged.connect(lambda *_: self._file_chosen(False))
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        for label, combo in (("Run", self.run_combo), (file_label, self.file_combo)):
            row.addWidget(QLabel(label))
            row.addWidget(combo, 1)

    def set_workspace(self, workspace) -> None:
        self.workspace = workspace
        self.refresh()

    def refresh(self) -> None:
        runs = self.runs_of(self.workspace.run_dirs() if self.workspace else [])
        if not refill_keeping_choice(self.run_combo, runs):
            self._run_chosen()
        elif not self._fill_files():
            self._file_chosen(False)
        elif self.loaded != file_stamp(self.file_combo.currentData()):
            self._file_chosen(True)

    def _run_chosen(self, *_) -> None:
        self._fill_files()
        self._file_chosen(False)

    def _fill_files(self) -> bool:
        run = self.run_combo.currentData()
        return refill_keeping_choice(self.file_combo, self.files_of(run) if run else [])

    def _file_chosen(self, rewritten: bool) -> None:
        path = self.file_combo.currentData()
        self.loaded = file_stamp(path)
        self.chosen.emit(path, rewritten)
