"""`forgebench run|resume --nproc N [--nnodes M --node-rank K --master-addr HOST]`: one job of
several processes, launched under torchrun (`python -m torch.distributed.run`).

The launcher is the job as the rest of Forgebench sees it: it holds the run lock from start to
end (so `status`, `stop` and the app find it), runs torchrun, which starts one
`forgebench worker` per rank, and when torchrun ends records what the ranks other than 0 left in
its reports folder as `error` events with their rank. Rank 0 writes everything else. A stop
(SIGTERM or SIGINT to the launcher, which is what `forgebench stop` sends) is passed to every
rank; they agree after the step they are in, and rank 0 writes the one checkpoint.

Several machines: start the same command on each with its `--node-rank`; the run directory
must be on a filesystem every machine sees at the same path (rank 0 writes it, the others read
run.json and the checkpoint they resume from).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from engine.errors import ForgebenchError
from engine.rundir import Checkpoint, RunDir

RUN_JSON_PATIENCE_S = 600   # a node other than 0 waits this long for rank 0's run.json


def world_size(args) -> int:
    return getattr(args, "nproc", 1) * getattr(args, "nnodes", 1)


def wants_launch(args) -> bool:
    return world_size(args) > 1


def torchrun_command(args, run: RunDir, threads: int, worker_flags: list[str]) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
    if args.nnodes == 1:
        command.append("--standalone")    # a free port on this machine, no rendezvous host
    else:
        command += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
                    f"--master-addr={args.master_addr}", f"--master-port={args.master_port}"]
    return command + ["-m", "engine", "worker", str(run.path), "--threads", str(threads),
                      *worker_flags]


def _signal_ranks(launched: subprocess.Popen, sig: int) -> None:
    """Pass a stop to every rank (torchrun's children), not to torchrun itself: torchrun would
    kill the ranks after a grace period, and a checkpoint must not race that."""
    import psutil

    try:
        ranks = psutil.Process(launched.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for rank in ranks:
        try:
            rank.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def record_rank_failures(run: RunDir, reports: list[dict], exit_code: int) -> None:
    """Every failed rank's error into events.jsonl (rank 0 logged its own), and a `failed`
    status if rank 0 could not say so itself (it was killed, or blocked on a dead peer)."""
    invocations = run.invocations()
    invocation = invocations[-1]["id"] if invocations else None
    for report in reports:
        run.log_event("error", rank=report["rank"], stage=report.get("stage"),
                      step=report.get("step"), message=report["message"],
                      traceback=report.get("traceback"), invocation=invocation)
    status = run.status()
    if exit_code != 0 and status.get("state") in ("queued", "running", "stopping"):
        reason = (f"rank {reports[0]['rank']}: {reports[0]['message']}" if reports else
                  f"the ranks exited with code {exit_code} and recorded no reason (killed?)")
        run.set_status("failed", error=reason[:2000], stage_detail=None, pid=None)


def launch(args, run: RunDir, *, threads: int, checkpoint: Checkpoint | None = None,
           overrides: dict | None = None) -> dict:
    """Run the job's ranks under torchrun and wait for them; the final status."""
    flags = []
    if checkpoint is not None:
        flags += ["--checkpoint", checkpoint.name]
    if overrides:
        flags += ["--overrides", json.dumps(overrides)]
    if getattr(args, "stop_after_step", None):
        flags += ["--stop-after-step", str(args.stop_after_step)]
    if args.node_rank != 0:
        _wait_for_run(run)
    reports_dir = tempfile.mkdtemp(prefix="forgebench-ranks-")
    from engine.train.distributed import RANK_REPORTS_ENV, read_failure_reports

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **{RANK_REPORTS_ENV: reports_dir})
    launched = subprocess.Popen(torchrun_command(args, run, threads, flags), env=env)

    def on_signal(signum, _frame):
        _signal_ranks(launched, signal.SIGTERM)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        exit_code = launched.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        reports = read_failure_reports(reports_dir)
    finally:
        shutil.rmtree(reports_dir, ignore_errors=True)
    if args.node_rank != 0:
        for report in reports:   # rank 0's node records; here the reports go to stderr
            print(f"rank {report['rank']} failed: {report['message']}", file=sys.stderr)
        return {"state": "completed" if exit_code == 0 else "failed"}
    record_rank_failures(run, reports, exit_code)
    status = run.status()
    if status.get("state") == "failed":
        raise ForgebenchError(status.get("error") or "a rank failed", path=run.path,
                              hint="events.jsonl holds every rank's error")
    return status


def _wait_for_run(run: RunDir) -> None:
    deadline = time.monotonic() + RUN_JSON_PATIENCE_S
    while not run.exists():
        if time.monotonic() > deadline:
            raise ForgebenchError("rank 0's node has not created the run", path=run.path,
                                  hint="start node 0 first; the run directory must be on a "
                                       "filesystem every node sees at the same path")
        time.sleep(1.0)


def note_world_change(run: RunDir, new_size: int) -> None:
    """A resume on another process count is allowed (checkpoints hold full tensors and the
    batch is global); it is recorded, because the all-reduce order changes the rounding."""
    previous = [i.get("world_size", 1) for i in run.invocations()]
    before = previous[-1] if previous else run.manifest().get("environment", {}).get(
        "world_size", 1)
    if before != new_size:
        run.log_event("warning", message=f"resumed on {new_size} process(es) instead of "
                      f"{before}: per-step results match to float rounding (the all-reduce "
                      "adds in another order), not bit for bit", override="world_size",
                      before=before, after=new_size)


def worker_config(run: RunDir, overrides_json: str | None):
    """The config a rank trains with: run.json's, with the launcher's resume overrides."""
    from engine.config import validate_config

    overrides = json.loads(overrides_json) if overrides_json else {}
    return validate_config(dict(run.manifest()["config"], **overrides), run.manifest_path)


def cmd_worker(args) -> int:
    """One rank of a launched job (torchrun starts it; not for use by hand)."""
    from engine.jobs import execute
    from engine.train.distributed import World, shutdown

    world = World.from_env()
    run = RunDir(args.run_dir).require()
    config = worker_config(run, args.overrides)
    checkpoint = run.checkpoint(args.checkpoint) if args.checkpoint else None
    try:
        execute(run, config, checkpoint, threads=args.threads, argv=["forgebench"] + sys.argv[1:],
                stop_after_step=args.stop_after_step if world.is_main else None, world=world)
    finally:
        shutdown()
    return 0
