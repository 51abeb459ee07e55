"""The step loop of the image and audio recipes (resume, the EMA, evaluate, keep the best,
checkpoint) and the class-list contract between a checkpoint and its data.

`train_loop` is a function, not a trainer class: a recipe hands it a `batch_loss(indices)` and a
`validate()` and reads top to bottom around it. The schedule, clip-and-step, metrics row,
progress and cadence are engine/train/lm_loop.py's, as for the language-model recipes.
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
    dumps,
    generator_state,
    load_checkpoint,
    save_checkpoint,
    set_generator_state,
)
from engine.train.data_order import DataCursor
from engine.train.lm_loop import LoopState, StepLoop, StepResult, optimizer_step
from engine.train.optim import clip_and_step
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
    generator = torch.Generator().manual_seed(config.seed)
    state = LoopState.fresh(loop.n_train, config.seed)
    if job.resume_from:
        require_same_classes(job.resume_from, loop.meta["classes"])
        tensors, optimizer_state, trainer_state = load_checkpoint(job.resume_from)
        loop.model.load_state_dict({k: v for k, v in tensors.items()
                                    if not k.startswith(EMA_PREFIX)})
        if loop.ema is not None:
            loop.ema.load({k[len(EMA_PREFIX):]: v for k, v in tensors.items()
                           if k.startswith(EMA_PREFIX)})
        loop.optimizer.load_state_dict(optimizer_state)
        state.resume(trainer_state)
        set_generator_state(generator, trainer_state["generator"])

    def save() -> Checkpoint:
        tensors = dict(loop.model.state_dict())
        if loop.ema is not None:
            tensors.update({EMA_PREFIX + k: v for k, v in loop.ema.state().items()})
        trainer_state = state.trainer_state(generator=generator_state(generator),
                                            best=state.best, invocation=job.invocation)
        saved = save_checkpoint(run, state.step, model_tensors=tensors,
                                optimizer=loop.optimizer, trainer_state=trainer_state,
                                extra_files={META_FILE: dumps(loop.meta)},
                                keep_last=config.keep_last,
                                protect=(state.best["checkpoint"],) if state.best else ())
        if loop.on_checkpoint is not None:
            job.stage = "sample"
            loop.on_checkpoint(saved)
        return saved

    def evaluate_val() -> None:
        loop.model.eval()
        with torch.no_grad():
            result = loop.validate()
        loop.model.train()
        run.log_metric({"invocation": job.invocation, "step": state.step, "split": "val",
                        "elapsed_s": state.elapsed, **result})
        if loop.select_best and loop.improves(result, state.best):
            state.best = {"checkpoint": checkpoint_name(state.step), "step": state.step,
                          **result}
            run.set_status("running", best_checkpoint=state.best["checkpoint"])

    steps = StepLoop(job, state, save, evaluate_val, config.optim, loop.optimizer,
                     precision=run_precision(run, config))
    loop.model.train()
    if loop.eval_at_start and job.resume_from is None:
        steps.validate()
        steps.checkpoint()
    steps.run(_batch_step(job, loop, state, generator))


def _batch_step(job: Job, loop: Loop, state: LoopState, generator: torch.Generator):
    """One step of a media recipe: the mean loss of a batch, one clipped AdamW step, the EMA
    after an update."""
    config = job.config

    def step(_step: int, _lr: float) -> StepResult:
        job.stage = "forward"
        indices = state.cursor.take(config.batch_size)
        loss = loop.batch_loss(indices, generator)
        job.stage = "backward"
        loss.backward()
        value = float(loss.detach())
        outcome = optimizer_step(job, loop.model.parameters(), loop.optimizer,
                                 config.optim.grad_clip, value)
        if loop.ema is not None and not outcome.skipped:
            loop.ema.update(loop.model, state.step + 1)
        return StepResult(value, outcome, len(indices), {"examples": len(indices)},
                          {"epoch": state.cursor.epoch}, rate_key="examples_per_s",
                          flops_work=len(indices), postfix={"loss": f"{value:.4f}"})

    return step


def meta_for(config, classes: list[str], **model: object) -> dict:
    """What a checkpoint must carry to be used on its own: classes, preprocessing, model."""
    section = getattr(config, "image", None) or getattr(config, "audio", None)
    return {"recipe": config.recipe, "classes": list(classes),
            "preprocessing": section.model_dump() if section is not None else None,
            "model": json.loads(json.dumps(model, default=list))}
