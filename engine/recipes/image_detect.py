"""image-detect: a one-object detector. Conv stages (16/32/64) keep a 4×4 spatial grid; the
head emits an objectness logit and one ordered box.

Loss = BCE(objectness) + box_weight × smooth-L1(box) on positive images only; empty scenes
teach the detector to stay silent. Evaluation reports mean IoU over positive images,
precision and recall at IoU ≥ iou_threshold, and the false-alarm rate on empty images, and
draws prediction overlays (green: target, red: prediction) for the app.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image, ImageDraw

from engine.eval.detection import detection_report
from engine.fsutil import atomic_write_text
from engine.jobs import Job, run_config
from engine.models.vision import WIDTHS, GridDetector, detection_loss
from engine.recipes.image_detect_config import ImageDetectConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.loop import (
    Loop,
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

KINDS = ("image-masks", "image-boxes")


def data_manifest(config: ImageDetectConfig) -> dict:
    return dataset_manifest(config, KINDS)


@torch.no_grad()
def predict(model: GridDetector, data: ImageSet, precision: str,
            batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(objectness logits [N], boxes [N, 4]) in float32."""
    logits, boxes = [], []
    for start in range(0, len(data), batch):
        with autocast(precision):
            logit, box = model(data.float_images(slice(start, start + batch)))
        logits.append(logit.float())
        boxes.append(box.float())
    return torch.cat(logits), torch.cat(boxes)


def report_for(model: GridDetector, data: ImageSet, config: ImageDetectConfig) -> dict:
    logits, boxes = predict(model, data, config.precision)
    targets = [b.tolist() if present else None for b, present in zip(data.boxes, data.has_object)]
    report = detection_report(torch.sigmoid(logits).tolist(), boxes.tolist(), targets,
                              config.threshold, config.iou_threshold)
    report["loss"] = float(detection_loss(logits, boxes, data.has_object, data.boxes,
                                          config.box_weight))
    for record, image_id in zip(report["per_image"], data.ids):
        record["id"] = image_id
    return report


def draw_overlay(image: np.ndarray, target: list[float] | None, box: list[float],
                 emitted: bool) -> np.ndarray:
    canvas = Image.fromarray(image).resize((image.shape[1] * 4, image.shape[0] * 4),
                                           Image.NEAREST)
    draw = ImageDraw.Draw(canvas)
    w, h = canvas.size

    def rect(b, colour):
        draw.rectangle([b[0] * w, b[1] * h, b[2] * w - 1, b[3] * h - 1], outline=colour, width=2)

    if target is not None:
        rect(target, (0, 200, 0))
    if emitted:
        rect(box, (230, 0, 0))
    return np.asarray(canvas)


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Detection metrics of one checkpoint: evals/<split>-<checkpoint>.json, and
    evals/<split>-<checkpoint>/per_image.jsonl + overlays/<id>.png."""
    config = run_config(run)
    dataset = open_dataset(config, KINDS)
    meta = require_same_classes(checkpoint, dataset.classes)
    model = GridDetector()
    load_weights(checkpoint, model)
    data = image_set(dataset, split, dataset.classes, config.image)
    report = report_for(model, data, config)
    folder = run.evals_dir / f"{split}-{checkpoint.name}"
    for k, record in enumerate(report["per_image"][:config.overlays]):
        target = data.boxes[k].tolist() if data.has_object[k] else None
        overlay = draw_overlay(data.images[k].permute(1, 2, 0).numpy(), target, record["box"],
                               record["emitted"])
        record["overlay"] = f"overlays/{record['id']}.png"
        save_png(folder / record["overlay"], overlay)
    atomic_write_text(folder / "per_image.jsonl",
                      "".join(json.dumps(r) + "\n" for r in report.pop("per_image")))
    report.update(split=split, checkpoint=checkpoint.name, step=checkpoint.step,
                  per_image=f"{folder.name}/per_image.jsonl", preprocessing=meta["preprocessing"])
    record_eval(run, checkpoint, split, report,
                ("loss", "mean_iou", "precision", "recall", "false_alarm_rate"))
    return report


def train(job: Job) -> None:
    config: ImageDetectConfig = job.config
    torch.manual_seed(config.seed)
    dataset = open_dataset(config, KINDS)
    classes = dataset.classes
    train_set = image_set(dataset, "train", classes, config.image)
    val_set = image_set(dataset, "val", classes, config.image)

    model = GridDetector()
    opt = config.optim
    optimizer = adamw_for(model.named_parameters(), opt)

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        images, _, boxes = augment(train_set.images[indices], generator,
                                   hflip=config.image.hflip, rot90=config.image.rot90,
                                   boxes=train_set.boxes[indices])
        with autocast(config.precision):
            logit, pred = model(images.float() / 255.0)             # [B], [B, 4]
        return detection_loss(logit.float(), pred.float(), train_set.has_object[indices], boxes,
                              config.box_weight)

    def validate() -> dict:
        report = report_for(model, val_set, config)
        return {k: report[k] for k in ("loss", "mean_iou", "precision", "recall",
                                       "false_alarm_rate")}

    train_loop(job, Loop(model, optimizer, len(train_set), batch_loss, validate,
                         meta=meta_for(config, classes, family="GridDetector", widths=WIDTHS,
                                       grid=4, threshold=config.threshold)))
