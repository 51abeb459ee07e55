"""Cold start, structurally: what a fresh process has imported once `app.main` is imported and
once the window is built, read from `sys.modules` in a subprocess (never a timing; the timing is
bench/bench_app_start.py).

The window paints its first pane before the heavy modules are loaded: torch never (layering
rule), pyqtgraph, numpy, pydantic and the recipe schemas only when a pane that needs them is
built. The twin runs the same check on a module that does import pyqtgraph, so the check
cannot pass by reading nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pyqtgraph", "numpy", "pydantic", "engine.config", "tqdm")


def heavy_modules_after(code: str, tmp_path: Path) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running `code`."""
    probe = code + f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} " \
                   "if m in sys.modules]))"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "FORGEBENCH_CONFIG_DIR":
           str(tmp_path / "config"), "FORGEBENCH_DATA_DIR": str(tmp_path / "data")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cold_import_of_the_app_loads_no_heavy_module(tmp_path):
    assert heavy_modules_after("import app.main", tmp_path) == []


def test_the_window_builds_only_its_first_pane_before_it_paints(tmp_path):
    code = ("from PySide6.QtWidgets import QApplication\n"
            "from app.viewmodels.workspace import Settings\n"
            "from app.views.main_window import MainWindow\n"
            "app = QApplication([])\n"
            "window = MainWindow(Settings())\n"
            "assert [type(p).__name__ for p in window.built_panes()] == ['DatasetsPane']\n")
    assert not {"torch", "pyqtgraph"} & set(heavy_modules_after(code, tmp_path))


def test_a_pane_asked_for_is_built_then_and_gets_the_open_workspace(tmp_path):
    """`window.runs` builds the Runs pane on first use (here before the window ever painted),
    hands it the workspace opened earlier, and imports pyqtgraph only then."""
    code = ("import sys\n"
            "from PySide6.QtWidgets import QApplication\n"
            "from app.viewmodels.workspace import Settings, Workspace\n"
            "from app.views.main_window import MainWindow\n"
            "app = QApplication([])\n"
            f"ws = Workspace.create({str(tmp_path / 'ws')!r})\n"
            "window = MainWindow(Settings())\n"
            "assert window.open_workspace(ws.root)\n"
            "assert 'pyqtgraph' not in sys.modules\n"
            "runs = window.runs\n"
            "assert runs.workspace.root == ws.root and window.runs is runs\n"
            "window.sidebar.setCurrentRow(2)\n"
            "assert window.stack.currentWidget().widget() is runs\n")
    assert "pyqtgraph" in heavy_modules_after(code, tmp_path)


def test_the_run_forms_precision_note_reads_the_cpu_without_torch(tmp_path):
    """The note under `precision` ("auto = f32 on this machine ...") is built on the GUI
    thread with the form; it must not import torch (seconds of a frozen window)."""
    code = ("from app.viewmodels.forms import RecipeForm\n"
            "notes = [s.note for s in RecipeForm('lm-pretrain').fields if s.note]\n"
            "assert notes and notes[0].startswith('auto = '), notes\n")
    assert "torch" not in heavy_modules_after(code, tmp_path)


def test_twin_the_check_sees_a_module_that_imports_pyqtgraph(tmp_path):
    assert "pyqtgraph" in heavy_modules_after("import app.views.charts", tmp_path)
