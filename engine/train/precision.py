"""Mixed precision on CPU: one switch for every recipe ("bf16" autocast, or "f32": none)."""

from __future__ import annotations

import contextlib

import torch


def autocast(precision: str):
    """torch's CPU autocast to bfloat16 for "bf16"; a no-op context for anything else."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
