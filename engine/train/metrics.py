"""Per-step measurements (token-weighted loss, throughput, elapsed time, peak memory) and the
one builder of a training row of `metrics.jsonl` (docs/design.md, "The metrics row")."""

from __future__ import annotations

import resource
import sys
import time


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB.

    Linux: VmHWM, the process's own high-water mark. Its ru_maxrss is not: across fork + exec it
    starts at the parent's peak, so a job started from a big process would report that memory.
    Elsewhere ru_maxrss (KB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


class StepClock:
    """Wall time of the run across invocations and supervised tokens/s of the latest step.

    `elapsed_before` carries the elapsed time of earlier invocations (from trainer_state).
    """

    def __init__(self, elapsed_before: float = 0.0):
        self.elapsed_before = elapsed_before
        self.started = time.perf_counter()
        self.last = self.started

    @property
    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def tick(self, tokens: int) -> float:
        """Mark the end of a step that processed `tokens`; return tokens per second."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return tokens / seconds if seconds > 0 else 0.0


class WindowLoss:
    """Loss over one accumulation window, weighted by tokens: sum of CE / supervised tokens.

    Micro-batches with different numbers of supervised tokens count in proportion to their
    tokens (a mean of per-batch means would not).
    """

    def __init__(self) -> None:
        self.sum = 0.0
        self.tokens = 0

    def add(self, loss_sum, tokens: int) -> None:
        """`loss_sum` a float, or a float64 tensor on the training device (summing on the
        device keeps the step free of host syncs until the value is read)."""
        self.sum += loss_sum
        self.tokens += tokens

    @property
    def value(self) -> float:
        return float(self.sum) / self.tokens if self.tokens else float("nan")


def train_row(*, invocation: int, step: int, loss: float, outcome, skipped_total: int, lr: float,
              elapsed_s: float, **throughput: float | int) -> dict:
    """The `metrics.jsonl` row of a logged optimizer step, the same keys for every recipe.

    `outcome` is the step's engine.train.optim.StepOutcome; `throughput` the recipe's own
    figures (`input_tokens`, `supervised_tokens`, `tokens_per_s`; or `examples`,
    `examples_per_s`, `epoch`). The app plots any numeric key, so a new key is additive.
    """
    return {"invocation": invocation, "step": step, "split": "train", "loss": loss,
            "grad_norm": outcome.grad_norm, "clipped": outcome.clipped,
            "skipped": outcome.skipped, "skipped_total": skipped_total, "lr": lr, **throughput,
            "elapsed_s": elapsed_s,
            "process_cpu_s": time.process_time(),   # this invocation's CPU, all threads
            "peak_rss_mb": peak_rss_mb()}
