"""The Transcripts pane: a speech-recognize run's evaluated clips, each played with its
reference and hypothesis aligned word by word and the errors marked (the alignment and its
markup live in app/viewmodels/transcripts.py; waveform, spectrogram and level-controlled
playback are the Samples pane's AudioView)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QLabel,
    QListWidget,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.audio import Player
from app.viewmodels import transcripts as vm
from app.viewmodels.workspace import Workspace
from app.views.combos import RunFilePicker
from app.views.labels import wrap_items
from app.views.samples_pane import AudioView

NO_RUN = ("Choose a speech-recognize run. Its evaluations (forgebench eval RUN --split val) "
          "list every clip here with its reference and hypothesis aligned.")


class TranscriptsPane(QWidget):
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.clips: list[vm.Clip] = []
        self.picker = RunFilePicker(
            "Evaluation", vm.speech_runs,
            lambda run: [(f.name[:-len(vm.SUFFIX)], str(f)) for f in vm.transcript_files(run)])
        self.picker.chosen.connect(self._eval_chosen)
        self.run_combo, self.eval_combo = self.picker.run_combo, self.picker.file_combo
        # A clip's error count and flags end its label, and they are what the list is scanned
        # for: labels wrap at the list's width instead of running off under the splitter.
        self.list = wrap_items(QListWidget())
        self.list.currentRowChanged.connect(self._clip_chosen)
        self.alignment = QLabel(NO_RUN)
        self.alignment.setWordWrap(True)
        self.alignment.setTextFormat(Qt.TextFormat.RichText)
        self.details = QLabel()
        self.details.setWordWrap(True)
        self.audio = AudioView(Player())
        self.audio.message.connect(self.message)

        detail = QWidget()
        right = QVBoxLayout(detail)
        right.addWidget(self.alignment)
        right.addWidget(self.details)
        right.addWidget(self.audio, 1)
        splitter = QSplitter()
        splitter.addWidget(self.list)
        splitter.addWidget(detail)
        splitter.setSizes([320, 640])
        layout = QVBoxLayout(self)
        layout.addWidget(self.picker)
        layout.addWidget(splitter, 1)

    def set_workspace(self, workspace: Workspace) -> None:
        self.picker.set_workspace(workspace)

    def refresh_runs(self) -> None:
        """New runs and evaluations appear; the chosen run, evaluation and clip stay chosen,
        and the chosen evaluation is read again when its file was written again."""
        self.picker.refresh()

    def _eval_chosen(self, _path, rewritten: bool) -> None:
        self._load_clips(max(self.list.currentRow(), 0) if rewritten else 0)

    def _load_clips(self, row: int) -> None:
        data = self.eval_combo.currentData()
        self.clips = vm.load_clips(data) if data else []
        self.list.clear()
        self.list.addItems([vm.clip_label(c) for c in self.clips])
        if self.clips:
            self.list.setCurrentRow(min(row, len(self.clips) - 1))
        else:
            self.alignment.setText(NO_RUN)
            self.details.clear()

    def _clip_chosen(self, row: int) -> None:
        if not 0 <= row < len(self.clips):
            return
        clip = self.clips[row]
        self.alignment.setText(vm.alignment_html(clip.reference, clip.hypothesis))
        self.details.setText(f"beam: {clip.beam or '(empty)'}" + (
            f" · review flags: {', '.join(clip.flags)} (not to be trusted)" if clip.flags
            else ""))
        flags = ("<b style='color:#b71c1c'>flagged: " + ", ".join(clip.flags) + "</b>"
                 if clip.flags else "<b style='color:#2e7d32'>no review flags</b>")
        self.audio.show_file(Path(clip.path), flags)

    def play(self) -> None:
        self.audio.play()
