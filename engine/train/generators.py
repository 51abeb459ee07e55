"""The class-conditional denoising generators (image-generate, audio-generate): training on the
shared loop, loading the EMA weights, the fixed-noise evaluation, and sampling jobs.

The diffusion arithmetic (schedule, EMA, losses, ancestral sampler) is engine.diffusion; the
U-Net is engine.models.diffusion.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import torch

from engine.data.dataset import Dataset
from engine.diffusion import (
    EMA,
    SCHEDULE_ID,
    Schedule,
    denoising_loss,
    fixed_noise_loss,
)
from engine.errors import ForgebenchError
from engine.jobs import Job, run_config
from engine.models.diffusion import DenoisingUNet, UNetConfig
from engine.rundir import Checkpoint
from engine.train.loop import (
    Loop,
    load_weights,
    meta_for,
    record_eval,
    require_same_classes,
    train_loop,
)
from engine.train.media_data import open_dataset
from engine.train.optim import adamw_for
from engine.train.precision import autocast


def train_generator(job: Job, unet: UNetConfig, classes: list[str], n_train: int,
                    train_batch: Callable[[list[int], torch.Generator],
                                          tuple[torch.Tensor, torch.Tensor]],
                    val_x0: torch.Tensor, val_labels: torch.Tensor,
                    on_checkpoint: Callable[[Checkpoint, torch.nn.Module], None] | None = None
                    ) -> None:
    """Train a class-conditional DDPM: ε-prediction on the cosine schedule, condition dropout
    to the learned null class, EMA weights, fixed-noise val loss.

    `train_batch(indices, generator)` gives clean examples in [-1, 1] and their labels;
    `on_checkpoint(checkpoint, model)` gets a copy of the network holding the EMA weights.
    """
    config = job.config
    d = config.diffusion
    model = DenoisingUNet(unet)
    ema = EMA(model, d.ema, d.ema_warmup)
    schedule = Schedule(d.levels)
    opt = config.optim
    optimizer = adamw_for(model.named_parameters(), opt)

    def precision():
        return autocast(config.precision)

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        x0, labels = train_batch(indices, generator)
        return denoising_loss(model, schedule, x0, labels, model.null_label, d.cond_dropout,
                              generator, precision, min_snr_gamma=d.min_snr_gamma)

    def validate() -> dict:
        return {"loss": fixed_noise_loss(model, schedule, val_x0, val_labels,
                                         autocast=precision)}

    def with_ema_weights(checkpoint: Checkpoint) -> None:
        ema_model = copy.deepcopy(model).eval()
        ema.copy_to(ema_model)
        on_checkpoint(checkpoint, ema_model)

    meta = meta_for(config, classes, family="DenoisingUNet", **unet.to_dict(),
                    schedule=SCHEDULE_ID, levels=d.levels)
    train_loop(job, Loop(model, optimizer, n_train, batch_loss, validate, meta=meta,
                         select_best=False, ema=ema,
                         on_checkpoint=with_ema_weights if on_checkpoint else None))


def load_generator(run, checkpoint: Checkpoint, kinds: tuple[str, ...],
                   unet_config: Callable[[object, int], UNetConfig]):
    """(run config, dataset, checkpoint meta, U-Net holding the EMA weights) of a generator
    checkpoint; refuses a dataset whose class list changed."""
    config = run_config(run)
    dataset = open_dataset(config, kinds)
    meta = require_same_classes(checkpoint, dataset.classes)
    model = DenoisingUNet(unet_config(config, len(dataset.classes)))
    load_weights(checkpoint, model, use_ema=True)
    return config, dataset, meta, model


def evaluate_generator(run, checkpoint: Checkpoint, split: str, kinds: tuple[str, ...],
                       unet_config: Callable[[object, int], UNetConfig],
                       load_split: Callable[[object, Dataset, str],
                                            tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Fixed-noise denoising MSE of the EMA weights on a split: a learning diagnostic, not an
    image-quality or listening score. `load_split(config, dataset, split)` gives the clean
    examples in [-1, 1] and their labels."""
    config, dataset, _, model = load_generator(run, checkpoint, kinds, unet_config)
    x0, labels = load_split(config, dataset, split)
    loss = fixed_noise_loss(model, Schedule(config.diffusion.levels), x0, labels)
    report = {"split": split, "checkpoint": checkpoint.name, "step": checkpoint.step,
              "loss": loss, "loss_kind": "fixed-noise epsilon MSE (EMA weights)",
              "n": len(labels)}
    return record_eval(run, checkpoint, split, report, ("loss",))


# -- sampling jobs ------------------------------------------------------------------------
def run_sampler(model: torch.nn.Module, schedule, shape: tuple[int, ...], labels: torch.Tensor,
                cfg: float, seed: int, *, cancellable: bool, desc: str = "sample") -> torch.Tensor:
    """Ancestral sampling with a progress bar on stderr. With `cancellable`, SIGTERM (and
    Ctrl-C) stop it between steps by raising KeyboardInterrupt: nothing has been written yet."""
    import signal
    import sys

    from tqdm import tqdm

    from engine.diffusion import ancestral_sample

    cancelled = []
    previous = None
    if cancellable:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: cancelled.append(signum))
    bar = tqdm(total=len(schedule.timesteps), desc=desc, unit="step", file=sys.stderr,
               leave=False, dynamic_ncols=True)

    def on_step(done: int) -> None:
        bar.update(1)
        if cancelled:
            raise KeyboardInterrupt("sampling cancelled")

    try:
        return ancestral_sample(model, schedule, shape, labels, model.null_label, cfg,
                                torch.Generator().manual_seed(seed), on_step=on_step)
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def sample_request(args, classes: list[str], config, checkpoint: Checkpoint,
                   run) -> tuple[list[str], int, float, int, Path]:
    """Validated (classes, n per class, cfg, sampler steps, output folder) of a sample job."""
    chosen = classes
    if args.class_name:
        if args.class_name not in classes:
            raise ForgebenchError(f"unknown class {args.class_name!r}", where="--class",
                                  hint="one of: " + ", ".join(classes))
        chosen = [args.class_name]
    if args.n < 1:
        raise ForgebenchError("must be at least 1", where="--n")
    cfg = config.sample.cfg if args.cfg is None else args.cfg
    steps = args.steps or config.diffusion.levels
    if not 1 <= steps <= config.diffusion.levels:
        raise ForgebenchError(f"sampler steps must be 1..{config.diffusion.levels}",
                              where="--steps")
    out = Path(args.out) if args.out else run.samples_dir / checkpoint.name
    return chosen, args.n, cfg, steps, out
