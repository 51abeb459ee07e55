"""The supervised language-model loss: summed cross-entropy at the supervised positions only.

Used by lm-sft (engine.recipes.lm_sft) and checked by engine.checks.verify_grads. Labels equal
to IGNORE (engine.llm.sft_data.IGNORE_INDEX: prompt tokens, padding) are not supervised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.llm.sft_data import IGNORE_INDEX as IGNORE
from engine.models.lm_head_loss import linear_cross_entropy
from engine.models.packed import PackedWeight


def supervised_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                    lengths: list[int] | None = None) -> torch.Tensor:
    """Summed cross-entropy over the supervised positions of inputs/labels [B, T] (or [T]);
    `lengths` marks [T] as samples packed one after another (what `pack` returns).

    The last MLP and the LM head run only at supervised positions: full [T, vocab] logits are
    never built (Gemma's vocabulary is 262,144). A frozen head goes through the fused loss; a
    trained or soft-capped one through plain logits.
    """
    if inputs.dim() == 1:
        inputs, labels = inputs[None], labels[None]
    inputs, labels, lengths = without_unsupervised_tail(inputs, labels, lengths)
    supervised = labels != IGNORE                          # [B, T]
    hidden = model.hidden(inputs, lengths=lengths, rows=supervised)   # [N, D]
    head = frozen_head(model)
    if head is not None:                                   # one fused pass over the head
        return linear_cross_entropy(hidden, head, labels[supervised])
    logits = model.logits(hidden)                          # [N, vocab]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> f32, f64 kept
    return F.cross_entropy(logits, labels[supervised], reduction="sum")


def without_unsupervised_tail(inputs: torch.Tensor, labels: torch.Tensor,
                              lengths: list[int] | None
                              ) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """inputs/labels [B, T] (and packed `lengths`) without the positions after each sequence's
    last supervised one: the same loss and gradients, for less work.

    Why it is exact: the decoders attend causally, so a position's hidden state reaches only
    its own label and those of later positions in its sequence; after the last supervised
    position nothing it computes reaches the loss. A chat template's closing tokens end each
    sample that way (gemma's "<end_of_turn>" then "\n": one position in 28-32 of the pirate
    pairs). Packed, each sequence is cut at its own last supervised position (one with none is
    left out); a batch [B, T] loses the columns after the last supervised one of every row.
    With nothing supervised at all, everything is kept as it was."""
    rows = labels.tolist()
    if lengths is None:
        last = max((max((t for t, label in enumerate(row) if label != IGNORE), default=-1)
                    for row in rows), default=-1)
        if last < 0 or last + 1 == labels.shape[1]:
            return inputs, labels, None
        return inputs[:, :last + 1], labels[:, :last + 1], None
    kept, start, positions = [], 0, []
    for n in lengths:
        last = max((t for t in range(n) if rows[0][start + t] != IGNORE), default=-1)
        if last >= 0:
            kept.append(last + 1)
            positions.append(torch.arange(start, start + last + 1))
        start += n
    if not kept or kept == lengths:
        return inputs, labels, lengths
    index = torch.cat(positions)
    return inputs[:, index], labels[:, index], kept


def frozen_head(model: nn.Module):
    """The LM head's weight [vocab, D] when logits are a plain product with a frozen matrix
    (no bias, no softcap, f32 numerics): what the fused loss can take; else None."""
    if getattr(model.config, "final_softcap", None):
        return None
    head = getattr(model, "output", None) or getattr(model, "tok_embeddings", None)
    if (head is None or getattr(head, "bias", None) is not None
            or getattr(head, "numerics", "f32") != "f32"):
        return None
    weight = head.weight
    if isinstance(weight, PackedWeight) or not weight.requires_grad:
        return weight
    return None


def one_thread_glue_serves(model: nn.Module) -> bool:
    """A training step on `model` may run its glue on one thread (packed.one_thread_glue): on
    the CPU, every large product takes the step's threads back itself, its layers frozen packed
    ones (FrozenQuantLinear, bare or under a LoRA, whose rank-wide products are small) and its
    loss the fused pass over a frozen head. A plain nn.Linear or nn.Embedding (a dense model, a
    trained head) would multiply on one thread, and so would llama.cpp numerics' products: not
    served."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    return (device.type == "cpu" and frozen_head(model) is not None
            and not any(isinstance(m, (nn.Linear, nn.Embedding))
                        or getattr(m, "numerics", "f32") != "f32" for m in model.modules()))


class SupervisedLoss(nn.Module):
    """`supervised_loss` of `model` as a module's forward: what DDP and FSDP2 wrap (both hook a
    module's forward, and the loss reaches the model through `hidden`, not `forward`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor,
                lengths: list[int] | None = None) -> torch.Tensor:
        return supervised_loss(self.model, inputs, labels, lengths)
