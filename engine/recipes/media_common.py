"""What the image and audio recipes share: reading and checking their files into tensors,
label-preserving augmentation, the class-list contract with checkpoints, and the step loop
(resume, clip, log, evaluate, keep the best, checkpoint).

The loop is a function, not a trainer class: a recipe hands it a `batch_loss(indices)` and a
`validate()` and reads top to bottom around it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from engine.data import formats as F
from engine.data import media
from engine.data.dataset import Dataset, load_dataset
from engine.diffusion import SCHEDULE_ID, EMA, Schedule, denoising_loss, fixed_noise_loss
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_bytes, atomic_writer, read_json
from engine.jobs import Job, run_config
from engine.models.diffusion import DenoisingUNet, UNetConfig
from engine.rundir import Checkpoint, checkpoint_name
from engine.train.checkpoint import (dumps, generator_state, load_checkpoint, rng_state,
                                     save_checkpoint, set_generator_state, set_rng_state)
from engine.train.data_order import DataCursor
from engine.train.metrics import StepClock, peak_rss_mb
from engine.train.optim import build_adamw, clip_and_step, lr_at, set_lr

META_FILE = "meta.json"
EMA_PREFIX = "ema."


# -- datasets -----------------------------------------------------------------------------
def record_eval(run, checkpoint: Checkpoint, split: str, report: dict,
                metric_keys: tuple[str, ...]) -> dict:
    """Write `evals/<split>-<checkpoint>.json` and one eval metric line with the headline keys."""
    run.write_eval(f"{split}-{checkpoint.name}", report)
    run.log_metric({"split": split, "step": checkpoint.step, "checkpoint": checkpoint.name,
                    **{key: report[key] for key in metric_keys}, "source": "forgebench eval"})
    return report


def open_dataset(config, kinds: tuple[str, ...]) -> Dataset:
    root = config.resolve_path(config.data.dir)
    if not root.is_dir():
        raise ForgebenchError("dataset folder not found", path=root, where="field 'data.dir'",
                              hint="generate one: forgebench data generate shapes --out DIR")
    dataset = load_dataset(root)
    if dataset.kind not in kinds:
        raise ForgebenchError(f"dataset kind is {dataset.kind!r}; {config.recipe} needs "
                              + " or ".join(repr(k) for k in kinds),
                              path=root / F.MANIFEST, where="field 'kind'")
    return dataset


def dataset_manifest(config, kinds: tuple[str, ...]) -> dict:
    """The dataset's files and SHA-256 (what resume re-validates)."""
    dataset = open_dataset(config, kinds)
    return {"dataset": str(dataset.root), "version": dataset.version,
            "files": dataset.files_manifest()}


def split_records(dataset: Dataset, split: str) -> list[dict]:
    records = dataset.records(split)
    if not records:
        raise ForgebenchError(f"the dataset has no {split!r} records", path=dataset.root,
                              where="field 'split'",
                              hint="assign splits: forgebench data split DIR")
    return records


