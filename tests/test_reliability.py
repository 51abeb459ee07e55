"""Reliability, round 2 (issue 52, items 3 to 8), on real `forgebench` processes and run
folders: verified checkpoints for every reader, the sealed run.json, full and read-only
disks, `--nproc` checks before spawning, and the launcher and its ranks living and dying
together. Each case has a twin that shows the check can fail (or what passes it)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lm_pretrain_support import REPO, forgebench, make_corpus, tree_digest, write_config

from engine.cli import main
from engine.errors import ForgebenchError
from engine.rundir import RunDir


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """A corpus, a config and a completed 4-step run (checkpoints at 2 and 4)."""
    root = tmp_path_factory.mktemp("reliab")
    corpus = make_corpus(root)
    config = write_config(root / "tiny.toml", corpus, steps=4, save_every=2, precision="f32")
    assert main(["run", str(config), "--out", str(root / "run"), "--threads", "1"]) == 0
    return {"root": root, "corpus": corpus, "config": config, "run": root / "run"}


def run_cli(capsys, argv: list) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err[err.index("error:"):], (needle, err)


def copy_run(ctx, tmp: Path) -> RunDir:
    shutil.copytree(ctx["run"], tmp / "run", symlinks=True)
    return RunDir(tmp / "run")


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


# -- item 4: every reader takes the newest committed AND verified checkpoint ---------------------
def test_eval_and_generate_skip_a_damaged_latest_checkpoint(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    flip_a_byte(run.path / "checkpoints" / "step-000004" / "model.safetensors")
    assert run.checkpoint("latest").name == "step-000002"
    capsys.readouterr()
    code, out, err = run_cli(capsys, ["eval", run.path])
    assert code == 0, err
    assert "step-000004 is damaged" in err and "different SHA-256" in err
    assert json.loads(out)["checkpoint"] == "step-000002"
    code, out, err = run_cli(capsys, ["generate", run.path, "--prompt", "Record",
                                      "--max-tokens", "4", "--json"])
    assert code == 0, err
    assert "step-000004 is damaged" in err
    # named exactly, the damaged one is refused with its problem and the intact ones
    code, _, err = run_cli(capsys, ["export", run.path, "--checkpoint", "step-000004",
                                    "--dtype", "f32", "--out", tmp_path / "export"])
    assert_one_clean_error(code, err, "step-000004 is damaged", "intact checkpoints: step-000002")
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())


def test_an_intact_run_reads_its_newest_checkpoint_without_a_warning(ctx, capsys):
    """Twin: nothing damaged, nothing skipped."""
    run = RunDir(ctx["run"])
    capsys.readouterr()
    assert run.checkpoint("latest").name == "step-000004"
    assert run.checkpoint(2).name == "step-000002"
    assert "damaged" not in capsys.readouterr().err


def test_a_stray_step_folder_with_an_empty_trainer_state_is_not_the_latest(ctx, tmp_path,
                                                                          capsys):
    run = copy_run(ctx, tmp_path)
    stray = run.path / "checkpoints" / "step-999999"
    stray.mkdir()
    (stray / "trainer_state.json").write_text("{}")
    capsys.readouterr()
    assert run.checkpoint("latest").name == "step-000004"
    assert run.latest_checkpoint().name == "step-000004"
    assert "step-999999 is damaged" in capsys.readouterr().err
    code, out, err = run_cli(capsys, ["eval", run.path])
    assert code == 0 and json.loads(out)["checkpoint"] == "step-000004", err
    # resume passes over it too, and says so in events.jsonl
    code, _, err = run_cli(capsys, ["resume", run.path, "--steps", "5"])
    assert code == 0, err
    assert run.invocations()[-1]["resumed_from"] == "step-000004"


def test_a_trainer_state_recording_no_files_is_refused(ctx, tmp_path, capsys):
    from engine.train.integrity import checkpoint_problems

    run = copy_run(ctx, tmp_path)
    latest = run.path / "checkpoints" / "step-000004"
    state = json.loads((latest / "trainer_state.json").read_text())
    assert checkpoint_problems(run.committed_checkpoint(4)) == []       # twin: as written
    (latest / "trainer_state.json").write_text(json.dumps(dict(state, files={})))
    assert any("records no files" in p for p in checkpoint_problems(run.committed_checkpoint(4)))
    code, _, err = run_cli(capsys, ["resume", run.path, "--steps", "5"])
    assert code == 0, err
    assert "records no files" in err
    assert run.invocations()[-1]["resumed_from"] == "step-000002"
    # a file the records do not name is not trusted either
    other = copy_run(ctx, tmp_path / "b")
    folder = other.path / "checkpoints" / "step-000002"
    shutil.copy(folder / "model.safetensors", folder / "model-extra.safetensors")
    assert any("model-extra.safetensors is not among" in p
               for p in checkpoint_problems(other.committed_checkpoint(2)))


def test_every_checkpoint_damaged_is_one_error_for_a_reader(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    for checkpoint in run.checkpoints():
        flip_a_byte(checkpoint.path / "model.safetensors")
    code, _, err = run_cli(capsys, ["eval", run.path])
    assert_one_clean_error(code, err, "every checkpoint of the run is damaged")


# -- item 5: run.json is sealed; a resume that finds it edited refuses ---------------------------
def test_resume_refuses_an_edited_run_json_naming_the_field(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    manifest = json.loads(run.manifest_path.read_text())
    manifest["config"]["optim"]["lr"] = 0.5
    run.manifest_path.write_text(json.dumps(manifest, indent=2))
    before = tree_digest(run.path)
    code, _, err = run_cli(capsys, ["resume", run.path, "--steps", "6"])
    assert_one_clean_error(code, err, "run.json was edited", "config.optim.lr")
    assert tree_digest(run.path) == before        # nothing trained, nothing logged


def test_an_unedited_or_relocated_run_json_resumes(ctx, tmp_path, capsys):
    """Twins: formatting alone is no edit, and relocate's rewrite reseals."""
    from engine.rundir import make_portable, relocate

    run = copy_run(ctx, tmp_path)
    manifest = json.loads(run.manifest_path.read_text())
    run.manifest_path.write_text(json.dumps(manifest, indent=None, sort_keys=False))
    assert run.manifest_drift() == []
    workspace = ctx["root"]                      # the folder the run's paths start with
    make_portable(run.path, workspace)
    assert "{workspace}" in run.manifest_path.read_text()
    assert run.manifest_drift() == []
    relocate(run.path, workspace)
    assert run.manifest_drift() == []
    code, _, err = run_cli(capsys, ["resume", run.path, "--steps", "5"])
    assert code == 0, err


