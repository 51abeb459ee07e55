"""Fault injection on real `forgebench` processes: SIGKILL at chosen and random moments
(checkpoint write, before the sentinel, keep-last cleanup, mid metrics append, anywhere),
a full disk during a metrics append, and two resumes at once. After each fault `status` reads,
and resuming ends bit for bit where an uninterrupted run ends.

Kills inside the engine are placed by a wrapper (`KILLER`) that patches one function of the
child process to SIGKILL itself at that point; the engine carries no test hooks.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lm_pretrain_support import REPO, assert_same_run, forgebench, uninterrupted_run

from engine.rundir import RunDir

STEPS = 12

# argv: KIND N forgebench-args...; SIGKILLs itself at the N-th hit of KIND.
KILLER = r"""
import os, signal, sys
kind, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
hits = [0]

def hit():
    hits[0] += 1
    if hits[0] >= n:
        os.kill(os.getpid(), signal.SIGKILL)

if kind == "checkpoint-write":      # a tensor file written, the next not yet: half-staged
    import engine.train.checkpoint as C
    save = C.save_file
    def save_file(tensors, path, *a, **k):
        save(tensors, path, *a, **k)
        hit()
    C.save_file = save_file
elif kind == "before-sentinel":     # every file staged but trainer_state.json
    import engine.train.checkpoint as C
    write = C.atomic_write_json
    def atomic_write_json(path, obj):
        if str(path).endswith("trainer_state.json"):
            hit()
        write(path, obj)
    C.atomic_write_json = atomic_write_json
elif kind == "cleanup":             # keep-last: sentinel unlinked, folder not yet removed
    import shutil
    rmtree = shutil.rmtree
    def hooked_rmtree(path, *a, **k):
        if os.path.basename(str(path)).startswith("step-"):
            hit()
        rmtree(path, *a, **k)
    shutil.rmtree = hooked_rmtree
