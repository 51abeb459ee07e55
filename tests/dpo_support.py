"""The tolerance of DPO's first step. At step 1 the policy is its own reference, so every reward
margin is zero in exact arithmetic. In f32 it is zero up to the rounding of the summed
log-probs, and the reference (eval micro-batches) and the policy (the training window) compute
those with matmuls of other shapes, whose last bits differ by CPU kernel (AVX2, AVX-512) and
thread count: -1.5e-6 was seen on an AVX-512 machine where 1e-6 had held elsewhere. The bound
scales with the log-probs' size; a wrong reference (another model, another checkpoint) gives
margins of the order of beta times their difference, far above it."""

from __future__ import annotations

F32_EPS = 2.0 ** -23
ULPS = 32          # of the two summed log-probs: generous for a sum over tens of tokens


def first_step_margin_tolerance(row: dict, beta: float) -> float:
    """How far step 1's mean reward margin may be from 0 (and its sigmoid loss from log 2,
    whose slope there is 1/2) given the step's mean chosen and rejected log-probs."""
    return beta * ULPS * F32_EPS * (abs(row["chosen_logp"]) + abs(row["rejected_logp"]))
