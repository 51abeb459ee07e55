"""Exact resume through real `forgebench` processes and real SIGTERMs, fresh-process reload,
and how a job records failure, skipped steps and retention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from lm_pretrain_support import (
    REPO,
    assert_same_run,
    forgebench,
    make_corpus,
    popen_forgebench,
    uninterrupted_run,
    write_config,
)
from safetensors.torch import load_file

from engine.cli import main
from engine.rundir import RunDir

STEPS = 12


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """One uninterrupted run of STEPS steps, the reference for every resumed run."""
    root = tmp_path_factory.mktemp("resume")
    return (root, *uninterrupted_run(root, STEPS, save_every=4))


def test_uninterrupted_run_protocol(baseline, capsys):
    _, _, run = baseline
    assert main(["status", str(run.path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["state"] == "completed" and summary["step"] == STEPS
    assert summary["last_eval"]["split"] == "val" and summary["last_eval"]["bpb"] > 0
    manifest = run.manifest()
    assert manifest["recipe"] == "lm-pretrain"
    assert manifest["environment"]["threads"] == 1
    assert set(manifest["data"]["files"]) == {"train.txt", "val.txt", "test.txt", "dataset.json"}
    assert len(manifest["code_version"]) == 64
    assert run.status()["state"] == "completed" and run.status()["step"] == STEPS
    # saved at 4, 8, 12; keep_last = 2 keeps the two newest (12 is also the best)
    assert [c.name for c in run.checkpoints()] == ["step-000008", "step-000012"]
    assert run.status()["best_checkpoint"] == "step-000012"
    kinds = [e["kind"] for e in run.events()]
    assert kinds.count("checkpoint_saved") == 3 and "sample_written" in kinds
    train = [m for m in run.metrics() if m.get("split") == "train"]
    for m in train:
        assert m["supervised_tokens"] == m["input_tokens"] == 4 * 2 * 32
        assert m["tokens_per_s"] > 0 and m["peak_rss_mb"] > 0
        assert m["grad_norm"] > 0 and m["invocation"] == 1
    samples = run.path / "samples" / "step-000012"
    assert (samples / "samples.jsonl").is_file() and (samples / "samples.json").is_file()


def test_stop_after_step_then_resume_is_bitwise_identical(baseline, tmp_path):
    _, config, reference = baseline
    out = tmp_path / "stopped"
    forgebench("run", str(config), "--out", str(out), "--threads", "1",
               "--stop-after-step", "5")
    run = RunDir(out)
    status = run.status()
    assert status["state"] == "stopped" and status["step"] == 5
    assert status["stop_reason"] == "SIGTERM"
    assert run.latest_checkpoint().name == "step-000005"
    assert run.invocations()[0]["stop_after_step"] == 5

    result = forgebench("resume", str(out))
    assert "completed" in result.stdout
    invocations = run.invocations()
    assert [i["kind"] for i in invocations] == ["start", "resume"]
    assert invocations[1]["start_step"] == 5 and invocations[1]["threads"] == 1
    assert_same_run(reference, run, STEPS)


def test_forgebench_stop_then_resume_is_bitwise_identical(baseline, tmp_path, capsys):
    _, config, reference = baseline
    out = tmp_path / "signalled"
    proc = popen_forgebench("run", str(config), "--out", str(out), "--threads", "1")
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count('"split": "train"') >= 2:
            break
        time.sleep(0.002)
    # Freeze the job so the signal lands mid-run whatever the machine's load, then have
    # `forgebench stop` send SIGTERM to the pid in status.json.
    proc.send_signal(signal.SIGSTOP)
    try:
        assert main(["stop", str(out)]) == 0
    finally:
        proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    assert f"stop requested (pid {proc.pid})" in capsys.readouterr().out
    run = RunDir(out)
    stopped_at = run.status()["step"]
    assert run.status()["state"] == "stopped", run.status()
    assert 2 <= stopped_at < STEPS
    assert run.latest_checkpoint().step == stopped_at

    forgebench("resume", str(out))
    assert_same_run(reference, run, STEPS)


def test_fresh_process_reload_gives_identical_logits(baseline, tmp_path):
    _, _, run = baseline
    from engine.recipes.lm_pretrain import load_model

    tokens = torch.tensor([[256] + list(b"Record item0007: the red mug is in the")])
    model, _, _ = load_model(run, run.latest_checkpoint())
    with torch.no_grad():
        here = model(tokens)
    script = (
        "import sys, torch; from safetensors.torch import save_file\n"
        "from engine.rundir import RunDir; from engine.recipes.lm_pretrain import load_model\n"
        "torch.set_num_threads(1)\n"
        "run = RunDir(sys.argv[1]); model, _, _ = load_model(run, run.latest_checkpoint())\n"
        "tokens = torch.tensor([[256] + list(b'Record item0007: the red mug is in the')])\n"
        "with torch.no_grad(): save_file({'logits': model(tokens)}, sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", script, str(run.path), str(tmp_path / "l.safetensors")],
                   cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), check=True,
                   timeout=300)
    there = load_file(str(tmp_path / "l.safetensors"))["logits"]
    assert torch.equal(here, there)


# -- in-process jobs: failure, non-finite policy -------------------------------------------
def _start(tmp_path, **config_kw):
    from engine.config import load_config
    from engine.jobs import start_run

    corpus = make_corpus(tmp_path)
    config = load_config(write_config(tmp_path / "c.toml", corpus, **config_kw))
    return start_run(config, tmp_path / "run", ["test"], threads=1), config


def test_crash_leaves_failed_status_with_stage_and_traceback(tmp_path, monkeypatch):
    from engine.jobs import execute
    from engine.models.llama import Llama

    run, config = _start(tmp_path, steps=6)
    calls = {"n": 0}
    original = Llama.forward

    def failing_forward(self, tokens):
        calls["n"] += 1
        if calls["n"] == 5:  # step 3, first micro-batch
            raise RuntimeError("simulated kernel failure")
        return original(self, tokens)

    monkeypatch.setattr(Llama, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        execute(run, config, None, threads=1, progress=False)
    status = run.status()
    assert status["state"] == "failed" and status["stage"] == "forward"
    assert status["step"] == 2 and "simulated kernel failure" in status["error"]
    error = [e for e in run.events() if e["kind"] == "error"][-1]
    assert error["stage"] == "forward" and "failing_forward" in error["traceback"]


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_nonfinite_loss_policy(tmp_path, monkeypatch, policy):
    import torch.nn.functional as F

    from engine.jobs import execute
    from engine.train.optim import NonFiniteError

    run, config = _start(tmp_path, steps=5, top=f'nonfinite = "{policy}"')
    assert run.manifest()["config"]["nonfinite"] == policy
    original = F.cross_entropy
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        value = original(*args, **kwargs)
        return value * float("nan") if calls["n"] in (5, 6) else value  # step 3's window

    monkeypatch.setattr(F, "cross_entropy", poisoned)
    if policy == "stop":
        with pytest.raises(NonFiniteError):
            execute(run, config, None, threads=1, progress=False)
        assert run.status()["state"] == "failed" and run.status()["stage"] == "optimizer"
        return
    execute(run, config, None, threads=1, progress=False)
    train = {m["step"]: m for m in run.metrics() if m.get("split") == "train"}
    assert train[3]["skipped"] and train[3]["skipped_total"] == 1
    assert not train[2]["skipped"] and train[5]["skipped_total"] == 1
    assert all(torch.isfinite(torch.tensor(m["loss"])) for s, m in train.items() if s != 3)
    assert run.status()["state"] == "completed"
