"""Multi-process training on torch.distributed (gloo, 2 CPU processes), through real
`forgebench run|resume|stop --nproc 2` jobs launched under torchrun, against one-process runs.

What the comparisons guarantee, and why not more: a 2-rank run adds each rank's partial
gradients (and loss sums) in the all-reduce, where one process sums every token in one pass, so
the float additions happen in another order. Per-step losses and gradient norms therefore match
a 1-rank run with the same global batch to rounding (1e-6 relative in f32 over these few
steps), not bit for bit. The runs here are pinned to f32, whatever "auto" would pick: under
bf16 autocast (its choice on an AVX512-BF16 or AMX CPU) each rank's smaller products also round
to bf16 in other places, and 1 and 2 ranks' gradient norms differed by 8e-6 on an AMX Xeon.
Between two runs on the *same* world size the order is the same, so a
2-rank run stopped by SIGTERM and resumed on 2 ranks is bitwise the uninterrupted 2-rank run.
All of this is on the CPU. On CUDA the same-device resume is exact as far as the kernels are
deterministic (torch's default cuBLAS GEMMs are, for a fixed shape and GPU; NCCL's reduction
order is fixed for a fixed topology), and a 2-GPU run matches 1 GPU to rounding, which
bench/gpu_check.sh checks at 1e-5 (TF32 stays off). A CPU <-> GPU move is never exact: it is a
recorded override (test_resume_onto_another_device_type_is_an_override).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
from lm_pretrain_support import (
    REPO,
    assert_same_run,
    forgebench,
    make_corpus,
    popen_forgebench,
    train_series,
    write_config,
)

from engine.errors import ForgebenchError
from engine.rundir import RunDir

REL = 1e-6

def assert_close_series(reference: dict, other: dict, rel: float = REL) -> None:
    """Every step's loss and gradient norm within `rel` of the reference (same lr, same clip)."""
    assert sorted(other) == sorted(reference)
    for step, (loss, grad_norm, lr, _clipped) in reference.items():
        o_loss, o_norm, o_lr, _ = other[step]
        assert o_lr == lr
        assert math.isclose(o_loss, loss, rel_tol=rel), (step, loss, o_loss)
        assert math.isclose(o_norm, grad_norm, rel_tol=rel), (step, grad_norm, o_norm)


def max_relative_difference(a: dict, b: dict) -> float:
    return max(abs(a[s][0] - b[s][0]) / abs(a[s][0]) for s in a)


