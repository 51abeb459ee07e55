"""The option-pointer head of a decision model (handbook chapter 24, "level C"), and the decoder
hidden states it reads.

A record is one causal sequence: request, question, each option ending at a known token, then a
readout token. The decoder's final-normed hidden state at each option's end can read that
option (and earlier ones); the readout's can read all of them. Two learned projections put them
in a common width P:

    q      = decision(h_readout)            [B, P]
    keys   = option(H_options)              [B, K, P]
    logits = keys @ q / sqrt(P)             [B, K]    (padded options: -inf, probability 0)

so the output indexes the options the record supplies: K may change from record to record, and
application code maps index i back to option i's id. For D = 1024 and P = 256 that is
2 * (1024 * 256 + 256) = 524,800 new parameters.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class OptionPointer(nn.Module):
    def __init__(self, dim: int, width: int = 256):
        super().__init__()
        self.width = width
        self.decision = nn.Linear(dim, width)
        self.option = nn.Linear(dim, width)

    def forward(self, readout: torch.Tensor, options: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """readout [B, D], options [B, K, D], mask [B, K] (True = a real option) -> [B, K]."""
        q = self.decision(readout)                                   # [B, P]
        keys = self.option(options)                                  # [B, K, P]
        logits = torch.einsum("bkp,bp->bk", keys, q) / math.sqrt(self.width)
        return logits.masked_fill(~mask, float("-inf"))


@torch.no_grad()
def gather_hidden(model: nn.Module, sequences: list[list[int]],
                  positions: list[list[int]]) -> list[torch.Tensor]:
    """The decoder's final-normed hidden states at `positions[i]` (strictly increasing) of
    `sequences[i]`, one [len(positions[i]), D] tensor per sequence. The sequences go through one
    packed forward (each attends only within itself, at positions 0...), and only the gathered
    rows pass the last MLP and the norm."""
    lengths = [len(s) for s in sequences]
    tokens = torch.tensor([[t for s in sequences for t in s]], dtype=torch.long)
    rows = torch.zeros(1, tokens.shape[1], dtype=torch.bool)
    offset = 0
    for length, wanted in zip(lengths, positions):
        if not wanted or any(b <= a for a, b in zip(wanted, wanted[1:])) \
                or not 0 <= wanted[0] <= wanted[-1] < length:
            raise ValueError(f"positions {wanted} are not increasing inside {length} tokens")
        rows[0, [offset + p for p in wanted]] = True
        offset += length
    hidden = model.hidden(tokens, lengths=lengths, rows=rows)     # [sum of wanted, D], in order
    return list(torch.split(hidden, [len(w) for w in positions]))
