""""What does this mean?" links: a label whose link opens the user guide's section on a topic
(app/viewmodels/guide.py: HELP_TOPICS) in a dialog, rendered from the guide's own markdown, so
the app says what the docs say and works with no browser or network."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QTextBrowser, QVBoxLayout

from app.viewmodels.guide import HELP_TOPICS, guide_path, guide_section
from engine.errors import ForgebenchError

SCHEME = "guide:"


def help_link(topic: str, text: str = "What does this mean?") -> QLabel:
    label = QLabel(f'<a href="{SCHEME}{HELP_TOPICS[topic]}">{text}</a>')
    label.setTextFormat(Qt.TextFormat.RichText)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.LinksAccessibleByMouse
                                  | Qt.TextInteractionFlag.LinksAccessibleByKeyboard)
    label.setToolTip("Opens the user guide's section on this")
    label.linkActivated.connect(lambda href: GuideDialog(href.removeprefix(SCHEME), label).show())
    return label


class GuideDialog(QDialog):
    def __init__(self, anchor: str, parent=None):
        super().__init__(parent)
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.setWindowTitle("Forgebench user guide")
        self.resize(640, 520)
        self.anchor = anchor
        self.text = QTextBrowser()
        self.text.setOpenExternalLinks(False)
        try:
            guide = guide_path()
            self.text.setSearchPaths([str(guide.parent)])      # the guide's screenshots
            self.text.setMarkdown(guide_section(anchor, guide))
        except ForgebenchError as exc:
            self.text.setPlainText(exc.render())
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.text, 1)
        layout.addWidget(buttons)
