"""Learning-rate schedule (engine/train/schedule.py, torch-free), AdamW (optionally with bf16
moments) and the clipped optimizer step."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterable, Literal

import torch

from engine.errors import ForgebenchError
from engine.kernels.cpu import torch_threads
from engine.train.schedule import lr_at  # torch-free: the app draws the same schedule


class AdamW(torch.optim.Optimizer):
    """AdamW whose moment buffers may be stored in bf16 (half the optimizer memory).

    The update is computed in float32 either way; only the stored moments are rounded. With
    fp32 moments use `torch.optim.AdamW` instead (see `build_adamw`).
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, moment_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.moment_dtype = moment_dtype

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts loaded state to the parameter dtype; the bf16 -> f32 -> bf16 round trip
        # is lossless, so casting back restores the moments bit for bit.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                if name in state:
                    state[name] = state[name].to(self.moment_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype)
                state["step"] += 1
                t = state["step"].item()
                grad = p.grad.float()
                m = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                denom = (v / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1 ** t))


def build_adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float,
                weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8,
                moments: Literal["fp32", "bf16"] = "fp32") -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices only (norm gains and biases are exempt)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if moments == "bf16":
        return AdamW(groups, lr=lr, betas=betas, eps=eps)
    # foreach=False: one kernel per tensor, the same arithmetic on every resume.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


def adamw_for(named_params: Iterable[tuple[str, torch.nn.Parameter]],
              optim) -> torch.optim.Optimizer:
    """`build_adamw` as a config's optimizer section (engine/recipes/optim_config.py) sets it:
    lr, weight decay and betas, and AdamW's eps and moment storage where the section has them
    (the language-model recipes)."""
    extras = {name: getattr(optim, name) for name in ("eps", "moments") if hasattr(optim, name)}
    return build_adamw(named_params, lr=optim.lr, weight_decay=optim.weight_decay,
                       betas=(optim.beta1, optim.beta2), **extras)


def scheduled_lr(optim, step: int, total: int, warmup: int | None = None) -> float:
    """`lr_at` as a config's optimizer section sets it; `warmup` steps when the section gives
    its warmup another way (lm-decision: a share of the steps)."""
    return lr_at(step, lr=optim.lr, warmup=optim.warmup if warmup is None else warmup,
                 total=total, schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's rate is `lr`, or `lr * group["lr_ratio"]` where a group keeps its own
    share of the schedule (nanochat's MuonAdamW: per-group rates)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float  # global L2 norm before clipping (nan/inf when non-finite)
    clipped: bool
    skipped: bool  # non-finite loss or gradient: no update was made


class NonFiniteError(ForgebenchError):
    """Raised under the 'stop' policy when the loss or gradient is not finite."""


def clip_and_step(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                  max_norm: float, nonfinite_policy: Literal["skip", "stop"] = "skip", *,
                  loss: float | None = None) -> StepOutcome:
    """Clip the global gradient norm to `max_norm` (<= 0: no clipping), step, zero the grads.

    A non-finite gradient (or `loss`) either skips the update (policy 'skip'; the caller counts
    it) or raises NonFiniteError (policy 'stop').
    """
    params = [p for p in params if p.grad is not None]
    with torch_threads(1) if one_thread_serves(params) else contextlib.nullcontext():
        return _clip_and_step(params, optimizer, max_norm, nonfinite_policy, loss)


def _clip_and_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                   max_norm: float, nonfinite_policy: str, loss: float | None) -> StepOutcome:
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
    grad_norm = float(norm)
    finite = math.isfinite(grad_norm) and (loss is None or math.isfinite(loss))
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        if nonfinite_policy == "stop":
            what = "loss" if loss is not None and not math.isfinite(loss) else "gradient"
            raise NonFiniteError(
                f"non-finite {what} (loss={loss}, grad_norm={grad_norm})", where="training step",
                hint="lower the learning rate, or set nonfinite = \"skip\" to skip such steps")
        return StepOutcome(grad_norm, False, True)
    clipped = max_norm > 0 and grad_norm > max_norm
    if clipped:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(grad_norm, clipped, False)


SMALL_TENSOR = 32768    # ATen's internal::GRAIN_SIZE: an op on fewer elements runs on one thread


def one_thread_serves(params: list[torch.nn.Parameter]) -> bool:
    """The optimizer step runs on one torch thread: on the CPU, where every trained tensor
    holds at most SMALL_TENSOR elements (LoRA's factors: gemma-3-270m's largest is 8192).

    Why: no op of such a step is split over threads (each tensor is below ATen's grain), so
    one thread computes the same bits, but at more threads the step still paid for them: the
    pirate LoRA's 72 factors, clip and AdamW, on a 2-core Zen 4 took 4.3 ms at 2 threads
    against 3.8 ms at one on a quiet machine, and at load 4 a median of 19-30 ms (at worst
    0.6 s, waiting on a descheduled partner thread) against 2.5 ms (at worst 7 ms).
    Larger tensors (a full fine-tune) keep every thread: their elementwise passes split."""
    return bool(params) and all(p.device.type == "cpu" and p.numel() <= SMALL_TENSOR
                                for p in params)
