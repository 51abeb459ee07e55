"""image-generate: a class-conditional tiny DDPM at 32×32 on the shapes set.

Cosine schedule, ε-prediction, condition dropout to a learned null class (so classifier-free
guidance works), an EMA copy of the weights for sampling. Every checkpoint gets a fixed-seed
sample grid (rows = classes). `forgebench sample` writes one PNG per sample with a JSON
sidecar: seed, settings, checkpoint, model identity and the nearest training image by pixels
and by gradient features.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.diffusion import SCHEDULE_ID, EMA, Schedule, denoising_loss, fixed_noise_loss
from engine.eval.neighbours import nearest_images
from engine.fsutil import atomic_write_json
from engine.jobs import Job, run_config
from engine.models.diffusion import DenoisingUNet, UNetConfig
from engine.recipes.image_generate_config import ImageGenerateConfig
from engine.recipes.media_common import (Loop, augment, autocast, checkpoint_meta,
                                         dataset_manifest, image_set, load_weights, meta_for,
                                         open_dataset, record_eval, require_same_classes,
                                         run_sampler, sample_request, save_png, train_loop)
from engine.rundir import Checkpoint, RunDir
from engine.train.optim import build_adamw

KINDS = ("image-masks", "image-classify", "image-boxes")


def data_manifest(config: ImageGenerateConfig) -> dict:
    return dataset_manifest(config, KINDS)


def unet_config(config: ImageGenerateConfig, num_classes: int) -> UNetConfig:
    return UNetConfig(dims=2, in_channels=3, channels=tuple(config.diffusion.channels),
                      factor=2, kernel=3, num_classes=num_classes,
                      emb_dim=config.diffusion.emb_dim)


def to_model_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, S, S] -> float in [-1, 1]."""
    return images.float() / 127.5 - 1.0


def to_pixels(x: torch.Tensor) -> np.ndarray:
    """[-1, 1] [B, 3, S, S] -> uint8 [B, S, S, 3]."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def write_grid(run: RunDir, checkpoint: Checkpoint, model: DenoisingUNet,
               config: ImageGenerateConfig, classes: list[str]) -> None:
    """samples/<checkpoint>/grid.png: rows = classes, fixed seed, EMA weights."""
    s = config.sample
    labels = torch.arange(len(classes)).repeat_interleave(s.per_class)
    schedule = Schedule(config.diffusion.levels, s.steps)
    size = config.image.size
    x = run_sampler(model, schedule, (len(labels), 3, size, size), labels, s.cfg, s.seed,
                    cancellable=False, desc="grid")
    tiles = to_pixels(x).reshape(len(classes), s.per_class, size, size, 3)
    grid = tiles.transpose(0, 2, 1, 3, 4).reshape(len(classes) * size, s.per_class * size, 3)
    grid = grid.repeat(2, axis=0).repeat(2, axis=1)
    folder = run.samples_dir / checkpoint.name
    save_png(folder / "grid.png", grid)
    atomic_write_json(folder / "grid.json", {
        "file": "grid.png", "rows": classes, "per_class": s.per_class, "seed": s.seed,
        "cfg": s.cfg, "steps": s.steps, "weights": "ema", "checkpoint": checkpoint.name,
        "step": checkpoint.step, "scale": 2, "schedule": SCHEDULE_ID})
    run.log_event("sample_written", checkpoint=checkpoint.name,
                  path=str((folder / "grid.png").relative_to(run.path)))


def sample(run: RunDir, checkpoint: Checkpoint, args) -> list:
    config: ImageGenerateConfig = run_config(run)
    classes = checkpoint_meta(checkpoint)["classes"]
    dataset = open_dataset(config, KINDS)
    meta = require_same_classes(checkpoint, dataset.classes)
    chosen, n, cfg, steps, out = sample_request(args, classes, config, checkpoint, run)
    model = DenoisingUNet(unet_config(config, len(classes)))
    load_weights(checkpoint, model, use_ema=True)

    labels = torch.tensor([classes.index(c) for c in chosen]).repeat_interleave(n)
    size = config.image.size
    x = run_sampler(model, Schedule(config.diffusion.levels, steps), (len(labels), 3, size, size),
                    labels, cfg, args.seed, cancellable=True)
    pixels = to_pixels(x)
    train = image_set(dataset, "train", classes, config.image,
                      keep=lambda r: r.get("label") in classes)
    neighbours = nearest_images(pixels / 255.0, train.images.permute(0, 2, 3, 1).numpy() / 255.0,
                                train.ids)
    paths = []
    for k, (image, label) in enumerate(zip(pixels, labels.tolist())):
        name = f"{classes[label]}-seed{args.seed}-{k % n:03d}"
        save_png(out / f"{name}.png", image)
        atomic_write_json(out / f"{name}.json", {
            "file": f"{name}.png", "class": classes[label], "index": k % n, "seed": args.seed,
            "batch": {"classes": chosen, "per_class": n, "position": k},
            "settings": {"cfg": cfg, "steps": steps, "sampler": "ddpm-ancestral",
                         "weights": "ema", "schedule": SCHEDULE_ID,
                         "levels": config.diffusion.levels},
            "checkpoint": checkpoint.name, "step": checkpoint.step, "run": str(run.path),
            "model": meta["model"], "nearest_training": neighbours[k]})
        run.log_event("sample_written", checkpoint=checkpoint.name, path=str(out / f"{name}.png"))
        paths.append(out / f"{name}.png")
    return paths


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Fixed-noise denoising MSE of the EMA weights on a split (a learning diagnostic, not an
    image-quality score)."""
    config = run_config(run)
    dataset = open_dataset(config, KINDS)
    classes = dataset.classes
    require_same_classes(checkpoint, classes)
    model = DenoisingUNet(unet_config(config, len(classes)))
    load_weights(checkpoint, model, use_ema=True)
    data = image_set(dataset, split, classes, config.image, keep=lambda r: r.get("label") in classes)
    loss = fixed_noise_loss(model, Schedule(config.diffusion.levels), to_model_range(data.images),
                            data.labels)
    report = {"split": split, "checkpoint": checkpoint.name, "step": checkpoint.step,
              "loss": loss, "loss_kind": "fixed-noise epsilon MSE (EMA weights)", "n": len(data)}
    return record_eval(run, checkpoint, split, report, ("loss",))


