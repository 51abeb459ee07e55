"""The learning-rate schedule as plain arithmetic (no torch): the engine's optimizer steps read
it through `engine.train.optim`, and the app draws the curve a resume would follow from it
before the user starts one (one function for both, so the drawn curve is the trained one)."""

from __future__ import annotations

import math
from typing import Literal


def lr_at(step: int, *, lr: float, warmup: int, total: int,
          schedule: Literal["cosine", "constant"] = "cosine", min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (0-based: the first update is step 0).

    Linear warmup from lr/warmup to lr over `warmup` steps, then constant or a cosine decay that
    reaches lr * min_lr_ratio at step `total - 1`.
    """
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    decay_steps = max(total - 1 - warmup, 1)
    progress = min(max(step - warmup, 0) / decay_steps, 1.0)
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def section_warmup(optim: dict, total: int) -> int:
    """The warmup steps a resolved optimizer section gives for a run of `total` steps: `warmup`
    in steps, or `warmup_fraction` of the steps (lm-decision: it grows when a run is
    extended)."""
    if isinstance(optim.get("warmup_fraction"), (int, float)):
        return round(optim["warmup_fraction"] * total)
    return int(optim.get("warmup") or 0)


def section_lr(optim: dict, step: int, total: int) -> float:
    """`lr_at` as a resolved optimizer section (a run.json's `config.optim`) sets it for a run
    of `total` steps."""
    return lr_at(step, lr=float(optim["lr"]), warmup=section_warmup(optim, total), total=total,
                 schedule=optim.get("schedule", "constant"),
                 min_lr_ratio=float(optim.get("min_lr_ratio", 0.1)))
