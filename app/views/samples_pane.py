"""The Samples pane: image grids (checkpoint × seed × class) with the nearest training image on
demand, audio clips with waveform, spectrogram, integrity flags and level-controlled playback,
BEFORE/AFTER text for LLM runs, rubric ratings, and a cancellable "generate samples" job."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QSize, Qt, Signal
from PySide6.QtGui import QIcon, QPixmap
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QScrollArea,
    QSlider,
    QSpinBox,
    QSplitter,
    QStackedWidget,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.audio import MAX_GAIN_DB, MIN_GAIN_DB, Player
from app.viewmodels import samples as vm
from app.viewmodels.workspace import Workspace
from app.views.charts import use_plot_style
from app.views.combos import refill_keeping_choice
from app.views.job_runner import JobRunner
from engine.errors import ForgebenchError

CELL = 96
NO_RUN = ("Choose a run. Image and audio generator runs show their samples here; LLM runs "
          "their BEFORE/AFTER generations.")
EMPTY_RUN = ("{name} has no samples yet. Generator runs: choose a checkpoint and press "
             "Generate samples. LLM runs write their answers when they save a checkpoint.")


# Below this a plot shows only its title (seen at ~15 px in a 1024x700 window): a column too
# short for both plots scrolls instead of squashing them.
PLOT_MIN_HEIGHT = 120


class ClipPlot(pg.PlotWidget):
    """A plot that asks for its minimum height (a graphics view asks for 480 px, which a
    scrolling column would give it, leaving screens of blank space); it still grows where its
    layout has room."""

    def __init__(self, title: str):
        use_plot_style()
        super().__init__()
        self.getPlotItem().setTitle(title, size="9pt")     # whole in a ~300 px column
        self.setMinimumHeight(PLOT_MIN_HEIGHT)

    def sizeHint(self) -> QSize:
        return QSize(super().sizeHint().width(), PLOT_MIN_HEIGHT)


class ColumnScroll(QScrollArea):
    """A column that scrolls up and down only: as wide as its content needs (two images side
    by side, the rubric's choices), so nothing is cut at its right edge."""

    def __init__(self, content: QWidget):
        super().__init__()
        self.setWidget(content)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        content.installEventFilter(self)

    def minimumSizeHint(self) -> QSize:
        width = self.widget().minimumSizeHint().width() + \
            self.verticalScrollBar().sizeHint().width()
        return QSize(width, super().minimumSizeHint().height())

    def eventFilter(self, watched, event) -> bool:
        if event.type() == QEvent.Type.LayoutRequest:
            self.updateGeometry()       # an image shown or hidden changes the width it needs
        return super().eventFilter(watched, event)


class AudioView(QWidget):
    """Waveform and spectrogram of one clip, its integrity flags, and playback."""

    message = Signal(str)

    def __init__(self, player: Player, parent=None):
        super().__init__(parent)
        self.player = player
        self.wave: np.ndarray | None = None
        self.rate = 16_000
        self.wave_plot = ClipPlot("waveform (as written, not normalized)")
        self.wave_plot.setYRange(-1, 1)
        self.wave_curve = self.wave_plot.plot(pen=pg.mkPen("#1565c0", width=1))
        self.spec_plot = ClipPlot("spectrogram (log |STFT|)")
        self.spec_image = pg.ImageItem()
        self.spec_image.setColorMap(pg.colormap.get("viridis"))
        self.spec_plot.addItem(self.spec_image)
        self.flags = QLabel()
        self.flags.setWordWrap(True)
        self.play_button = QPushButton("▶ Play")
        self.play_button.clicked.connect(self.play)
        self.level = QSlider(Qt.Orientation.Horizontal)
        self.level.setRange(int(MIN_GAIN_DB), int(MAX_GAIN_DB))
        self.level.setValue(int(player.gain_db))
        self.level.valueChanged.connect(self._level_changed)
        self.level_label = QLabel()
        self.device = QLabel()
        self.device.setWordWrap(True)
        self._level_changed(self.level.value())
        row = QHBoxLayout()
        row.addWidget(self.play_button)
        row.addWidget(QLabel("Level"))
        row.addWidget(self.level, 1)
        row.addWidget(self.level_label)
        layout = QVBoxLayout(self)
        layout.addWidget(self.wave_plot, 1)
        layout.addWidget(self.spec_plot, 1)
        layout.addWidget(self.flags)
        layout.addLayout(row)
        layout.addWidget(self.device)
        self._show_device()

    def _show_device(self) -> None:
        problem = self.player.problem
        self.play_button.setEnabled(self.player.available)
        self.device.setText(f"<span style='color:#b71c1c'>{problem}. Everything else works; "
                            "the waveform and spectrogram are shown.</span>" if problem else
                            "Playback starts quiet; raise the level slowly.")

    def _level_changed(self, value: int) -> None:
        self.player.gain_db = float(value)
        self.level_label.setText(f"{value} dB")

    def show_clip(self, sample: vm.Sample) -> None:
        flags = sample.integrity_flags
        info = sample.sidecar.get("integrity", {})
        self.show_file(sample.path, (
            "<b style='color:#b71c1c'>integrity: " + ", ".join(flags) + "</b>" if flags
            else "<b style='color:#2e7d32'>integrity: no flags</b>")
            + f" — peak {info.get('peak', float('nan')):.3f}, "
              f"rms {info.get('rms', float('nan')):.3f}")

    def show_file(self, path: Path, flags_html: str) -> None:
        """Any WAV file with a line of flags (the Transcripts pane shows its clips here)."""
        self.wave, self.rate = vm.waveform(path)
        self.wave_curve.setData(np.arange(self.wave.size) / self.rate, self.wave)
        self.spec_image.setImage(vm.spectrogram(self.wave))
        self.flags.setText(flags_html)

    def play(self) -> None:
        if self.wave is not None and not self.player.play(self.wave, self.rate):
            self._show_device()
            self.message.emit(self.player.problem or "playback failed")


class RubricBox(QGroupBox):
    """Scores 1..5 for the recipe's rubric dimensions; saved append-only per answer."""

    def __init__(self, parent=None):
        super().__init__("Rubric", parent)
        self.combos: dict[str, QComboBox] = {}
        self.dimensions = QWidget()
        self.rater = QLineEdit("me")
        self.note = QLineEdit()
        self.save_button = QPushButton("Save rating")
        self.saved = QLabel()
        fixed = QFormLayout()
        fixed.addRow("rater", self.rater)
        fixed.addRow("note", self.note)
        fixed.addRow(self.save_button, self.saved)
        self.layout_ = QVBoxLayout(self)
        self.layout_.addWidget(self.dimensions)
        self.layout_.addLayout(fixed)

    def set_kind(self, kind: str | None) -> None:
        """One 1..5 choice per dimension the recipe names (a fresh set per kind; none for a
        run that has nothing to rate)."""
        self.combos = {}
        dimensions = QWidget()
        form = QFormLayout(dimensions)
        form.setContentsMargins(0, 0, 0, 0)
        for dimension in vm.RUBRICS.get(kind, ()):
            combo = QComboBox()
            combo.addItem("—", None)
            for score in vm.SCORES:
                combo.addItem(str(score), score)
            self.combos[dimension] = combo
            form.addRow(dimension, combo)
        self.layout_.replaceWidget(self.dimensions, dimensions)
        self.dimensions.hide()
        self.dimensions.deleteLater()
        self.dimensions = dimensions

    def scores(self) -> dict[str, int]:
        return {d: c.currentData() for d, c in self.combos.items() if c.currentData() is not None}

    def show_scores(self, scores: dict) -> None:
        for dimension, combo in self.combos.items():
            combo.setCurrentIndex(combo.findData(scores.get(dimension)) if dimension in scores
                                  else 0)


class SamplesPane(QWidget):
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.run_dir: Path | None = None
        self.samples: list[vm.Sample] = []
        self.current: vm.Sample | None = None
        self.player = Player()
        self.job = JobRunner("sampling")
        self.job.finished.connect(self._generated)
        controls = self._controls()
        # The detail column scrolls on its own when its plots, flags, settings and rubric need
        # more height than the window has; the sample list beside it stays in view.
        splitter = QSplitter()
        splitter.addWidget(self._views())
        self.detail_scroll = ColumnScroll(self._detail())
        splitter.addWidget(self.detail_scroll)
        splitter.setSizes([700, 500])
        layout = QVBoxLayout(self)
        layout.addLayout(controls)
        layout.addWidget(self.job)
        layout.addWidget(splitter, 1)
        self._show_detail(None)

    def _controls(self) -> QVBoxLayout:
        """Two rows (what to look at; what to generate), so the pane fits a 1024-pixel window;
        the run picker takes the spare width, so run names are not cut short."""
        self.run_combo = QComboBox()
        self.run_combo.currentIndexChanged.connect(self._run_chosen)
        self.checkpoint = QComboBox()
        self.class_name = QComboBox()
        self.n = QSpinBox()
        self.n.setRange(1, 64)
        self.n.setValue(2)
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.cfg = QDoubleSpinBox()
        self.cfg.setRange(0.0, 20.0)
        self.cfg.setSpecialValueText("recipe default")
        self.steps = QSpinBox()         # sampler steps, respaced from the model's noise levels
        self.steps.setRange(0, 1000)
        self.steps.setSpecialValueText("recipe default")
        self.steps.setToolTip("Sampler steps: fewer is faster and rougher; at most the model's "
                              "noise levels")
        self.generate_button = QPushButton("Generate samples")
        self.generate_button.clicked.connect(self.generate)
        controls = QVBoxLayout()
        pick, make = QHBoxLayout(), QHBoxLayout()
        for row, pairs in ((pick, (("Run", self.run_combo), ("Checkpoint", self.checkpoint))),
                           (make, (("Class", self.class_name), ("Per class", self.n),
                                   ("Seed", self.seed), ("CFG", self.cfg),
                                   ("Steps", self.steps)))):
            for label, widget in pairs:
                row.addWidget(QLabel(label))
                row.addWidget(widget, 2 if widget is self.run_combo else 0)
            controls.addLayout(row)
        self.checkpoint.setMinimumContentsLength(12)
        self.run_combo.setMinimumContentsLength(24)
        make.addWidget(self.generate_button)
        make.addStretch(1)
        return controls

    def _views(self) -> QStackedWidget:
        """The samples: an image grid, a list of clips, or a text run's BEFORE/AFTER table."""
        self.grid = QTableWidget()
        self.grid.setIconSize(QSize(CELL, CELL))
        self.grid.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.grid.horizontalHeader().setDefaultSectionSize(CELL + 8)
        self.grid.verticalHeader().setDefaultSectionSize(CELL + 8)
        self.grid.currentCellChanged.connect(lambda r, c, *_: self._cell_chosen(r, c))
        self.clips = QListWidget()
        self.clips.currentRowChanged.connect(self._clip_chosen)
        self.text_table = QTableWidget(0, 3)
        self.text_table.setHorizontalHeaderLabels(["Prompt", "BEFORE (base)", "AFTER (tuned)"])
        self.text_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.text_table.setWordWrap(True)
        self.text_table.currentCellChanged.connect(lambda r, *_: self._text_chosen(r))
        self.views = QStackedWidget()
        self.empty = QLabel(NO_RUN)
        self.empty.setWordWrap(True)
        for widget in (self.empty, self.grid, self.clips, self.text_table):
            self.views.addWidget(widget)
        return self.views

    def _detail(self) -> QWidget:
        """The chosen sample: its image beside the nearest training item, or its clip; its
        settings and flags; the rubric."""
        self.detail_image = QLabel()
        self.detail_image.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.neighbour_image = QLabel()
        self.neighbour_image.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.neighbour_button = QPushButton("Show nearest training item")
        self.neighbour_button.clicked.connect(self.show_neighbour)
        self.info = QLabel()
        self.info.setWordWrap(True)
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.audio = AudioView(self.player)
        self.audio.message.connect(self.message)
        self.rubric = RubricBox()
        self.rubric.save_button.clicked.connect(self.save_rating)
        images = QHBoxLayout()
        images.addWidget(self.detail_image)
        images.addWidget(self.neighbour_image)
        detail = QWidget()
        layout = QVBoxLayout(detail)
        layout.addLayout(images)
        layout.addWidget(self.neighbour_button)
        layout.addWidget(self.audio, 2)
        layout.addWidget(self.info)
        layout.addWidget(self.rubric)
        layout.addStretch(1)
        return detail

    # -- workspace and run ---------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.reload_runs()

    def reload_runs(self) -> None:
        refill_keeping_choice(self.run_combo, self._sample_runs())
        self._run_chosen()

    def _sample_runs(self) -> list[tuple[str, str]]:
        return vm.sample_runs(self.workspace.run_dirs() if self.workspace else [])

    def refresh_runs(self) -> None:
        """New runs, checkpoints and samples appear; the chosen run, checkpoint and sample
        stay chosen (the workspace watch calls this when something changed)."""
        if not refill_keeping_choice(self.run_combo, self._sample_runs()):
            self._run_chosen()
            return
        refill_keeping_choice(self.checkpoint, [(name, name) for name in
                                                vm.checkpoint_names(self.run_dir)])
        if [s.path for s in vm.run_samples(self.run_dir)] != [s.path for s in self.samples]:
            chosen = self.current.path if self.current else None
            self.reload()
            if chosen is not None:
                self.select_sample(chosen)

    def select_run(self, path: Path) -> None:
        index = self.run_combo.findData(str(path))
        if index >= 0:
            self.run_combo.setCurrentIndex(index)
            self._run_chosen()

    def _run_chosen(self, *_) -> None:
        data = self.run_combo.currentData()
        self.run_dir = Path(data) if data else None
        self.checkpoint.clear()
        self.class_name.clear()
        if self.run_dir is None:
            self.reload()
            return
        options = vm.sampling_options(self.run_dir)
        self.checkpoint.addItems(options.checkpoints)
        self.steps.setMaximum(options.max_steps)
        self.class_name.addItem("all classes", None)
        for label in options.classes:
            self.class_name.addItem(label, label)
        for widget in (self.generate_button, self.class_name, self.n, self.seed, self.cfg,
                       self.steps):
            widget.setEnabled(options.media)
        self.reload()

    def reload(self) -> None:
        """Re-read the run's samples (after a sampling job, or on request)."""
        self.samples = vm.run_samples(self.run_dir) if self.run_dir else []
        images = [s for s in self.samples if s.kind == "image"]
        clips = [s for s in self.samples if s.kind == "audio"]
        if images:
            self._fill_grid()
            self.views.setCurrentWidget(self.grid)
            self.rubric.set_kind("image")
        elif clips:
            self.clips.clear()
            for sample in clips:
                item = QListWidgetItem(f"{sample.checkpoint}  {sample.item}"
                                       + ("  ⚠ " + ", ".join(sample.integrity_flags)
                                          if sample.integrity_flags else ""))
                item.setData(Qt.ItemDataRole.UserRole, str(sample.path))
                self.clips.addItem(item)
            self.views.setCurrentWidget(self.clips)
            self.rubric.set_kind("audio")
        elif self.run_dir and vm.generation_checkpoints(self.run_dir):
            rows = vm.before_after(self.run_dir)
            self.text_table.setHorizontalHeaderLabels(
                ["Prompt", *vm.before_after_headers(self.run_dir)])
            self.text_table.setRowCount(len(rows))
            for r, row in enumerate(rows):
                for c, text in enumerate(row):
                    self.text_table.setItem(r, c, QTableWidgetItem(text))
            self.text_table.resizeRowsToContents()
            self.views.setCurrentWidget(self.text_table)
            self.rubric.set_kind("text")
        else:
            self.empty.setText(
                EMPTY_RUN.format(name=self.run_dir.name) if self.run_dir else NO_RUN)
            self.views.setCurrentWidget(self.empty)
            self.rubric.set_kind(None)      # nothing to rate: no dimensions of another run
        self._show_detail(None)

    def _fill_grid(self) -> None:
        rows, columns, cells = vm.image_grid(self.samples)
        self.grid_index = (rows, columns, cells)
        self.grid.clear()
        self.grid.setRowCount(len(rows))
        self.grid.setColumnCount(len(columns))
        self.grid.setVerticalHeaderLabels(rows)
        self.grid.setHorizontalHeaderLabels([f"{c}\nseed {s} #{int(p)}" for c, s, p in columns])
        for r, label in enumerate(rows):
            for c, column in enumerate(columns):
                sample = cells.get((label, column))
                if sample is not None:
                    item = QTableWidgetItem()
                    item.setIcon(QIcon(self._pixmap(sample.path)))
                    self.grid.setItem(r, c, item)

    @staticmethod
    def _pixmap(path: Path, size: int = CELL) -> QPixmap:
        return QPixmap(str(path)).scaled(size, size, Qt.AspectRatioMode.KeepAspectRatio,
                                         Qt.TransformationMode.FastTransformation)

    # -- selection -----------------------------------------------------------------------
    def _cell_chosen(self, row: int, column: int) -> None:
        rows, columns, cells = self.grid_index
        if 0 <= row < len(rows) and 0 <= column < len(columns):
            self._show_detail(cells.get((rows[row], columns[column])))

    def _clip_chosen(self, row: int) -> None:
        clips = [s for s in self.samples if s.kind == "audio"]
        self._show_detail(clips[row] if 0 <= row < len(clips) else None)

    def _text_chosen(self, row: int) -> None:
        self.current = None
        self.info.setText(f"prompt {row + 1}: rate the AFTER answer" if row >= 0 else "")

    def select_sample(self, path: Path) -> None:
        for sample in self.samples:
            if sample.path == Path(path):
                self._show_detail(sample)

    def _show_detail(self, sample: vm.Sample | None) -> None:
        self.current = sample
        image = sample is not None and sample.kind == "image"
        self.detail_image.setVisible(image)
        self.neighbour_image.setVisible(False)
        self.neighbour_button.setVisible(image or (sample is not None and sample.kind == "audio"))
        self.audio.setVisible(sample is not None and sample.kind == "audio")
        self.rubric.setEnabled(sample is not None or self.views.currentWidget() is self.text_table)
        if sample is None:
            self.info.setText("")
            return
        if image:
            self.detail_image.setPixmap(self._pixmap(sample.path, 192))
        else:
            self.audio.show_clip(sample)
        s = sample.sidecar
        self.info.setText(f"<b>{sample.item}</b> — {sample.checkpoint} (step {s.get('step')}), "
                          f"seed {sample.seed}, class {sample.label}<br>settings: "
                          + ", ".join(f"{k}={v}" for k, v in sorted(sample.settings.items())))
        latest = vm.RubricStore(self._ratings_dir(), self.run_dir).latest(
            sample.path, self.rubric.rater.text())
        self.rubric.show_scores(latest["scores"] if latest else {})
        self.rubric.saved.setText("")

    def show_neighbour(self) -> None:
        if self.current is None:
            return
        try:
            path = vm.nearest_training_file(self.run_dir, self.current)
        except ForgebenchError as exc:
            self.message.emit(exc.render())
            return
        near = self.current.sidecar.get("nearest_training", {})
        distance = next(iter(near.values()), {})
        text = (f"nearest training item: {self.current.nearest_training_id()} "
                f"(distance {next((v for k, v in distance.items() if 'distance' in k), '?'):.4g})")
        if path is not None and path.suffix.lower() == ".png":
            self.neighbour_image.setPixmap(self._pixmap(path, 192))
            self.neighbour_image.setVisible(True)
        self.info.setText(self.info.text() + "<br>" + text
                          + (f"<br><code>{path}</code>" if path else ""))

    # -- rating and generating -----------------------------------------------------------
    def _ratings_dir(self) -> Path:
        return (self.workspace.root if self.workspace else self.run_dir.parent) / "ratings"

    def save_rating(self) -> None:
        kind = "text" if self.views.currentWidget() is self.text_table else \
            (self.current.kind if self.current else None)
        if kind is None or self.run_dir is None:
            return
        if kind == "text":
            row = max(self.text_table.currentRow(), 0)
            names = vm.generation_checkpoints(self.run_dir)
            target = vm.generations_file(self.run_dir, names[-1])
            note = f"prompt {row}: {self.text_table.item(row, 0).text()} {self.rubric.note.text()}"
        else:
            target, note = self.current.path, self.rubric.note.text()
        try:
            vm.RubricStore(self._ratings_dir(), self.run_dir).record(
                target, kind, self.rubric.scores(), self.rubric.rater.text() or "anonymous",
                note.strip())
        except ForgebenchError as exc:
            self.message.emit(exc.render())
            return
        self.rubric.saved.setText("saved ✓")

    def generate(self) -> None:
        if self.run_dir is None or not self.checkpoint.currentText():
            return
        argv = vm.sample_argv(self.run_dir, checkpoint=self.checkpoint.currentText(),
                              class_name=self.class_name.currentData(), n=self.n.value(),
                              seed=self.seed.value(),
                              cfg=self.cfg.value() if self.cfg.value() > 0 else None,
                              steps=self.steps.value() or None)
        self.generate_button.setEnabled(False)
        self.job.start(argv, f"sampling {self.checkpoint.currentText()}")

    def _generated(self, ok: bool, message: str) -> None:
        self.generate_button.setEnabled(True)
        self.message.emit("samples written" if ok else message)
        if ok:
            self.reload()