def train(job: Job) -> None:
    config: ImageGenerateConfig = job.config
    torch.manual_seed(config.seed)
    dataset = open_dataset(config, KINDS)
    classes = dataset.classes
    keep = lambda r: r.get("label") in classes  # noqa: E731 - scenes that hold an object
    train_set = image_set(dataset, "train", classes, config.image, keep=keep)
    val_set = image_set(dataset, "val", classes, config.image, keep=keep)
    val_x0 = to_model_range(val_set.images)

    d = config.diffusion
    model = DenoisingUNet(unet_config(config, len(classes)))
    ema = EMA(model, d.ema, d.ema_warmup)
    sampler_model = DenoisingUNet(unet_config(config, len(classes))).eval()
    schedule = Schedule(d.levels)
    opt = config.optim
    optimizer = build_adamw(model.named_parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                            betas=(opt.beta1, opt.beta2))

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        images, _, _ = augment(train_set.images[indices], generator,
                               hflip=config.image.hflip, rot90=config.image.rot90)
        return denoising_loss(model, schedule, to_model_range(images), train_set.labels[indices],
                              model.null_label, d.cond_dropout, generator,
                              lambda: autocast(config.precision))

    def validate() -> dict:
        return {"loss": fixed_noise_loss(model, schedule, val_x0, val_set.labels,
                                         autocast=lambda: autocast(config.precision))}

    def on_checkpoint(checkpoint: Checkpoint) -> None:
        if config.sample.grid_every_checkpoint:
            ema.copy_to(sampler_model)
            write_grid(job.run, checkpoint, sampler_model, config, classes)

    meta = meta_for(config, classes, family="DenoisingUNet",
                    **unet_config(config, len(classes)).to_dict(), schedule=SCHEDULE_ID,
                    levels=d.levels)
    train_loop(job, Loop(model, optimizer, len(train_set), batch_loss, validate, meta=meta,
                         select_best=False, ema=ema, on_checkpoint=on_checkpoint))