# -- item 7: --nproc checks before spawning ------------------------------------------------------
def test_nproc_that_does_not_split_the_batch_is_refused_before_spawning(ctx, tmp_path, capsys):
    out = tmp_path / "three"
    code, _, err = run_cli(capsys, ["run", ctx["config"], "--out", out, "--threads", "1",
                                    "--nproc", "3"])
    assert_one_clean_error(code, err, "train.batch_size = 4 does not split evenly across 3",
                           "hint: use a multiple of 3")
    assert not out.exists()                      # no run created, no torchrun started
    # a resume is refused the same way, and the run stays as it was
    run = copy_run(ctx, tmp_path)
    before = tree_digest(run.path)
    code, _, err = run_cli(capsys, ["resume", run.path, "--steps", "6", "--nproc", "3"])
    assert_one_clean_error(code, err, "does not split evenly across 3")
    assert tree_digest(run.path) == before
    assert run.status()["state"] == "completed"
    code, _, err = run_cli(capsys, ["run", ctx["config"], "--out", out, "--nproc", "2",
                                    "--nnodes", "2", "--node-rank", "5"])
    assert_one_clean_error(code, err, "--node-rank 5 is outside the 2 machines")


def test_the_world_check_passes_a_batch_that_splits():
    """Twin: 2 ranks split a batch of 4 (the 2-rank runs in test_distributed.py train)."""
    from argparse import Namespace

    from engine.commands.launch import check_world
    from engine.config import validate_config

    config = validate_config({"recipe": "lm-pretrain", "data": {"dir": "."},
                              "train": {"batch_size": 4}, "device": "cpu"})
    check_world(config, Namespace(nproc=2, nnodes=1, node_rank=0, device=None))
    with pytest.raises(ForgebenchError, match="across 8 processes"):
        check_world(config, Namespace(nproc=8, nnodes=1, node_rank=0, device=None))


