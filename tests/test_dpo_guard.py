"""lm-dpo's guardrails: a warning below `guard.min_pairs`, the collapse rule on worked numbers
(engine/train/preference.py: `collapse`), a real run stopped on collapse with its AFTER answers
written beside the checkpoint it stopped at (what the A/B pane compares with BEFORE), and the
twin: the same run with `collapse = "warn"` trains to its last step."""

from __future__ import annotations

import json

import pytest
from lm_pretrain_support import forgebench
from test_lm_dpo import rows, sft_run, write_dpo  # noqa: F401 (sft_run: the fixture)

from app.viewmodels.runs import run_notices
from engine.rundir import RunDir
from engine.train.preference import collapse


def test_collapse_rule_on_worked_numbers():
    """The issue's run (margin 27 at step 2) collapses by its margin; chosen answers losing
    30 nats against the reference (β 0.1: chosen reward −3) collapse by the drop; a healthy
    step (margin 1.2, chosen down 2 nats) does not."""
    found = collapse({"reward_margin": 27.0, "chosen_reward": 0.5}, 0.1, 10.0, 20.0)
    assert (found.rule, found.value, found.limit) == ("margin", 27.0, 10.0)
    assert "running away" in found.message
    found = collapse({"reward_margin": 2.0, "chosen_reward": -3.0}, 0.1, 10.0, 20.0)
    assert found.rule == "chosen_drop" and found.value == pytest.approx(30.0)
    assert collapse({"reward_margin": 1.2, "chosen_reward": -0.2}, 0.1, 10.0, 20.0) is None


def events(run) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def guarded(folder, sft, collapse_action: str):
    config = write_dpo(folder, sft, steps=4, save_every=0)
    config.write_text(config.read_text() + f"""[guard]
min_pairs = 8
collapse = "{collapse_action}"
max_margin = 0.01
""")
    forgebench("run", str(config), "--out", str(folder / "run"))
    return folder / "run"


@pytest.mark.slow
def test_a_collapsing_run_stops_with_its_after_answers_and_the_twin_warns_only(tmp_path,
                                                                             sft_run):  # noqa: F811
    from app.viewmodels.ab import common_items, gather_system

    run = guarded(tmp_path / "stop", sft_run, "stop")
    status = RunDir(run).status()
    found = [e for e in events(run) if e["kind"] == "dpo_collapse"]
    assert status["state"] == "stopped" and "DPO collapse" in status["stop_reason"]
    assert len(found) == 1 and found[0]["rule"] == "margin" and found[0]["action"] == "stop"
    stopped_at = found[0]["step"]
    assert 1 < stopped_at < 4 and rows(run)[-1]["step"] == stopped_at
    assert [c.name for c in RunDir(run).checkpoints()] == [f"step-{stopped_at:06d}"]
    warning = [e for e in events(run) if e["kind"] == "warning"]
    assert warning[0]["check"] == "min_pairs" and warning[0]["pairs"] == 3
    said = run_notices(run)     # what the Runs pane's details say
    assert "only 3 preference pair(s)" in said and f"stopped at step {stopped_at}: DPO " \
        "collapse" in said
    # BEFORE (the starting policy) and AFTER (where it stopped): the A/B pane's two systems
    before = gather_system(run, "step-000000")
    after = gather_system(run, f"step-{stopped_at:06d}")
    assert common_items({"before": before, "after": after}) == ["Say hello."]

    twin = guarded(tmp_path / "warn", sft_run, "warn")
    assert RunDir(twin).status()["state"] == "completed"
    assert [r["step"] for r in rows(twin)] == [1, 2, 3, 4]
    assert {e["action"] for e in events(twin) if e["kind"] == "dpo_collapse"} == {"warn"}
