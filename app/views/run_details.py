"""What the Runs pane says about the selected runs beside the ledger and the charts: the
reason the last start was refused (a banner above the ledger, kept until the next start),
each selected run's notices, why it stopped and its failure report with the traceback (under
the ledger), and what its job is doing now (above the charts). The texts come from
app/viewmodels/runs.py (`run_notices`, `failure_report`, the ledger rows' stage lines); an
lm-cartridge run's held-out comparison in one sentence from app/viewmodels/reports.py."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QPlainTextEdit

from app.viewmodels.reports import comparison_summary
from app.viewmodels.runs import LedgerRow, failure_report, run_notices
from app.views import theme


class RefusedStart(QLabel):
    """Why the last start was refused, until the next start."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWordWrap(True)
        self.setMinimumWidth(1)      # a long line wraps; never widens the pane
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        theme.style(self, "QLabel {{ background: {error_bg}; color: {error}; "
                          "border: 1px solid {error_border}; padding: 4px; }}")
        self.hide()

    def refuse(self, name: str, reason: str) -> None:
        self.setText(f"<b>{name} did not start.</b><br>"
                     + html.escape(reason).replace("\n", "<br>"))
        self.show()


class RunDetails(QPlainTextEdit):
    """The selected runs' notices and failure reports."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setReadOnly(True)
        self.setPlaceholderText("Select a run: its warnings, why it stopped, its error and "
                                "traceback when it failed, and a cartridge run's held-out "
                                "comparison show here.")
        self._shown_states: list = []  # (run, state) pairs the box was filled for

    def show_runs(self, paths: list[Path]) -> None:
        texts = []
        for path in paths:
            said = "\n\n".join(t for t in (run_notices(path), failure_report(path),
                                            comparison_summary(path)) if t)
            if said:
                texts.append(f"{path.name}\n{said}")
        self.setPlainText("\n\n".join(texts))

    def states_moved(self, shown: list[LedgerRow]) -> bool:
        """Whether a shown run's state moved (it stopped, it failed) since the last call: the
        box is then filled again."""
        states = [(r.path, r.state) for r in shown]
        moved, self._shown_states = states != self._shown_states, states
        return moved


class StageLine(QLabel):
    """What the selected running jobs are doing right now."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWordWrap(True)
        self.setMinimumWidth(1)
        theme.style(self, "QLabel {{ color: {stage}; font-weight: bold; }}")
        self.hide()

    def show_rows(self, shown: list[LedgerRow]) -> None:
        doing = [f"{r.name}: {r.stage_line}" for r in shown if r.active]
        self.setText("\n".join(doing))
        self.setVisible(bool(doing))
