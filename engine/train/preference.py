"""The preference (DPO) loss: sequence log-probabilities of responses and the DPO objective.

A sequence's log-probability is the sum of log p(token) over its supervised positions only:
the response and the template's end-of-turn marker, never the prompt (labels equal to IGNORE
are masked, as in `engine.train.loss`). With y+ the chosen and y- the rejected response,

    z = β [(log π(y+|x) − log π_ref(y+|x)) − (log π(y−|x) − log π_ref(y−|x))]

and the variants (`LOSSES`):

- "sigmoid" (DPO, Rafailov et al. 2023): −(1−ε) log σ(z) − ε log σ(−z), with ε the label
  smoothing (the conservative cDPO form, for raters who are sometimes wrong; ε = 0 is DPO);
- "ipo" (Azar et al. 2023): (z/β − 1/(2β))², a squared loss that does not push the margin to
  infinity on deterministic preferences; its log-ratios are per token (lengths divided out),
  as TRL computes them.

`length_normalized` divides each side's log-ratio by its response's token count first (TRL's
"sigmoid_norm": a long answer no longer wins for being long). The rewards β(log π − log π_ref)
of the chosen and rejected responses (summed, whatever the variant, as TRL logs them), their
difference (the reward margin) and the share of pairs with a positive margin (preference
accuracy) are what a run logs per step.

Collapse (`collapse`): DPO on a handful of pairs can drive the loss to 0 within a step or two by
pushing the two answers' log-probs apart without bound, and the chosen answer's own probability
often falls with the rejected one (4 pairs: loss 0 at step 2, margin 27, a worse answer). A
step is collapsed when, over its window,

- the mean reward margin exceeds `max_margin` (the margin running away: the pairs are
  memorised, nothing more is learned from them), or
- the mean chosen log-prob lies more than `max_chosen_drop` nats below the reference's (the
  chosen answers themselves became less likely: the policy is moving away from the data).

lm-dpo checks every step and, by default, stops the run there (its config's `guard` section).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.lm_head_loss import linear_cross_entropy
from engine.train.loss import IGNORE, frozen_head

LOSSES = ("sigmoid", "ipo")


def sequence_logps(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                   lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each packed sample's supervised tokens [K], their counts [K])
    for samples packed one after another in inputs/labels [T] (`lm_base.pack`).

    Like `supervised_loss`, the last MLP and the head run only at supervised positions and a
    frozen head goes through the fused pass (per row), so no [T, vocab] logits are built.
    """
    supervised = labels != IGNORE                                          # [T]
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    owner = owner[supervised]                                              # [N] sample of row
    hidden = model.hidden(inputs[None], lengths=lengths, rows=supervised[None])   # [N, D]
    targets = labels[supervised]
    head = frozen_head(model)
    if head is not None:
        token_ce = linear_cross_entropy(hidden, head, targets, per_row=True)
    else:
        logits = model.logits(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        token_ce = F.cross_entropy(logits, targets, reduction="none")
    logps = torch.zeros(len(lengths), dtype=token_ce.dtype).index_add(0, owner, -token_ce)
    counts = torch.bincount(owner, minlength=len(lengths))
    return logps, counts


@dataclass(frozen=True)
class PreferenceLoss:
    """The loss settings of a run (the `dpo` section of an lm-dpo config)."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    length_normalized: bool = False

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}")


@dataclass
class PreferenceTerms:
    """Per pair [K]: the losses and the implicit rewards of each side."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards


def preference_loss(settings: PreferenceLoss, chosen: torch.Tensor, rejected: torch.Tensor,
                    ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                    chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor) -> PreferenceTerms:
    """The per-pair loss and rewards from summed sequence log-probs (policy and reference) and
    the responses' token counts (which IPO and the length-normalised variant divide out)."""
    chosen_ratio = chosen - ref_chosen
    rejected_ratio = rejected - ref_rejected
    if settings.length_normalized or settings.loss == "ipo":
        delta = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens
    else:
        delta = chosen_ratio - rejected_ratio
    beta = settings.beta
    if settings.loss == "sigmoid":
        eps = settings.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    else:
        losses = (delta - 1 / (2 * beta)) ** 2
    return PreferenceTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


@dataclass(frozen=True)
class Collapse:
    """Why a step counts as collapsed (see the module docstring)."""

    rule: str            # "margin" or "chosen_drop"
    value: float
    limit: float

    @property
    def message(self) -> str:
        if self.rule == "margin":
            return (f"the mean reward margin {self.value:.3g} exceeds {self.limit:g}: the pairs "
                    "are memorised (the margin is running away)")
        return (f"the chosen answers' mean log-prob fell {self.value:.3g} nats below the "
                f"reference's (limit {self.limit:g}): the policy is moving away from them")


def collapse(row: dict, beta: float, max_margin: float, max_chosen_drop: float) -> Collapse | None:
    """The collapse of a step from its logged means (`reward_margin`, `chosen_reward` =
    β·(log π − log π_ref) of the chosen answers), or None for a healthy step."""
    if row["reward_margin"] > max_margin:
        return Collapse("margin", row["reward_margin"], max_margin)
    drop = -row["chosen_reward"] / beta
    if drop > max_chosen_drop:
        return Collapse("chosen_drop", drop, max_chosen_drop)
    return None
