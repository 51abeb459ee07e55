"""The blind A/B pane: choose systems (run checkpoints), rate pairs with A / B / T (tie) /
S (skip) without seeing which system is which, then read the results and export preferences.

Every answer goes through `RatingStore.record` (fsynced) before the next pair is shown;
identities stay hidden until the session is finished."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QPixmap, QShortcut
from PySide6.QtWidgets import (QCheckBox, QComboBox, QFormLayout, QGroupBox, QHBoxLayout,
                               QLabel, QLineEdit, QListWidget, QListWidgetItem, QPlainTextEdit,
                               QPushButton, QSpinBox, QSplitter, QStackedWidget, QTextBrowser,
                               QVBoxLayout, QWidget)

from engine.errors import ForgebenchError
from engine.rundir import RunDir

from app.audio import Player
from app.viewmodels import ab as vm
from app.viewmodels.samples import text_file, waveform
from app.viewmodels.workspace import Workspace

PREVIEW = 256


class SideView(QStackedWidget):
    """One side of a pair: an image, a text, or an audio clip (played on demand)."""

    def __init__(self, title: str, parent=None):
        super().__init__(parent)
        self.image = QLabel()
        self.image.setAlignment(Qt.AlignmentFlag.AlignCenter)
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


class ABPane(QWidget):
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.session: vm.ABSession | None = None
        self.player = Player()
        self.pending_fidelity: str | None = None

        # setup
        self.systems = QListWidget()
        self.name = QLineEdit("ab-session")
        self.rater = QLineEdit("me")
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.limit = QSpinBox()
        self.limit.setRange(0, 100_000)
        self.limit.setSpecialValueText("all pairs")
        self.allowed = QLineEdit()
        self.allowed.setPlaceholderText("settings that differ on purpose, e.g. cfg")
        self.rubric = QCheckBox("Rate fidelity before style (two answers per pair)")
        self.start_button = QPushButton("Start blind session")
        self.start_button.clicked.connect(self.start_session)
        self.sessions = QComboBox()
        self.resume_button = QPushButton("Resume / show results")
        self.resume_button.clicked.connect(self.resume_session)
        self.setup_status = QLabel()
        self.setup_status.setWordWrap(True)
        self.setup_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        setup = QGroupBox("Setup: systems are run checkpoints with samples or generations")
        form = QFormLayout(setup)
        form.addRow(self.systems)
        form.addRow("Session name", self.name)
        form.addRow("Rater", self.rater)
        form.addRow("Order seed", self.seed)
        form.addRow("Pairs", self.limit)
        form.addRow("Allowed differences", self.allowed)
        form.addRow(self.rubric)
        form.addRow(self.start_button)
        form.addRow("Earlier sessions", self.sessions)
        form.addRow(self.resume_button)
        form.addRow(self.setup_status)

        # rating
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
        buttons = QHBoxLayout()
        self.answer_buttons = {}
        for key, text in (("A", "A is better [A]"), ("B", "B is better [B]"), ("T", "Tie [T]"),
                          ("S", "Skip [S]"), ("P", "Play A then B [P]")):
            button = QPushButton(text)
            button.clicked.connect(lambda _=False, k=key: self.key_pressed(k))
            buttons.addWidget(button)
            self.answer_buttons[key] = button
            QShortcut(QKeySequence(key), self, activated=lambda k=key: self.key_pressed(k),
                      context=Qt.ShortcutContext.WidgetWithChildrenShortcut)
        rating = QGroupBox("Blind rating")
        rv = QVBoxLayout(rating)
        rv.addWidget(self.progress)
        rv.addWidget(self.prompt)
        rv.addLayout(sides, 1)
        rv.addLayout(buttons)

        # results
        self.results = QTextBrowser()
        self.export_button = QPushButton("Export preferences as a dataset…")
        self.export_button.clicked.connect(self.export_preferences)
        results = QGroupBox("Results")
        xv = QVBoxLayout(results)
        xv.addWidget(self.results, 1)
        xv.addWidget(self.export_button)

        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(rating)
        right.addWidget(results)
        right.setSizes([520, 320])
        splitter = QSplitter()
        splitter.addWidget(setup)
        splitter.addWidget(right)
        splitter.setSizes([380, 900])
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)
        self._show_pair()

    # -- setup ---------------------------------------------------------------------------
    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.reload()

    @property
    def ratings_dir(self) -> Path:
        return self.workspace.root / "ratings"

    def reload(self) -> None:
        """Every (run, checkpoint) that has samples or generations, as a checkable system."""
        self.systems.clear()
        for run_dir in self.workspace.run_dirs() if self.workspace else []:
            samples = RunDir(run_dir).samples_dir
            if not samples.is_dir():
                continue
            for folder in sorted(p for p in samples.iterdir() if p.is_dir()):
                if not any(f.suffix in (".png", ".wav") and f.stem != "grid"
                           for f in folder.iterdir()) and not text_file(folder):
                    continue
                item = QListWidgetItem(vm.system_name(run_dir, folder.name))
                item.setData(Qt.ItemDataRole.UserRole, (str(run_dir), folder.name))
                item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
                item.setCheckState(Qt.CheckState.Unchecked)
                self.systems.addItem(item)
        self.sessions.clear()
        if self.workspace and self.ratings_dir.is_dir():
            for path in sorted(self.ratings_dir.glob("*.jsonl")):
                if not path.name.startswith("rubric-"):
                    self.sessions.addItem(path.stem, str(path))

    def check_system(self, run_dir: Path, checkpoint: str, checked: bool = True) -> None:
        for i in range(self.systems.count()):
            item = self.systems.item(i)
            if tuple(item.data(Qt.ItemDataRole.UserRole)) == (str(run_dir), checkpoint):
                item.setCheckState(Qt.CheckState.Checked if checked else Qt.CheckState.Unchecked)

    def start_session(self) -> None:
        chosen = [self.systems.item(i).data(Qt.ItemDataRole.UserRole)
                  for i in range(self.systems.count())
                  if self.systems.item(i).checkState() == Qt.CheckState.Checked]
        allowed = tuple(a.strip() for a in self.allowed.text().split(",") if a.strip())
        try:
            if len(chosen) < 2:
                raise ForgebenchError("choose at least two systems", where="systems")
            systems = {vm.system_name(Path(r), c): vm.gather_system(r, c) for r, c in chosen}
            self.session = vm.ABSession.create(
                self.ratings_dir, self.name.text(), systems, self.rater.text() or "anonymous",
                seed=self.seed.value(), limit=self.limit.value() or None,
                allow_differences=allowed)
        except ForgebenchError as exc:
            self.setup_status.setText(f"<span style='color:#b71c1c'>Refused: "
                                      f"{html.escape(exc.render())}</span>")
            return
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
            self.prompt.setText(self.prompt.text() + f"<br><span style='color:#b71c1c'>"
                                f"{html.escape(self.player.problem or '')}</span>")

    def _show_pair(self) -> None:
        session = self.session
        pair = session.current() if session else None
        for button in self.answer_buttons.values():
            button.setEnabled(pair is not None)
        self.answer_buttons["P"].setVisible(session is not None and session.kind == "audio")
        self.export_button.setEnabled(bool(session and session.finished
                                           and session.kind == "text"))
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
        self.message.emit(f"preference dataset written: {out}")


def results_html(results: dict, reveal: bool) -> str:
    """The results as HTML tables; system names are replaced by placeholders until `reveal`."""
    names = {s: (s if reveal else f"system {i + 1}") for i, s in enumerate(results["systems"])}
    out = [f"<p>{results['answered']} of {results['planned']} pairs answered"
           + (" — identities hidden until the session ends" if not reveal else "") + "</p>"]
    if not reveal:
        return "".join(out)
    out.append("<h4>Win rates (ties count half; 95% Wilson interval)</h4><table border=1 "
               "cellpadding=4><tr><th>A</th><th>B</th><th>A wins</th><th>B wins</th>"
               "<th>ties</th><th>A win rate</th><th>95% CI</th></tr>")
    for row in results["pairs"]:
        out.append(f"<tr><td>{html.escape(names[row['a']])}</td><td>"
                   f"{html.escape(names[row['b']])}</td><td>{row['wins_a']}</td>"
                   f"<td>{row['wins_b']}</td><td>{row['ties']}</td>"
                   f"<td>{row['win_rate_a']:.3f}</td><td>[{row['ci_low']:.3f}, "
                   f"{row['ci_high']:.3f}]</td></tr>")
    out.append("</table>")
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
