"""A dataset's records as training tensors, for the image and audio recipes: open and check
the dataset a config names, read and check images, masks and clips (fitting them to the
configured size), label-preserving augmentation, and writing generated PNGs and WAVs.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from engine.data import formats as F
from engine.data import media
from engine.data.dataset import VERSION_SCHEME, Dataset, load_dataset
from engine.data.generators import sample_hint
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_bytes, atomic_writer


def open_dataset(config, kinds: tuple[str, ...]) -> Dataset:
    root = config.resolve_path(config.data.dir, "field 'data.dir'")
    if not root.is_dir():
        raise ForgebenchError("dataset folder not found", path=root, where="field 'data.dir'",
                              hint=sample_hint(kinds))
    dataset = load_dataset(root)
    if dataset.kind not in kinds:
        raise ForgebenchError(f"dataset kind is {dataset.kind!r}; {config.recipe} needs "
                              + " or ".join(repr(k) for k in kinds),
                              path=root / F.MANIFEST, where="field 'kind'")
    return dataset


def dataset_manifest(config, kinds: tuple[str, ...]) -> dict:
    """The dataset's folder, version and files' SHA-256: what resume re-validates
    (`engine.data.dataset.data_change` compares them, a record from before versions covered
    dataset.json included)."""
    dataset = open_dataset(config, kinds)
    return {"dataset": str(dataset.root), "version": dataset.version,
            "version_scheme": VERSION_SCHEME, "files": dataset.files_manifest()}


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
    """An RGB image as uint8 [S, S, 3] after the configured resize policy, and its file size.

    Greyscale, palette, alpha and 16-bit files are converted as `media.rgb_conversion` says
    (what `data validate` accepted, and what the data card counts)."""
    image, reason = media.open_image(path)
    if not reason:
        image, reason = media.to_rgb(image)
    if reason:
        raise ForgebenchError(reason, path=path)
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
