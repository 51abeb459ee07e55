"""The shared step loop of the image and audio recipes (resume, clip, log, evaluate, keep
the best, checkpoint) and the class-list contract between a checkpoint and its data.

The loop is a function, not a trainer class: a recipe hands it a `batch_loss(indices)` and a
`validate()` and reads top to bottom around it. Metrics rows follow engine.train.metrics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from engine.diffusion import EMA
from engine.errors import ForgebenchError
from engine.fsutil import read_json
from engine.jobs import Job
from engine.rundir import Checkpoint, checkpoint_name
from engine.train.checkpoint import (
    checkpoint_due,
    dumps,
    generator_state,
    load_checkpoint,
    loop_state,
    resume_loop,
    save_checkpoint,
    set_generator_state,
)
from engine.train.data_order import DataCursor
from engine.train.metrics import StepClock, StepUtilisation, train_row
from engine.train.optim import clip_and_step, scheduled_lr, set_lr
from engine.train.precision import (
    measure_step_precision,
    pinned_auto,
    requested_precision,
    run_precision,
    step_cache_key,
)

META_FILE = "meta.json"
EMA_PREFIX = "ema."


def record_eval(run, checkpoint: Checkpoint, split: str, report: dict,
                metric_keys: tuple[str, ...]) -> dict:
    """Write `evals/<split>-<checkpoint>.json` and one eval metric line with the headline keys."""
    run.write_eval(f"{split}-{checkpoint.name}", report)
    run.log_metric({"split": split, "step": checkpoint.step, "checkpoint": checkpoint.name,
                    **{key: report[key] for key in metric_keys}, "source": "forgebench eval"})
    return report


# -- checkpoints and the class contract ---------------------------------------------------
def checkpoint_meta(checkpoint: Checkpoint) -> dict:
    return read_json(checkpoint.path / META_FILE)


def require_same_classes(checkpoint: Checkpoint, classes: list[str]) -> dict:
    """The checkpoint's meta.json; refuses data whose class list differs from the trained one
    (a changed order silently relabels every output)."""
    meta = checkpoint_meta(checkpoint)
    if meta["classes"] != list(classes):
        raise ForgebenchError(
            f"the class list changed against this checkpoint: trained on {meta['classes']}, "
            f"the data now has {list(classes)}", path=checkpoint.path / META_FILE,
            where="field 'classes'",
            hint="use the dataset the run was trained on, or start a new run")
    return meta


def load_weights(checkpoint: Checkpoint, model: torch.nn.Module, use_ema: bool = False) -> None:
    """Load a checkpoint's weights (or its EMA copy) into `model` and switch it to eval mode."""
    tensors, _, _ = load_checkpoint(checkpoint)
    prefix = EMA_PREFIX if use_ema else ""
    missing = [name for name in model.state_dict() if prefix + name not in tensors]
    if missing:
        raise ForgebenchError(f"checkpoint lacks tensors {missing[:3]}", path=checkpoint.path,
                              hint="the checkpoint belongs to another recipe or model size")
    model.load_state_dict({name: tensors[prefix + name] for name in model.state_dict()})
    model.eval()


