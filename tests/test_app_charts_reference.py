"""A run's reference loss trace beside its loss (`[compare] reference_trace`): the Qt-free
overlay (shared steps, the largest |Δ loss|, the ladder's 1e-4) against hand-computed numbers,
reading a trace and refusing a bad one, and the Runs pane drawing it as a second curve with its
label and readout in the summary, whole, in a 1024x700 window."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from layout_support import labels_cut_off

from app.viewmodels.reference_trace import (
    ReferenceTrace,
    loss_overlay,
    read_reference_trace,
    reference_trace_path,
)
from app.viewmodels.workspace import BUNDLED_SAMPLE
from engine.errors import ForgebenchError
from engine.rundir import RunDir

# the trace: steps 1-4; the run logged 2, 3 twice (a resume re-logged it: 2.0 counts), 4 as NaN
# (a skipped step) and 5, which the trace lacks. Shared: 2 (|3.25 - 3.0| = 0.25), 3 (|2.0 - 2.5|
# = 0.5): the largest is 0.5, at step 3, over 2 steps.
TRACE = ReferenceTrace("nanochat 92d63d4 (reference)", [1, 2, 3, 4], [4.0, 3.0, 2.5, 2.0],
                       threads=1)
RUN_STEPS = [2, 3, 3, 4, 5]
RUN_LOSS = [3.25, 9.0, 2.0, math.nan, 1.0]


def test_overlay_takes_the_largest_delta_over_the_shared_steps():
    overlay = loss_overlay(TRACE, RUN_STEPS, RUN_LOSS, run_threads=1)
    assert (overlay.shared_steps, overlay.max_abs_delta, overlay.at_step) == (2, 0.5, 3)
    assert (overlay.steps, overlay.loss) == (TRACE.steps, TRACE.loss)   # its curve, whole
    assert overlay.readout() == ("max |Δ loss| 0.5 at step 3 (2 shared steps): beyond the "
                                 "ladder's 1e-4")
    # twin: had the first value of the re-logged step counted, |9.0 - 2.5| would be the largest
    stale = loss_overlay(TRACE, RUN_STEPS[:2], RUN_LOSS[:2])
    assert (stale.max_abs_delta, stale.at_step) == (6.5, 3)


def test_readout_within_the_ladder_and_the_threads_caveat():
    same = loss_overlay(TRACE, [1, 2], [4.0, 3.0 + 2 ** -14], run_threads=1)   # 6.1e-5
    assert same.readout() == ("max |Δ loss| 6.1e-05 at step 2 (2 shared steps): within the "
                              "ladder's 1e-4")
    exact = loss_overlay(TRACE, [1, 2], [4.0, 3.0], run_threads=2)
    assert exact.readout() == "|Δ loss| 0 at all 2 shared steps: within the ladder's 1e-4"
    # twin: 2**-13 = 1.2e-4 is beyond; on 2 threads against a 1-thread trace the readout says so
    other = loss_overlay(TRACE, [1, 2], [4.0, 3.0 + 2 ** -13], run_threads=2)
    assert other.readout() == (
        "max |Δ loss| 0.00012 at step 2 (2 shared steps): beyond the ladder's 1e-4; reference on 1 "
        "thread, this run on 2 (another summation order's rounding, which training amplifies)")
    assert loss_overlay(TRACE, [9], [1.0]).readout() == "no shared steps yet"


def test_trace_path_is_relative_to_the_configs_folder(tmp_path):
    config = {"base_dir": str(tmp_path / "configs"),
              "compare": {"reference_trace": "../traces/t.json"}}
    assert reference_trace_path(config) == tmp_path / "configs" / "../traces/t.json"
    absolute = {"base_dir": "/elsewhere", "compare": {"reference_trace": str(tmp_path / "t")}}
    assert reference_trace_path(absolute) == tmp_path / "t"
    # twin: a config naming none (or an older run's, without the section) has none
    assert reference_trace_path({"base_dir": "/x", "compare": {"reference_trace": ""}}) is None
    assert reference_trace_path({"base_dir": "/x"}) is None


def test_the_shipped_trace_reads_and_a_bad_one_is_refused(tmp_path):
    shipped = read_reference_trace(
        BUNDLED_SAMPLE / "reference-traces" / "nanochat-tiny-92d63d4.json")
    assert shipped.label == "nanochat 92d63d4 (reference)" and shipped.threads == 1
    assert shipped.steps == list(range(1, 41)) and len(shipped.loss) == 40
    with pytest.raises(ForgebenchError) as missing:
        read_reference_trace(tmp_path / "none.json")
    assert missing.value.where == "field 'compare.reference_trace'"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "reference-loss-trace", "steps": [1, 2], "loss": [1.0]}))
    with pytest.raises(ForgebenchError, match="one length") as short:
        read_reference_trace(bad)
    assert short.value.path == str(bad)
    bad.write_text(json.dumps({"kind": "metrics", "steps": [1], "loss": [1.0]}))
    with pytest.raises(ForgebenchError, match="not a reference loss trace"):
        read_reference_trace(bad)


# -- the Runs pane --------------------------------------------------------------------------
def write_compared_run(path: Path, trace: str | None) -> RunDir:
    """A stopped lm-pretrain run of 3 steps (losses 4.0, 3.25, 2.0 against the trace's 4.0,
    3.0, 2.5: |Δ| 0, 0.25, 0.5) whose config names `trace`."""
    run = RunDir(path)
    config = {"steps": 3, "base_dir": str(path.parent), "optim": {"lr": 1e-3}}
    if trace is not None:
        config["compare"] = {"reference_trace": trace}
    run.create({"recipe": "lm-pretrain", "created": time.time(), "config": config,
                "environment": {"threads": 1},
                "data": {"dataset": "/data/records", "files": {"train.txt": "ab" * 32}}})
    run.log_invocation({"id": 1, "start_step": 0})
    for step, loss in zip((1, 2, 3), (4.0, 3.25, 2.0)):
        run.log_metric({"invocation": 1, "step": step, "split": "train", "loss": loss,
                        "lr": 1e-3, "tokens_per_s": 100.0, "time": 1000.0 + step})
    run.set_status("stopped", step=3, target_steps=3)
    run.release_lock()
    return run


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    from app.viewmodels.workspace import Settings, Workspace
    from app.views.main_window import PANES, MainWindow

    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    workspace = Workspace.create(tmp_path / "ws", name="reference test")
    win = MainWindow(Settings())
    win.close_policy = "stop"
    qtbot.addWidget(win)
    win.resize(1024, 700)
    win.show()
    qtbot.waitExposed(win)
    win.open_workspace(workspace.root)
    win.tour_panel.act(win.tour_panel.tour.dismiss)
    win.first_tune.hide()
    win.sidebar.setCurrentRow(PANES.index("Runs"))
    yield win, workspace
    win.close()


def shown_run(qtbot, win, path: Path):
    runs = win.runs
    runs.poll(force=True)
    runs.select_run(path)
    charts = runs.charts
    charts.controls.smoothing.setValue(0)
    charts.redraw()
    qtbot.waitUntil(lambda: not charts.unbuilt and not charts.pending
                    and charts.point_count() == 3)
    return charts


def test_runs_pane_draws_the_reference_beside_the_loss_with_its_readout(window, qtbot):
    from app.views.charts import REFERENCE_COLOUR

    win, workspace = window
    (workspace.runs_dir / "ref.json").write_text(json.dumps({
        "kind": "reference-loss-trace", "label": "nanochat 92d63d4 (reference)",
        "reference": {"threads": 1}, "steps": [1, 2, 3, 4], "loss": [4.0, 3.0, 2.5, 2.0]}))
    run = write_compared_run(workspace.runs_dir / "compared", "ref.json")
    charts = shown_run(qtbot, win, run.path)
    curve = charts.curves[(str(run.path), "loss", "reference")]
    xs, ys = curve.getData()
    assert list(xs) == [1, 2, 3, 4] and list(ys) == [4.0, 3.0, 2.5, 2.0]
    assert curve.opts["pen"].color().name() == REFERENCE_COLOUR
    own = charts.curves[(str(run.path), "loss")].getData()
    assert list(own[1]) == [4.0, 3.25, 2.0]                 # the run's own curve is unchanged
    text = charts.summary.text()
    assert "nanochat 92d63d4 (reference)" in text
    assert "max |Δ loss| 0.5 at step 3 (3 shared steps): beyond the ladder's 1e-4" in text
    # the key and readout show whole at 1024x700: the summary wraps (no sideways scroll) and
    # is as tall as its text; scrolled to its end, the readout is on screen
    assert labels_cut_off(charts) == []
    scroll = charts.summary_scroll
    assert charts.summary.width() <= scroll.viewport().width()
    scroll.verticalScrollBar().setValue(scroll.verticalScrollBar().maximum())
    assert charts.summary.visibleRegion().boundingRect().height() > 0


def test_a_run_without_a_reference_or_with_a_missing_one(window, qtbot):
    win, workspace = window
    plain = write_compared_run(workspace.runs_dir / "plain", None)
    charts = shown_run(qtbot, win, plain.path)
    assert (str(plain.path), "loss", "reference") not in charts.curves
    assert "(reference)" not in charts.summary.text() and "Δ loss" not in charts.summary.text()
    # twin: a named trace that is gone is said beside the figures, no curve drawn
    gone = write_compared_run(workspace.runs_dir / "gone", "missing.json")
    charts = shown_run(qtbot, win, gone.path)
    assert (str(gone.path), "loss", "reference") not in charts.curves
    assert "reference trace not found: " in charts.summary.text()
    assert labels_cut_off(charts) == []
