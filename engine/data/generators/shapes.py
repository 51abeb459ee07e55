"""Shapes with masks: one circle, square or triangle (or nothing) per RGB image.

Each shape is drawn as a person would draw it: a filled shape with a darker outline, edges
anti-aliased (drawn by Pillow at four times the size and reduced), so a classifier's,
detector's, segmenter's or generator's pictures are recognisable at a glance. Nuisance factors
vary independently of the class so that only the shape outline teaches it: foreground and
background colours are drawn uniformly (kept apart enough to see), the background carries a
random illumination gradient and a faint texture, and position, size and rotation are random.
Each image is drawn from its own seed (seed, index), so a larger `n` reproduces the smaller set
exactly and adds to it. The mask is the shape's own drawing (pixels at least half covered), and
boxes follow the handbook's rule: derived from the mask, normalized xyxy, exclusive max edge,
null for an empty scene.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from engine.data import formats as F
from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, RECORD_RIGHTS, staged_dataset_dir
from engine.data.media import box_from_mask
from engine.data.splits import DEFAULT_RATIOS, block_split

CLASSES = ("circle", "square", "triangle")
MIN_COLOUR_DISTANCE = 90.0  # RGB distance between object and background
SUPERSAMPLE = 4             # shapes are drawn this many times larger, then reduced (anti-aliasing)
OUTLINE = 0.045             # outline width, as a fraction of the image size
OUTLINE_SHADE = 0.45        # the outline is the fill colour at this brightness
RADIUS = (0.2, 0.34)        # circumradius range, as a fraction of the image size


def shape_outline(label: str, cx: float, cy: float, radius: float,
                  angle: float) -> list[tuple[float, float]]:
    """The polygon of a square or equilateral triangle inscribed in a circle of `radius`
    around (cx, cy), rotated by `angle` radians (image coordinates, y down)."""
    corners = 4 if label == "square" else 3
    return [(cx + radius * np.cos(angle + 2 * np.pi * k / corners),
             cy + radius * np.sin(angle + 2 * np.pi * k / corners)) for k in range(corners)]


def shape_coverage(label: str, size: int, cx: float, cy: float, radius: float, angle: float,
                   inset: float = 0.0) -> np.ndarray:
    """Float [size, size] in [0, 1]: how much of each pixel the shape covers (drawn at
    SUPERSAMPLE times the size by Pillow and averaged down); `inset` shrinks the shape by that
    many pixels all round (the fill inside the outline)."""
    big = Image.new("L", (size * SUPERSAMPLE, size * SUPERSAMPLE), 0)
    draw = ImageDraw.Draw(big)
    scale = SUPERSAMPLE
    if label == "circle":
        r = (radius - inset) * scale
        draw.ellipse([cx * scale - r, cy * scale - r, cx * scale + r, cy * scale + r], fill=255)
    else:
        # a regular polygon's inset is its circumradius less inset / cos(pi / corners)
        corners = 4 if label == "square" else 3
        r = radius - inset / np.cos(np.pi / corners)
        draw.polygon([(x * scale, y * scale) for x, y in shape_outline(label, cx, cy, r, angle)],
                     fill=255)
    reduced = np.asarray(big, dtype=np.float64).reshape(size, scale, size, scale)
    return reduced.mean(axis=(1, 3)) / 255.0


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
    shape = np.zeros((size, size))
    fill = np.zeros((size, size))
    if label != F.EMPTY_LABEL:
        radius = rng.uniform(*RADIUS) * size
        cx, cy = rng.uniform(radius + 1, size - radius - 1, 2)
        angle = rng.uniform(0, 2 * np.pi)
        shape = shape_coverage(label, size, cx, cy, radius, angle)
        fill = shape_coverage(label, size, cx, cy, radius, angle, inset=OUTLINE * size)
    # background, then the outline colour over the whole shape, then the fill inside it
    outline = foreground * OUTLINE_SHADE
    base = background + texture[..., None]
    base = base * (1 - shape[..., None]) + outline * shape[..., None]
    base = base * (1 - fill[..., None]) + foreground * fill[..., None]
    image = base + light[..., None] + rng.normal(0, 4, (size, size, 3))
    mask = shape >= 0.5
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
