"""The blind A/B pane: choose systems (run checkpoints, or an lm-sft run's base), either use the
outputs they already have or generate them all now with one settings dict (one engine job per
system and seed or prompt, run in turn with progress and cancel), rate pairs with A / B / T
(tie) / S (skip) without seeing which system is which, then read the results and export
preferences (text, or images/sounds copied into the dataset).

Every answer goes through `RatingStore.record` (fsynced) before the next pair is shown;
identities stay hidden until the session is finished."""

from __future__ import annotations

import html
import shutil
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QPixmap, QShortcut
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QStackedWidget,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.audio import Player
from app.viewmodels import ab as vm
from app.viewmodels.runs import stable_order
from app.viewmodels.samples import waveform
from app.viewmodels.workspace import Workspace
from app.views import theme
from app.views.job_runner import JobRunner
from app.views.labels import wrap_items, wrapped_label
from engine.errors import ForgebenchError

PREVIEW = 256


class SideView(QStackedWidget):
    """One side of a pair: an image, a text, or an audio clip (played on demand)."""

    def __init__(self, title: str, parent=None):
        super().__init__(parent)
        self.image = QLabel()
        self.image.setAlignment(Qt.AlignmentFlag.AlignCenter)
        # The preview never sets the pane's width: on a small window it is shown cropped
        # around its centre rather than pushing the answer buttons off-screen.
        self.image.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Ignored)
        self.image.setMinimumSize(120, 120)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.audio = QLabel()
        self.audio.setAlignment(Qt.AlignmentFlag.AlignCenter)
        for widget in (self.image, self.text, self.audio):
            self.addWidget(widget)
        self.title = title

    def show_side(self, side: vm.Side) -> None:
        if side.kind == "image":
            self.image.setPixmap(QPixmap(side.output).scaled(
                PREVIEW, PREVIEW, Qt.AspectRatioMode.KeepAspectRatio,
                Qt.TransformationMode.FastTransformation))
            self.setCurrentWidget(self.image)
        elif side.kind == "audio":
            self.audio.setText(f"<h2>{self.title}</h2>clip {self.title} — press P to play "
                               "A then B")
            self.setCurrentWidget(self.audio)
        else:
            self.text.setPlainText(side.output)
            self.setCurrentWidget(self.text)


def _spin(low: int, high: int, value: int | None = None, special: str = "") -> QSpinBox:
    """A spin box over [low, high]; `special` names its lowest value ("all pairs")."""
    spin = QSpinBox()
    spin.setRange(low, high)
    if value is not None:
        spin.setValue(value)
    if special:
        spin.setSpecialValueText(special)
    return spin


class StatusLine(QLabel):
    """A line shown only while it has something to say (an empty one takes no height)."""

    def setText(self, text: str) -> None:      # noqa: N802 (Qt's name)
        super().setText(text)
        self.setVisible(bool(text))


