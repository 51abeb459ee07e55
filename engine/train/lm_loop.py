"""The step loop every training recipe runs: schedule, stop checks, accumulation window,
clip-and-step, metrics row, progress, evaluation and checkpoint cadence, and loop state.

A recipe keeps what is its own (data, model, what one step computes, what a checkpoint holds)
and hands the loop:

- a step function `step(step, lr) -> StepResult`: the step's work, ending in an optimizer step
  (`gradient_step` builds one from a micro-step `batch -> (loss_sum, tokens)`, see below) or
  any other update (lm-es: evolution strategies, no gradient);
- `save() -> Checkpoint` (what a checkpoint holds, with `LoopState.trainer_state` in it) and,
  optionally, `evaluate()` (a val row; may set `state.best`) and `after_step()`.

The loop owns, per step: the learning rate (`scheduled_lr`, set on the optimizer; or a fixed
one), the step count and skipped-step total, the metrics row (`train_row`, with the step's
throughput and, when asked, its utilisation), the progress bar, `job.step_done` (status and the
stop flag), evaluation every `eval_every` steps and at the end, and the checkpoint cadence
(`checkpoint_due`). `LoopState` is where a loop stands (data cursor, step, skipped steps,
training seconds, best) and what `trainer_state.json` records of it, so resume is exact.

The accumulation window (`gradient_step`): every micro-batch's summed loss is divided by one
divisor for the whole window (the window's supervised tokens over every rank, or its pairs)
before backward, so the gradient is token-weighted whatever the micro-batching; under DDP only
the last micro-batch all-reduces (`distributed.accumulating`), the window's loss is reduced over
the ranks, and one clipped optimizer step follows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from engine.models.packed import one_thread_glue
from engine.rundir import Checkpoint
from engine.train import distributed
from engine.train.checkpoint import checkpoint_due, loop_state, resume_loop
from engine.train.data_order import DataCursor
from engine.train.metrics import StepClock, StepUtilisation, WindowLoss, train_row
from engine.train.optim import StepOutcome, clip_and_step, scheduled_lr, set_lr


@dataclass
class LoopState:
    """Where a training loop stands; `trainer_state` is what a checkpoint records of it."""

    cursor: DataCursor
    step: int = 0
    skipped_total: int = 0
    elapsed_before: float = 0.0
    best: dict | None = None
    clock: StepClock | None = None      # set when the loop starts

    @classmethod
    def fresh(cls, n_items: int, seed: int) -> "LoopState":
        return cls(DataCursor(n_items, seed))

    def resume(self, trainer_state: dict) -> None:
        """Restore the RNGs and the loop's position from a checkpoint's trainer_state."""
        self.cursor, self.step, self.skipped_total, self.elapsed_before = \
            resume_loop(trainer_state)
        self.best = trainer_state.get("best", self.best)

    @property
    def elapsed(self) -> float:
        return self.clock.elapsed if self.clock is not None else self.elapsed_before

    def trainer_state(self, **extra: Any) -> dict:
        """loop_state (cursor, RNGs, skipped steps, training time) and the recipe's `extra`."""
        return {**loop_state(self.cursor, self.skipped_total, self.elapsed), **extra}


@dataclass
class StepResult:
    """What one step did. The row is `train_row(loss, outcome, ...)` with, in this order,
    `fields`, the throughput `rate_key` (`work` per second), `more`, and the utilisation of
    `flops_work` units when the loop measures it."""

    loss: float
    outcome: StepOutcome
    work: int
    fields: dict = field(default_factory=dict)
    more: dict = field(default_factory=dict)
    rate_key: str = "tokens_per_s"
    flops_work: int | None = None
    postfix: dict = field(default_factory=dict)


