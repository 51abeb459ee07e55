"""Evolution strategies over a list of float tensors, in place, with no optimizer state.

One iteration t over parameters θ (seed 000 §15.8; the OpenAI-ES estimator):

    noise    ε_j ~ N(0, I), j = 0 .. pairs-1, regenerated from (seed, t, j), never stored
    members  antithetic: member 2j is θ + σ·ε_j, member 2j+1 is θ − σ·ε_j
             (plain: member j is θ + σ·ε_j)
    shaping  centered ranks: the rewards' ranks 0..n-1 mapped to rank/(n−1) − ½, so the
             update sees the order of the rewards and never their scale (an outlier reward
             weighs no more than any other); or "none" (the raw rewards)
    update   g = 1/(n·σ) · Σ_i u_i · s_i·ε_{j(i)}          s_i = ±1, the member's sign
             θ ← θ + lr·g − lr·λ·D(θ − θ₀)                  D = sign (l1) or identity (l2)

θ₀ is the anchor: the weights the run *started* from, captured when the strategy is built. On
resume the caller builds the strategy over the freshly initialised weights first and then
loads the checkpoint into it (`load`); capturing after the load would anchor the decay to the
resumed weights and pull a resumed run somewhere the uninterrupted run never went.

Members are evaluated in place on one model: `perturb(i)` adds member i's noise, the caller
scores, `restore()` copies the centre back bit for bit (the centre is one saved copy, never
a population of replicas). Everything is in float32 and the same on every resume: the noise is
a pure function of (seed, iteration, pair), so (seed, iteration) is the whole optimizer state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from engine.errors import ForgebenchError
from engine.lora import derive_seed

Shaping = Literal["centered_ranks", "none"]
AnchorDecay = Literal["none", "l1", "l2"]


def centered_ranks(rewards: Sequence[float]) -> list[float]:
    """Rank of each reward (0 = lowest) mapped linearly onto [−½, ½]; ties are broken by the
    member index, so the result is a permutation of the same n values whatever the rewards.
    One member has weight 0."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    order = sorted(range(n), key=lambda i: (rewards[i], i))
    shaped = [0.0] * n
    for rank, member in enumerate(order):
        shaped[member] = rank / (n - 1) - 0.5
    return shaped


@dataclass(frozen=True)
class StepReport:
    """What one update did: the rewards' spread and the sizes of the estimate and the step."""

    reward_mean: float
    reward_max: float
    reward_min: float
    reward_std: float
    grad_norm: float              # ‖g‖: the ES estimate of the reward's gradient
    update_norm: float            # ‖θ_new − θ_old‖, decay included
    finite: bool                  # False: a reward was not finite and no update was made