# -- lm-pretrain: 1 rank, 2 ranks, SIGTERM + resume on 2 and on 1 ------------------------------
@pytest.fixture(scope="module")
def pretrain(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    config = write_config(root / "tiny.toml", make_corpus(root), steps=4, save_every=2,
                          precision="f32")
    runs = {}
    forgebench("run", str(config), "--out", str(root / "one"), "--threads", "1")
    forgebench("run", str(config), "--out", str(root / "two"), "--threads", "1", "--nproc", "2")
    forgebench("run", str(config), "--out", str(root / "stopped"), "--threads", "1",
               "--nproc", "2", "--stop-after-step", "1")
    shutil.copytree(root / "stopped", root / "stopped-to-one")
    runs["stopped_events"] = RunDir(root / "stopped").events()
    runs["stopped_status"] = RunDir(root / "stopped").status()
    forgebench("resume", str(root / "stopped"), "--nproc", "2")
    forgebench("resume", str(root / "stopped-to-one"))
    runs.update({name: RunDir(root / name) for name in ("one", "two", "stopped",
                                                        "stopped-to-one")})
    runs["root"], runs["config"] = root, config
    return runs


def test_two_ranks_give_the_one_rank_losses_within_rounding(pretrain):
    one, two = train_series(pretrain["one"]), train_series(pretrain["two"])
    assert sorted(one) == [1, 2, 3, 4]
    assert_close_series(one, two)
    # the run knows how it was trained: run.json, the invocation, per-rank throughput
    manifest = pretrain["two"].manifest()
    assert manifest["environment"]["world_size"] == 2
    assert manifest["environment"]["device"]["type"] == "cpu"
    assert pretrain["two"].invocations()[0]["world_size"] == 2
    row = [m for m in pretrain["two"].metrics() if m.get("split") == "train"][-1]
    assert row["world_size"] == 2 and row["rank_tokens_per_s"] == row["tokens_per_s"] / 2
    assert row["supervised_tokens"] == pretrain["one"].metrics()[0]["supervised_tokens"]


def test_the_tolerance_tells_a_different_run_apart(pretrain, tmp_path):
    """Twin: the same check rejects a run whose batch differs (a seed moves the data order)."""
    config = tmp_path / "other.toml"
    config.write_text(pretrain["config"].read_text().replace("seed = 3", "seed = 4"))
    forgebench("run", str(config), "--out", str(tmp_path / "other"), "--threads", "1")
    with pytest.raises(AssertionError):
        assert_close_series(train_series(pretrain["one"]),
                            train_series(RunDir(tmp_path / "other")))


def test_sigterm_on_two_ranks_checkpoints_once_and_resumes_bitwise(pretrain):
    events, status = pretrain["stopped_events"], pretrain["stopped_status"]
    assert status["state"] == "stopped" and status["step"] == 1
    saved = [e for e in events if e["kind"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [1]           # one checkpoint, written once (rank 0)
    assert_same_run(pretrain["two"], pretrain["stopped"], 4)


def test_two_ranks_to_one_resumes_within_rounding_and_says_so(pretrain):
    assert_close_series(train_series(pretrain["two"]),
                        train_series(pretrain["stopped-to-one"]))
    warnings = [e for e in pretrain["stopped-to-one"].events()
                if e["kind"] == "warning" and e.get("override") == "world_size"]
    assert [(w["before"], w["after"]) for w in warnings] == [(2, 1)]
    assert pretrain["stopped-to-one"].invocations()[-1]["world_size"] == 1


def test_stop_command_stops_every_rank_after_one_checkpoint(pretrain, tmp_path):
    config = tmp_path / "long.toml"
    config.write_text(pretrain["config"].read_text().replace("steps = 4", "steps = 100000")
                      .replace("save_every = 2", "save_every = 0"))
    job = popen_forgebench("run", str(config), "--out", str(tmp_path / "run"), "--threads", "1",
                           "--nproc", "2")
    run = RunDir(tmp_path / "run")
    deadline = time.monotonic() + 120
    while (run.status().get("step") or 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    forgebench("stop", str(run.path), "--wait", "120")
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    status = run.status()
    assert status["state"] == "stopped"
    saved = [e for e in run.events() if e["kind"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [status["step"]]
    assert run.latest_checkpoint().step == status["step"]


SIGTERM_RANK_1_AFTER_AGREEING = """\
import os, signal
if os.environ.get("RANK") == "1":
    import engine.train.distributed as distributed
    original = distributed.agree_stop

    def agree_stop(stop, world, device=None):
        agreed = original(stop, world, device)
        if not stop and not agreed and not os.environ.get("SIGNALLED"):
            os.environ["SIGNALLED"] = "1"   # once: at step 2, after the ranks agreed to go on
            os.kill(os.getpid(), signal.SIGTERM)
        return agreed

    distributed.agree_stop = agree_stop
"""


def test_a_stop_landing_just_after_the_agreement_waits_for_the_next_step(pretrain, tmp_path):
    """SIGTERM reaches rank 1 between the ranks' stop agreement and the loop's own check (the
    window a real `forgebench stop` can hit). Rank 1 must not checkpoint and leave alone: the
    stop is agreed after the next step, and both ranks stop there, together."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SIGTERM_RANK_1_AFTER_AGREEING)
    config = tmp_path / "long.toml"
    config.write_text(pretrain["config"].read_text().replace("steps = 4", "steps = 50")
                      .replace("save_every = 2", "save_every = 0"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{hooks}{os.pathsep}{REPO}")
    result = subprocess.run([sys.executable, "-m", "engine", "run", str(config),
                             "--out", str(tmp_path / "run"), "--threads", "1", "--nproc", "2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunDir(tmp_path / "run")
    status = run.status()
    assert status["state"] == "stopped" and status["step"] == 2, status
    assert status["stop_reason"] == "another rank was asked to stop"
    assert [e["step"] for e in run.events() if e["kind"] == "checkpoint_saved"] == [2]


# -- every rank's failure reaches events.jsonl ---------------------------------------------------
FAIL_RANK_1 = """\
import os
if os.environ.get("RANK") == "1":
    import engine.jobs as jobs
    original = jobs.Job.step_done

    def step_done(self, step, **fields):
        if step == 2:
            raise RuntimeError("injected failure on rank 1 at step 2")
        return original(self, step, **fields)

    jobs.Job.step_done = step_done
"""


def test_a_failure_on_rank_one_surfaces_with_its_rank(pretrain, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAIL_RANK_1)   # every rank imports it at start
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{hooks}{os.pathsep}{REPO}")
    result = subprocess.run([sys.executable, "-m", "engine", "run", str(pretrain["config"]),
                             "--out", str(tmp_path / "run"), "--threads", "1", "--nproc", "2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "error:" in result.stderr
    run = RunDir(tmp_path / "run")
    errors = [e for e in run.events() if e["kind"] == "error"]
    by_rank = {e["rank"]: e for e in errors}
    assert "injected failure on rank 1 at step 2" in by_rank[1]["message"]
    assert by_rank[1]["step"] == 1 and by_rank[1]["invocation"] == 1
    assert 0 in by_rank              # rank 0 lost its peer and says so too
    assert run.status()["state"] == "failed"


# -- lm-sft: LoRA under DDP, a full fine-tune under FSDP2 ------------------------------------------
@pytest.mark.parametrize("method, qtype", [("lora", "Q4_K"), ("full", "F32")])
def test_lm_sft_on_two_ranks_matches_one_rank(tmp_path, method, qtype):
    """LoRA over a packed Q4_K base under DDP; a full fine-tune of a float base under FSDP2
    (`fully_shard`: each rank holds half of every weight and of its AdamW moments)."""
    from fixtures_gguf import write_tiny_gguf
    from lm_sft_support import write_config as write_sft_config

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype=qtype, n_layers=2)
    # window 4 = 2 samples per rank; the held prompt's AFTER answer comes from rank 0
    config = write_sft_config(tmp_path, gguf, steps=3, method=method, dropout=0.0, window=4,
                              precision="f32")
    forgebench("run", str(config), "--out", str(tmp_path / "one"), "--threads", "1")
    forgebench("run", str(config), "--out", str(tmp_path / "two"), "--threads", "1",
               "--nproc", "2")
    one, two = train_series(RunDir(tmp_path / "one")), train_series(RunDir(tmp_path / "two"))
    assert sorted(one) == [1, 2, 3]
    assert_close_series(one, two)
    rows = [m for m in RunDir(tmp_path / "two").metrics() if m.get("split") == "train"]
    first = [m for m in RunDir(tmp_path / "one").metrics() if m.get("split") == "train"]
    # the supervised-token counts are all-reduced: the same per-step totals as one process
    assert [r["supervised_tokens"] for r in rows] == [r["supervised_tokens"] for r in first]
    if method == "full":   # the gathered checkpoint is the one-process file, tensor by tensor
        from safetensors.torch import load_file

        final = "checkpoints/step-000003/model.safetensors"
        a = load_file(str(tmp_path / "one" / final))
        b = load_file(str(tmp_path / "two" / final))
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype
            # AdamW divides by sqrt(v): where a gradient is near zero its rounding moves the
            # update by up to lr, so weights agree to 1e-3 of their scale, the losses to 1e-6
            assert (a[key] - b[key]).abs().max() <= 1e-3 * a[key].abs().max(), key


# -- devices --------------------------------------------------------------------------------------
def test_cuda_without_a_gpu_is_refused_before_anything_is_written(pretrain, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench/gpu_check.sh covers CUDA")
    result = forgebench("run", str(pretrain["config"]), "--out", str(tmp_path / "run"),
                        "--device", "cuda", check=False)
    assert result.returncode == 2
    assert "device 'cuda' was asked for" in result.stderr and "hint:" in result.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_resume_onto_another_device_type_is_an_override(pretrain, tmp_path):
    """A run recorded on a GPU resumed on this CPU: refused with the reason, or with
    --allow-device-change continued and recorded as a warning."""
    run_path = tmp_path / "moved"
    shutil.copytree(pretrain["root"] / "one", run_path)
    manifest = json.loads((run_path / "run.json").read_text())
    manifest["environment"]["device"] = {"type": "cuda", "index": 0, "name": "a GPU"}
    (run_path / "run.json").write_text(json.dumps(manifest))
    RunDir(run_path).seal_manifest()   # as a run made on a GPU was sealed
    refused = forgebench("resume", str(run_path), "--steps", "5", check=False)
    assert refused.returncode == 2
    assert "trained on cuda; resuming on cpu would not be exact" in refused.stderr
    forgebench("resume", str(run_path), "--steps", "5", "--device", "cpu",
               "--allow-device-change")
    warnings = [e for e in RunDir(run_path).events() if e.get("override") == "device"]
    assert [(w["before"], w["after"]) for w in warnings] == [("cuda", "cpu")]
    assert RunDir(run_path).status()["state"] == "completed"


def test_device_words_and_uneven_shards_are_refused_with_the_reason():
    import torch

    from engine.train import devices, distributed

    assert devices.resolve("cpu").type == "cpu"
    assert devices.resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ForgebenchError, match="unknown device"):
        devices.resolve("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ForgebenchError, match="CPU-only build|finds no GPU"):
            devices.resolve("cuda:1")
    two = distributed.World(rank=1, size=2)
    assert distributed.shard([10, 11, 12, 13], two) == [12, 13]
    with pytest.raises(ForgebenchError, match="a window of 3 does not split evenly across 2"):
        distributed.shard([1, 2, 3], two, "window", "field 'train.window'")
    # one process: the collectives are the identity
    single = distributed.SINGLE
    assert distributed.all_reduce_sum([3, 4.5], single) == [3.0, 4.5]
    assert distributed.agree_stop(True, single) is True
    assert distributed.rank_throughput(10.0, single) == {}


def test_doctor_reports_the_gpus_or_why_there_are_none():
    from engine.commands.doctor import gpu_lines, report

    info = report()
    lines = gpu_lines(info)
    if info["cuda"] is None:
        assert lines[0].startswith("no CUDA device (")
    fake = {"torch_cuda": "12.8", "cuda": {"cuda": "12.8", "devices": [
        {"index": 0, "name": "NVIDIA L4", "memory_bytes": 24 * 2**30, "capability": "8.9",
         "bf16": True, "allow_tf32": False}]}}
    assert gpu_lines(fake) == ["CUDA 12.8:", "  cuda:0 NVIDIA L4, 24.0 GiB, compute 8.9, "
                                             "bf16 yes, tf32 matmul off"]
    assert "finds no GPU" in gpu_lines({"torch_cuda": "12.8", "cuda": None})[0]


def test_packed_gguf_weights_follow_the_module_to_its_device_and_are_never_cast(tmp_path):
    """`model.to(device)` moves the packed bytes (no Parameter, no buffer) so a GPU dequantizes
    them itself; dtype casts leave them alone. The meta device stands in for a GPU here."""
    import torch
    from fixtures_gguf import write_tiny_gguf

    from engine.models.gguf_model import load_gguf_model, packed_weights

    model, _ = load_gguf_model(write_tiny_gguf(tmp_path / "t.gguf", arch="gemma3",
                                               qtype="Q4_K", n_layers=1),
                               numerics="f32", weights="packed")
    raw = [w.raw.dtype for w in packed_weights(model)]
    model.float()
    assert [w.raw.dtype for w in packed_weights(model)] == raw == [torch.uint8] * len(raw)
    model.to("meta")
    assert {w.raw.device.type for w in packed_weights(model)} == {"meta"}


# -- the app's view of devices and processes (Qt-free view-models) --------------------------------
def test_new_run_form_and_resume_carry_the_process_count(pretrain, tmp_path):
    from app.viewmodels import jobs
    from app.viewmodels.runs import device_text

    pending = jobs.PendingRun(tmp_path / "c.toml", tmp_path / "out", threads=1, processes=2)
    assert pending.argv()[-4:] == ["--threads", "1", "--nproc", "2"]
    assert "--nproc" not in jobs.PendingRun(tmp_path / "c.toml", tmp_path / "o").argv()
    assert jobs.resume_argv(pretrain["two"].path)[-2:] == ["--nproc", "2"]
    assert "--nproc" not in jobs.resume_argv(pretrain["one"].path)
    assert device_text(pretrain["two"].manifest()) == "cpu × 2"
    assert device_text(pretrain["one"].manifest()) == "cpu"
    assert device_text({"environment": {"device": {"type": "cuda", "name": "NVIDIA L4"},
                                        "world_size": 1}}) == "NVIDIA L4"
    gpus = tmp_path / "nvidia" / "gpus"
    (gpus / "0000:01:00.0").mkdir(parents=True)
    (gpus / "0000:01:00.0" / "information").write_text("Model: \t NVIDIA L4\nIRQ: 1\n")
    found = jobs.machine_devices(gpus)
    assert found["gpus"] == ["NVIDIA L4"] and found["cpus"] >= 1
    assert jobs.machine_text({"cpus": 2, "gpus": []}) == "this machine: 2 CPU cores; no NVIDIA GPU"
