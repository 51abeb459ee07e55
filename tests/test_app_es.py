"""The app and lm-es runs. The Runs pane's charts: the reward plot appears for a run that logs
rewards (the centre's reward, the population's mean, max and min), the grad-norm plot gains
the update norm and the lr plot σ; a run without rewards keeps the reward plot hidden. The
Export wizard and the A/B pane treat an lm-es run as the GGUF fine-tune it is."""

from __future__ import annotations

import time

import pytest
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
    qtbot.waitUntil(lambda: not charts.pending)          # plots are drawn one per tick
    assert not charts.plot_widgets["reward"].isVisible()
    assert drawn(charts, "reward") == []

    es = write_es_run(tmp_path / "es")
    charts.set_runs([pretrain.path, es.path])
    qtbot.waitUntil(lambda: not charts.pending)
    assert charts.plot_widgets["reward"].isVisible()
    curves = drawn(charts, "reward")
    assert [round(0.1 + 0.02 * s, 10) for s in range(1, 7)] in [
        [round(float(v), 10) for v in c] for c in curves]
    assert len(curves) == 4                      # centre, mean, max, min
    assert [0.05] * 6 in drawn(charts, "grad_norm")          # the update norm beside it
    assert [0.02] * 6 in drawn(charts, "lr")                 # σ beside the learning rate


@pytest.mark.slow
def test_an_lm_es_run_is_exportable_and_has_an_untuned_base_for_ab(tmp_path):
    """The Export wizard lists an lm-es run with its adapter size, and the A/B pane finds its
    GGUF base (a real tiny run)."""
    from fixtures_gguf import write_tiny_gguf
    from lm_pretrain_support import forgebench
    from test_lm_es import write_config

    from app.viewmodels import ab
    from app.viewmodels import export_wizard as vm

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q4_K", n_layers=2)
    forgebench("run", str(write_config(tmp_path, gguf, steps=1, population=2)), "--out",
               str(tmp_path / "run"))
    (run,) = vm.exportable_runs([tmp_path / "run"])
    assert run.recipe == "lm-es" and run.checkpoints == ["step-000001"]
    sizes = vm.size_estimates(run, "step-000001")
    # rank 4 on q and v of 2 layers: A [4, 256] each, B [256 q-out, 4] and [128 v-out, 4], f32
    assert sizes["adapter"] == 2 * (2 * 4 * 256 + 4 * 256 + 4 * 128) * 4
    assert ab.base_gguf(tmp_path / "run") == gguf
