"""image-segment: TinyUNet (2 down, 2 up, skip connections) predicting one foreground logit
per pixel, trained with BCE + soft Dice.

At every validation the probability threshold is tuned for val IoU and frozen into the
checkpoint; `forgebench eval` applies the frozen value (never re-tuned on test). Evaluation
reports IoU and boundary F1 (tolerance from the config; both-empty = 1, one-empty = 0), and
writes for the app:

    evals/<split>-<checkpoint>.json                 summary
    evals/<split>-<checkpoint>/per_image.jsonl      id, label, iou, boundary_f1, file names
    evals/<split>-<checkpoint>/panels/<id>-{input,probability,prediction,target}.png
    evals/<split>-<checkpoint>/contours/<id>.json   predicted outlines with hole hierarchy
"""

from __future__ import annotations

import json

import numpy as np
import torch

from engine.eval.contours import write_contours
from engine.eval.masks import boundary_f1, iou
from engine.fsutil import atomic_write_text
from engine.jobs import Job, run_config
from engine.models.vision import TinyUNet, segmentation_loss
from engine.recipes.image_segment_config import ImageSegmentConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.loop import (
    Loop,
    checkpoint_meta,
    load_weights,
    meta_for,
    record_eval,
    require_same_classes,
    train_loop,
)
from engine.train.media_data import (
    ImageSet,
    augment,
    dataset_manifest,
    image_set,
    open_dataset,
    save_png,
)
from engine.train.optim import adamw_for
from engine.train.precision import autocast

KINDS = ("image-masks",)


def data_manifest(config: ImageSegmentConfig) -> dict:
    return dataset_manifest(config, KINDS)


@torch.no_grad()
def probabilities(model: TinyUNet, data: ImageSet, precision: str,
                  batch: int = 64) -> tuple[torch.Tensor, float]:
    """(foreground probabilities [N, H, W], mean BCE + Dice loss over the split)."""
    probs, loss_sum = [], 0.0
    for start in range(0, len(data), batch):
        index = slice(start, start + batch)
        with autocast(precision):
            logits = model(data.float_images(index)).float()        # [b, 1, H, W]
        target = data.masks[index].float()
        loss_sum += float(segmentation_loss(logits, target)) * logits.shape[0]
        probs.append(torch.sigmoid(logits)[:, 0])
    return torch.cat(probs), loss_sum / len(data)


def mask_scores(prob: np.ndarray, masks: np.ndarray, threshold: float,
                tolerance: int) -> tuple[list[float], list[float]]:
    predictions = prob >= threshold
    ious = [iou(p, t) for p, t in zip(predictions, masks)]
    bf1 = [boundary_f1(p, t, tolerance) for p, t in zip(predictions, masks)]
    return ious, bf1


def tune_threshold(prob: np.ndarray, masks: np.ndarray, candidates: list[float]) -> float:
    """The candidate with the highest mean IoU (the first one on ties)."""
    means = [np.mean([iou(p, t) for p, t in zip(prob >= c, masks)]) for c in candidates]
    return float(candidates[int(np.argmax(means))])


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    config = run_config(run)
    dataset = open_dataset(config, KINDS)
    meta = require_same_classes(checkpoint, dataset.classes)
    threshold = meta["threshold"]
    model = TinyUNet(config.width, config.batch_norm)
    load_weights(checkpoint, model)
    data = image_set(dataset, split, dataset.classes, config.image, need_masks=True)
    prob_t, loss = probabilities(model, data, config.precision)
    prob, masks = prob_t.numpy(), data.masks[:, 0].numpy()
    ious, bf1 = mask_scores(prob, masks, threshold, config.boundary_tolerance)

    folder = run.evals_dir / f"{split}-{checkpoint.name}"
    lines = []
    for k, image_id in enumerate(data.ids):
        record = {"id": image_id, "label": data.records[k].get("label"), "iou": ious[k],
                  "boundary_f1": bf1[k]}
        if k < config.panels:
            prediction = prob[k] >= threshold
            panels = {"input": data.images[k].permute(1, 2, 0).numpy(),
                      "probability": np.rint(prob[k] * 255).astype(np.uint8),
                      "prediction": prediction.astype(np.uint8) * 255,
                      "target": masks[k].astype(np.uint8) * 255}
            record["panels"] = {}
            for name, array in panels.items():
                record["panels"][name] = f"panels/{image_id}-{name}.png"
                save_png(folder / record["panels"][name], array)
            record["contours"] = f"contours/{image_id}.json"
            write_contours(prediction, folder / record["contours"], config.contour_epsilon)
        lines.append(record)
    atomic_write_text(folder / "per_image.jsonl", "".join(json.dumps(r) + "\n" for r in lines))
    report = {"split": split, "checkpoint": checkpoint.name, "step": checkpoint.step,
              "n": len(data), "loss": loss, "threshold": threshold,
              "threshold_source": "tuned on val during training, frozen in meta.json",
              "iou": float(np.mean(ious)), "boundary_f1": float(np.mean(bf1)),
              "boundary_tolerance_px": config.boundary_tolerance,
              "empty_convention": "both empty = 1, exactly one empty = 0",
              "per_image": f"{folder.name}/per_image.jsonl",
              "preprocessing": meta["preprocessing"]}
    return record_eval(run, checkpoint, split, report, ("loss", "iou", "boundary_f1", "threshold"))


def train(job: Job) -> None:
    config: ImageSegmentConfig = job.config
    torch.manual_seed(config.seed)
    dataset = open_dataset(config, KINDS)
    classes = dataset.classes
    train_set = image_set(dataset, "train", classes, config.image, need_masks=True)
    val_set = image_set(dataset, "val", classes, config.image, need_masks=True)

    model = TinyUNet(config.width, config.batch_norm)
    opt = config.optim
    optimizer = adamw_for(model.named_parameters(), opt)
    meta = meta_for(config, classes, family="TinyUNet", width=config.width,
                    batch_norm=config.batch_norm)
    # The frozen threshold travels with the weights; a resumed run starts from the saved one.
    meta["threshold"] = checkpoint_meta(job.resume_from)["threshold"] if job.resume_from else 0.5

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        images, masks, _ = augment(train_set.images[indices], generator,
                                   hflip=config.image.hflip, rot90=config.image.rot90,
                                   masks=train_set.masks[indices])
        with autocast(config.precision):
            logits = model(images.float() / 255.0)                  # [B, 1, H, W]
        return segmentation_loss(logits.float(), masks.float())

    def validate() -> dict:
        prob, loss = probabilities(model, val_set, config.precision)
        masks = val_set.masks[:, 0].numpy()
        meta["threshold"] = tune_threshold(prob.numpy(), masks, config.thresholds)
        ious, bf1 = mask_scores(prob.numpy(), masks, meta["threshold"], config.boundary_tolerance)
        return {"loss": loss, "iou": float(np.mean(ious)), "boundary_f1": float(np.mean(bf1)),
                "threshold": meta["threshold"]}

    train_loop(job, Loop(model, optimizer, len(train_set), batch_loss, validate, meta=meta))
