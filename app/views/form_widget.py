"""A recipe form: one editor per schema field (tooltips from the schema's descriptions),
invalid fields marked inline, Start blocked. Lists are edited one item per line; path fields
have Browse (and, for data, a pick of the workspace's datasets); the mouse wheel scrolls the
form and never changes a field the user did not click into.

A form of forty fields takes a few hundred ms to build on a loaded machine, so it is built one
section per event-loop turn (`building` is true meanwhile, `built` fires at the end): the
window keeps answering while the form appears."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

if TYPE_CHECKING:     # annotations only: the window imports this module before any schema
    from app.viewmodels.forms import FieldSpec, RecipeForm

INVALID_STYLE = "border: 2px solid #c62828; background: #ffebee;"


class WheelGuard(QObject):
    """Sends wheel events over an unfocused combo box or spin box to the scrolling form, so
    scrolling never edits a value by accident."""

    def eventFilter(self, watched, event) -> bool:
        if event.type() == QEvent.Type.Wheel and not watched.hasFocus():
            event.ignore()
            return True
        return False


def guard_wheel(widget: QWidget, guard: WheelGuard) -> None:
    widget.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
    widget.installEventFilter(guard)


class RecipeFormWidget(QScrollArea):
    """Edits a RecipeForm; emits `validity_changed(bool)` after every edit."""

    validity_changed = Signal(bool)
    built = Signal()
    top_section = "run"  # the group title of the schema's top-level fields
    progressive = True   # build one section per event-loop turn

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.form: RecipeForm | None = None
        self.editors: dict[str, QWidget] = {}
        self.error_labels: dict[str, QLabel] = {}
        self.general = QLabel()
        self.general.setWordWrap(True)
        self.general.setStyleSheet("color: #c62828;")
        self.wheel_guard = WheelGuard(self)
        self.datasets: list[Path] = []     # the workspace's datasets, for the data pickers
        self.models: list[tuple[str, Path]] = []   # its model library, for the base picker
        self.building = False
        self._sections: list[list[FieldSpec]] = []    # still to build
        self._generation = 0                          # a newer set_form drops older turns

    def set_datasets(self, datasets: list[Path]) -> None:
        self.datasets = list(datasets)

    def set_models(self, models: list[tuple[str, Path]]) -> None:
        """The workspace's model library (name, file), for the base-model picker."""
        self.models = list(models)

    def set_form(self, form: RecipeForm) -> None:
        self.form = form
        self.editors.clear()
        self.error_labels.clear()
        body = QWidget()
        self._outer = QVBoxLayout(body)
        sections: dict[str, list[FieldSpec]] = {}
        for spec in form.fields:
            sections.setdefault(spec.section, []).append(spec)
        self._sections = list(sections.values())
        self._generation += 1
        self.building = True
        self.general.setParent(None)
        self.setWidget(body)
        self._build_next(self._generation)

    def _build_next(self, generation: int) -> None:
        if generation != self._generation:
            return
        while self._sections:
            self._build_section(self._sections.pop(0))
            if self.progressive and self._sections:
                QTimer.singleShot(0, lambda: self._build_next(generation))
                return
        self._outer.addWidget(self.general)
        self._outer.addStretch(1)
        self.building = False
        self._show_errors()
        self.built.emit()

    def _build_section(self, specs: list[FieldSpec]) -> None:
        box = QGroupBox(specs[0].section or self.top_section)
        layout = QFormLayout(box)
        # A field with Browse / Dataset buttons goes under its label when the pane is narrow.
        layout.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        self._outer.addWidget(box)
        for spec in specs:
            editor = self._editor(spec)
            editor.setToolTip(spec.description)
            editor.setObjectName(spec.name)
            field = self._with_path_buttons(spec, editor) if spec.path_kind else editor
            error = QLabel()
            error.setStyleSheet("color: #c62828;")
            error.setWordWrap(True)
            error.hide()
            column = QWidget()
            col = QVBoxLayout(column)
            col.setContentsMargins(0, 0, 0, 0)
            col.setSpacing(1)
            col.addWidget(field)
            if spec.note:
                note = QLabel(spec.note)
                note.setWordWrap(True)
                note.setStyleSheet("color: #666;")
                col.addWidget(note)
            col.addWidget(error)
            label = QLabel(spec.label + ("" if not spec.required else " *"))
            label.setToolTip(spec.description)
            layout.addRow(label, column)
            self.editors[spec.name] = editor
            self.error_labels[spec.name] = error

    def _editor(self, spec) -> QWidget:
        text = self.form.text[spec.name]
        if spec.kind == "bool":
            box = QCheckBox()
            box.setChecked(text.lower() == "true")
            box.toggled.connect(lambda on, n=spec.name: self._edited(n, "true" if on else "false"))
            return box
        if spec.kind == "choice":
            combo = QComboBox()
            for choice in spec.choices:
                combo.addItem(str(choice))
            combo.setCurrentText(text)
            combo.currentTextChanged.connect(lambda t, n=spec.name: self._edited(n, t))
            guard_wheel(combo, self.wheel_guard)
            return combo
        if spec.kind == "list":
            lines = QPlainTextEdit(text)
            lines.setPlaceholderText("one item per line")
            lines.setFixedHeight(lines.fontMetrics().lineSpacing() * 4 + 12)
            lines.textChanged.connect(
                lambda n=spec.name, e=lines: self._edited(n, e.toPlainText()))
            return lines
        line = QLineEdit(text)
        line.setPlaceholderText("(none)" if spec.optional else "required" if spec.required else "")
        line.textEdited.connect(lambda t, n=spec.name: self._edited(n, t))
        return line

    def _with_path_buttons(self, spec: FieldSpec, editor: QLineEdit) -> QWidget:
        box = QWidget()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(editor, 1)
        browse = QPushButton("Browse…")
        browse.setToolTip(f"Choose the {spec.path_kind if spec.path_kind != 'any' else 'file'} "
                          f"for {spec.name}")
        browse.clicked.connect(lambda _=False, s=spec: self.browse(s))
        row.addWidget(browse)
        if spec.name.startswith("data."):
            row.addWidget(self._picker(
                spec, "Dataset ▾", "Pick one of this workspace's datasets",
                lambda: [(p.name, p) for p in self.datasets], "(no datasets in this workspace)"))
        if spec.name == "model.gguf":
            row.addWidget(self._picker(
                spec, "Library ▾", "Pick a model from this workspace's model library",
                lambda: self.models, "(no models in the library: add one in the Models pane)"))
        return box

    def _picker(self, spec: FieldSpec, text: str, tip: str, choices, empty: str) -> QPushButton:
        """A button whose menu lists `choices()` (name, path), filled when it opens."""
        pick = QPushButton(text)
        pick.setToolTip(tip)
        menu = QMenu(pick)

        def fill() -> None:
            menu.clear()
            for name, path in choices():
                menu.addAction(name, lambda p=path: self.set_value(spec.name,
                                                                   self.form.relative(p)))
            if menu.isEmpty():
                menu.addAction(empty).setEnabled(False)

        menu.aboutToShow.connect(fill)
        pick.setMenu(menu)
        return pick

    def browse(self, spec: FieldSpec) -> None:
        current = self.form.resolve(self.form.text[spec.name] or ".")
        start = str(current if current.exists() else Path(self.form.base_dir or "."))
        if spec.path_kind == "folder":
            chosen = QFileDialog.getExistingDirectory(self, spec.name, start)
        else:
            chosen, _ = QFileDialog.getOpenFileName(
                self, spec.name, start, "GGUF (*.gguf);;All files (*)"
                if spec.name == "model.gguf" else "All files (*)")
        if chosen:
            self.set_value(spec.name, self.form.relative(chosen))

    def set_value(self, name: str, text: str) -> None:
        """Type a value into a field as the user would (used by tests and presets)."""
        editor = self.editors[name]
        if isinstance(editor, QPlainTextEdit):
            editor.setPlainText(text)
        elif isinstance(editor, QLineEdit):
            editor.setText(text)
            self._edited(name, text)
        elif isinstance(editor, QComboBox):
            editor.setCurrentText(text)
        elif isinstance(editor, QCheckBox):
            editor.setChecked(text.lower() == "true")

    def _edited(self, name: str, text: str) -> None:
        self.form.set_text(name, text)
        if not self.building:
            self._show_errors()

    def _show_errors(self) -> None:
        for name, editor in self.editors.items():
            message = self.form.errors.get(name)
            label = self.error_labels[name]
            editor.setStyleSheet(INVALID_STYLE if message else "")
            editor.setProperty("invalid", bool(message))
            label.setText(message or "")
            label.setVisible(bool(message))
        self.general.setText(self.form.general_error or "")
        self.general.setVisible(bool(self.form.general_error))
        self.validity_changed.emit(self.form.valid)
