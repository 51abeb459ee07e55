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

The launcher, torchrun and the ranks live and die together: torchrun runs under a guard
(`run_torchrun`) and each rank under `cmd_worker`, and both ask the kernel to kill them when
their parent dies (`die_with_parent`: Linux's PR_SET_PDEATHSIG, a polling thread elsewhere), so
a `kill -9` of the launcher leaves no rank training. Each rank also holds the run's rank lock
(`engine.runlock.hold_rank_lock`) for its whole life: a `resume` that finds a rank still alive
is refused. The guard records how torchrun saw each rank end (`torchrun.json` in the reports
folder); a rank that died without a word (SIGKILL, the OOM killer) is named as the cause in
events.jsonl and status.json, not its survivor's "connection reset".

What can be checked before any process starts is (`check_world`): the batch splits evenly
over the ranks, this node's rank lies in the world, the GPUs asked for exist.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from engine.errors import ForgebenchError
from engine.rundir import Checkpoint, RunDir

RUN_JSON_PATIENCE_S = 600   # a node other than 0 waits this long for rank 0's run.json
LAUNCHER_PID_ENV = "FORGEBENCH_LAUNCHER_PID"   # the guard's parent: the launcher
AGENT_PID_ENV = "FORGEBENCH_AGENT_PID"         # a rank's parent: the guarded torchrun
TORCHRUN_REPORT = "torchrun.json"
_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None) -> str:
    """Have the kernel SIGKILL this process when its parent dies; if the parent is already
    gone (it died before we got here), die now. Returns how: "prctl" or "polling"."""
    how = "polling"
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                how = "prctl"
    parent = expected_parent or os.getppid()
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "polling":   # no parent-death signal here (macOS): watch the parent's pid
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
    return how


def _parent_from_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def check_world(config, args) -> None:
    """The checks a launch can make before starting any process (see the module docstring):
    a failure here is one error, exit 2, with no torchrun started and the run untouched."""
    size = world_size(args)
    if size <= 1:
        return
    if getattr(args, "node_rank", 0) >= getattr(args, "nnodes", 1):
        raise ForgebenchError(f"--node-rank {args.node_rank} is outside the {args.nnodes} "
                              "machines of --nnodes", where="--node-rank",
                              hint=f"number the machines 0 to {args.nnodes - 1}")
    from engine.recipe_registry import REGISTRY

    field = REGISTRY[config.recipe].sharded_batch
    if field:
        value = config
        for part in field.split("."):
            value = getattr(value, part)
        if value % size:
            raise ForgebenchError(
                f"{field} = {value} does not split evenly across {size} processes: the ranks "
                "train in lockstep, so each needs the same share", where=f"field '{field}'",
                hint=f"use a multiple of {size}, or a process count that divides {value}")
    device = str(getattr(config, "device", "cpu") if getattr(args, "device", None) is None
                 else args.device)
    if device.startswith("cuda") or device == "auto":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device != "auto" or gpus) and args.nproc > gpus:
            raise ForgebenchError(f"--nproc {args.nproc} asks for one GPU per process; this "
                                  f"machine has {gpus}", where="--nproc",
                                  hint=f"use --nproc {max(gpus, 1)} or fewer, or --device cpu")


def world_size(args) -> int:
    return getattr(args, "nproc", 1) * getattr(args, "nnodes", 1)


def wants_launch(args) -> bool:
    return world_size(args) > 1


def torchrun_command(args, run: RunDir, threads: int, worker_flags: list[str]) -> list[str]:
    """torchrun (`torch.distributed.run`) under `run_torchrun`'s guard, starting the ranks."""
    command = [sys.executable, "-c", "import sys; from engine.commands.launch import "
               "run_torchrun; sys.exit(run_torchrun(sys.argv[1:]))",
               f"--nproc-per-node={args.nproc}"]
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


def run_torchrun(argv: list[str]) -> int:
    """The guard around torchrun (the launcher starts it): die with the launcher, let the
    ranks die with us, and record how torchrun saw each failed rank end (`TORCHRUN_REPORT`)."""
    die_with_parent(_parent_from_env(LAUNCHER_PID_ENV))
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(argv)
    except ChildFailedError as exc:
        folder = os.environ.get(_reports_env())
        if folder:
            from engine.fsutil import atomic_write_json

            with contextlib.suppress(OSError):
                atomic_write_json(os.path.join(folder, TORCHRUN_REPORT), [
                    {"rank": rank, "pid": failure.pid, "exitcode": failure.exitcode,
                     "signal": failure.signal_name() if failure.exitcode < 0 else None}
                    for rank, failure in sorted(exc.failures.items())])
        return 1
    return 0