# -- images -------------------------------------------------------------------------------
def _fit(image: Image.Image, size: int, policy: str, resample: int) -> Image.Image:
    if policy == "stretch":
        return image.resize((size, size), resample)
    scale = size / max(image.size)
    inner = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                         resample)
    canvas = Image.new(image.mode, (size, size))
    canvas.paste(inner, ((size - inner.width) // 2, (size - inner.height) // 2))
    return canvas


def read_rgb(path: Path, section) -> tuple[np.ndarray, tuple[int, int]]:
    """An RGB image as uint8 [S, S, 3] after the configured resize policy, and its file size."""
    image, reason = media.open_image(path)
    if reason:
        raise ForgebenchError(reason, path=path)
    if image.mode != "RGB":
        raise ForgebenchError(f"image mode is {image.mode}; this recipe needs RGB", path=path,
                              hint="convert the file to 8-bit RGB (no alpha, no palette)")
    original = image.size
    if section.resize == "none":
        if image.size != (section.size, section.size):
            raise ForgebenchError(
                f"image size is {image.width}x{image.height}; the config expects "
                f"{section.size}x{section.size}", path=path, where="field 'image.size'",
                hint="set image.size to match, or image.resize = \"stretch\" or \"pad\"")
    elif image.size != (section.size, section.size):
        image = _fit(image, section.size, section.resize, Image.BILINEAR)
    return np.asarray(image, dtype=np.uint8), original


def read_mask(path: Path, image_size: tuple[int, int], section) -> np.ndarray:
    """A binary mask as bool [S, S]; it must have exactly its image's size."""
    mask, reason = media.open_image(path)
    array = None
    if not reason:
        array, reason = media.mask_array(mask)
    if reason:
        raise ForgebenchError(reason, path=path)
    if mask.size != image_size:
        raise ForgebenchError(f"mask size {mask.width}x{mask.height} differs from its image's "
                              f"{image_size[0]}x{image_size[1]}", path=path,
                              hint="masks must be pixel-aligned with their images")
    if mask.size != (section.size, section.size):  # nearest keeps the mask binary
        mask = _fit(Image.fromarray((array > 0).astype(np.uint8) * 255, "L"), section.size,
                    section.resize, Image.NEAREST)
        array = np.asarray(mask)
    return array > 0


@dataclass
class ImageSet:
    """One split as tensors: images uint8 [N, 3, S, S], masks bool [N, 1, S, S] or None."""

    ids: list[str]
    images: torch.Tensor
    labels: torch.Tensor                  # [N] class index (-1 when unlabelled)
    has_object: torch.Tensor              # [N] bool
    boxes: torch.Tensor                   # [N, 4] normalized xyxy, zeros when empty
    masks: torch.Tensor | None = None
    records: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def float_images(self, index=slice(None)) -> torch.Tensor:
        return self.images[index].float() / 255.0


def image_set(dataset: Dataset, split: str, classes: list[str], section, *,
              need_masks: bool = False, keep: Callable[[dict], bool] = lambda r: True) -> ImageSet:
    records = [r for r in split_records(dataset, split) if keep(r)]
    ids, images, masks, labels, boxes, present = [], [], [], [], [], []
    for record in records:
        rgb, size = read_rgb(Path(record["image"]), section)
        images.append(rgb.transpose(2, 0, 1))
        label = record.get("label")
        labels.append(classes.index(label) if label in classes else -1)
        box = record.get("box")
        if need_masks or ("mask" in record and "box" not in record):
            mask = read_mask(Path(record["mask"]), size, section)
            masks.append(mask[None])
            box = media.box_from_mask(mask) if "box" not in record else box
        present.append(box is not None and label != F.EMPTY_LABEL)
        boxes.append(box if box is not None else [0.0, 0.0, 0.0, 0.0])
        ids.append(str(record.get("id")))
    return ImageSet(ids, torch.from_numpy(np.stack(images)), torch.tensor(labels),
                    torch.tensor(present), torch.tensor(boxes, dtype=torch.float32),
                    torch.from_numpy(np.stack(masks)) if masks else None, records)


def augment(images: torch.Tensor, generator: torch.Generator, *, hflip: bool, rot90: bool,
            masks: torch.Tensor | None = None, boxes: torch.Tensor | None = None):
    """Random horizontal flip and 90° rotation per example, applied identically to image, mask
    and box (boxes: normalized xyxy, exclusive max edge)."""
    n = images.shape[0]
    flips = torch.rand(n, generator=generator) < 0.5 if hflip else torch.zeros(n, dtype=torch.bool)
    turns = torch.randint(0, 4, (n,), generator=generator) if rot90 else torch.zeros(n).long()
    images = images.clone()
    masks = masks.clone() if masks is not None else None
    boxes = boxes.clone() if boxes is not None else None
    for i in range(n):
        if flips[i]:
            images[i] = images[i].flip(-1)
            if masks is not None:
                masks[i] = masks[i].flip(-1)
            if boxes is not None:
                x0, y0, x1, y1 = boxes[i].tolist()
                boxes[i] = torch.tensor([1 - x1, y0, 1 - x0, y1])
        k = int(turns[i])
        if k:
            images[i] = torch.rot90(images[i], k, dims=(-2, -1))
            if masks is not None:
                masks[i] = torch.rot90(masks[i], k, dims=(-2, -1))
            if boxes is not None:
                for _ in range(k):  # rot90 (counter-clockwise): new = [y0, 1-x1, y1, 1-x0]
                    x0, y0, x1, y1 = boxes[i].tolist()
                    boxes[i] = torch.tensor([y0, 1 - x1, y1, 1 - x0])
    return images, masks, boxes


def save_png(path: Path, array: np.ndarray) -> None:
    """uint8 [H, W] or [H, W, 3] to PNG, atomically."""
    mode = "L" if array.ndim == 2 else "RGB"
    with atomic_writer(path) as handle:
        Image.fromarray(np.ascontiguousarray(array), mode).save(handle, format="PNG")


# -- audio --------------------------------------------------------------------------------
def read_clip(path: Path, section) -> np.ndarray:
    """A mono PCM WAV of exactly the configured rate and length as float32 [L] in [-1, 1]."""
    spec = {"channels": 1, "sample_rate": section.sample_rate, "samples": section.samples}
    audio, _, reason = media.check_audio(path, spec)
    if reason:
        raise ForgebenchError(reason, path=path,
                              hint="prepare clips offline as mono 16-bit WAV at the configured "
                                   "rate and length; nothing is resampled or cropped here")
    return audio[0]


def write_wav(path: Path, wave: np.ndarray, sample_rate: int) -> None:
    """Mono PCM16 WAV, clipped to [-1, 1] and never peak-normalized."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(wave, -1, 1), sample_rate, subtype="PCM_16", format="WAV")
    atomic_write_bytes(path, buffer.getvalue())


# -- checkpoints and the class contract ---------------------------------------------------
def autocast(precision: str):
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
    model is in eval mode and gradients are off). With `select_best`, the lowest val loss is
    recorded as the run's best checkpoint and protected from retention.
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


def train_loop(job: Job, loop: Loop) -> None:
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
        cursor = DataCursor.from_state(state["cursor"])
        set_generator_state(generator, state["generator"])
        set_rng_state(state["rng"])
        step, skipped_total = state["step"], state["skipped_total"]
        elapsed_before, best = state["elapsed_s"], state["best"]

    def checkpoint_now() -> Checkpoint:
        job.stage = "save"
        tensors = dict(loop.model.state_dict())
        if loop.ema is not None:
            tensors.update({EMA_PREFIX + k: v for k, v in loop.ema.state().items()})
        state = {"cursor": cursor.state(), "generator": generator_state(generator),
                 "rng": rng_state(), "skipped_total": skipped_total,
                 "elapsed_s": clock.elapsed, "best": best, "invocation": job.invocation}
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
        if loop.select_best and (best is None or result["loss"] < best["loss"]):
            best = {"checkpoint": checkpoint_name(step), "step": step, **result}
            run.set_status("running", best_checkpoint=best["checkpoint"])

    clock = StepClock(elapsed_before)
    loop.model.train()
    bar = job.progress(config.steps, initial=step)
    while step < config.steps and not job.stop_requested:
        lr = lr_at(step, lr=opt.lr, warmup=opt.warmup, total=config.steps,
                   schedule=opt.schedule, min_lr_ratio=opt.min_lr_ratio)
        set_lr(loop.optimizer, lr)
        job.stage = "forward"
        indices = cursor.take(config.batch_size)
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
        if step % config.log_every == 0 or step == config.steps:
            run.log_metric({
                "invocation": job.invocation, "step": step, "split": "train", "loss": value,
                "grad_norm": outcome.grad_norm, "clipped": outcome.clipped,
                "skipped": outcome.skipped, "skipped_total": skipped_total, "lr": lr,
                "examples": len(indices), "examples_per_s": examples_per_s,
                "epoch": cursor.epoch, "elapsed_s": clock.elapsed,
                "peak_rss_mb": peak_rss_mb()})
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}")
        job.step_done(step)
        eval_due = bool(config.eval_every) and step % config.eval_every == 0
        if eval_due or step == config.steps:
            evaluate_val()
        if (eval_due or step == config.steps or job.stop_requested
                or (config.save_every and step % config.save_every == 0)):
            checkpoint_now()
    bar.close()


def meta_for(config, classes: list[str], **model: object) -> dict:
    """What a checkpoint must carry to be used on its own: classes, preprocessing, model."""
    section = getattr(config, "image", None) or getattr(config, "audio", None)
    return {"recipe": config.recipe, "classes": list(classes),
            "preprocessing": section.model_dump() if section is not None else None,
            "model": json.loads(json.dumps(model, default=list))}


# -- the denoising generators (image-generate, audio-generate) ----------------------------
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
    optimizer = build_adamw(model.named_parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                            betas=(opt.beta1, opt.beta2))

    def precision():
        return autocast(config.precision)

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        x0, labels = train_batch(indices, generator)
        return denoising_loss(model, schedule, x0, labels, model.null_label, d.cond_dropout,
                              generator, precision)

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
