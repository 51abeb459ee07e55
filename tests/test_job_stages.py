"""Stage announcements: a job entering a long stage before its first step (loading a base,
encoding samples) says so in status.json at once and keeps a `stage` event; the first step
clears the detail, so the app switches to "step N/M, ETA"."""

from __future__ import annotations

from types import SimpleNamespace

from engine.jobs import job_session
from engine.rundir import RunDir


def test_announced_stage_is_in_status_and_events_until_the_first_step(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create({"recipe": "test"})
    config = SimpleNamespace(steps=3, optim=None)
    with job_session(run, config, None, argv=["test"], progress=False) as job:
        job.announce("loading", "loading base 250 MB")
        status = run.status()
        assert status["state"] == "running"
        assert (status["stage"], status["stage_detail"]) == ("loading", "loading base 250 MB")
        stages = [e for e in run.events() if e["kind"] == "stage"]
        assert [(e["stage"], e["detail"], e["step"]) for e in stages] == \
            [("loading", "loading base 250 MB", 0)]
        job.step_done(1)
        assert run.status()["stage_detail"] is None
        job.step_done(3)
    assert run.status()["state"] == "completed" and run.status()["stage_detail"] is None
