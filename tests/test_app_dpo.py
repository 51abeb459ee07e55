"""Closing the loop in the workbench: a finished blind A/B session over an lm-sft run's outputs
→ "Train on these preferences" (a new dataset version with its card, an lm-dpo config refining
the winning checkpoint, started in the Runs pane) → a real lm-dpo job whose reward-margin chart
grows → "Compare with the previous model" (a new blind session, tuned vs the SFT checkpoint, on
held-out prompts). Tiny random Gemma-3 GGUF; every job is a real `forgebench` subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dpo_support import first_step_margin_tolerance
from lm_pretrain_support import forgebench
from PySide6.QtCore import Qt
from test_app_support import make_workspace
from test_lm_dpo import SFT_CONFIG, SFT_PAIRS, write_jsonl

from app.viewmodels import ab as vm
from app.viewmodels.workspace import Settings
from app.views.main_window import MainWindow

pytestmark = pytest.mark.slow
PROMPTS = ["Say hello.", "What is the sea?", "Name a color.", "Name a fruit."]


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    win = MainWindow(Settings())
    win.close_policy = "stop"
    win.timer.setInterval(100)
    qtbot.addWidget(win)
    win.resize(1280, 860)
    win.show()
    yield win
    win.close()


def sft_run_with_a_session(ws, tmp_path: Path) -> Path:
    """An lm-sft run on a tiny Gemma 3 GGUF, and a blind session over its checkpoint and its
    untuned base: pirate answers vs plain ones."""
    from fixtures_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q4_K", n_layers=2)
    write_jsonl(ws.configs_dir / "sft.jsonl",
                [{"instruction": q, "response": a} for q, a in SFT_PAIRS])
    (ws.configs_dir / "sft-source.toml").write_text(SFT_CONFIG.format(gguf=gguf))
    sft = ws.runs_dir / "sft"
    forgebench("run", str(ws.configs_dir / "sft-source.toml"), "--out", str(sft))
    (ws.configs_dir / "sft-source.toml").unlink()

    pirate = {p: f"Ahoy! {p[:-1]}, matey!" for p in PROMPTS}
    plain = {p: f"{p[:-1]}." for p in PROMPTS}
    systems = {"sft/step-000002": {"run": str(sft), "checkpoint": "step-000002", "kind": "text",
                                   "settings": {"max_tokens": 4}, "outputs": pirate},
               "sft/base": {"run": str(sft), "checkpoint": "base", "kind": "text",
                            "settings": {"max_tokens": 4}, "outputs": plain}}
    vm.ABSession.create(ws.root / "ratings", "pirate-ab", systems, "ana",
                        generation={"prompts": PROMPTS, "max_tokens": 4, "temperature": 0.0,
                                    "seed": 0})
    return sft


def rate_pirate_over_plain(qtbot, pane) -> None:
    """The rater prefers pirate speak, except one tie."""
    keys = {"A": Qt.Key.Key_A, "B": Qt.Key.Key_B, "T": Qt.Key.Key_T}
    while not pane.session.finished:
        pair = pane.session.current()
        key = "T" if pair.item == "Name a fruit." else \
            "A" if "matey" in pane.left.text.toPlainText() else "B"
        qtbot.keyClick(pane, keys[key])


def test_a_finished_session_trains_lm_dpo_and_compares_the_tuned_model(qtbot, tmp_path,
                                                                       window, monkeypatch):
    from engine.data.dataset import load_dataset
    from engine.rundir import RunDir

    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    sft_run_with_a_session(ws, tmp_path)
    assert window.open_workspace(ws.root)
    pane = window.ab
    pane.rater.setText("ana")
    pane.sessions.setCurrentIndex(pane.sessions.findText("pirate-ab"))
    pane.resume_session()
    assert not pane.train_button.isEnabled()             # nothing to train on mid-session
    rate_pirate_over_plain(qtbot, pane)
    assert pane.train_button.isEnabled()

    monkeypatch.setattr(vm, "DPO_STEPS", 8)
    monkeypatch.setattr(vm, "DPO_LR", 2e-2)
    qtbot.mouseClick(pane.train_button, Qt.MouseButton.LeftButton)

    dataset = load_dataset(ws.datasets_dir / "preferences-pirate-ab")
    provenance = dataset.manifest["provenance"]
    assert dataset.kind == "preferences" and len(dataset.records()) == 3
    assert (provenance["ties"], provenance["skips"], provenance["raters"]) == (1, 0, {"ana": 3})
    assert all(r["rater"] == "ana" and r["session"] == "pirate-ab" and "matey" in r["chosen"]
               for r in dataset.records())
    card = json.loads((dataset.root / "card.json").read_text())
    assert card["kind"] == "preferences" and "ties (1)" in card["preprocessing"]
    config = ws.configs_dir / "dpo-pirate-ab.toml"
    assert 'sft_run = "' in config.read_text() and "step-000002" in config.read_text()

    runs = window.runs
    assert window.stack.currentWidget().widget() is runs          # the Runs pane is shown
    charts = runs.charts
    qtbot.waitUntil(lambda: any(RunDir(p).manifest()["recipe"] == "lm-dpo"
                                for p in ws.run_dirs()), timeout=60_000)
    tuned, = [p for p in ws.run_dirs() if RunDir(p).manifest()["recipe"] == "lm-dpo"]

    def drawn() -> int:
        """Points of the tuned run's curve on the reward-margin chart, as drawn."""
        curve = charts.curves.get((str(tuned), "reward_margin"))
        return 0 if curve is None or curve.getData()[0] is None else len(curve.getData()[0])

    # The new run is followed and its chart grows with its metrics. (The tiny run can finish
    # between two polls, so the growth is read from the metrics, not from two redraws.)
    qtbot.waitUntil(lambda: drawn() >= 1, timeout=300_000)
    assert not charts.plot_widgets["reward_margin"].isHidden()        # the preference row shows
    qtbot.waitUntil(lambda: RunDir(tuned).live_status()["state"] == "completed",
                    timeout=300_000)
    train = [r for r in RunDir(tuned).metrics() if r.get("split") == "train"]
    margins = [r["reward_margin"] for r in train]
    beta = RunDir(tuned).manifest()["config"]["dpo"]["beta"]
    assert len(margins) == 8 and margins[0] == pytest.approx(
        0, abs=first_step_margin_tolerance(train[0], beta))
    assert margins[-1] > margins[1] > 0
    qtbot.waitUntil(lambda: drawn() == 8, timeout=30_000)
    assert list(charts.curves[(str(tuned), "reward_margin")].getData()[1]) == \
        pytest.approx(margins)                                    # the chart is the metrics

    # Compare: held-out prompts only (a trained one is dropped), tuned vs the SFT checkpoint
    window.sidebar.setCurrentRow(4)
    pane.gen_prompts.setPlainText("Say hello.\nWhat is a ship?")
    pane.gen_max_tokens.setValue(3)
    qtbot.mouseClick(pane.compare_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: pane.session is not None
                    and pane.session.plan.session == "pirate-ab-compare", timeout=300_000)
    compare = pane.session
    assert set(compare.plan.systems) == {f"{tuned.name}/step-000008", "sft/step-000002"}
    assert compare.plan.items == ["What is a ship?"] and compare.total == 1