def _reports_env() -> str:
    from engine.train.distributed import RANK_REPORTS_ENV

    return RANK_REPORTS_ENV


def read_torchrun_report(folder: str | os.PathLike) -> list[dict]:
    """How torchrun saw each failed rank end: rank, pid, exit code, signal (or [])."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(folder, TORCHRUN_REPORT), encoding="utf-8") as handle:
            ended = json.load(handle)
        return [e for e in ended if isinstance(e, dict) and isinstance(e.get("rank"), int)]
    return []


def dead_ranks(reports: list[dict], ended: list[dict]) -> list[dict]:
    """The ranks that died without leaving a report of their own (killed by a signal, or
    exited without a word): those are the cause; the reports of their peers are the effect.
    A SIGTERM/SIGINT death is torchrun ending the survivors (a rank stops gracefully on
    those itself), never a cause."""
    reported = {r.get("rank") for r in reports}
    return [e for e in ended if e["rank"] not in reported
            and e.get("signal") not in ("SIGTERM", "SIGINT")
            and (e.get("signal") or e.get("exitcode") not in (0, 1, 2, 130))]


def record_rank_failures(run: RunDir, reports: list[dict], exit_code: int,
                         ended: list[dict] | None = None) -> None:
    """Every failed rank's error into events.jsonl (rank 0 logged its own); a rank that died
    without a word is named as the cause in an `error` event and in the `failed` status, ahead
    of its peers' "connection reset"; a `failed` status if rank 0 could not say so itself (it
    was killed, or blocked on a dead peer)."""
    invocations = run.invocations()
    invocation = invocations[-1]["id"] if invocations else None
    dead = dead_ranks(reports, ended or [])
    for rank in dead:
        how = (f"killed by {rank['signal']}" if rank.get("signal")
               else f"exited with code {rank.get('exitcode')}")
        rank["message"] = (f"rank {rank['rank']} (pid {rank.get('pid')}) died: {how}, without "
                           "an error of its own (out of memory? killed by hand?); the other "
                           "ranks failed because it was gone")
        run.log_event("error", rank=rank["rank"], message=rank["message"], pid=rank.get("pid"),
                      exitcode=rank.get("exitcode"), signal=rank.get("signal"), cause=True,
                      invocation=invocation)
    for report in reports:
        run.log_event("error", rank=report["rank"], stage=report.get("stage"),
                      step=report.get("step"), message=report["message"],
                      traceback=report.get("traceback"), invocation=invocation)
    status = run.status()
    if exit_code != 0 and (dead or status.get("state") in ("queued", "running", "stopping")):
        reason = (dead[0]["message"] if dead else
                  f"rank {reports[0]['rank']}: {reports[0]['message']}" if reports else
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

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **{RANK_REPORTS_ENV: reports_dir,
                                                           LAUNCHER_PID_ENV: str(os.getpid())})
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
        ended = read_torchrun_report(reports_dir)
    finally:
        shutil.rmtree(reports_dir, ignore_errors=True)
    if args.node_rank != 0:
        for report in reports:   # rank 0's node records; here the reports go to stderr
            print(f"rank {report['rank']} failed: {report['message']}", file=sys.stderr)
        return {"state": "completed" if exit_code == 0 else "failed"}
    record_rank_failures(run, reports, exit_code, ended)
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
    die_with_parent(_parent_from_env(AGENT_PID_ENV))
    from engine.jobs import execute
    from engine.runlock import hold_rank_lock
    from engine.train.distributed import World, shutdown

    world = World.from_env()
    run = RunDir(args.run_dir).require()
    hold_rank_lock(run.path)    # for this process's life: no resume while a rank lives
    config = worker_config(run, args.overrides)
    checkpoint = run.checkpoint(args.checkpoint) if args.checkpoint else None
    finished = False
    try:
        execute(run, config, checkpoint, threads=args.threads, argv=["forgebench"] + sys.argv[1:],
                stop_after_step=args.stop_after_step if world.is_main else None, world=world)
        finished = True
    finally:
        shutdown(finished)
    return 0
