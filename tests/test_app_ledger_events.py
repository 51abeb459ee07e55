"""The Runs ledger's view-model announces what changed (app/viewmodels/runs.py `Ledger`,
app/viewmodels/events.py), so the pane neither diffs rows nor re-checks run states on its
timer: a new list of runs resets, a run read afresh that no job trains is `settled` (the jobs
panel reports it finished), once. Tested without Qt."""

from __future__ import annotations

import time

from test_app_support import write_run

from app.viewmodels.events import Listeners
from app.viewmodels.runs import Ledger
from app.viewmodels.workspace import Workspace
from engine.rundir import RunDir


def recorded(ledger: Ledger) -> list:
    events: list = []
    ledger.resetting.connect(lambda: events.append("resetting"))
    ledger.reset.connect(lambda: events.append("reset"))
    ledger.row_changed.connect(lambda i: events.append(("changed", ledger.rows[i].name)))
    ledger.settled.connect(lambda row: events.append(("settled", row.name, row.state)))
    return events


def test_a_run_seen_training_is_announced_settled_once_when_it_ends(tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    write_run(workspace.runs_dir / "done", steps=4, state="completed")
    live = RunDir(workspace.runs_dir / "live")      # this process holds its lock: it trains
    live.create({"recipe": "lm-pretrain", "created": time.time(), "config": {"steps": 4}})
    live.set_status("running", step=1, target_steps=4)
    ledger = Ledger()
    events = recorded(ledger)

    ledger.refresh(workspace.run_dirs(), [])
    assert events == ["resetting", "reset", ("settled", "done", "completed")]
    assert [r.name for r in ledger.rows] == ["live", "done"] and ledger.rows[0].active
    events.clear()
    ledger.refresh(workspace.run_dirs(), [])        # nothing on disk moved
    assert "reset" not in events and not any(e[0] == "settled" for e in events), events

    live.set_status("completed", step=4, target_steps=4)
    live.release_lock()
    events.clear()
    ledger.refresh(workspace.run_dirs(), [])
    assert events == [("changed", "live"), ("settled", "live", "completed")]
    events.clear()
    ledger.refresh(workspace.run_dirs(), [])        # twin: an ended run is not announced again
    assert events == []


def test_a_launch_without_a_folder_resets_the_list_and_a_listener_can_leave(tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    write_run(workspace.runs_dir / "done", steps=4, state="stopped")
    ledger = Ledger()
    ledger.refresh(workspace.run_dirs(), [])
    events = recorded(ledger)
    ledger.refresh(workspace.run_dirs(), [("next", "starting")])
    assert events == ["resetting", "reset"] and ledger.extra == [("next", "starting")]

    heard: list = []
    listeners = Listeners()
    listeners.connect(heard.append)
    listeners.emit(1)
    listeners.disconnect(heard.append)
    listeners.emit(2)
    assert heard == [1]


def test_a_launch_and_a_first_tune_run_are_followed_from_the_disk_and_their_process(tmp_path):
    """Before its folder exists a launched run is "starting" while its process lives and
    "gone" once it died; the first fine-tune's run has no outcome while it trains."""
    import subprocess
    import sys

    from app.viewmodels.first_tune import run_outcome
    from app.viewmodels.runs import launch_state

    job = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                           stdin=subprocess.PIPE)
    out = tmp_path / "run"
    assert launch_state(out, job.pid) == "starting"
    assert run_outcome(out, job.pid) is None
    run = RunDir(out)          # this process holds the run: it trains
    run.create({"recipe": "lm-sft", "created": time.time(), "config": {"steps": 3}})
    run.set_status("running", step=1, target_steps=3)
    assert launch_state(out, job.pid) == "listed" and run_outcome(out, job.pid) is None
    run.set_status("completed", step=3, target_steps=3)
    run.release_lock()
    assert run_outcome(out, job.pid) == "completed"
    job.stdin.close()
    job.wait()
    # twin: the same launch without a folder, its process gone
    assert launch_state(tmp_path / "never", job.pid) == "gone"
    assert run_outcome(tmp_path / "never", job.pid) == "starting"