# -- item 3: one writer across all ranks; the launcher and its ranks die together ----------------
HOLD_RANK_LOCK = ("import sys, time; from engine.runlock import hold_rank_lock\n"
                  "hold_rank_lock(sys.argv[1]); print('held', flush=True); time.sleep(60)")


def test_a_live_rank_whose_launcher_is_gone_holds_the_run(ctx, tmp_path, capsys):
    run = copy_run(ctx, tmp_path)
    rank = subprocess.Popen([sys.executable, "-c", HOLD_RANK_LOCK, str(run.path)], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            text=True)
    try:
        assert rank.stdout.readline().strip() == "held"
        holder = run.lock_holder()
        assert holder is not None and holder["purpose"].startswith("ranks of a launched job")
        code, _, err = run_cli(capsys, ["resume", run.path, "--steps", "5"])
        assert_one_clean_error(code, err, "ranks of a launched job", "still running")
        assert run.status()["state"] == "completed"
    finally:
        rank.kill()
        rank.wait()
    assert run.lock_holder() is None            # twin: the rank gone, the run is free
    code, _, err = run_cli(capsys, ["resume", run.path, "--steps", "5"])
    assert code == 0, err


DIES_WITH_PARENT = r"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os, sys, time\n"
    "from engine.commands.launch import die_with_parent\n"
    "if sys.argv[1] == 'yes': die_with_parent(int(sys.argv[2]))\n"
    "print('ready', flush=True); time.sleep(60)", sys.argv[1], str(os.getpid())],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_child_dies_with_its_parent(guarded):
    """The mechanism the guard around torchrun and every rank use; twin: without it the child
    outlives its killed parent (an orphan, as the ranks were)."""
    parent = subprocess.Popen([sys.executable, "-c", DIES_WITH_PARENT,
                               "yes" if guarded else "no"], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + (10 if guarded else 2)
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    try:
        assert _alive(child) is not guarded
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    from engine.runlock import pid_alive

    return pid_alive(pid)


def _wait_for_step(run: RunDir, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run.status().get("step") or 0) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout} s")


