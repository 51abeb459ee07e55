"""DDPM pieces shared by the image and audio generators: the cosine noise schedule, forward
noising, the ancestral sampler with classifier-free guidance, condition dropout and EMA.

Conventions (Ho et al. 2020, cosine schedule from Nichol & Dhariwal 2021):
    alpha_bar(t) = f(t) / f(0),  f(t) = cos²((t/T + s) / (1 + s) · π/2),  s = 0.008
    beta_t = min(1 − alpha_bar_t / alpha_bar_{t−1}, 0.999), alpha_bar recomputed as Π(1 − beta)
    x_t = sqrt(alpha_bar_t) x0 + sqrt(1 − alpha_bar_t) ε        (the network predicts ε)
    guided ε = ε_null + g (ε_cond − ε_null)                        (g = 1: conditional only)
Timesteps are 0-based: t = 0 is the least noisy level, t = T − 1 the most.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SCHEDULE_ID = "cosine-s0.008-maxbeta0.999"


def cosine_betas(num_steps: int, s: float = 0.008, max_beta: float = 0.999) -> torch.Tensor:
    def f(t: float) -> float:
        return math.cos((t / num_steps + s) / (1 + s) * math.pi / 2) ** 2

    return torch.tensor([min(1 - f(t + 1) / f(t), max_beta) for t in range(num_steps)],
                        dtype=torch.float64)


class Schedule:
    """Per-level coefficients of one noise schedule, optionally respaced for faster sampling.

    A respaced schedule keeps a subset of the training levels; its betas are recomputed so that
    its alpha_bar at each kept level equals the training value (the model sees the same noise
    levels it was trained on).
    """

    def __init__(self, num_steps: int, sample_steps: int | None = None):
        train_alpha_bar = torch.cumprod(1 - cosine_betas(num_steps), dim=0)
        self.num_steps = num_steps
        if sample_steps is None or sample_steps >= num_steps:
            self.timesteps = torch.arange(num_steps)
        else:
            self.timesteps = torch.linspace(0, num_steps - 1, sample_steps).round().long()
        alpha_bar = train_alpha_bar[self.timesteps]
        prev = torch.cat([torch.ones(1, dtype=torch.float64), alpha_bar[:-1]])
        self.alpha_bar = alpha_bar
        self.alpha_bar_prev = prev
        self.betas = 1 - alpha_bar / prev
        # Posterior q(x_{t-1} | x_t, x0) = N(c0 · x0 + ct · x_t, var)
        self.posterior_var = self.betas * (1 - prev) / (1 - alpha_bar)
        self.coef_x0 = self.betas * prev.sqrt() / (1 - alpha_bar)
        self.coef_xt = (1 - prev) * (1 - self.betas).sqrt() / (1 - alpha_bar)

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Noise clean x0 [B, ...] to levels t [B] (indices into this schedule)."""
        shape = (-1,) + (1,) * (x0.dim() - 1)
        a = self.alpha_bar[t].to(x0.dtype).view(shape)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def predict_x0(self, x_t: torch.Tensor, i: int, eps: torch.Tensor) -> torch.Tensor:
        a = float(self.alpha_bar[i])
        return (x_t - math.sqrt(1 - a) * eps) / math.sqrt(a)

    def step(self, x_t: torch.Tensor, i: int, eps: torch.Tensor, noise: torch.Tensor | None,
             clip: float | None = 1.0) -> torch.Tensor:
        """One ancestral update x_t -> x_{t-1} at schedule index i; the clean estimate is
        bounded to the data range [-clip, clip]."""
        x0 = self.predict_x0(x_t, i, eps)
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
        mean = float(self.coef_x0[i]) * x0 + float(self.coef_xt[i]) * x_t
        if i == 0 or noise is None:
            return mean
        return mean + math.sqrt(float(self.posterior_var[i])) * noise


def guided_eps(model: Callable, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor,
               null_label: int, cfg: float) -> torch.Tensor:
    """Classifier-free guidance: one batched call for conditional and null predictions."""
    if cfg == 1.0:
        return model(x, t, labels)
    both = model(torch.cat([x, x]), torch.cat([t, t]),
                 torch.cat([labels, torch.full_like(labels, null_label)]))
    cond, uncond = both.chunk(2)
    return uncond + cfg * (cond - uncond)


