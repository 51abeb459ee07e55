"""audio-generate: a 1-D U-Net DDPM on 8192-sample 16 kHz mono waveforms.

Time and class embeddings, condition dropout to a learned null class, EMA weights, 256 cosine
noise levels, ancestral sampling with classifier-free guidance. Clips are read exactly as
stored (mono PCM, the configured rate and length; nothing is resampled, cropped or
normalized) and generated clips are written as PCM16 WAV clipped to [-1, 1] but never
peak-normalized, so loudness and clipping defects stay visible. Each WAV has a JSON sidecar:
seed, cfg, steps, checkpoint, class, signal-integrity flags and the nearest training clip by
log-STFT distance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.diffusion import SCHEDULE_ID, EMA, Schedule, denoising_loss, fixed_noise_loss
from engine.eval.audio import integrity_flags
from engine.eval.neighbours import nearest_clips
from engine.fsutil import atomic_write_json
from engine.jobs import Job, run_config
from engine.models.diffusion import DenoisingUNet, UNetConfig
from engine.recipes.audio_generate_config import AudioGenerateConfig
from engine.recipes.media_common import (Loop, autocast, checkpoint_meta, dataset_manifest,
                                         load_weights, meta_for, open_dataset, read_clip,
                                         record_eval, require_same_classes, run_sampler,
                                         sample_request, split_records, train_loop, write_wav)
from engine.rundir import Checkpoint, RunDir
from engine.train.optim import build_adamw

KINDS = ("audio-clips",)


def data_manifest(config: AudioGenerateConfig) -> dict:
    return dataset_manifest(config, KINDS)


def unet_config(config: AudioGenerateConfig, num_classes: int) -> UNetConfig:
    return UNetConfig(dims=1, in_channels=1, channels=tuple(config.diffusion.channels),
                      factor=4, kernel=5, num_classes=num_classes,
                      emb_dim=config.diffusion.emb_dim)


def load_clips(dataset, split: str, classes: list[str],
               config: AudioGenerateConfig) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(ids, waveforms [N, 1, L] in [-1, 1], class indices [N]) of one split."""
    records = [r for r in split_records(dataset, split) if r.get("label") in classes]
    waves = np.stack([read_clip(Path(r["path"]), config.audio) for r in records])
    return ([str(r["id"]) for r in records], torch.from_numpy(waves).float()[:, None],
            torch.tensor([classes.index(r["label"]) for r in records]))


def sample(run: RunDir, checkpoint: Checkpoint, args) -> list:
    config: AudioGenerateConfig = run_config(run)
    classes = checkpoint_meta(checkpoint)["classes"]
    dataset = open_dataset(config, KINDS)
    meta = require_same_classes(checkpoint, dataset.classes)
    chosen, n, cfg, steps, out = sample_request(args, classes, config, checkpoint, run)
    model = DenoisingUNet(unet_config(config, len(classes)))
    load_weights(checkpoint, model, use_ema=True)

    labels = torch.tensor([classes.index(c) for c in chosen]).repeat_interleave(n)
    x = run_sampler(model, Schedule(config.diffusion.levels, steps),
                    (len(labels), 1, config.audio.samples), labels, cfg, args.seed,
                    cancellable=True)
    waves = x[:, 0].numpy().astype(np.float64)
    train_ids, train_waves, _ = load_clips(dataset, "train", classes, config)
    neighbours = nearest_clips(list(waves), list(train_waves[:, 0].numpy()), train_ids)
    paths = []
    for k, (wave, label) in enumerate(zip(waves, labels.tolist())):
        name = f"{classes[label]}-seed{args.seed}-{k % n:03d}"
        write_wav(out / f"{name}.wav", wave, config.audio.sample_rate)
        atomic_write_json(out / f"{name}.json", {
            "file": f"{name}.wav", "class": classes[label], "index": k % n, "seed": args.seed,
            "batch": {"classes": chosen, "per_class": n, "position": k},
            "cfg": cfg, "steps": steps,
            "settings": {"sampler": "ddpm-ancestral", "weights": "ema", "schedule": SCHEDULE_ID,
                         "levels": config.diffusion.levels, "peak_normalized": False},
            "sample_rate": config.audio.sample_rate, "samples": config.audio.samples,
            "checkpoint": checkpoint.name, "step": checkpoint.step, "run": str(run.path),
            "model": meta["model"], "integrity": integrity_flags(wave),
            "nearest_training": neighbours[k]})
        run.log_event("sample_written", checkpoint=checkpoint.name, path=str(out / f"{name}.wav"))
        paths.append(out / f"{name}.wav")
    return paths


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Fixed-noise denoising MSE of the EMA weights on a split (a learning diagnostic, not a
    listening score)."""
    config = run_config(run)
    dataset = open_dataset(config, KINDS)
    classes = dataset.classes
    require_same_classes(checkpoint, classes)
    model = DenoisingUNet(unet_config(config, len(classes)))
    load_weights(checkpoint, model, use_ema=True)
    _, waves, labels = load_clips(dataset, split, classes, config)
    loss = fixed_noise_loss(model, Schedule(config.diffusion.levels), waves, labels)
    report = {"split": split, "checkpoint": checkpoint.name, "step": checkpoint.step,
              "loss": loss, "loss_kind": "fixed-noise epsilon MSE (EMA weights)",
              "n": len(labels)}
    return record_eval(run, checkpoint, split, report, ("loss",))


def train(job: Job) -> None:
    config: AudioGenerateConfig = job.config
    torch.manual_seed(config.seed)
    dataset = open_dataset(config, KINDS)
    classes = dataset.classes
    _, train_waves, train_labels = load_clips(dataset, "train", classes, config)
    _, val_waves, val_labels = load_clips(dataset, "val", classes, config)

    d = config.diffusion
    model = DenoisingUNet(unet_config(config, len(classes)))
    ema = EMA(model, d.ema, d.ema_warmup)
    schedule = Schedule(d.levels)
    opt = config.optim
    optimizer = build_adamw(model.named_parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                            betas=(opt.beta1, opt.beta2))

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        return denoising_loss(model, schedule, train_waves[indices], train_labels[indices],
                              model.null_label, d.cond_dropout, generator,
                              lambda: autocast(config.precision))

    def validate() -> dict:
        return {"loss": fixed_noise_loss(model, schedule, val_waves, val_labels,
                                         autocast=lambda: autocast(config.precision))}

    meta = meta_for(config, classes, family="DenoisingUNet",
                    **unet_config(config, len(classes)).to_dict(), schedule=SCHEDULE_ID,
                    levels=d.levels)
    train_loop(job, Loop(model, optimizer, len(train_waves), batch_loss, validate, meta=meta,
                         select_best=False, ema=ema))
