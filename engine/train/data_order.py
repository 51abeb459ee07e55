"""Data order as a pure function of (seed, epoch), and a cursor that resumes mid-epoch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epoch_permutation(seed: int, epoch: int, n: int) -> list[int]:
    """The order of `n` examples in `epoch`: the same on every machine and every resume."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(n).tolist()


@dataclass
class DataCursor:
    """Position in the epoch-by-epoch order; `state()` goes into trainer_state.json."""

    n: int
    seed: int
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError("DataCursor needs at least one example")
        self._order: list[int] | None = None

    def _current_order(self) -> list[int]:
        if self._order is None:
            self._order = epoch_permutation(self.seed, self.epoch, self.n)
        return self._order

    def take(self, count: int) -> list[int]:
        """The next `count` example indices, rolling into the next epoch when one ends."""
        out = []
        while len(out) < count:
            if self.position >= self.n:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            order = self._current_order()
            chunk = order[self.position:self.position + count - len(out)]
            out += chunk
            self.position += len(chunk)
        return out

    def state(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, state: dict) -> "DataCursor":
        return cls(n=state["n"], seed=state["seed"], epoch=state["epoch"],
                   position=state["position"])
