"""A user who brings their own GGUF (no Gemma package installed) goes from an empty library to a
rated sample and an export without editing a file by hand (issue 46, item 1).

The workspace holds the shipped pirate config as it comes (its base is the Gemma package's
file, which is not there: HOME is a scratch folder and the package counts as not installed) and
the pirate pairs. The user adds a tiny Gemma-3 GGUF through the Models pane; the first-fine-tune
strip offers "Use <it>" instead of the install line, which points the config at the file; Start
trains a real detached `forgebench run`; the Samples pane shows its BEFORE/AFTER answers and the
AFTER answer is rated there; the export wizard exports the adapter. The config is shrunk to a few
steps by the test's set-up (the shipped file's step count and window), never by the user.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
from app_part2_support import go_and_wait, wait_for
from app_wait import settle
from fixtures_gguf import write_tiny_gguf
from lm_sft_support import REPO, SHIPPED_BASE
from PySide6.QtCore import Qt

from app.viewmodels import first_tune
from app.viewmodels.workspace import Settings, Workspace
from app.views.main_window import MainWindow
from engine import model_library

TIMEOUT_MS = 300_000


def own_model_workspace(folder: Path) -> Path:
    """A workspace with the sample workspace's pirate config (3 steps, window 3) and the
    pirate pairs; the library is empty."""
    from engine.data.generators.text import generate_pirate

    workspace = Workspace.create(folder / "ws")
    generate_pirate(workspace.datasets_dir / "pirate")
    shipped = REPO / "resources" / "sample-workspace" / "configs" / first_tune.CONFIG_NAME
    text = shipped.read_text()
    for line, new in (("steps = 30", "steps = 3"), ("window = 5", "window = 3"),
                      ("micro_batch = 5", "micro_batch = 3"), ("max_tokens = 24",
                                                               "max_tokens = 4")):
        assert line in text, line
        text = text.replace(line, new)
    assert SHIPPED_BASE in text
    (workspace.root / "configs").mkdir(exist_ok=True)
    (workspace.root / "configs" / first_tune.CONFIG_NAME).write_text(text)
    return workspace.root


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))      # the shipped base is not there
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FORGEBENCH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(model_library, "package_installed", lambda package: False)
    win = MainWindow(Settings())
    win.close_policy = "stop"
    qtbot.addWidget(win)
    win.resize(1024, 700)
    win.show()
    yield win
    win.close()


def rate_the_after_answer(window, run_dir: Path, root: Path) -> None:
    """Samples: the run's BEFORE/AFTER answers, and the AFTER answer rated."""
    window.show_pane("Samples")
    samples = window.samples
    samples.refresh_runs()
    samples.select_run(run_dir)
    assert samples.views.currentWidget() is samples.text_table
    after = json.loads((run_dir / "samples" / "step-000003" / "generations.jsonl")
                       .read_text().splitlines()[0])["answer"]
    assert samples.text_table.item(0, 2).text() == after
    samples.text_table.setCurrentCell(0, 2)
    samples.rubric.rater.setText("me")
    samples.save_rating()
    assert samples.rubric.saved.text() == "saved ✓"
    assert list((root / "ratings").rglob("*.jsonl"))


def test_own_gguf_reaches_start_trains_samples_rates_and_exports(qtbot, window, tmp_path):
    root = own_model_workspace(tmp_path)
    (tmp_path / "downloads").mkdir()
    own = write_tiny_gguf(tmp_path / "downloads" / "my-tiny-gemma.gguf", arch="gemma3",
                          qtype="F32", n_layers=2, seed=3)
    window.open_workspace(root)
    panel = window.first_tune
    settle(qtbot, panel)
    # Nothing in the library yet: the install line and the way to bring one's own model.
    assert panel.isVisible() and "pip install" in panel.offer.text()
    assert "add your own GGUF in Models" in panel.offer.text()
    assert not panel.start_button.isVisible() and not panel.use_button.isVisible()

    window.show_pane("Models")
    models = window.models
    models.add_file(str(own))
    qtbot.waitUntil(lambda: not models.busy, timeout=TIMEOUT_MS)
    settle(qtbot, panel)
    # The strip offers the user's model instead of the package, and no Start until chosen.
    assert "Use my-tiny-gemma" == panel.use_button.text() and panel.use_button.isVisible()
    assert "my-tiny-gemma" in panel.offer.text() and not panel.start_button.isVisible()

    config = root / "configs" / first_tune.CONFIG_NAME
    comments = [line for line in config.read_text().splitlines() if line.startswith("#")]
    qtbot.mouseClick(panel.use_button, Qt.MouseButton.LeftButton)
    settle(qtbot, panel)
    library_file = model_library.entry_path(root, model_library.get_entry(root, "my-tiny-gemma"))
    assert Path(tomllib.loads(config.read_text())["model"]["gguf"]) == library_file.resolve()
    assert [line for line in config.read_text().splitlines() if line.startswith("#")] == \
        comments                                          # only the gguf line changed
    assert panel.start_button.isVisible() and panel.start_button.isEnabled()
    assert not panel.use_button.isVisible() and "pip install" not in panel.offer.text()
    assert "pirate LoRA on my-tiny-gemma" in panel.offer.text()

    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    run_dir = panel.run_dir
    qtbot.waitUntil(lambda: panel.result.isVisible() or "ended" in panel.run_status.text()
                    or "did not start" in panel.run_status.text(),
                    timeout=TIMEOUT_MS)
    assert panel.result.isVisible(), panel.run_status.text()
    manifest = json.loads((run_dir / "run.json").read_text())
    assert Path(manifest["config"]["model"]["gguf"]) == library_file.resolve()

    rate_the_after_answer(window, run_dir, root)

    # Export: the strip's "Export it" opens the wizard on the run; the adapter is exported.
    window.show_pane("Runs")
    qtbot.mouseClick(panel.export_button, Qt.MouseButton.LeftButton)
    export = window.export
    assert Path(export.run_combo.currentData()) == run_dir
    go_and_wait(qtbot, export, 1)
    go_and_wait(qtbot, export, 2)
    export.set_dtype("adapter")
    export.go(3)
    export.out_name.setText("my-pirate")
    export.export()
    wait_for(qtbot, export.export_job, 600)
    assert (root / "exports" / "my-pirate").is_dir(), export.export_job.output[-2000:]
    assert "export failed" not in export.verdict.text(), export.verdict.text()