elif kind == "metrics-append":      # half a metrics line on disk
    import engine.rundir as R
    append = R.append_line
    def append_line(path, obj):
        if str(path).endswith("metrics.jsonl") and hits[0] + 1 >= n:
            import json
            line = json.dumps(obj).encode()
            with open(path, "ab") as f:
                f.write(line[: len(line) // 2])
        if str(path).endswith("metrics.jsonl"):
            hit()
        append(path, obj)
    R.append_line = append_line
from engine.cli import main
sys.exit(main(argv))
"""


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def spawn(*args: str, kill: tuple[str, int] | None = None, **popen) -> subprocess.Popen:
    command = ([sys.executable, "-c", KILLER, kill[0], str(kill[1])] if kill
               else [sys.executable, "-m", "engine"])
    return subprocess.Popen(command + [str(a) for a in args], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return (root, *uninterrupted_run(root, STEPS, save_every=1))


def status_reads(run: RunDir) -> dict:
    result = forgebench("status", str(run.path))
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


def kill_at_random(proc: subprocess.Popen, run: RunDir, rng: random.Random) -> None:
    """SIGKILL after a random number of new metric lines plus a random few milliseconds."""
    metrics = run.path / "metrics.jsonl"
    start = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
    wanted = start + rng.randint(0, 3)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_bytes().count(b"\n") >= wanted:
            break
        time.sleep(0.001)
    time.sleep(rng.uniform(0, 0.05))
    proc.send_signal(signal.SIGKILL)


def kill_and_resume_until_done(baseline, tmp_path, plan: list, seed: int) -> int:
    """Start a run, then resume it after each fault of `plan` until it reaches STEPS.
    Returns the number of SIGKILLs that landed."""
    _, config, reference = baseline
    rng = random.Random(seed)
    run = RunDir(tmp_path / "killed")
    kills, invocations = 0, 0
    for fault in plan + [None] * 6:
        latest = run.latest_checkpoint() if run.exists() else None
        if latest is not None and latest.step == STEPS:
            break
        args = (["run", config, "--out", run.path, "--threads", "1"] if invocations == 0
                else ["resume", run.path])
        invocations += 1
        proc = spawn(*args, kill=fault if isinstance(fault, tuple) else None)
        if fault == "random":
            kill_at_random(proc, run, rng)
        out, err = proc.communicate(timeout=300)
        if proc.returncode == -signal.SIGKILL:
            kills += 1
            assert run.exists(), "the first fault must land after run.json is written"
            summary = status_reads(run)
            assert summary["state"] == "failed", summary  # no holder: the job died
        else:
            assert proc.returncode == 0, (fault, out, err)
            assert "Traceback" not in err
    latest = run.latest_checkpoint()
    assert latest is not None and latest.step == STEPS
    assert_same_run(reference, run, STEPS)
    return kills


def test_sigkill_at_chosen_moments_then_resume_is_bitwise_exact(baseline, tmp_path):
    plan = [("checkpoint-write", 3), ("cleanup", 1), "random"]
    assert kill_and_resume_until_done(baseline, tmp_path, plan, seed=1) == 3


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FORGEBENCH_SLOW") != "1",
                    reason="12 SIGKILLs of real runs (about 2 minutes): set FORGEBENCH_SLOW=1")
def test_sigkill_at_twelve_moments_then_resume_is_bitwise_exact(baseline, tmp_path):
    plan = [("checkpoint-write", 1), ("before-sentinel", 2), ("cleanup", 1),
            ("metrics-append", 2), ("checkpoint-write", 2), "random", ("cleanup", 2),
            "random", ("metrics-append", 1), "random", "random", "random"]
    kills = kill_and_resume_until_done(baseline, tmp_path, plan, seed=7)
    print(f"{kills} SIGKILLs landed; the run resumed to a bitwise-identical end")
    assert kills >= 10


# -- a full disk during a metrics append -----------------------------------------------------
@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str):
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and mount rights for a tmpfs (the file-size-limit variant "
                    "covers the same path)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _limit_file_size(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


@pytest.mark.parametrize("how", ["tmpfs", "file-size limit"])
def test_disk_full_during_metrics_append_then_resume(baseline, tmp_path, how):
    _, config, reference = baseline
    run = RunDir(tmp_path / "run")
    forgebench("run", str(config), "--out", str(run.path), "--threads", "1",
               "--stop-after-step", "6")
    metrics = run.path / "metrics.jsonl"
    room = 1000  # bytes left for appends: two or three metric lines
    with contextlib.ExitStack() as stack:
        if how == "tmpfs":
            # metrics.jsonl moves to a one-page tmpfs, filled with blank lines (which readers
            # skip) up to `room` bytes before the page is full: the third or so append meets
            # ENOSPC
            space = stack.enter_context(tiny_tmpfs(tmp_path / "space", "4k"))
            data = metrics.read_bytes()
            (space / "metrics.jsonl").write_bytes(data + b"\n" * (4096 - room - len(data)))
            metrics.unlink()
            metrics.symlink_to(space / "metrics.jsonl")
            proc = spawn("resume", run.path)
        else:
            # no file of the job may grow past `room` more bytes than metrics.jsonl holds
            # (EFBIG); --save-every keeps checkpoints (larger files) out of the way
            limit = metrics.stat().st_size + room
            proc = spawn("resume", run.path, "--save-every", "100",
                         preexec_fn=_limit_file_size(limit))
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (out, err)
        assert err.count("error:") == 1 and "Traceback" not in err, err
        assert "metrics.jsonl" in err and "the line was not written" in err
        assert "forgebench resume" in err
        summary = status_reads(run)
        assert summary["state"] == "failed" and 6 < summary["step"] < STEPS, summary
        assert metrics.read_bytes().endswith(b"\n")  # no torn line left behind
        if how == "tmpfs":  # free the space: move the log back to the roomy disk
            data = metrics.read_bytes()
            metrics.unlink()
            metrics.write_bytes(data)
    result = forgebench("resume", str(run.path))
    assert "completed" in result.stdout and "Traceback" not in result.stderr
    assert status_reads(run)["state"] == "completed"
    assert_same_run(reference, run, STEPS)


# -- two resumes at once -----------------------------------------------------------------------
def test_two_concurrent_resumes_exactly_one_trains(baseline, tmp_path):
    _, config, reference = baseline
    run = RunDir(tmp_path / "run")
    forgebench("run", str(config), "--out", str(run.path), "--threads", "1",
               "--stop-after-step", "3")
    procs = [spawn("resume", run.path) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, _, err in results if code == 2)
    assert loser.count("error:") == 1 and "Traceback" not in loser, loser
    assert "another forgebench job is writing this run" in loser or "already at step" in loser
    assert [i["kind"] for i in run.invocations()] == ["start", "resume"]
    assert status_reads(run)["state"] == "completed"
    assert_same_run(reference, run, STEPS)