@dataclass
class StepLoop:
    """The loop of one job (see the module docstring). `optim` and `optimizer` set a scheduled
    learning rate (`warmup` overrides the section's); without them the row logs `fixed_lr`.
    `utilisation` measures FLOPs and MFU in the run's `precision`. With `eval_at_end` False the
    last step is not evaluated (the recipe does it with its final report); with
    `save_on_eval` False an evaluation does not force a checkpoint."""

    job: Any
    state: LoopState
    save: Callable[[], Checkpoint]
    evaluate: Callable[[], None] | None = None
    optim: Any = None
    optimizer: torch.optim.Optimizer | None = None
    warmup: int | None = None
    fixed_lr: float | None = None
    precision: str | None = None
    eval_at_end: bool = True
    save_on_eval: bool = True
    last: Checkpoint | None = None

    def __post_init__(self) -> None:
        # the peak FLOP/s is measured (once per machine) before the clock starts
        self.utilisation = (StepUtilisation(self.precision, self.job.threads)
                            if self.precision is not None else None)
        self.state.clock = StepClock(self.state.elapsed_before)

    def checkpoint(self) -> Checkpoint:
        self.job.stage = "save"
        self.last = self.save()
        return self.last

    def validate(self) -> None:
        if self.evaluate is not None and self.job.world.is_main:
            self.job.stage = "eval"
            self.evaluate()

    def lr_at(self, step: int) -> float:
        if self.optimizer is None:
            return self.fixed_lr
        lr = scheduled_lr(self.optim, step, self.job.config.steps, self.warmup)
        set_lr(self.optimizer, lr)
        return lr

    def run(self, step_fn: Callable[[int, float], StepResult]) -> LoopState:
        """Train from `state.step` to the config's steps or a stop; returns the state."""
        job, state, config = self.job, self.state, self.job.config
        utilisation, clock = self.utilisation, self.state.clock
        bar = job.progress(config.steps, initial=state.step)
        while state.step < config.steps and not job.stop_requested:
            lr = self.lr_at(state.step)
            if utilisation is not None:
                utilisation.begin()
            result = step_fn(state.step, lr)
            state.skipped_total += result.outcome.skipped
            state.step += 1
            rate = clock.tick(result.work)
            flops = (utilisation.step(result.flops_work, clock.seconds)
                     if utilisation is not None else None)
            if state.step % config.log_every == 0 or state.step == config.steps:
                job.run.log_metric(train_row(
                    invocation=job.invocation, step=state.step, loss=result.loss,
                    outcome=result.outcome, skipped_total=state.skipped_total, lr=lr,
                    elapsed_s=clock.elapsed, utilisation=flops, **result.fields,
                    **{result.rate_key: rate}, **result.more,
                    **distributed.rank_throughput(rate, job.world)))
            bar.update(1)
            bar.set_postfix(**result.postfix)
            job.step_done(state.step)
            self.after_step()
        bar.close()
        return state

    def after_step(self) -> None:
        """Evaluate and checkpoint when due after the step just taken."""
        step, config = self.state.step, self.job.config
        at_end = step == config.steps
        eval_due = (self.evaluate is not None and bool(config.eval_every)
                    and step % config.eval_every == 0)
        if (eval_due and not at_end) or (at_end and self.eval_at_end):
            self.validate()
        if checkpoint_due(config, step, self.job.stop_requested,
                          eval_due and self.save_on_eval):
            self.checkpoint()

    def finished(self) -> bool:
        """The run reached its last step in this invocation, not stopped: what writes the
        AFTER samples and reports."""
        return self.state.step == self.job.config.steps and not self.job.stop_requested


def accumulate(job, batches: Sequence, micro_step: Callable[[int, Any], tuple], divisor,
               trained: torch.nn.Module | None = None,
               glue_on_one_thread: bool = False) -> WindowLoss:
    """One accumulation window: for each micro-batch `micro_step(micro, batch) -> (loss_sum,
    tokens)` (forward under the recipe's autocast), then `(loss_sum / divisor).backward()`;
    under DDP only the last micro-batch all-reduces its gradients. Returns the window's loss
    over every rank (summed loss / tokens). `glue_on_one_thread`: forward and backward under
    packed.one_thread_glue (for a model engine.train.loss.one_thread_glue_serves)."""
    window = WindowLoss()
    for micro, batch in enumerate(batches):
        job.stage = "forward"
        last = micro == len(batches) - 1
        with distributed.accumulating(trained, last=last) if trained is not None \
                else contextlib.nullcontext(), one_thread_glue(glue_on_one_thread):
            loss_sum, tokens = micro_step(micro, batch)
            job.stage = "backward"
            (loss_sum / divisor).backward()
        window.add(loss_sum.detach().double(), tokens)   # no host sync here
    return distributed.reduce_window(window, job.world, job.device)


def optimizer_step(job, params: Iterable[torch.nn.Parameter], optimizer, grad_clip: float,
                   loss: float) -> StepOutcome:
    """Clip the gradients and step (or skip / stop on a non-finite loss or gradient, as the
    config's `nonfinite` says)."""
    job.stage = "optimizer"
    return clip_and_step(params, optimizer, grad_clip, job.config.nonfinite, loss=loss)