def test_kill_9_of_the_launcher_ends_torchrun_and_every_rank(ctx, tmp_path):
    import psutil

    config = tmp_path / "long.toml"
    config.write_text(ctx["config"].read_text().replace("steps = 4", "steps = 100000")
                      .replace("save_every = 2", "save_every = 1"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "engine", "run", str(config), "--out",
                                 str(tmp_path / "run"), "--threads", "1", "--nproc", "2"],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    run = RunDir(tmp_path / "run")
    _wait_for_step(run, 2, launcher)
    family = psutil.Process(launcher.pid).children(recursive=True)
    assert len(family) >= 3                            # torchrun and two ranks
    launcher.kill()
    launcher.wait()
    gone, alive = psutil.wait_procs(family, timeout=15)
    try:
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        for proc in alive:
            proc.kill()
    assert run.lock_holder() is None
    assert run.live_status()["state"] == "failed"
    # the newest checkpoint can be ahead of status.json's step: a rank may commit one more
    # checkpoint after the last status write before the kill reaches it
    newest = max(run.status()["step"], run.latest_checkpoint().step)
    result = forgebench("resume", str(run.path), "--steps", str(newest + 1),
                        "--threads", "1")
    assert "completed" in result.stdout


KILL_RANK_1 = """\
import os, signal
if os.environ.get("RANK") == "1":
    import engine.jobs as jobs
    original = jobs.Job.step_done

    def step_done(self, step, **fields):
        if step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, step, **fields)

    jobs.Job.step_done = step_done
"""


def test_a_rank_killed_by_a_signal_is_named_as_the_cause(ctx, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILL_RANK_1)   # every rank imports it at start
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{hooks}{os.pathsep}{REPO}")
    result = subprocess.run([sys.executable, "-m", "engine", "run", str(ctx["config"]),
                             "--out", str(tmp_path / "run"), "--threads", "1", "--nproc", "2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    run = RunDir(tmp_path / "run")
    causes = [e for e in run.events() if e["kind"] == "error" and e.get("cause")]
    assert [(e["rank"], e["signal"]) for e in causes] == [(1, "SIGKILL")]
    status = run.status()
    assert status["state"] == "failed"
    assert status["error"].startswith("rank 1 (pid") and "killed by SIGKILL" in status["error"]
    assert "rank 1" in result.stderr.split("error:")[-1]


# -- item 6: full and read-only disks ------------------------------------------------------------
def _limit_file_size(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_checkpoint_write_that_hits_the_file_size_limit_fails_the_run_cleanly(ctx, tmp_path):
    """Simulated full disk: RLIMIT_FSIZE below the checkpoint's size (the kernel answers EFBIG
    inside safetensors' Rust writer); the run ends `failed`, resumable, with one message naming
    the file and the free space."""
    config = write_config(tmp_path / "c.toml", ctx["corpus"], steps=4, save_every=2,
                          precision="f32")
    model_size = (ctx["run"] / "checkpoints" / "step-000002" / "model.safetensors").stat().st_size
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), "--threads", "1",
                        check=False, preexec_fn=_limit_file_size(model_size // 2))
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "cannot write" in err and " free)" in err and "model.safetensors" in err, err
    run = RunDir(tmp_path / "run")
    status = run.status()
    assert status["state"] == "failed" and "cannot write" in status["error"], status
    assert run.checkpoints() == []            # nothing half-written taken as a checkpoint
    forgebench("resume", str(run.path), "--threads", "1")
    assert run.status()["state"] == "completed"


@contextlib.contextmanager
def tmpfs(path: Path, size: str, options: str = ""):
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and mount rights for a tmpfs (the monkeypatched variant "
                    "covers the same path)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_the_failed_status_is_written_on_a_truly_full_disk(ctx, tmp_path):
    """A real ENOSPC (a full tmpfs): no new file fits, the final status still replaces
    `running` (written in place)."""
    with tmpfs(tmp_path / "full", "64k") as space:
        run = RunDir(space / "run")
        run.path.mkdir()
        run.set_status("running", step=3, pid=os.getpid())
        with open(space / "filler", "wb", buffering=0) as handle, \
                contextlib.suppress(OSError):
            while True:
                handle.write(b"\0" * 4096)
        with pytest.raises(OSError):
            (space / "probe").write_bytes(b"x" * 4096)
        run.set_status("failed", error="the disk is full")
        assert run.status()["state"] == "failed" and run.status()["step"] == 3


def test_the_failed_status_falls_back_when_no_new_file_can_be_made(tmp_path, monkeypatch):
    """The same path simulated anywhere (no root needed): atomic writes raise ENOSPC."""
    import engine.rundir as rundir

    run = RunDir(tmp_path)
    run.set_status("running", step=3)

    def full(path, obj):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(rundir, "atomic_write_json", full)
    run.set_status("failed", error="x")
    assert run.status()["state"] == "failed"
    def denied(path, obj):   # twin: another error is not a full disk and is raised
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(rundir, "atomic_write_json", denied)
    with pytest.raises(PermissionError):
        run.set_status("running")


@contextlib.contextmanager
def read_only_view(source: Path):
    """`source` itself made read-only in place (a read-only bind mount over it)."""
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(source), str(source)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount rights for a read-only bind mount (the in-process "
                    "variant covers the message)")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(source)], check=True)
        yield source
    finally:
        subprocess.run(["umount", "-l", str(source)], check=False)


def test_relocate_and_chat_save_on_a_read_only_workspace(ctx, tmp_path):
    from engine.rundir import make_portable

    workspace = tmp_path / "ws"
    (workspace / "runs").mkdir(parents=True)
    shutil.copytree(ctx["run"], workspace / "runs" / "run")
    make_portable(workspace / "runs" / "run", ctx["root"])
    from lm_sft_support import tiny_base

    model = tiny_base(tmp_path / "src", "tiny.gguf")
    with read_only_view(workspace):
        relocated = forgebench("relocate", str(workspace / "runs" / "run"), check=False)
        saved = forgebench("chat", str(model), "--prompt", "hi", "--max-tokens", "2", "--save",
                           str(workspace / "chat.json"), check=False)
    for result in (relocated, saved):
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
        assert "read-only" in result.stderr and " free)" in result.stderr
        assert str(workspace) in result.stderr


def test_models_add_on_a_read_only_workspace(tmp_path, workspace):
    from lm_sft_support import tiny_base

    source = tiny_base(tmp_path / "src", "tiny.gguf")
    with read_only_view(workspace):
        result = forgebench("models", "--workspace", str(workspace), "add", str(source),
                            check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
    assert "read-only" in result.stderr and str(workspace) in result.stderr
    assert json.loads((workspace / "workspace.json").read_text()).get("models", []) == []


def test_data_generate_on_a_full_disk(tmp_path):
    with tmpfs(tmp_path / "tiny", "64k") as space:
        result = forgebench("data", "generate", "sfx", "--out", str(space / "d"), "--n", "50",
                            check=False)
        assert result.returncode == 2, result.stderr
        err = result.stderr
        assert err.count("error:") == 1 and "Traceback" not in err, err
        assert "the disk is full" in err and str(space / "d") in err and " free)" in err
        assert list(space.iterdir()) == []              # nothing half-written left behind


def test_a_disk_error_anywhere_in_a_command_is_one_message(tmp_path, capsys, monkeypatch):
    """Any command: an ENOSPC/EROFS OSError becomes one error with path and free space."""
    import engine.commands.runs as runs

    def fails(args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "x.json"))

    monkeypatch.setattr(runs, "cmd_status", fails)
    code, _, err = run_cli(capsys, ["status", tmp_path])
    assert_one_clean_error(code, err, "read-only", str(tmp_path / "x.json"), "free)")

    def other(args):   # twin: a bug is no disk error and keeps its traceback
        raise OSError(errno.EBADF, "bad descriptor")

    monkeypatch.setattr(runs, "cmd_status", other)
    with pytest.raises(OSError):
        main(["status", str(tmp_path)])


# -- item 8: `status | head` -----------------------------------------------------------------------
def _into_a_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess:
    """Run `argv` with stdout a pipe whose reader is already gone (as `| head` leaves it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)


def test_status_into_a_closed_pipe_ends_quietly(ctx):
    result = _into_a_closed_pipe([sys.executable, "-m", "engine", "status", str(ctx["run"])])
    assert "BrokenPipeError" not in result.stderr and "Traceback" not in result.stderr, \
        result.stderr
    assert result.returncode == 141
    # twin: the same pipe makes a plain print fail loudly
    plain = _into_a_closed_pipe([sys.executable, "-c", "print('x' * 100)"])
    assert "BrokenPipeError" in plain.stderr


# -- item 8: validation gaps ----------------------------------------------------------------------
def edited_config(ctx, tmp: Path, old: str, new: str) -> Path:
    text = ctx["config"].read_text()
    assert old in text
    path = tmp / "edited.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize("old, new, field", [
    ("batch_size = 4", "batch_size = 1e8", "field 'train.batch_size'"),
    ("ffn_dim = 64", "ffn_dim = 4e9", "field 'model.ffn_dim'"),
])
def test_sizes_beyond_the_machine_are_refused_with_the_estimate(ctx, tmp_path, capsys, old, new,
                                                                field):
    config = edited_config(ctx, tmp_path, old, new)
    code, _, err = run_cli(capsys, ["run", config, "--out", tmp_path / "run"])
    assert_one_clean_error(code, err, field, "needs at least", "GB of memory",
                           "this machine has")
    assert not (tmp_path / "run").exists()


def test_the_memory_estimate_passes_the_shipped_configs():
    """Twin: the estimate is a lower bound that every shipped lm-pretrain config is under."""
    from engine.config import load_config, memory_estimate

    configs = sorted((REPO / "resources").rglob("lm-pretrain*.toml"))
    assert configs
    for path in configs:
        estimate = memory_estimate(load_config(path))
        assert estimate is not None and sum(estimate.values()) < 1e9, path


def test_steps_in_a_config_are_capped_like_the_flag(ctx, tmp_path, capsys):
    from engine.config import validate_config

    config = edited_config(ctx, tmp_path, "steps = 4", "steps = 100000000000000")
    code, _, err = run_cli(capsys, ["run", config, "--out", tmp_path / "run"])
    assert_one_clean_error(code, err, "field 'steps'", "1000000000")
    code, _, err = run_cli(capsys, ["run", ctx["config"], "--steps", "100000000000000"])
    assert code == 2 and "must be between 1 and 1000000000" in err
    # twin: the cap itself is accepted
    data = {"recipe": "lm-pretrain", "data": {"dir": "."}, "steps": 10**9}
    assert validate_config(data).steps == 10**9


def test_symlink_loops_as_config_or_model_paths(ctx, tmp_path, capsys):
    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)
    code, _, err = run_cli(capsys, ["run", loop])
    assert_one_clean_error(code, err, str(loop), "symbolic links")
    model = tmp_path / "loop.gguf"
    model.symlink_to(model)
    code, _, err = run_cli(capsys, ["generate", "--model", model, "--prompt", "x"])
    assert_one_clean_error(code, err, "--model")
    from app.viewmodels.workspace import Workspace

    workspace = Workspace.create(tmp_path / "ws").root
    code, _, err = run_cli(capsys, ["models", "--workspace", workspace, "add", model])
    assert_one_clean_error(code, err, "FILE", "symlink loop")
    data_loop = tmp_path / "data-loop"
    data_loop.symlink_to(data_loop)
    config = edited_config(ctx, tmp_path, f'dir = "{ctx["corpus"]}"', f'dir = "{data_loop}"')
    code, _, err = run_cli(capsys, ["run", config, "--out", tmp_path / "run"])
    assert_one_clean_error(code, err, "field 'data.dir'")


def test_a_dataset_json_that_is_a_list_is_refused(ctx, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    shutil.copytree(ctx["corpus"], corpus)
    (corpus / "dataset.json").write_text("[]")
    config = edited_config(ctx, tmp_path, f'dir = "{ctx["corpus"]}"', f'dir = "{corpus}"')
    code, _, err = run_cli(capsys, ["run", config, "--out", tmp_path / "run"])
    assert_one_clean_error(code, err, "dataset.json", "must be a JSON object, not a JSON list")
    code, _, err = run_cli(capsys, ["data", "validate", corpus])
    assert code != 0 and "Traceback" not in err


def test_a_zero_frame_wav_with_a_transcript_fails_validate(tmp_path, capsys):
    import soundfile

    from engine.data.dataset import version_id
    from engine.data.generators.speech import generate_speech
    from engine.fsutil import sha256_file

    root = generate_speech(tmp_path / "speech", n_speakers=2, per_session=2, progress=False)
    assert main(["data", "validate", str(root)]) == 0           # twin: as generated
    capsys.readouterr()
    manifest = json.loads((root / "dataset.json").read_text())
    clip = sorted(name for name in manifest["files"] if name.endswith(".wav"))[0]
    info = soundfile.info(str(root / clip))
    soundfile.write(str(root / clip), __import__("numpy").zeros((0, info.channels)),
                    info.samplerate, subtype=info.subtype)
    manifest["files"][clip] = sha256_file(root / clip)
    manifest["version"] = version_id(manifest["files"])
    (root / "dataset.json").write_text(json.dumps(manifest, indent=2))
    code, out, err = run_cli(capsys, ["data", "validate", root])
    assert code != 0, out
    assert "holds no audio (0 frames)" in out + err and "Traceback" not in err


@pytest.fixture
def workspace(tmp_path):
    from app.viewmodels.workspace import Workspace

    return Workspace.create(tmp_path / "ws").root


def test_models_add_refuses_a_file_that_is_no_gguf(tmp_path, workspace, capsys):
    from lm_sft_support import tiny_base

    bad = tmp_path / "notes.gguf"
    bad.write_text("just some text\n")
    code, _, err = run_cli(capsys, ["models", "--workspace", workspace, "add", bad])
    assert_one_clean_error(code, err, "not a GGUF file", str(bad))
    assert not (workspace / "models").exists() or list((workspace / "models").iterdir()) == []
    code, _, err = run_cli(capsys, ["models", "--workspace", workspace, "add",   # twin
                                    tiny_base(tmp_path / "src", "tiny.gguf"), "--name", "tiny"])
    assert code == 0, err


def test_a_linked_model_changed_on_disk_is_refused_before_chatting(tmp_path, workspace):
    from lm_sft_support import tiny_base

    from engine import model_library

    source = tiny_base(tmp_path / "src", "tiny.gguf")
    entry = model_library.add_model(workspace, source, name="tiny", mode="link")
    assert model_library.verified_entry_path(workspace, entry) == workspace / "models/tiny.gguf"
    flip_a_byte(source)
    with pytest.raises(ForgebenchError, match="changed since it was added"):
        model_library.verified_entry_path(workspace, entry)
    from engine.serve_local import load_system

    with pytest.raises(ForgebenchError, match="changed since it was added"):
        load_system("A", {"library": "tiny", "workspace": str(workspace)})


def test_a_library_entry_pointing_outside_the_library(tmp_path, workspace, capsys):
    outside = tmp_path / "precious.gguf"
    outside.write_bytes(b"GGUF" + b"\0" * 60)
    manifest = json.loads((workspace / "workspace.json").read_text())
    manifest["models"] = [{"name": "escape", "path": "../precious.gguf", "mode": "copy",
                           "sha256": "0" * 64, "bytes": 64},
                          {"path": str(outside)}]                         # keys missing too
    (workspace / "workspace.json").write_text(json.dumps(manifest))
    code, out, err = run_cli(capsys, ["models", "--workspace", workspace, "list"])
    assert code == 0 and "Traceback" not in err, err
    assert "escape" in out and "points outside the library" in out
    from engine.serve_local import load_system

    with pytest.raises(ForgebenchError, match="points outside the library"):
        load_system("A", {"library": "escape", "workspace": str(workspace)})
    code, _, err = run_cli(capsys, ["models", "--workspace", workspace, "remove", "escape"])
    assert code == 0, err
    assert outside.is_file()                      # forgotten, never deleted


def test_a_search_index_of_pickled_objects_is_refused(tmp_path):
    import numpy as np

    from engine.fsutil import load_numeric_array

    good = tmp_path / "good.npy"
    np.save(good, np.ones((2, 3), dtype=np.float32))
    assert load_numeric_array(good).shape == (2, 3)                      # twin
    pickled = tmp_path / "pickled.npy"
    np.save(pickled, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ForgebenchError, match="not a numeric .npy array") as refused:
        load_numeric_array(pickled)
    assert refused.value.path == str(pickled)
