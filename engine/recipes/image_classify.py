"""image-classify: a small CNN (16/32/64 conv stages, global average pooling, linear head)
trained from scratch with cross-entropy on raw logits.

Reads top to bottom: dataset -> class list -> tensors (resize policy from the config, recorded
in run.json and in every checkpoint) -> label-preserving augmentation -> AdamW loop that keeps
the lowest-val-loss checkpoint as "best" -> evaluation with macro-F1 and the confusion matrix.
The test split is read only by `forgebench eval --split test`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.data.formats import EMPTY_LABEL
from engine.eval.classification import classification_report
from engine.jobs import Job, run_config
from engine.models.vision import WIDTHS, SmallCNN
from engine.recipes.image_classify_config import ImageClassifyConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.devices import module_device, to_device
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
)
from engine.train.optim import adamw_for
from engine.train.precision import autocast

KINDS = ("image-classify", "image-masks", "image-boxes")


def data_manifest(config: ImageClassifyConfig) -> dict:
    return dataset_manifest(config, KINDS)


def class_list(config: ImageClassifyConfig, dataset) -> list[str]:
    """The dataset's classes, plus 'empty' when scenes without an object occur."""
    classes = list(dataset.classes)
    if config.include_empty and any(r.get("label") == EMPTY_LABEL for r in dataset.raw_records()):
        classes.append(EMPTY_LABEL)
    return classes


def load_split(config: ImageClassifyConfig, dataset, classes: list[str], split: str) -> ImageSet:
    return image_set(dataset, split, classes, config.image,
                     keep=lambda r: r.get("label") in classes)


@torch.no_grad()
def predict(model: SmallCNN, data: ImageSet, precision: str, batch: int = 256) -> torch.Tensor:
    """Logits [N, classes] in float32 (on the CPU, wherever the model is)."""
    out = []
    device = module_device(model)
    for start in range(0, len(data), batch):
        images = to_device(data.float_images(slice(start, start + batch)), device)
        with autocast(precision, device.type):
            out.append(model(images).float().cpu())
    return torch.cat(out)


def scores(logits: torch.Tensor, data: ImageSet, classes: list[str]) -> dict:
    report = classification_report(data.labels.tolist(), logits.argmax(1).tolist(), classes)
    report["loss"] = float(F.cross_entropy(logits, data.labels))
    return report


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Macro-F1, accuracy, per-class scores and the confusion matrix of one checkpoint;
    writes evals/<split>-<checkpoint>.json."""
    config = run_config(run)
    dataset = open_dataset(config, KINDS)
    classes = class_list(config, dataset)
    meta = require_same_classes(checkpoint, classes)
    model = SmallCNN(len(classes), batch_norm=config.batch_norm)
    load_weights(checkpoint, model)
    data = load_split(config, dataset, classes, split)
    report = scores(predict(model, data, config.precision), data, classes)
    report.update(split=split, checkpoint=checkpoint.name, step=checkpoint.step,
                  preprocessing=meta["preprocessing"])
    return record_eval(run, checkpoint, split, report, ("loss", "macro_f1", "accuracy"))


def train(job: Job) -> None:
    config: ImageClassifyConfig = job.config
    torch.manual_seed(config.seed)
    dataset = open_dataset(config, KINDS)
    classes = class_list(config, dataset)
    train_set = load_split(config, dataset, classes, "train")
    val_set = load_split(config, dataset, classes, "val")

    device = job.device
    model = SmallCNN(len(classes), batch_norm=config.batch_norm).to(device)
    opt = config.optim
    optimizer = adamw_for(model.named_parameters(), opt)

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        images, _, _ = augment(train_set.images[indices], generator,
                               hflip=config.image.hflip, rot90=config.image.rot90)
        images = to_device(images, device)      # augmented on the CPU (its generator's home)
        with autocast(config.precision, device.type):
            logits = model(images.float() / 255.0)                   # [B, classes]
        return F.cross_entropy(logits.float(), to_device(train_set.labels[indices], device))

    def validate() -> dict:
        report = scores(predict(model, val_set, config.precision), val_set, classes)
        return {"loss": report["loss"], "macro_f1": report["macro_f1"],
                "accuracy": report["accuracy"]}

    train_loop(job, Loop(model, optimizer, len(train_set), batch_loss, validate,
                         meta=meta_for(config, classes, family="SmallCNN", widths=WIDTHS,
                                       batch_norm=config.batch_norm)))
