"""The run-directory protocol: fresh runs, sentinel-committed checkpoints, retention, free
space, tolerant readers, and checkpoints that restore model, optimizer and RNGs exactly."""

from __future__ import annotations

import random
import shutil
from collections import namedtuple

import numpy as np
import pytest
import torch

from engine.errors import ForgebenchError
from engine.fsutil import append_jsonl, read_jsonl
from engine.rundir import SENTINEL, RunDir
from engine.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from engine.train.optim import build_adamw


def fresh(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create({"recipe": "test"})
    return run


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train_steps(model, optimizer, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_fresh_run_refuses_non_empty_directory(tmp_path):
    run = fresh(tmp_path)
    assert run.status()["state"] == "queued" and run.checkpoints_dir.is_dir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(ForgebenchError, match="not empty"):
        RunDir(tmp_path / "other").create({"recipe": "test"})
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ForgebenchError, match="not empty"):
        run.create({"recipe": "again"})
    assert run.manifest() == {"recipe": "test"}


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_checkpoint_restores_model_optimizer_and_rng_exactly(tmp_path, moments):
    run = fresh(tmp_path)
    model = small_model()
    optimizer = build_adamw(model.named_parameters(), lr=1e-2, weight_decay=0.1,
                            moments=moments)
    train_steps(model, optimizer, 3, seed=1)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    ckpt = save_checkpoint(run, 3, model_tensors=model.state_dict(), optimizer=optimizer,
                           trainer_state={"rng": rng_state(), "note": "x"},
                           extra_files={"tokenizer.json": b"{}"}, keep_last=3)
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    train_steps(model, optimizer, 2, seed=2)  # the uninterrupted continuation

    restored = small_model()
    restored_opt = build_adamw(restored.named_parameters(), lr=1e-2, weight_decay=0.1,
                               moments=moments)
    tensors, opt_state, state = load_checkpoint(ckpt)
    restored.load_state_dict(tensors)
    restored_opt.load_state_dict(opt_state)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    set_rng_state(state["rng"])
    assert (random.random(), np.random.rand()) == expected_draws[:2]
    assert torch.equal(torch.rand(3), expected_draws[2])
    train_steps(restored, restored_opt, 2, seed=2)
    for a, b in zip(model.state_dict().values(), restored.state_dict().values()):
        assert torch.equal(a, b)
    assert state["step"] == 3 and state["note"] == "x"
    assert (ckpt.path / "tokenizer.json").read_bytes() == b"{}"
    assert [e["kind"] for e in run.events()] == ["checkpoint_saved"]


def test_sentinel_commits_and_crashes_leave_nothing(tmp_path):
    run = fresh(tmp_path)
    with pytest.raises(RuntimeError, match="without trainer_state.json"):
        with run.staging_checkpoint(5) as tmp:
            (tmp / "model.safetensors").write_bytes(b"partial")
    with pytest.raises(KeyError):
        with run.staging_checkpoint(6) as tmp:
            (tmp / SENTINEL).write_text("{}")
            raise KeyError("crash while saving")
    assert run.checkpoints() == [] and list(run.checkpoints_dir.iterdir()) == []
    # a directory without the sentinel (e.g. copied by hand) is not a checkpoint
    (run.checkpoints_dir / "step-000007").mkdir()
    assert run.checkpoints() == []
    with pytest.raises(ForgebenchError, match="no committed checkpoint"):
        run.checkpoint("latest")


def test_retention_keeps_last_k_and_protected(tmp_path):
    run = fresh(tmp_path)
    w = {"w": torch.zeros(2)}
    for step in range(1, 6):
        save_checkpoint(run, step, model_tensors=w, trainer_state={}, keep_last=2,
                        protect=("step-000002",))
    assert [c.name for c in run.checkpoints()] == ["step-000002", "step-000004", "step-000005"]
    assert run.checkpoint(4).step == 4 and run.checkpoint("step-000005").step == 5
    # keep_last never deletes the only good checkpoint
    single = RunDir(tmp_path / "single")
    single.create({})
    save_checkpoint(single, 1, model_tensors=w, trainer_state={}, keep_last=1)
    assert [c.name for c in single.checkpoints()] == ["step-000001"]
    assert single.apply_retention(1) == []


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch):
    run = fresh(tmp_path)
    save_checkpoint(run, 1, model_tensors={"w": torch.zeros(10)}, trainer_state={}, keep_last=1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ForgebenchError, match="not enough free disk space") as info:
        save_checkpoint(run, 2, model_tensors={"w": torch.zeros(1000)}, trainer_state={},
                        keep_last=1)
    assert info.value.path == str(run.checkpoints_dir)
    assert [c.name for c in run.checkpoints()] == ["step-000001"]
    assert sorted(p.name for p in run.checkpoints_dir.iterdir()) == ["step-000001"]


def test_jsonl_reader_skips_an_append_in_progress(tmp_path):
    path = tmp_path / "m.jsonl"
    append_jsonl(path, {"step": 1})
    with open(path, "a") as handle:
        handle.write('{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1}]
    path.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ForgebenchError, match="line 2"):
        read_jsonl(path)


def test_status_of_a_vanished_process_reads_failed(tmp_path):
    import subprocess
    import sys

    run = fresh(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    run.set_status("running", pid=proc.pid, step=3)
    assert run.live_status()["state"] == "running"  # this process holds the lock
    run.release_lock()  # as the job's exit does
    status = run.live_status()
    assert status["state"] == "failed" and status["stale"] and not run.is_active()
    assert run.status()["state"] == "running"  # the file itself is not rewritten by a reader
