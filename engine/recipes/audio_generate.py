"""audio-generate: a 1-D U-Net DDPM on 8192-sample 16 kHz mono waveforms.

Time and class embeddings, condition dropout to a learned null class, EMA weights, 256 cosine
noise levels, ancestral sampling with classifier-free guidance. Clips are read exactly as
stored (mono PCM, the configured rate and length; nothing is resampled, cropped or
normalized) and generated clips are written as PCM16 WAV clipped to [-1, 1] but never
peak-normalized, so loudness and clipping defects stay visible; their mean is removed and their
ends faded over 5 ms (`engine.eval.audio.finished_clip`: a waveform DDPM's constant drift and
abrupt ends are inaudible content but audible clicks). Each WAV has a JSON sidecar: seed, cfg,
steps, checkpoint, class, the written clip's signal-integrity flags (and the model output's,
before finishing), and the nearest training clip by log-STFT distance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.diffusion import SCHEDULE_ID, Schedule
from engine.eval.audio import FADE_S, finished_clip, integrity_flags
from engine.eval.neighbours import nearest_clips
from engine.fsutil import atomic_write_json
from engine.jobs import Job
from engine.models.diffusion import UNetConfig
from engine.recipes.audio_generate_config import AudioGenerateConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.generators import (
    evaluate_generator,
    load_generator,
    run_sampler,
    sample_request,
    train_generator,
)
from engine.train.media_data import (
    dataset_manifest,
    open_dataset,
    read_clip,
    split_records,
    write_wav,
)

KINDS = ("audio-clips",)


def data_manifest(config: AudioGenerateConfig) -> dict:
    return dataset_manifest(config, KINDS)


def unet_config(config: AudioGenerateConfig, num_classes: int) -> UNetConfig:
    return UNetConfig(dims=1, in_channels=1, channels=tuple(config.diffusion.channels),
                      factor=4, kernel=5, num_classes=num_classes,
                      emb_dim=config.diffusion.emb_dim,
                      attention=config.diffusion.attention)


def load_clips(dataset, split: str, classes: list[str],
               config: AudioGenerateConfig) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(ids, waveforms [N, 1, L] in [-1, 1], class indices [N]) of one split."""
    records = [r for r in split_records(dataset, split) if r.get("label") in classes]
    waves = np.stack([read_clip(Path(r["path"]), config.audio) for r in records])
    return ([str(r["id"]) for r in records], torch.from_numpy(waves).float()[:, None],
            torch.tensor([classes.index(r["label"]) for r in records]))


def sample(run: RunDir, checkpoint: Checkpoint, args) -> list:
    config, dataset, meta, model = load_generator(run, checkpoint, KINDS, unet_config)
    classes = meta["classes"]
    chosen, n, cfg, steps, out = sample_request(args, classes, config, checkpoint, run)

    labels = torch.tensor([classes.index(c) for c in chosen]).repeat_interleave(n)
    x = run_sampler(model, Schedule(config.diffusion.levels, steps),
                    (len(labels), 1, config.audio.samples), labels, cfg, args.seed,
                    cancellable=True)
    raws = x[:, 0].numpy().astype(np.float64)
    waves = [finished_clip(raw, config.audio.sample_rate) for raw in raws]
    train_ids, train_waves, _ = load_clips(dataset, "train", classes, config)
    neighbours = nearest_clips(waves, list(train_waves[:, 0].numpy()), train_ids)
    paths = []
    for k, (raw, wave, label) in enumerate(zip(raws, waves, labels.tolist())):
        name = f"{classes[label]}-seed{args.seed}-{k % n:03d}"
        write_wav(out / f"{name}.wav", wave, config.audio.sample_rate)
        atomic_write_json(out / f"{name}.json", {
            "file": f"{name}.wav", "class": classes[label], "index": k % n, "seed": args.seed,
            "batch": {"classes": chosen, "per_class": n, "position": k},
            "cfg": cfg, "steps": steps,
            "settings": {"sampler": "ddpm-ancestral", "weights": "ema", "schedule": SCHEDULE_ID,
                         "levels": config.diffusion.levels, "peak_normalized": False,
                         "mean_removed": True, "edge_fade_s": FADE_S},
            "sample_rate": config.audio.sample_rate, "samples": config.audio.samples,
            "checkpoint": checkpoint.name, "step": checkpoint.step, "run": str(run.path),
            "model": meta["model"], "integrity": integrity_flags(wave),
            "integrity_model_output": integrity_flags(raw),
            "nearest_training": neighbours[k]})
        run.log_event("sample_written", checkpoint=checkpoint.name, path=str(out / f"{name}.wav"))
        paths.append(out / f"{name}.wav")
    return paths


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Fixed-noise denoising MSE of the EMA weights on a split (not a listening score)."""
    return evaluate_generator(run, checkpoint, split, KINDS, unet_config, load_split)


def load_split(config: AudioGenerateConfig, dataset, split: str) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    _, waves, labels = load_clips(dataset, split, dataset.classes, config)
    return waves, labels


def train(job: Job) -> None:
    config: AudioGenerateConfig = job.config
    torch.manual_seed(config.seed)
    dataset = open_dataset(config, KINDS)
    classes = dataset.classes
    _, train_waves, train_labels = load_clips(dataset, "train", classes, config)
    _, val_waves, val_labels = load_clips(dataset, "val", classes, config)
    train_generator(job, unet_config(config, len(classes)), classes, len(train_waves),
                    lambda indices, generator: (train_waves[indices], train_labels[indices]),
                    val_waves, val_labels)