class ABPane(QWidget):
    message = Signal(str)
    train_requested = Signal(str)   # an lm-dpo config to start (the Runs pane starts it)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.session: vm.ABSession | None = None
        self.player = Player()
        self.pending_fidelity: str | None = None
        self.job = JobRunner("generation")
        self.job.finished.connect(self._job_finished)
        self.pending_jobs: list[vm.GenerationJob] = []
        self.current_job: vm.GenerationJob | None = None
        self.generation: tuple[list[vm.GenerationJob], dict] | None = None
        self.setup_status = StatusLine()
        self.setup_status.setText("")
        self.setup_status.setWordWrap(True)
        self.setup_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        setup = self._setup_box()       # built in reading (and tab) order
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self._rating_box())
        right.addWidget(self._results_box())
        right.setSizes([520, 320])
        setup_scroll = QScrollArea()     # the long setup form scrolls on its own
        setup_scroll.setWidgetResizable(True)
        setup_scroll.setWidget(setup)
        splitter = QSplitter()
        splitter.addWidget(setup_scroll)
        splitter.addWidget(right)
        splitter.setSizes([340, 540])      # the setup column fits its form at 1024 px
        layout = QVBoxLayout(self)
        # The setup's answers (a refusal, the generation's progress, the session started) sit
        # over both columns, where the user looks after a click: never at the bottom of the
        # long setup column, below the fold.
        layout.addWidget(self.setup_status)
        layout.addWidget(splitter, 1)
        self._show_pair()

    def _setup_box(self) -> QGroupBox:
        # "run/checkpoint" names wrap in the narrow setup column: their checkpoint, which tells
        # two systems of one run apart, is never out of sight behind a sideways scroll.
        self.systems = wrap_items(QListWidget())
        self.name = QLineEdit("ab-session")
        self.rater = QLineEdit("me")
        self.seed = _spin(0, 2**31 - 1)
        self.limit = _spin(0, 100_000, special="all pairs")
        self.allowed = QLineEdit()
        self.allowed.setPlaceholderText("settings that differ on purpose, e.g. cfg")
        self.rubric = QCheckBox("Rate fidelity, then style")
        self.rubric.setToolTip("Two answers per pair: which is more faithful, then which has "
                               "the better style")
        self.start_button = QPushButton("Start blind session")
        self.start_button.clicked.connect(self.start_session)
        self.sessions = QComboBox()
        self.resume_button = QPushButton("Resume / show results")
        self.resume_button.clicked.connect(self.resume_session)
        setup = QGroupBox("Setup")     # short titles: a long one would widen the column
        form = QFormLayout(setup)
        form.addRow(wrapped_label("Systems are run checkpoints with samples or generations."))
        form.addRow(self.systems)
        # The names a session and its earlier ones go by run long ("example-sound-checkpoints"):
        # each gets the column's whole width under its label, so it is read whole.
        form.addRow(QLabel("Session name"))
        form.addRow(self.name)
        for label, widget in (("Rater", self.rater), ("Order seed", self.seed),
                              ("Pairs", self.limit), ("Allowed differences", self.allowed)):
            form.addRow(label, widget)
        form.addRow(self.rubric)
        form.addRow(self.start_button)
        form.addRow(self._generate_box())
        form.addRow(QLabel("Earlier sessions"))
        form.addRow(self.sessions)
        form.addRow(self.resume_button)
        return setup

    def _generate_box(self) -> QGroupBox:
        """Generation: every system's outputs made now, with one settings dict."""
        self.gen_seeds = QLineEdit("0")
        self.gen_seeds.setPlaceholderText("seeds, e.g. 0, 1, 2")
        self.gen_n = _spin(1, 64, 2)
        self.gen_class = QLineEdit()
        self.gen_class.setPlaceholderText("all classes")
        self.gen_cfg = QDoubleSpinBox()
        self.gen_cfg.setRange(0.0, 20.0)
        self.gen_cfg.setSingleStep(0.5)
        self.gen_cfg.setSpecialValueText("run default")
        self.gen_steps = _spin(0, 10_000, special="run default")
        self.gen_prompts = QPlainTextEdit()
        self.gen_prompts.setPlaceholderText("text runs: one prompt per line")
        self.gen_prompts.setMaximumHeight(70)
        self.gen_max_tokens = _spin(1, 4096, 32)
        self.generate_button = QPushButton("Generate outputs and start")
        self.generate_button.clicked.connect(self.generate_outputs)
        generate = QGroupBox("Or generate outputs now")
        form = QFormLayout(generate)
        form.addRow(wrapped_label("Every system's outputs, made with identical settings."))
        for label, widget in (("Seeds", self.gen_seeds), ("Per class", self.gen_n),
                              ("Class", self.gen_class), ("Guidance (cfg)", self.gen_cfg),
                              ("Sampler steps", self.gen_steps), ("Prompts", self.gen_prompts),
                              ("Max tokens", self.gen_max_tokens)):
            form.addRow(label, widget)
        form.addRow(self.generate_button)
        form.addRow(self.job)
        return generate

    def _rating_box(self) -> QGroupBox:
        self.prompt = QLabel()
        self.prompt.setWordWrap(True)
        self.progress = QLabel()
        self.left = SideView("A")
        self.right = SideView("B")
        sides = QHBoxLayout()
        for title, view in (("A", self.left), ("B", self.right)):
            box = QVBoxLayout()
            box.addWidget(QLabel(f"<h3>{title}</h3>"), 0, Qt.AlignmentFlag.AlignHCenter)
            box.addWidget(view, 1)
            sides.addLayout(box, 1)
        buttons = QGridLayout()     # two rows: every answer fits a 1024-pixel window
        self.answer_buttons = {}
        for i, (key, text) in enumerate((("A", "A is better [A]"), ("B", "B is better [B]"),
                                         ("T", "Tie [T]"), ("S", "Skip [S]"),
                                         ("P", "Play A then B [P]"))):
            button = QPushButton(text)
            button.clicked.connect(lambda _=False, k=key: self.key_pressed(k))
            buttons.addWidget(button, i // 3, i % 3)
            self.answer_buttons[key] = button
            # The window's shortcut while this pane shows: the keys rate without a click in
            # the pane first (a text field still takes them as typing).
            QShortcut(QKeySequence(key), self, activated=lambda k=key: self.key_pressed(k),
                      context=Qt.ShortcutContext.WindowShortcut)
        rating = QGroupBox("Blind rating")
        layout = QVBoxLayout(rating)
        layout.addWidget(self.progress)
        layout.addWidget(self.prompt)
        layout.addLayout(sides, 1)
        layout.addLayout(buttons)
        return rating

    def _results_box(self) -> QGroupBox:
        self.results = QTextBrowser()
        self.export_button = QPushButton("Export preferences as a dataset…")
        self.export_button.clicked.connect(self.export_preferences)
        self.train_button = QPushButton("Train on these preferences")
        self.train_button.setToolTip("Export the judgements as a new dataset version, then "
                                     "start lm-dpo from the winning lm-sft checkpoint")
        self.train_button.clicked.connect(self.train_on_preferences)
        self.compare_button = QPushButton("Compare with the previous model")
        self.compare_button.setToolTip("A new blind session, tuned vs the model it started "
                                       "from, on the held-out prompts in the Prompts box")
        self.compare_button.clicked.connect(self.compare_with_previous)
        results = QGroupBox("Results")
        layout = QVBoxLayout(results)
        layout.addWidget(self.results, 1)
        layout.addWidget(self.export_button)
        loop = QHBoxLayout()
        loop.addWidget(self.train_button)
        loop.addWidget(self.compare_button)
        layout.addLayout(loop)
        return results

    # -- setup ---------------------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.reload()

    @property
    def ratings_dir(self) -> Path:
        return self.workspace.root / "ratings"

    def reload(self) -> None:
        """Every (run, checkpoint) that has samples or generations, or whose generator can
        make them, as a checkable system. The list is updated in place: the systems shown keep
        their rows (and check marks), new ones are added after them, and the row under the
        pointer never moves (vm.stable_order)."""
        found = vm.available_systems(self.workspace.run_dirs() if self.workspace else [])
        items = {tuple(self.systems.item(i).data(Qt.ItemDataRole.UserRole)):
                 self.systems.item(i) for i in range(self.systems.count())}
        order = stable_order(list(items), list(found))
        if order != list(items):
            for key in [k for k in items if k not in found]:
                self.systems.takeItem(self.systems.row(items.pop(key)))
            for key in order:
                if key not in items:
                    item = items[key] = QListWidgetItem(found[key])
                    item.setData(Qt.ItemDataRole.UserRole, key)
                    item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
                    item.setCheckState(Qt.CheckState.Unchecked)
                    self.systems.addItem(item)
        session = self.sessions.currentData()
        self.sessions.clear()
        for path in vm.session_files(self.ratings_dir) if self.workspace else []:
            self.sessions.addItem(path.stem, str(path))
        self.sessions.setCurrentIndex(max(self.sessions.findData(session), 0))

    def check_system(self, run_dir: Path, checkpoint: str, checked: bool = True) -> None:
        for i in range(self.systems.count()):
            item = self.systems.item(i)
            if tuple(item.data(Qt.ItemDataRole.UserRole)) == (str(run_dir), checkpoint):
                item.setCheckState(Qt.CheckState.Checked if checked else Qt.CheckState.Unchecked)

    def chosen(self) -> list[tuple[str, str]]:
        return [tuple(self.systems.item(i).data(Qt.ItemDataRole.UserRole))
                for i in range(self.systems.count())
                if self.systems.item(i).checkState() == Qt.CheckState.Checked]

    def _refused(self, exc: ForgebenchError) -> None:
        self.setup_status.setText(f"<span style='color:{theme.colour('error')}'>Refused: "
                                  f"{html.escape(exc.render())}</span>")

    def generate_outputs(self) -> None:
        """Queue one sampling job per system and seed, all with one settings dict; the session
        is built from exactly those outputs when the last job has finished."""
        if self.job.running:
            return
        try:
            seeds = [int(x) for x in self.gen_seeds.text().replace(",", " ").split()]
        except ValueError:
            self._refused(ForgebenchError("seeds must be whole numbers", where="Seeds",
                                          hint="e.g. 0, 1, 2"))
            return
        try:
            if vm.all_text(self.chosen()):
                settings = vm.text_settings_of(self.gen_prompts.toPlainText().splitlines(),
                                               self.gen_max_tokens.value(),
                                               seeds[0] if seeds else 0)
            else:
                settings = vm.generation_settings_of(
                    seeds, self.gen_n.value(), self.gen_cfg.value() or None,
                    self.gen_steps.value() or None, self.gen_class.text().strip() or None)
            name = vm.session_name(self.name.text())
            if (self.ratings_dir / f"{name}.jsonl").exists():
                raise ForgebenchError("a rating session with this name exists already",
                                      path=self.ratings_dir / f"{name}.jsonl",
                                      hint="resume it, or choose another name")
            jobs = vm.generation_jobs(self.chosen(), settings,
                                      self.ratings_dir / "outputs" / name)
        except ForgebenchError as exc:
            self._refused(exc)
            return
        self.generation = (jobs, settings)
        self.pending_jobs = list(jobs)
        self.generate_button.setEnabled(False)
        self.start_button.setEnabled(False)
        self._next_job()

    def _next_job(self) -> None:
        jobs, _ = self.generation
        job = self.pending_jobs.pop(0)
        done = len(jobs) - len(self.pending_jobs)
        self.setup_status.setText(f"generating outputs: job {done} of {len(jobs)}")
        what = f"prompt {job.prompt!r}" if job.prompt is not None else \
            f"seed {job.argv[job.argv.index('--seed') + 1]}"
        self.current_job = job
        self.job.start(job.argv, f"job {done}/{len(jobs)}: {job.system}, {what}")

    def _job_finished(self, ok: bool, message: str) -> None:
        if ok and self.current_job.prompt is not None:
            try:
                vm.record_text_output(self.current_job, self.job.output)
            except ForgebenchError as exc:
                ok, message = False, exc.render()
        if not ok:       # a stopped generation leaves no outputs a session could half-use
            self.pending_jobs = []
            shutil.rmtree(self.generation[0][0].folder.parent, ignore_errors=True)
            self.generate_button.setEnabled(True)
            self.start_button.setEnabled(True)
            self.setup_status.setText(f"<span style='color:{theme.colour('error')}'>"
                                      f"Generation stopped: {html.escape(message)}</span>")
            return
        if self.pending_jobs:
            self._next_job()
            return
        self.generate_button.setEnabled(True)
        self.start_button.setEnabled(True)
        jobs, settings = self.generation
        try:
            self._create(vm.generated_systems(jobs, settings), settings)
        except ForgebenchError as exc:
            self._refused(exc)

    def start_session(self) -> None:
        """A session over outputs the systems already have."""
        try:
            chosen = self.chosen()
            if len(chosen) < 2:
                raise ForgebenchError("choose at least two systems", where="systems")
            self._create({vm.system_name(Path(r), c): vm.gather_system(r, c)
                          for r, c in chosen}, None)
        except ForgebenchError as exc:
            self._refused(exc)

    def _create(self, systems: dict[str, dict], generation: dict | None) -> None:
        allowed = tuple(a.strip() for a in self.allowed.text().split(",") if a.strip())
        self.session = vm.ABSession.create(
            self.ratings_dir, self.name.text(), systems, self.rater.text() or "anonymous",
            seed=self.seed.value(), limit=self.limit.value() or None,
            allow_differences=allowed, generation=generation)
        note = self.session.plan.recorded_differences
        self.setup_status.setText(f"Session {self.session.plan.session}: {self.session.total} "
                                  "pairs" + (f"; recorded differences: {', '.join(note)}"
                                             if note else ""))
        self.reload()
        self._show_pair()
        self.setFocus()

    def resume_session(self) -> None:
        path = self.sessions.currentData()
        if not path:
            return
        try:
            self.session = vm.ABSession.open(Path(path), self.rater.text() or "anonymous")
        except ForgebenchError as exc:
            self.setup_status.setText(html.escape(exc.render()))
            return
        self._show_pair()

    # -- rating --------------------------------------------------------------------------
    def key_pressed(self, key: str) -> None:
        if self.session is None or self.session.finished:
            return
        if key == "P":
            self.play_pair()
            return
        choice = vm.KEYS[key]
        if self.rubric.isChecked() and choice != "skip" and self.pending_fidelity is None:
            self.pending_fidelity = choice      # first answer: fidelity; then style
            self._show_pair()
            return
        rubric = None
        if self.pending_fidelity is not None:
            rubric = {"fidelity": self.pending_fidelity, "style": choice}
            choice, self.pending_fidelity = self.pending_fidelity, None
        self.session.answer(choice, rubric)     # fsynced before the next pair is shown
        self._show_pair()

    def keyPressEvent(self, event) -> None:
        """A / B / T / S / P when the pane itself has focus (the shortcuts cover children)."""
        key = event.text().upper()
        if key in vm.KEYS or key == "P":
            self.key_pressed(key)
        else:
            super().keyPressEvent(event)

    def play_pair(self) -> None:
        pair = self.session.current() if self.session else None
        if pair is None or self.session.kind != "audio":
            return
        left, right = self.session.sides(pair)
        if not self.player.play_sequence([waveform(Path(left.output)),
                                          waveform(Path(right.output))]):
            self.message.emit(self.player.problem or "playback failed")
            self.prompt.setText(self.prompt.text() + "<br><span style='color:"
                                f"{theme.colour('error')}'>"
                                f"{html.escape(self.player.problem or '')}</span>")

    def _show_pair(self) -> None:
        session = self.session
        pair = session.current() if session else None
        for button in self.answer_buttons.values():
            button.setEnabled(pair is not None)
        self.answer_buttons["P"].setVisible(session is not None and session.kind == "audio")
        self.export_button.setEnabled(bool(session and session.finished))
        for button in (self.train_button, self.compare_button):
            button.setEnabled(bool(session and session.finished and session.kind == "text"))
        if session is None:
            self.progress.setText("Choose two or more systems and start a session.")
            self.prompt.setText("")
            self.results.setHtml("")
            return
        self.progress.setText(f"pair {min(session.done + 1, session.total)} of {session.total}"
                              f" — rater {session.rater}")
        if pair is None:
            self.prompt.setText("<b>Session finished.</b> Identities are shown in the results.")
            for view in (self.left, self.right):
                view.show_side(vm.Side("text", ""))
            self.results.setHtml(results_html(session.results(), reveal=True))
            return
        step = ("<br><b>Fidelity</b> first: which is more faithful to the request?"
                if self.rubric.isChecked() and self.pending_fidelity is None else
                f"<br>Fidelity: {self.pending_fidelity}. Now <b>style</b>: which sounds/reads "
                "better?" if self.pending_fidelity else "")
        self.prompt.setText(f"<b>{html.escape(session.prompt(pair))}</b>{step}")
        left, right = session.sides(pair)
        self.left.show_side(left)
        self.right.show_side(right)
        self.results.setHtml(results_html(session.results(), reveal=False))

    def export_preferences(self) -> None:
        if self.session is None:
            return
        out = self.workspace.datasets_dir / f"preferences-{self.session.plan.session}"
        try:
            self.session.export_preferences(out)
        except ForgebenchError as exc:
            self.message.emit(exc.render())
            return
        self.message.emit(vm.preferences_written(out))


    # -- closing the loop ----------------------------------------------------------------
    def train_on_preferences(self) -> None:
        """Export the session as a new preference dataset (with its card), write an lm-dpo
        config that refines the winning lm-sft checkpoint on it, and ask for it to start."""
        if self.session is None or self.workspace is None:
            return
        try:
            out = self.session.export_preferences(vm.next_free(
                self.workspace.datasets_dir, f"preferences-{self.session.plan.session}"))
            config = vm.dpo_config_for(self.session, out, self.workspace.configs_dir)
        except ForgebenchError as exc:
            self._refused(exc)
            self.message.emit(exc.render())
            return
        self.setup_status.setText(f"Preferences exported to datasets/{out.name}; lm-dpo "
                                  f"config configs/{config.name} started in Runs.")
        self.train_requested.emit(str(config))

    def compare_with_previous(self) -> None:
        """A new blind session: the latest finished lm-dpo run trained on this session against
        the checkpoint it started from, on the held-out prompts of the Prompts box."""
        if self.session is None or self.workspace is None:
            return
        try:
            tuned = vm.tuned_runs(self.workspace.run_dirs(), self.session.store.path)
            if not tuned:
                raise ForgebenchError("no finished lm-dpo run was trained on this session yet",
                                      where="Compare", hint="press Train on these preferences "
                                                            "and wait for the run to complete")
            prompts = vm.held_out_prompts(self.gen_prompts.toPlainText().splitlines(),
                                          tuned[-1])
            systems = vm.comparison_systems(tuned[-1])
        except ForgebenchError as exc:
            self._refused(exc)
            return
        self.reload()
        for i in range(self.systems.count()):
            self.systems.item(i).setCheckState(Qt.CheckState.Unchecked)
        for run_dir, checkpoint in systems:
            self.check_system(Path(run_dir), checkpoint)
        self.name.setText(vm.next_free(self.ratings_dir, f"{self.session.plan.session}-compare",
                                       ".jsonl").stem)
        self.gen_prompts.setPlainText("\n".join(prompts))
        self.generate_outputs()


def results_html(results: dict, reveal: bool) -> str:
    """The results as HTML tables; system names are replaced by placeholders until `reveal`."""
    names = {s: (s if reveal else f"system {i + 1}") for i, s in enumerate(results["systems"])}
    out = [f"<p>{results['answered']} of {results['planned']} pairs answered"
           + (" — identities hidden until the session ends" if not reveal else "") + "</p>"]
    if not reveal:
        return "".join(out)
    # Each pair's names head its own row of numbers: as two columns beside five numbers they
    # squeezed the table until Qt broke words apart ("tie s", "image-generat e-demo") in the
    # pane's width at 1024 px, and Qt shares a spanning cell's width out no better.
    # Non-breaking spaces keep each header and interval whole (Qt's rich text ignores nowrap).
    out.append("<h4>Win rates (ties count half; 95% Wilson interval)</h4>")
    for row in results["pairs"]:
        out.append(f"<p><b>A</b> {html.escape(names[row['a']])} &nbsp;vs&nbsp; <b>B</b> "
                   f"{html.escape(names[row['b']])}</p><table border=1 cellpadding=4><tr>"
                   "<th>A&nbsp;wins</th><th>B&nbsp;wins</th><th>ties</th>"
                   "<th>A&nbsp;win&nbsp;rate</th><th>95%&nbsp;CI</th></tr>"
                   f"<tr><td>{row['wins_a']}</td><td>{row['wins_b']}</td><td>{row['ties']}</td>"
                   f"<td>{row['win_rate_a']:.3f}</td><td>[{row['ci_low']:.3f},&nbsp;"
                   f"{row['ci_high']:.3f}]</td></tr></table>")
    if results["bradley_terry"]:
        out.append("<h4>Bradley–Terry ranking</h4><table border=1 cellpadding=4>"
                   "<tr><th>#</th><th>system</th><th>strength</th></tr>")
        ranked = sorted(results["bradley_terry"].items(), key=lambda kv: -kv[1])
        for i, (system, strength) in enumerate(ranked):
            out.append(f"<tr><td>{i + 1}</td><td>{html.escape(names[system])}</td>"
                       f"<td>{strength:.3f}</td></tr>")
        out.append("</table>")
    out.append("<h4>Per item</h4><table border=1 cellpadding=4><tr><th>item</th><th>answers"
               "</th><th>wins</th><th>ties</th><th>skips</th></tr>")
    for row in results["items"]:
        wins = ", ".join(f"{html.escape(names[s])}: {n}" for s, n in sorted(row["wins"].items()))
        out.append(f"<tr><td>{html.escape(row['item'])}</td><td>{row['answers']}</td>"
                   f"<td>{wins}</td><td>{row['ties']}</td><td>{row['skips']}</td></tr>")
    out.append("</table>")
    agreement = results["agreement"]
    if len(results["raters"]) > 1:
        out.append(f"<h4>Rater agreement</h4><p>{agreement['pairs']} pairs rated by several "
                   "raters: " + (f"raw agreement {agreement['agreement']:.3f}, Fleiss' κ "
                                 f"{agreement['fleiss_kappa']:.3f}" if agreement["pairs"]
                                 else "none shared") + "</p>")
    if results["recorded_differences"]:
        out.append("<p>Recorded setting differences (the point of the comparison): "
                   + html.escape(", ".join(results["recorded_differences"])) + "</p>")
    return "".join(out)