# -- the step loop ------------------------------------------------------------------------
@dataclass
class Loop:
    """What the shared loop needs from a recipe.

    `batch_loss(indices, generator)` returns the mean loss of those training examples (with
    the forward pass under autocast); `validate()` returns a dict with at least "loss" (the
    model is in eval mode and gradients are off). With `select_best`, the best val
    `best_key` (lowest, or highest with `higher_is_better`) is recorded as the run's best
    checkpoint and protected from retention. `eval_at_start` scores and checkpoints the
    untrained model as step 0 of a fresh run, so it competes for "best" like any other.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    n_train: int
    batch_loss: Callable[[list[int], torch.Generator], torch.Tensor]
    validate: Callable[[], dict]
    meta: dict
    select_best: bool = True
    ema: EMA | None = None
    on_checkpoint: Callable[[Checkpoint], None] | None = None
    best_key: str = "loss"
    higher_is_better: bool = False
    eval_at_start: bool = False

    def improves(self, result: dict, best: dict | None) -> bool:
        if best is None:
            return True
        new, old = result[self.best_key], best[self.best_key]
        return new > old if self.higher_is_better else new < old


def train_loop(job: Job, loop: Loop) -> None:
    """Train in the run's precision: "auto" is settled on a fresh run by timing its own first
    batch in both (engine.train.precision.measure_step_precision, on one CPU process), and
    every autocast("auto") of the recipe then computes as run.json records."""
    on_one_cpu = not job.world.distributed and getattr(job.device, "type", "cpu") == "cpu"
    if job.resume_from is None and on_one_cpu:
        first = DataCursor(loop.n_train, job.config.seed).take(job.config.batch_size)

        def trial(precision: str) -> None:
            with pinned_auto(precision):
                generator = torch.Generator().manual_seed(job.config.seed)
                loss = loop.batch_loss(first, generator)
                loss.backward()
            clip_and_step(loop.model.parameters(), loop.optimizer, job.config.optim.grad_clip,
                          job.config.nonfinite, loss=float(loss.detach()))

        key = step_cache_key(job.config.recipe, loop.model, job.config.batch_size, job.threads)
        measure_step_precision(job.run, requested_precision(job.config), loop.model, trial,
                               loop.optimizer, key)
    with pinned_auto(run_precision(job.run, job.config)):
        _train_steps(job, loop)


def _train_steps(job: Job, loop: Loop) -> None:
    config, run = job.config, job.run
    opt = config.optim
    generator = torch.Generator().manual_seed(config.seed)
    cursor = DataCursor(loop.n_train, config.seed)
    step, skipped_total, elapsed_before, best = 0, 0, 0.0, None
    if job.resume_from:
        require_same_classes(job.resume_from, loop.meta["classes"])
        tensors, optimizer_state, state = load_checkpoint(job.resume_from)
        loop.model.load_state_dict({k: v for k, v in tensors.items()
                                    if not k.startswith(EMA_PREFIX)})
        if loop.ema is not None:
            loop.ema.load({k[len(EMA_PREFIX):]: v for k, v in tensors.items()
                           if k.startswith(EMA_PREFIX)})
        loop.optimizer.load_state_dict(optimizer_state)
        cursor, step, skipped_total, elapsed_before = resume_loop(state)
        set_generator_state(generator, state["generator"])
        best = state["best"]

    def checkpoint_now() -> Checkpoint:
        job.stage = "save"
        tensors = dict(loop.model.state_dict())
        if loop.ema is not None:
            tensors.update({EMA_PREFIX + k: v for k, v in loop.ema.state().items()})
        state = {**loop_state(cursor, skipped_total, clock.elapsed),
                 "generator": generator_state(generator), "best": best,
                 "invocation": job.invocation}
        saved = save_checkpoint(run, step, model_tensors=tensors, optimizer=loop.optimizer,
                                trainer_state=state, extra_files={META_FILE: dumps(loop.meta)},
                                keep_last=config.keep_last,
                                protect=(best["checkpoint"],) if best else ())
        if loop.on_checkpoint is not None:
            job.stage = "sample"
            loop.on_checkpoint(saved)
        return saved

    def evaluate_val() -> None:
        nonlocal best
        job.stage = "eval"
        loop.model.eval()
        with torch.no_grad():
            result = loop.validate()
        loop.model.train()
        run.log_metric({"invocation": job.invocation, "step": step, "split": "val",
                        "elapsed_s": clock.elapsed, **result})
        if loop.select_best and loop.improves(result, best):
            best = {"checkpoint": checkpoint_name(step), "step": step, **result}
            run.set_status("running", best_checkpoint=best["checkpoint"])

    utilisation = StepUtilisation(run_precision(run, config), job.threads)
    clock = StepClock(elapsed_before)
    loop.model.train()
    if loop.eval_at_start and job.resume_from is None:
        evaluate_val()
        checkpoint_now()
    bar = job.progress(config.steps, initial=step)
    while step < config.steps and not job.stop_requested:
        lr = scheduled_lr(opt, step, config.steps)
        set_lr(loop.optimizer, lr)
        job.stage = "forward"
        indices = cursor.take(config.batch_size)
        utilisation.begin()
        loss = loop.batch_loss(indices, generator)
        job.stage = "backward"
        loss.backward()
        job.stage = "optimizer"
        value = float(loss.detach())
        outcome = clip_and_step(loop.model.parameters(), loop.optimizer, opt.grad_clip,
                                config.nonfinite, loss=value)
        skipped_total += outcome.skipped
        step += 1
        if loop.ema is not None and not outcome.skipped:
            loop.ema.update(loop.model, step)
        examples_per_s = clock.tick(len(indices))
        flops = utilisation.step(len(indices), clock.seconds)
        if step % config.log_every == 0 or step == config.steps:
            run.log_metric(train_row(
                invocation=job.invocation, step=step, loss=value, outcome=outcome,
                skipped_total=skipped_total, lr=lr, elapsed_s=clock.elapsed,
                examples=len(indices), examples_per_s=examples_per_s, epoch=cursor.epoch,
                utilisation=flops))
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}")
        job.step_done(step)
        eval_due = bool(config.eval_every) and step % config.eval_every == 0
        if eval_due or step == config.steps:
            evaluate_val()
        if checkpoint_due(config, step, job.stop_requested, eval_due):
            checkpoint_now()
    bar.close()


def meta_for(config, classes: list[str], **model: object) -> dict:
    """What a checkpoint must carry to be used on its own: classes, preprocessing, model."""
    section = getattr(config, "image", None) or getattr(config, "audio", None)
    return {"recipe": config.recipe, "classes": list(classes),
            "preprocessing": section.model_dump() if section is not None else None,
            "model": json.loads(json.dumps(model, default=list))}
