"""Shapes with masks: one circle, square or triangle (or nothing) per RGB image.

Nuisance factors vary independently of the class so that only the shape outline teaches it:
foreground and background colours are drawn uniformly (kept apart enough to see), the
background carries a random illumination gradient and a faint texture, and position, size
and rotation are random. Each image is drawn from its own seed (seed, index), so a larger `n`
reproduces the smaller set exactly and adds to it. Boxes follow the handbook's rule: derived
from the mask, normalized xyxy, exclusive max edge, null for an empty scene.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from PIL import Image

from engine.data import formats as F
from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, RECORD_RIGHTS, staged_dataset_dir
from engine.data.media import box_from_mask
from engine.data.splits import DEFAULT_RATIOS, block_split

CLASSES = ("circle", "square", "triangle")
MIN_COLOUR_DISTANCE = 90.0  # RGB distance between object and background


def shape_mask(label: str, size: int, cx: float, cy: float, radius: float,
               angle: float) -> np.ndarray:
    """Boolean [size, size] mask of a shape inscribed in a circle of `radius`, tested at
    pixel centres; the square and triangle are rotated by `angle` radians."""
    ys, xs = np.mgrid[0:size, 0:size] + 0.5
    dx, dy = xs - cx, ys - cy
    if label == "circle":
        return dx * dx + dy * dy <= radius * radius
    u = dx * np.cos(angle) + dy * np.sin(angle)
    v = -dx * np.sin(angle) + dy * np.cos(angle)
    if label == "square":
        half = radius / np.sqrt(2.0)
        return (np.abs(u) <= half) & (np.abs(v) <= half)
    # equilateral triangle: inside all three edge half-planes (apothem = radius / 2)
    inside = np.ones((size, size), dtype=bool)
    for k in range(3):
        theta = 2 * np.pi * k / 3
        inside &= u * np.cos(theta) + v * np.sin(theta) <= radius / 2
    return inside


def _colour_pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    background = rng.uniform(0, 255, 3)
    while True:
        foreground = rng.uniform(0, 255, 3)
        if np.linalg.norm(foreground - background) >= MIN_COLOUR_DISTANCE:
            return foreground, background


def draw_scene(rng: np.random.Generator, label: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(RGB uint8 [size, size, 3], mask uint8 [size, size] in {0, 255})."""
    foreground, background = _colour_pair(rng)
    ys, xs = np.mgrid[0:size, 0:size] / size
    phi = rng.uniform(0, 2 * np.pi)
    light = rng.uniform(-40, 40) * ((xs - 0.5) * np.cos(phi) + (ys - 0.5) * np.sin(phi))
    texture = np.zeros((size, size))
    for _ in range(2):
        freq, theta, phase = rng.uniform(2, 9), rng.uniform(0, np.pi), rng.uniform(0, 2 * np.pi)
        texture += rng.uniform(4, 12) * np.sin(
            2 * np.pi * freq * (xs * np.cos(theta) + ys * np.sin(theta)) + phase)
    mask = np.zeros((size, size), dtype=bool)
    if label != F.EMPTY_LABEL:
        radius = rng.uniform(0.15, 0.32) * size
        cx, cy = rng.uniform(radius + 1, size - radius - 1, 2)
        mask = shape_mask(label, size, cx, cy, radius, rng.uniform(0, 2 * np.pi))
    base = np.where(mask[..., None], foreground, background + texture[..., None])
    image = base + light[..., None] + rng.normal(0, 4, (size, size, 3))
    return np.clip(np.rint(image), 0, 255).astype(np.uint8), mask.astype(np.uint8) * 255


def generate_shapes(out_dir: str | os.PathLike, n: int = 600, size: int = 64, seed: int = 0,
                    empty_prob: float = 0.1) -> Path:
    """Write an `image-masks` dataset of `n` scenes to `out_dir` (which must be new or empty)."""
    with staged_dataset_dir(out_dir) as root:
        (root / "images").mkdir()
        (root / "masks").mkdir()
        lines = []
        for index in range(n):
            rng = np.random.default_rng([seed, index])
            label = F.EMPTY_LABEL if rng.random() < empty_prob else CLASSES[rng.integers(3)]
            image, mask = draw_scene(rng, label, size)
            rid = f"shape-{index:05d}"
            Image.fromarray(image, "RGB").save(root / "images" / f"{rid}.png")
            Image.fromarray(mask, "L").save(root / "masks" / f"{rid}.png")
            lines.append(json.dumps({
                "id": rid, "image": f"images/{rid}.png", "mask": f"masks/{rid}.png",
                "label": label, "box": box_from_mask(mask), "group": rid,
                "split": block_split(index, seed),
                "source": "forgebench shapes generator",
                "rights": RECORD_RIGHTS}))
        (root / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        write_manifest(
            root, "image-masks", "shapes", records="records.jsonl", classes=list(CLASSES),
            image={"mode": "RGB", "size": [size, size]}, mask_values="binary", max_objects=1,
            split_policy={"method": "block", "ratios": DEFAULT_RATIOS, "seed": seed,
                          "group_field": "group"},
            provenance={"generator": "engine.data.generators.shapes", "seed": seed, "n": n,
                        "size": size, "empty_prob": empty_prob},
            rights=GENERATED_RIGHTS,
            card={"task": "segment (or box, or classify) the single shape in a scene; "
                          "'empty' scenes hold none",
                  "sources": ["procedural drawing by engine.data.generators.shapes"],
                  "preprocessing": "none: images are written as generated",
                  "known_gaps": ["flat synthetic shapes; says nothing about photographs",
                                 "at most one object per image"],
                  "intended_uses": ["pipeline smoke tests", "teaching segmentation, boxes "
                                    "and classification"],
                  "prohibited_uses": ["claims about real-world detection quality"]})
    return Path(out_dir).expanduser().absolute()
