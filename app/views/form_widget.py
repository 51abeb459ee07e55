"""A recipe form: one editor per schema field, invalid fields marked inline, Start blocked."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QFormLayout, QGroupBox, QLabel, QLineEdit,
                               QScrollArea, QVBoxLayout, QWidget)

from app.viewmodels.forms import RecipeForm

INVALID_STYLE = "border: 2px solid #c62828; background: #ffebee;"


class RecipeFormWidget(QScrollArea):
    """Edits a RecipeForm; emits `validity_changed(bool)` after every edit."""

    validity_changed = Signal(bool)
    top_section = "run"  # the group title of the schema's top-level fields

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.form: RecipeForm | None = None
        self.editors: dict[str, QWidget] = {}
        self.error_labels: dict[str, QLabel] = {}
        self.general = QLabel()
        self.general.setWordWrap(True)
        self.general.setStyleSheet("color: #c62828;")

    def set_form(self, form: RecipeForm) -> None:
        self.form = form
        self.editors.clear()
        self.error_labels.clear()
        body = QWidget()
        outer = QVBoxLayout(body)
        sections: dict[str, QFormLayout] = {}
        for spec in form.fields:
            layout = sections.get(spec.section)
            if layout is None:
                box = QGroupBox(spec.section or self.top_section)
                layout = sections[spec.section] = QFormLayout(box)
                outer.addWidget(box)
            editor = self._editor(spec)
            editor.setToolTip(spec.description)
            editor.setObjectName(spec.name)
            error = QLabel()
            error.setStyleSheet("color: #c62828;")
            error.setWordWrap(True)
            error.hide()
            column = QWidget()
            col = QVBoxLayout(column)
            col.setContentsMargins(0, 0, 0, 0)
            col.setSpacing(1)
            col.addWidget(editor)
            col.addWidget(error)
            label = QLabel(spec.label + ("" if not spec.required else " *"))
            label.setToolTip(spec.description)
            layout.addRow(label, column)
            self.editors[spec.name] = editor
            self.error_labels[spec.name] = error
        self.general.setParent(None)
        outer.addWidget(self.general)
        outer.addStretch(1)
        self.setWidget(body)
        self._show_errors()

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
            return combo
        line = QLineEdit(text)
        line.setPlaceholderText("(none)" if spec.optional else "required" if spec.required else "")
        line.textEdited.connect(lambda t, n=spec.name: self._edited(n, t))
        return line

    def set_value(self, name: str, text: str) -> None:
        """Type a value into a field as the user would (used by tests and presets)."""
        editor = self.editors[name]
        if isinstance(editor, QLineEdit):
            editor.setText(text)
            self._edited(name, text)
        elif isinstance(editor, QComboBox):
            editor.setCurrentText(text)
        elif isinstance(editor, QCheckBox):
            editor.setChecked(text.lower() == "true")

    def _edited(self, name: str, text: str) -> None:
        self.form.set_text(name, text)
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