class EvolutionStrategy:
    """Antithetic ES over `params` (tensors updated in place; no autograd)."""

    def __init__(self, params: Sequence[torch.Tensor], *, seed: int, population: int,
                 sigma: float, lr: float, antithetic: bool = True,
                 shaping: Shaping = "centered_ranks", anchor_decay: AnchorDecay = "none",
                 decay: float = 0.0):
        if population < 2:
            raise ForgebenchError(f"population {population} is too small: ES needs at least "
                                  "two members", where="field 'es.population'")
        if antithetic and population % 2:
            raise ForgebenchError(f"population {population} is odd; antithetic sampling pairs "
                                  "every +ε member with its −ε twin", where="field 'es.population'",
                                  hint="use an even population, or antithetic = false")
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ForgebenchError(f"sigma must be a positive noise scale, not {sigma}",
                                  where="field 'es.sigma'")
        self.params = [p for p in params]
        self.seed, self.population, self.sigma, self.lr = seed, population, sigma, lr
        self.antithetic, self.shaping = antithetic, shaping
        self.anchor_decay, self.decay = anchor_decay, decay
        with torch.no_grad():
            self.centre = [p.detach().clone() for p in self.params]
            # the starting weights: taken now, before any checkpoint is loaded (module doc)
            self.anchor = ([p.detach().clone() for p in self.params]
                           if anchor_decay != "none" and decay > 0 else None)

    # -- noise ------------------------------------------------------------------------------
    @property
    def pairs(self) -> int:
        """Distinct noise draws per iteration."""
        return self.population // 2 if self.antithetic else self.population

    def member_noise(self, member: int) -> tuple[int, float]:
        """(noise index j, sign) of a member."""
        if self.antithetic:
            return member // 2, (1.0 if member % 2 == 0 else -1.0)
        return member, 1.0

    def noise(self, iteration: int, j: int) -> list[torch.Tensor]:
        """ε_j of an iteration, one tensor per parameter, regenerated from (seed, t, j)."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "es", iteration, j))
        return [torch.randn(p.shape, generator=generator, dtype=torch.float32)
                for p in self.params]

    # -- evaluation in place --------------------------------------------------------------
    @torch.no_grad()
    def perturb(self, iteration: int, member: int) -> None:
        """Set the parameters to member `member`'s point θ + s·σ·ε_j."""
        j, sign = self.member_noise(member)
        for p, centre, eps in zip(self.params, self.centre, self.noise(iteration, j)):
            p.copy_(centre + (sign * self.sigma) * eps.to(p.dtype))

    @torch.no_grad()
    def restore(self) -> None:
        """Back to the centre, bit for bit."""
        for p, centre in zip(self.params, self.centre):
            p.copy_(centre)

    # -- the update -------------------------------------------------------------------------
    def shaped(self, rewards: Sequence[float]) -> list[float]:
        return centered_ranks(rewards) if self.shaping == "centered_ranks" else list(rewards)

    @torch.no_grad()
    def estimate(self, iteration: int, rewards: Sequence[float]) -> list[torch.Tensor]:
        """g = 1/(n·σ) Σ_i u_i s_i ε_{j(i)}, noise regenerated pair by pair."""
        if len(rewards) != self.population:
            raise ValueError(f"{len(rewards)} rewards for a population of {self.population}")
        weights = self.shaped(rewards)
        coefficient = [0.0] * self.pairs                      # Σ over the members sharing ε_j
        for member, weight in enumerate(weights):
            j, sign = self.member_noise(member)
            coefficient[j] += sign * weight
        grad = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]
        scale = 1.0 / (self.population * self.sigma)
        for j, c in enumerate(coefficient):
            if c == 0.0:
                continue
            for g, eps in zip(grad, self.noise(iteration, j)):
                g.add_(eps, alpha=c * scale)
        return grad

    @torch.no_grad()
    def step(self, iteration: int, rewards: Sequence[float]) -> StepReport:
        """Apply iteration `iteration`'s update from its members' rewards (the parameters must
        be at the centre); a non-finite reward skips the update."""
        values = [float(r) for r in rewards]
        finite = all(math.isfinite(r) for r in values)
        mean = sum(values) / len(values)
        std = math.sqrt(sum((r - mean) ** 2 for r in values) / len(values)) if finite \
            else math.nan
        spread = dict(reward_mean=mean, reward_max=max(values), reward_min=min(values),
                      reward_std=std)
        if not finite:
            self.restore()
            return StepReport(**spread, grad_norm=math.nan, update_norm=0.0, finite=False)
        grad = self.estimate(iteration, values)
        grad_sq, update_sq = 0.0, 0.0
        for index, (p, centre, g) in enumerate(zip(self.params, self.centre, grad)):
            new = centre + self.lr * g.to(centre.dtype)
            if self.anchor is not None:
                offset = centre - self.anchor[index]
                pull = offset.sign() if self.anchor_decay == "l1" else offset
                new -= (self.lr * self.decay) * pull
            grad_sq += float(g.double().square().sum())
            update_sq += float((new - centre).double().square().sum())
            centre.copy_(new)
            p.copy_(new)
        return StepReport(**spread, grad_norm=math.sqrt(grad_sq),
                          update_norm=math.sqrt(update_sq), finite=True)

    @torch.no_grad()
    def load(self, tensors: Sequence[torch.Tensor]) -> None:
        """Resume: set the parameters (and the centre) to saved values; the anchor stays the
        starting weights captured at construction."""
        for p, centre, saved in zip(self.params, self.centre, tensors, strict=True):
            centre.copy_(saved)
            p.copy_(saved)
