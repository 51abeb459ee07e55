"""The question asked before a run is resumed to a larger step target when its learning-rate
schedule would not simply continue (app/viewmodels/runs.py `extension_plan`): what changes in
words, and the rate it trained with (solid) beside the rate it would follow (dashed), so the new
curve is seen before anything starts. Accepting starts the resume; nothing starts otherwise."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QVBoxLayout

from app.viewmodels.runs import ExtensionPlan
from app.views import theme


class ExtendDialog(QDialog):
    def __init__(self, plan: ExtensionPlan, parent=None):
        super().__init__(parent)
        self.plan = plan
        self.setWindowTitle(f"Extend {plan.run}: a new learning-rate schedule")
        self.text = QLabel(plan.text)
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.plot = pg.PlotWidget(background=theme.colour("panel_bg"))
        self.plot.setMinimumHeight(180)
        self.plot.addLegend(offset=(-10, 10))
        self.plot.setLabel("bottom", "step")
        self.plot.setLabel("left", "learning rate")
        self.seen = self.plot.plot(*plan.seen, pen=pg.mkPen("#1565c0", width=2),
                                   name="trained so far")
        self.planned = self.plot.plot(*plan.planned, name=f"resumed to step {plan.new_total}",
                                      pen=pg.mkPen("#c62828", width=2,
                                                   style=Qt.PenStyle.DashLine))
        buttons = QDialogButtonBox()
        self.start_button = buttons.addButton("Resume with the new schedule",
                                              QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.addButton(QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.text)
        layout.addWidget(self.plot, 1)
        layout.addWidget(buttons)
        self.resize(640, 420)
