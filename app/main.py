"""`forgebench-app`: the workbench window. First launch opens the bundled sample workspace."""

from __future__ import annotations

import argparse
import sys

from PySide6.QtWidgets import QApplication

from app.viewmodels.workspace import Settings, install_sample_workspace
from app.views import theme
from app.views.gui_gc import GuiThreadCollector
from app.views.main_window import MainWindow
from engine.errors import ForgebenchError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forgebench-app", description=__doc__)
    parser.add_argument("workspace", nargs="?", help="workspace folder to open")
    args = parser.parse_args(argv)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Forgebench")
    collector = GuiThreadCollector(parent=app)   # cycles collected on this thread only
    theme.apply(app)        # light or dark as the desktop is, and again when it changes
    window = MainWindow(Settings())
    open_initial_workspace(window, args.workspace)
    window.show()
    code = app.exec()
    collector.stop()
    window.deleteLater()  # tear the widgets down inside Qt, before the interpreter exits
    app.processEvents()
    return code


def open_initial_workspace(window: MainWindow, path: str | None = None) -> bool:
    """The workspace named on the command line, else the most recent one, else (first launch)
    the bundled sample workspace. A missing one is reported in the window with ways out."""
    if path:
        return window.open_workspace(path)
    if window.settings.recent:
        return window.open_workspace(window.settings.recent[0])
    try:
        return window.open_workspace(install_sample_workspace())
    except ForgebenchError as exc:
        window.report_problem("sample workspace", exc)
        return False


if __name__ == "__main__":
    sys.exit(main())
