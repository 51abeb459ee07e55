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

from engine.diffusion import SCHEDULE_ID, Schedule
from engine.eval.neighbours import nearest_images
from engine.fsutil import atomic_write_json
from engine.jobs import Job
from engine.models.diffusion import DenoisingUNet, UNetConfig
from engine.recipes.image_generate_config import ImageGenerateConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.generators import (
    evaluate_generator,
    load_generator,
    run_sampler,
    sample_request,
    train_generator,
)
from engine.train.media_data import (
    augment,
    dataset_manifest,
    image_set,
    open_dataset,
    save_png,
)

KINDS = ("image-masks", "image-classify", "image-boxes")


def data_manifest(config: ImageGenerateConfig) -> dict:
    return dataset_manifest(config, KINDS)


def unet_config(config: ImageGenerateConfig, num_classes: int) -> UNetConfig:
    return UNetConfig(dims=2, in_channels=3, channels=tuple(config.diffusion.channels),
                      factor=2, kernel=3, num_classes=num_classes,
                      emb_dim=config.diffusion.emb_dim,
                      attention=config.diffusion.attention)


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
    config, dataset, meta, model = load_generator(run, checkpoint, KINDS, unet_config)
    classes = meta["classes"]
    chosen, n, cfg, steps, out = sample_request(args, classes, config, checkpoint, run)

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
    """Fixed-noise denoising MSE of the EMA weights on a split (not an image-quality score)."""
    return evaluate_generator(run, checkpoint, split, KINDS, unet_config, load_split)


def load_split(config: ImageGenerateConfig, dataset, split: str) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """(images [N, 3, S, S] in [-1, 1], class indices [N]) of the scenes holding an object."""
    data = image_set(dataset, split, dataset.classes, config.image,
                     keep=lambda r: r.get("label") in dataset.classes)
    return to_model_range(data.images), data.labels


def train(job: Job) -> None:
    config: ImageGenerateConfig = job.config
    torch.manual_seed(config.seed)
    dataset = open_dataset(config, KINDS)
    classes = dataset.classes
    train_set = image_set(dataset, "train", classes, config.image,
                          keep=lambda r: r.get("label") in classes)
    val_x0, val_labels = load_split(config, dataset, "val")

    def train_batch(indices: list[int], generator: torch.Generator):
        images, _, _ = augment(train_set.images[indices], generator,
                               hflip=config.image.hflip, rot90=config.image.rot90)
        return to_model_range(images), train_set.labels[indices]

    def grid(checkpoint: Checkpoint, ema_model: DenoisingUNet) -> None:
        write_grid(job.run, checkpoint, ema_model, config, classes)

    train_generator(job, unet_config(config, len(classes)), classes, len(train_set),
                    train_batch, val_x0, val_labels,
                    on_checkpoint=grid if config.sample.grid_every_checkpoint else None)
