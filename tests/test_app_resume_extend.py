"""Resuming and extending a run from the Runs pane (issue 46, item 5).

- A step target typed for one run is never carried over to another: choosing another run puts
  the box back to "same target".
- Extending a finished run whose learning-rate schedule would not simply continue (a cosine laid
  out again over the new target, a warmup given as a share of the steps) asks first, with the new
  curve drawn beside the one trained; nothing starts until the user accepts. The plan's numbers
  are checked against the cosine written out by hand.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from app_wait import settle

from app.viewmodels.runs import extension_plan
from app.viewmodels.workspace import Workspace
from engine.rundir import RunDir

COSINE = {"lr": 3e-3, "schedule": "cosine", "warmup": 2, "min_lr_ratio": 0.1}


def hand_lr(step: int, total: int, lr=3e-3, warmup=2, floor_ratio=0.1) -> float:
    """The cosine with linear warmup, written out: lr·(s+1)/w in the warmup, then
    floor + (lr − floor)·½(1 + cos(π·(s − w)/(total − 1 − w))), held at the floor after."""
    if step < warmup:
        return lr * (step + 1) / warmup
    floor = lr * floor_ratio
    progress = min((step - warmup) / (total - 1 - warmup), 1.0)
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def finished_run(path: Path, optim: dict, steps: int = 20, state: str = "completed") -> Path:
    run = RunDir(path)
    run.create({"recipe": "lm-pretrain", "created": time.time(),
                "config": {"steps": steps, "optim": optim}})
    run.log_invocation({"id": 1, "start_step": 0})
    for step in range(1, steps + 1):
        run.log_metric({"invocation": 1, "step": step, "split": "train", "loss": 1.0,
                        "lr": hand_lr(step - 1, steps), "time": 1000.0 + step})
    run.set_status(state, step=steps, target_steps=steps)
    run.release_lock()
    return path


def test_the_plan_of_an_extended_cosine_is_the_schedule_laid_out_again(tmp_path):
    run = finished_run(tmp_path / "cosine", COSINE)
    plan = extension_plan(run, 40)
    assert plan is not None and (plan.done, plan.old_total, plan.new_total) == (20, 20, 40)
    assert plan.planned[0] == list(range(20, 40))
    assert plan.planned[1] == pytest.approx([hand_lr(s, 40) for s in range(20, 40)])
    # the rate it stopped at (the floor, 3e-4) and the one it would start again at (~1.6e-3)
    assert plan.seen[1][-1] == pytest.approx(3e-4)
    assert f"was at {3e-4:.3g}" in plan.text and f"starts at {hand_lr(20, 40):.3g}" in plan.text
    assert "laid out again over 40 steps" in plan.text
    # twins: a constant rate continues, so nothing is asked; nor for a target not above it
    assert extension_plan(finished_run(tmp_path / "constant", {"lr": 1e-3}), 40) is None
    assert extension_plan(run, 20) is None


def test_a_warmup_given_as_a_share_of_the_steps_warms_up_again(tmp_path):
    share = {"lr": 1e-3, "schedule": "constant", "warmup_fraction": 0.5}
    plan = extension_plan(finished_run(tmp_path / "share", share, steps=10), 40)
    # warmup round(0.5 × 40) = 20 steps: at step 10 the rate is 11/20 of lr again
    assert plan is not None and plan.planned[1][0] == pytest.approx(1e-3 * 11 / 20)
    assert "rises to 0.001 at step 19" in plan.text


@pytest.fixture
def pane(qtbot, tmp_path, monkeypatch):
    import app.views.runs_pane as runs_pane

    started: list[list[str]] = []
    monkeypatch.setattr(runs_pane, "start_detached",
                        lambda argv, log: started.append(argv) or 999_999)
    workspace = Workspace.create(tmp_path / "ws")
    finished_run(workspace.runs_dir / "cosine", COSINE)
    finished_run(workspace.runs_dir / "constant", {"lr": 1e-3}, state="stopped")
    widget = runs_pane.RunsPane()
    qtbot.addWidget(widget)
    widget.resize(864, 640)
    widget.show()
    widget.set_workspace(workspace)
    settle(qtbot, widget)
    widget.started = started
    return widget


def test_a_target_typed_for_one_run_is_not_carried_to_another(pane, qtbot):
    ws = pane.workspace
    pane.select_run(ws.runs_dir / "constant")
    pane.resume_steps.setValue(35)
    pane.poll(force=True)                       # a poll re-selects; the typed target stays
    assert pane.resume_steps.value() == 35
    pane.select_run(ws.runs_dir / "cosine")
    assert pane.resume_steps.value() == 0 and pane.resume_steps.text() == "same target"
    pane.select_run(ws.runs_dir / "constant")
    assert pane.resume_steps.value() == 0


def test_extending_a_cosine_run_shows_the_new_curve_and_starts_only_when_accepted(pane, qtbot):
    cosine = pane.workspace.runs_dir / "cosine"
    pane.select_run(cosine)
    pane.resume_steps.setValue(40)
    pane.resume_selected()
    qtbot.waitUntil(lambda: pane.extend_dialog is not None and pane.extend_dialog.isVisible())
    dialog = pane.extend_dialog
    assert "laid out again over 40 steps" in dialog.text.text()
    xs, ys = dialog.planned.getData()
    assert list(xs) == list(range(20, 40)) and list(ys) == pytest.approx(
        [hand_lr(s, 40) for s in range(20, 40)])
    assert len(dialog.seen.getData()[0]) == 20
    dialog.reject()
    settle(qtbot, pane)
    assert pane.started == []                   # cancelled: nothing started

    pane.resume_selected()
    qtbot.waitUntil(lambda: pane.extend_dialog is not dialog and pane.extend_dialog is not None
                    and pane.extend_dialog.isVisible())
    pane.extend_dialog.start_button.click()
    qtbot.waitUntil(lambda: bool(pane.started))
    argv = pane.started[0]
    assert argv[argv.index("resume") + 1] == str(cosine) and \
        argv[argv.index("--steps") + 1] == "40"


def test_a_constant_run_resumes_to_a_larger_target_without_a_question(pane, qtbot):
    pane.select_run(pane.workspace.runs_dir / "constant")
    pane.resume_steps.setValue(30)
    pane.resume_selected()
    qtbot.waitUntil(lambda: bool(pane.started))
    assert pane.extend_dialog is None and "30" in pane.started[0]

