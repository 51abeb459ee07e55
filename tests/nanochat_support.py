"""What the nanochat tests share with the scripts that made their reference data
(tests/data/nanochat/make_goldens.py runs in the reference's own venv, without the engine, so
the tests load it from its file rather than the other way round)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DATA = Path(__file__).parent / "data" / "nanochat"


def goldens_script():
    spec = importlib.util.spec_from_file_location("make_goldens", DATA / "make_goldens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_kind() -> str:
    """The kind of CPU the reference data records (vendor and torch's vector width)."""
    return goldens_script().cpu_kind()


def train_on_goldens(model, batches, lrs: dict, steps: int, groups=None, compute_dtype=None):
    """The reference's loop over the goldens' stored batches [steps, B, T+1]: forward, backward,
    MuonAdamW step (`groups`, nanochat's by default, at the goldens' rates `lrs`;
    `compute_dtype` the optimizer's, fp32 by default). Returns the losses and the optimizer."""
    import torch

    from engine.train.muon import MuonAdamW, nanochat_groups

    groups = groups or nanochat_groups
    optimizer = MuonAdamW(groups(model, **lrs), compute_dtype=compute_dtype or torch.float32)
    losses = []
    for step in range(steps):
        loss = model(batches[step, :, :-1], batches[step, :, 1:])
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return losses, optimizer
