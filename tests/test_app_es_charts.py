"""The Runs pane's charts of an lm-es run: the reward plot appears for a run that logs rewards
(the centre's reward, the population's mean, max and min), the grad-norm plot gains the update
norm and the lr plot σ; a run without rewards keeps the reward plot hidden."""

from __future__ import annotations

import time

from test_app_support import write_run

from app.views.charts import RunCharts
from engine.rundir import RunDir


def write_es_run(path, steps: int = 6) -> RunDir:
    run = RunDir(path)
    run.create({"recipe": "lm-es", "created": time.time(),
                "config": {"steps": steps, "es": {"lr": 0.01, "sigma": 0.02}},
                "data": {"files": {"train:pairs.jsonl": "ab" * 32}}})
    run.log_invocation({"id": 1, "start_step": 0})
    for step in range(1, steps + 1):
        reward = 0.1 + 0.02 * step
        run.log_metric({"invocation": 1, "step": step, "split": "train", "loss": 3.0 - step / 10,
                        "grad_norm": 5.0, "clipped": False, "lr": 0.01, "sigma": 0.02,
                        "reward": reward, "reward_mean": reward - 0.01,
                        "reward_max": reward + 0.05, "reward_min": reward - 0.05,
                        "update_norm": 0.05, "tokens_per_s": 50.0, "peak_rss_mb": 900.0,
                        "time": 1000.0 + step})
    run.set_status("completed", step=steps, target_steps=steps)
    run.release_lock()
    return run


def drawn(charts: RunCharts, metric: str) -> list[list[float]]:
    return [list(item.getData()[1]) for item in charts.plots[metric].listDataItems()
            if item.getData()[1] is not None and len(item.getData()[1])]


def test_reward_plot_shows_for_an_es_run_only(qtbot, tmp_path):
    charts = RunCharts()
    qtbot.addWidget(charts)
    charts.show()
    pretrain = write_run(tmp_path / "pretrain")
    charts.set_runs([pretrain.path])
    assert not charts.plot_widgets["reward"].isVisible()
    assert drawn(charts, "reward") == []

    es = write_es_run(tmp_path / "es")
    charts.set_runs([pretrain.path, es.path])
    assert charts.plot_widgets["reward"].isVisible()
    curves = drawn(charts, "reward")
    assert [round(0.1 + 0.02 * s, 10) for s in range(1, 7)] in [
        [round(float(v), 10) for v in c] for c in curves]
    assert len(curves) == 4                      # centre, mean, max, min
    assert [0.05] * 6 in drawn(charts, "grad_norm")          # the update norm beside it
    assert [0.02] * 6 in drawn(charts, "lr")                 # σ beside the learning rate
