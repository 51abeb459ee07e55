"""Helpers shared by the lm-pretrain, resume and CLI-error tests: a tiny corpus and config, and
a `forgebench` subprocess runner."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TINY_CONFIG = """\
recipe = "lm-pretrain"
seed = 3
steps = {steps}
log_every = 1
eval_every = 0
save_every = {save_every}
keep_last = 2
{top}
[data]
dir = "{data}"

[tokenizer]
kind = "{tokenizer}"
vocab_size = 300

[model]
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_dim = 64
context = 32

[optim]
lr = 3e-3
warmup = 2

[train]
batch_size = 4
grad_accum = 2
precision = "{precision}"

[eval]
batch_size = 64
max_windows = 8

[sample]
prompts = ["Record item"]
max_tokens = 16
"""


def make_corpus(root: Path, n: int = 60) -> Path:
    from engine.data.generators.records import generate_records

    return generate_records(root / "corpus", n=n, seed=1)


def write_config(path: Path, data: Path, *, steps: int = 6, save_every: int = 0,
                 tokenizer: str = "byte", top: str = "", precision: str = "auto") -> Path:
    """The tiny test config; `top` adds top-level TOML lines (e.g. 'nonfinite = "stop"');
    precision "auto" is bf16 where the CPU multiplies bf16 faster than f32, f32 elsewhere."""
    path.write_text(TINY_CONFIG.format(steps=steps, save_every=save_every, data=data,
                                       tokenizer=tokenizer, top=top, precision=precision))
    return path


def forgebench(*args: str, timeout: float = 300, check: bool = True,
               **popen) -> subprocess.CompletedProcess:
    """Run `python -m engine ARGS` from the repository, one thread, and return the result."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout, **popen)
    if check and result.returncode != 0:
        raise AssertionError(f"forgebench {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


def uninterrupted_run(root: Path, steps: int, save_every: int):
    """(config path, RunDir) of one uninterrupted tiny run: the reference resumed runs must
    match bit for bit."""
    from engine.rundir import RunDir

    config = write_config(root / "tiny.toml", make_corpus(root), steps=steps,
                          save_every=save_every)
    forgebench("run", str(config), "--out", str(root / "uninterrupted"), "--threads", "1")
    return config, RunDir(root / "uninterrupted")


def popen_forgebench(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> SHA-256 of every file under root (to prove nothing was touched)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def train_series(run) -> dict[int, tuple]:
    """step -> (loss, grad_norm, lr, clipped) of a run's train metrics, without the lines a
    later invocation superseded (a killed job's steps after its last checkpoint)."""
    series = {}
    for m in run.current_metrics():
        if m.get("split") == "train":
            assert m["step"] not in series, f"step {m['step']} logged twice"
            series[m["step"]] = (m["loss"], m["grad_norm"], m["lr"], m["clipped"])
    return series


def assert_same_run(a, b, steps: int) -> None:
    """Bitwise the same training: every step's metrics, the final weights and optimizer state,
    and the last val evaluation."""
    import torch
    from safetensors.torch import load_file

    sa, sb = train_series(a), train_series(b)
    assert sorted(sa) == list(range(1, steps + 1))
    assert sa == sb  # bitwise: JSON keeps every float's exact repr
    final = f"checkpoints/step-{steps:06d}"
    for name in ("model.safetensors", "optimizer.safetensors"):
        wa, wb = load_file(str(a.path / final / name)), load_file(str(b.path / final / name))
        assert wa.keys() == wb.keys()
        for key in wa:
            assert wa[key].dtype == wb[key].dtype
            assert torch.equal(wa[key].reshape(-1).view(torch.uint8),
                               wb[key].reshape(-1).view(torch.uint8)), (name, key)
    val_a = [m for m in a.metrics() if m.get("split") == "val"][-1]
    val_b = [m for m in b.metrics() if m.get("split") == "val"][-1]
    assert val_a["loss"] == val_b["loss"] and val_a["bpb"] == val_b["bpb"]
