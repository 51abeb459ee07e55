"""Waiting for the window's background work in GUI tests: panes read datasets, configs and the
workspace on worker threads, so a test waits for them as a user waits for the screen."""

from __future__ import annotations

import threading

from app.views.background import BackgroundCall
from app.views.datasets_pane import DatasetsPane
from app.views.form_widget import RecipeFormWidget

TIMEOUT_MS = 120_000


def busy(widget) -> bool:
    """True while any worker call of `widget` (or its children) runs or a dataset loads."""
    panes = [widget] if isinstance(widget, DatasetsPane) else []
    panes += widget.findChildren(DatasetsPane)
    forms = widget.findChildren(RecipeFormWidget)
    return any(call.running for call in widget.findChildren(BackgroundCall)) or \
        any(pane.loading for pane in panes) or any(form.building for form in forms)


def settle(qtbot, widget, timeout: int = TIMEOUT_MS) -> None:
    """Wait until the widget's background reads are done and their results are on screen."""
    qtbot.waitUntil(lambda: not busy(widget), timeout=timeout)


class GuiThreadGuard:
    """Wraps calls the window must never make on the GUI thread (engine validation, config
    and schema loading, workspace scans, file writes, process starts) and records each one
    made there: a structural check that the event loop is never blocked by them, on any
    machine, however loaded."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.on_gui: list[str] = []
        self.off_gui: list[str] = []

    def wrap(self, owner, name: str, before=None) -> None:
        """Guard `owner.name`; `before()` runs first (a test can hold the call there)."""
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"

        def guarded(*args, **kwargs):
            on_gui = threading.current_thread() is threading.main_thread()
            (self.on_gui if on_gui else self.off_gui).append(label)
            if before is not None:
                before()
            return original(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, guarded)

    def guard_the_window(self) -> "GuiThreadGuard":
        """Everything the newcomer's journey reaches that reads, validates, writes or starts."""
        import app.viewmodels.datasets as datasets
        import app.viewmodels.export_wizard as export_wizard
        import app.viewmodels.forms as forms
        import app.viewmodels.jobs as jobs
        import app.views.run_form as run_form
        import app.views.runs_pane as runs_pane
        from app.viewmodels.workspace import WorkspaceWatch

        for owner, name in ((datasets, "validate_dataset"), (datasets, "read_raw_records"),
                            (forms, "schema_for"), (run_form, "new_config_from_template"),
                            (jobs, "prepare_run"), (runs_pane, "start_detached"),
                            (WorkspaceWatch, "changes"), (export_wizard, "base_info"),
                            (export_wizard, "size_estimates")):
            self.wrap(owner, name)
        return self
