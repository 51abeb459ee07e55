"""The first-run tour's panel (state in app/viewmodels/tour.py): a strip above the panes with
the step's title and text, Back / Next (Finish on the last step) and "Skip tour". Each step
selects its pane in the sidebar so the user sees what the text describes."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout

from app.viewmodels.tour import Tour
from app.views import theme


class TourPanel(QFrame):
    show_pane = Signal(str)     # the sidebar entry this step is about

    def __init__(self, tour: Tour):
        super().__init__()
        self.tour = tour
        theme.style(self, "TourPanel {{ background: {tour_bg}; border: 1px solid {tour_border}; }}"
                          " TourPanel QLabel {{ color: {text}; }}")
        self.title = QLabel()
        self.title.setStyleSheet("font-weight: bold;")
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.back_button = QPushButton("Back")
        self.next_button = QPushButton("Next")
        self.skip_button = QPushButton("Skip tour")
        self.skip_button.setToolTip("Hide the tour for good (Help → Tour shows it again)")
        self.back_button.clicked.connect(lambda: self.act(self.tour.back))
        self.next_button.clicked.connect(lambda: self.act(self.tour.next))
        self.skip_button.clicked.connect(lambda: self.act(self.tour.dismiss))
        row = QHBoxLayout()
        row.addWidget(self.title, 1)
        for button in (self.back_button, self.next_button, self.skip_button):
            row.addWidget(button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 4)     # compact: the panes keep the height
        layout.setSpacing(2)
        layout.addLayout(row)
        layout.addWidget(self.text)
        self.sync()

    def sync(self) -> None:
        self.setVisible(self.tour.active)
        if not self.tour.active:
            return
        step = self.tour.step
        self.title.setText(step.title)
        self.text.setText(step.text)
        self.back_button.setEnabled(self.tour.index > 0)
        self.next_button.setText("Finish" if self.tour.is_last else "Next")
        self.show_pane.emit(step.pane)

    def act(self, change) -> None:
        """Apply one of the tour's moves, then show where it left the user."""
        change()
        self.sync()

    def restart(self) -> None:
        self.act(self.tour.restart)