@torch.no_grad()
def ancestral_sample(model: Callable, schedule: Schedule, shape: tuple[int, ...],
                     labels: torch.Tensor, null_label: int, cfg: float,
                     generator: torch.Generator, clip: float | None = 1.0,
                     on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """Draw samples from pure noise, walking the schedule from its noisiest level to 0.

    `model(x, t, labels)` is called with training-level timesteps. `on_step(done)` is called
    after every update (progress bars; it may raise to cancel).
    """
    x = torch.randn(shape, generator=generator)
    n = len(schedule.timesteps)
    for done, i in enumerate(reversed(range(n)), start=1):
        t = torch.full((shape[0],), int(schedule.timesteps[i]), dtype=torch.long)
        eps = guided_eps(model, x, t, labels, null_label, cfg).float()
        noise = torch.randn(shape, generator=generator) if i > 0 else None
        x = schedule.step(x, i, eps, noise, clip)
        if on_step is not None:
            on_step(done)
    return x.clamp(-1, 1) if clip is not None else x


def drop_labels(labels: torch.Tensor, null_label: int, p: float,
                generator: torch.Generator) -> torch.Tensor:
    """Replace each label with the learned null label with probability p (teaches CFG)."""
    drop = torch.rand(labels.shape, generator=generator) < p
    return torch.where(drop, torch.full_like(labels, null_label), labels)


class EMA:
    """Exponential moving average of a model's parameters: ema ← d·ema + (1 − d)·param.

    With `warmup`, update k (1-based) uses d_k = min(decay, (1 + k) / (10 + k)): at 0.999 a
    400-step CPU run would otherwise still hold 0.999^400 ≈ 67 % of the random initialisation.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False):
        self.decay = decay
        self.warmup = warmup
        self.params = {name: p.detach().clone() for name, p in model.named_parameters()}

    def decay_at(self, update: int) -> float:
        return min(self.decay, (1 + update) / (10 + update)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, update: int = 1) -> None:
        weight = 1 - self.decay_at(update)
        for name, p in model.named_parameters():
            self.params[name].lerp_(p.detach(), weight)

    def state(self) -> dict[str, torch.Tensor]:
        return self.params

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.params:
            self.params[name].copy_(tensors[name])

    def copy_to(self, model: nn.Module) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.params[name])


def min_snr_weights(schedule: Schedule, t: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-example loss weights min(SNR_t, gamma) / SNR_t of the ε objective (Hang et al. 2023,
    "Efficient Diffusion Training via Min-SNR Weighting Strategy"), SNR_t = ᾱ_t / (1 − ᾱ_t).

    Levels noisier than SNR = gamma keep weight 1; the nearly clean ones, where the ε target
    is mostly the data's own pixel noise and texture, weigh less, so the gradient goes to the
    levels that decide an object's shape."""
    a = schedule.alpha_bar[t]
    snr = a / (1 - a)
    return (snr.clamp(max=gamma) / snr).float()


def denoising_loss(model: Callable, schedule: Schedule, x0: torch.Tensor, labels: torch.Tensor,
                   null_label: int, cond_dropout: float, generator: torch.Generator,
                   autocast=contextlib.nullcontext,
                   min_snr_gamma: float | None = None) -> torch.Tensor:
    """The DDPM training objective: MSE between the drawn noise and its prediction, with a
    timestep per example and labels dropped to the null class at rate `cond_dropout`; with
    `min_snr_gamma`, each example's MSE is weighted by `min_snr_weights`."""
    t = torch.randint(0, schedule.num_steps, (x0.shape[0],), generator=generator)
    noise = torch.randn(x0.shape, generator=generator)
    labels = drop_labels(labels, null_label, cond_dropout, generator)
    x_t = schedule.q_sample(x0, t, noise).float()
    with autocast():
        predicted = model(x_t, t, labels)
    if min_snr_gamma is None:
        return F.mse_loss(predicted.float(), noise)
    per_example = (predicted.float() - noise).pow(2).flatten(1).mean(1)     # [B]
    return (min_snr_weights(schedule, t, min_snr_gamma) * per_example).mean()


@torch.no_grad()
def fixed_noise_loss(model: Callable, schedule: Schedule, x0: torch.Tensor, labels: torch.Tensor,
                     seed: int = 1234, batch: int = 64, autocast=contextlib.nullcontext) -> float:
    """Validation MSE with noise and timesteps fixed by `seed`: comparable across checkpoints."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.randint(0, schedule.num_steps, (x0.shape[0],), generator=generator)
    noise = torch.randn(x0.shape, generator=generator)
    total = 0.0
    for start in range(0, x0.shape[0], batch):
        part = slice(start, start + batch)
        x_t = schedule.q_sample(x0[part], t[part], noise[part]).float()
        with autocast():
            predicted = model(x_t, t[part], labels[part]).float()
        total += float(F.mse_loss(predicted, noise[part], reduction="sum"))
    return total / noise.numel()
