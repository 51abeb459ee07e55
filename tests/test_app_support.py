"""Shared set-up for the app tests (no tests here): real workspaces built with the engine's
own generators, and run directories written through `engine.rundir.RunDir`'s writer API."""

from __future__ import annotations

import math
import time
from pathlib import Path

from app.viewmodels.workspace import Workspace
from engine.data.generators.records import generate_records
from engine.data.generators.shapes import generate_shapes
from engine.rundir import RunDir

# A few-second lm-pretrain: a 1-layer byte model, one small window per step.
TINY_CONFIG = """recipe = "lm-pretrain"
seed = 0
steps = {steps}
log_every = 1
eval_every = 0
save_every = 0
keep_last = 2

[data]
dir = "../datasets/records"

[model]
dim = 16
n_layers = 1
n_heads = 2
n_kv_heads = 1
ffn_dim = 32
context = 16

[optim]
lr = 3e-3
warmup = 5
grad_clip = 1.0

[train]
batch_size = 2

[eval]
max_windows = 4

[sample]
prompts = ["Record item"]
max_tokens = 4
"""


def make_workspace(root: Path, *, shapes: int = 24, records: bool = True,
                   steps: int = 5000) -> Workspace:
    workspace = Workspace.create(root, name="test workspace")
    if shapes:
        generate_shapes(workspace.datasets_dir / "shapes", n=shapes)
    if records:
        generate_records(workspace.datasets_dir / "records", n=60)
        (workspace.configs_dir / "tiny.toml").write_text(TINY_CONFIG.format(steps=steps))
    return workspace


def write_run(path: Path, *, steps: int = 12, state: str = "stopped", grad_clip: float = 1.0,
              resume_at: int | None = None, checkpoint_every: int = 5) -> RunDir:
    """A run directory as a job writes it: manifest, invocations, metrics, events, status."""
    run = RunDir(path)
    run.create({"recipe": "lm-pretrain", "created": time.time(),
                "config": {"steps": steps, "optim": {"lr": 1e-3, "grad_clip": grad_clip}},
                "data": {"dataset": "/data/records", "files": {"train.txt": "ab" * 32}}})
    run.log_invocation({"id": 1, "start_step": 0})
    for step in range(1, steps + 1):
        if step == resume_at:
            run.log_invocation({"id": 2, "start_step": step - 1})
        run.log_metric({"invocation": 1, "step": step, "split": "train",
                        "loss": 3.0 * math.exp(-step / 6) + 1.0, "grad_norm": 2.0 / step,
                        "clipped": 2.0 / step > grad_clip, "lr": 1e-3,
                        "tokens_per_s": 100.0, "peak_rss_mb": 250.0, "time": 1000.0 + step})
        if step % checkpoint_every == 0:
            run.log_metric({"step": step, "split": "val", "loss": 3.0 * math.exp(-step / 6)
                            + 1.2, "time": 1000.0 + step})
            run.log_event("checkpoint_saved", step=step, checkpoint=f"step-{step:06d}")
    run.set_status(state, step=steps, target_steps=steps)
    run.release_lock()  # the writing job is over; a test that needs a live one starts it
    return run
