"""The data-card dialog: the form generated from the card schema (lists edited one item per
line), invalid fields marked inline and Save blocked, and the rendered card.md after saving."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels.card_form import CardForm
from app.views.form_widget import RecipeFormWidget
from app.views.labels import wrapped_label
from engine.errors import ForgebenchError


class CardFormWidget(RecipeFormWidget):
    """The recipe form widget, with a multi-line editor for list fields."""

    top_section = "card"
    progressive = False     # a short form, built whole as its dialog opens

    def _editor(self, spec) -> QWidget:
        if spec.kind != "list":
            return super()._editor(spec)
        edit = QPlainTextEdit(self.form.text[spec.name])
        edit.setPlaceholderText("one per line")
        edit.setFixedHeight(66)
        edit.textChanged.connect(lambda n=spec.name, e=edit: self._edited(n, e.toPlainText()))
        return edit

    def set_value(self, name: str, text: str) -> None:
        editor = self.editors[name]
        if isinstance(editor, QPlainTextEdit):
            editor.setPlainText(text)
        else:
            super().set_value(name, text)


class CardDialog(QDialog):
    """Emits `saved(card.md path)` after card.json and card.md are written."""

    saved = Signal(str)

    def __init__(self, root: Path, parent=None):
        super().__init__(parent)
        self.root = Path(root)
        self.setWindowTitle(f"Data card — {self.root.name}")
        self.resize(1200, 800)
        self.form = CardForm(self.root)
        self.form_widget = CardFormWidget()
        self.form_widget.validity_changed.connect(self._validity)
        self.rendered = QTextBrowser()
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.save_button = QPushButton("&Save card.json and card.md")
        self.save_button.clicked.connect(self.save)
        close = QPushButton("Close")
        close.clicked.connect(self.accept)
        splitter = QSplitter()
        splitter.addWidget(self.form_widget)
        splitter.addWidget(self.rendered)
        splitter.setSizes([620, 580])
        buttons = QHBoxLayout()
        buttons.addWidget(self.status, 1)
        buttons.addWidget(self.save_button)
        buttons.addWidget(close)
        layout = QVBoxLayout(self)
        layout.addWidget(wrapped_label("What people state about the data. Counts, lengths and file "
                                "hashes are measured from the data itself when the card is "
                                "saved; anything left empty is listed as not stated."))
        layout.addWidget(splitter, 1)
        layout.addLayout(buttons)
        self.form_widget.set_form(self.form)
        self._show_card()

    def _validity(self, valid: bool) -> None:
        self.save_button.setEnabled(valid)

    def _show_card(self) -> None:
        path = self.root / "card.md"
        if path.is_file():
            self.rendered.setMarkdown(path.read_text(encoding="utf-8"))
        else:
            self.rendered.setPlainText("No card.md yet: save to write one.")

    def save(self) -> None:
        try:
            _, md_path = self.form.save()
        except ForgebenchError as exc:
            self.status.setStyleSheet("color: #c62828;")
            self.status.setText(exc.render())
            return
        self.status.setStyleSheet("color: #2e7d32;")
        self.status.setText(f"wrote {md_path.name} and card.json")
        self._show_card()
        self.saved.emit(str(md_path))
