"""Mixed precision on the CPU or a GPU: one switch for every recipe ("bf16" autocast, or
"f32": none)."""

from __future__ import annotations

import contextlib

import torch


def autocast(precision: str, device_type: str = "cpu"):
    """torch's autocast to bfloat16 for "bf16" on the CPU or CUDA (`device_type`); a no-op
    context for anything else. The weights (and full fine-tuning's master copy) stay f32."""
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
