"""Mask inspection and editing: overlay data, the derived box, contours and holes, brush and
eraser strokes with undo/redo, and saving the edit as a new dataset version (the original
dataset folder is never written)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from engine.data.dataset import Dataset, load_dataset, save_new_version
from engine.data.media import box_from_mask, mask_array, open_image
from engine.errors import ForgebenchError
from engine.eval.masks import boundary, dilate

MAX_UNDO = 100


def holes(mask: np.ndarray) -> np.ndarray:
    """Background pixels enclosed by foreground: not 8-connected to the image border."""
    background = ~mask
    reach = np.zeros_like(mask)
    reach[0, :], reach[-1, :], reach[:, 0], reach[:, -1] = (background[0, :], background[-1, :],
                                                            background[:, 0], background[:, -1])
    while True:
        grown = dilate(reach, 1) & background
        if np.array_equal(grown, reach):
            return background & ~reach
        reach = grown


def count_regions(mask: np.ndarray) -> int:
    """Number of 8-connected regions of True pixels."""
    remaining, count = mask.copy(), 0
    while remaining.any():
        seed = np.zeros_like(remaining)
        y, x = np.argwhere(remaining)[0]
        seed[y, x] = True
        while True:
            grown = dilate(seed, 1) & remaining
            if np.array_equal(grown, seed):
                break
            seed = grown
        remaining &= ~seed
        count += 1
    return count


class MaskEditor:
    """A binary mask [H, W] edited with round brushes; one stroke is one undo step."""

    def __init__(self, mask: np.ndarray):
        self.mask = np.asarray(mask).astype(bool).copy()
        self.original = self.mask.copy()
        self._undo: list[np.ndarray] = []
        self._redo: list[np.ndarray] = []
        self._before: np.ndarray | None = None
        self._last: tuple[float, float] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.mask.shape

    @property
    def dirty(self) -> bool:
        return not np.array_equal(self.mask, self.original)

    @property
    def can_undo(self) -> bool:
        return bool(self._undo)

    @property
    def can_redo(self) -> bool:
        return bool(self._redo)

    def _disk(self, x: float, y: float, radius: float) -> np.ndarray:
        h, w = self.mask.shape
        yy, xx = np.ogrid[:h, :w]
        return (xx - x) ** 2 + (yy - y) ** 2 <= radius ** 2

    def begin_stroke(self) -> None:
        self._before = self.mask.copy()
        self._last = None

    def paint(self, x: float, y: float, radius: float, value: bool) -> None:
        """Paint (value True, the brush) or erase (False) a disk; a drag fills the gaps."""
        if self._before is None:
            self.begin_stroke()
        points = [(x, y)]
        if self._last is not None:
            lx, ly = self._last
            n = int(max(abs(x - lx), abs(y - ly)) / max(radius / 2, 0.5))
            points = [(lx + (x - lx) * t / (n + 1), ly + (y - ly) * t / (n + 1))
                      for t in range(1, n + 2)]
        for px, py in points:
            self.mask[self._disk(px, py, radius)] = value
        self._last = (x, y)

    def end_stroke(self) -> None:
        if self._before is not None and not np.array_equal(self._before, self.mask):
            self._undo.append(self._before)
            del self._undo[:-MAX_UNDO]
            self._redo.clear()
        self._before, self._last = None, None

    def stroke(self, points: list[tuple[float, float]], radius: float, value: bool) -> None:
        self.begin_stroke()
        for x, y in points:
            self.paint(x, y, radius, value)
        self.end_stroke()

    def undo(self) -> None:
        if self._undo:
            self._redo.append(self.mask.copy())
            self.mask = self._undo.pop()

    def redo(self) -> None:
        if self._redo:
            self._undo.append(self.mask.copy())
            self.mask = self._redo.pop()

    def box(self) -> list[float] | None:
        return box_from_mask(self.mask)

    def contour(self) -> np.ndarray:
        return boundary(self.mask)

    def holes(self) -> np.ndarray:
        return holes(self.mask)

    def png_bytes(self) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(self.mask.astype(np.uint8) * 255, mode="L").save(buffer, format="PNG")
        return buffer.getvalue()


def read_mask(path: Path) -> np.ndarray:
    image, reason = open_image(path)
    array = None
    if not reason:
        array, reason = mask_array(image)
    if reason:
        raise ForgebenchError(reason, path=path)
    return array > 0


def read_rgb(path: Path) -> np.ndarray:
    image, reason = open_image(path)
    if reason:
        raise ForgebenchError(reason, path=path)
    return np.asarray(image.convert("RGB"))


def _records_rel(dataset: Dataset) -> str:
    rel = dataset.manifest.get("records") or "records.jsonl"
    if rel not in dataset.manifest["files"]:
        raise ForgebenchError("the dataset's records file is not listed in dataset.json",
                              path=dataset.root / rel)
    return rel


def updated_records(dataset: Dataset, record_id: str, **fields) -> tuple[str, bytes]:
    """The records file with one record's fields replaced; every other line kept byte for byte."""
    rel = _records_rel(dataset)
    lines = (dataset.root / rel).read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        record = json.loads(line)
        if isinstance(record, dict) and record.get("id") == record_id:
            record.update(fields)
            lines[i] = json.dumps(record)
            return rel, "\n".join(lines).encode("utf-8")
    raise ForgebenchError(f"no record with id {record_id!r}", path=dataset.root / rel)


def save_mask_version(dataset: Dataset, record: dict, editor: MaskEditor,
                      label: str | None = None) -> Dataset:
    """Write the edited mask (and the box derived from it) as a new dataset version."""
    mask_rel = Path(record["mask"]).relative_to(dataset.root).as_posix()
    fields = {"box": editor.box()} if "box" in record or editor.box() is not None else {}
    if label:
        fields["label"] = label
    rel, records = updated_records(dataset, record["id"], **fields)
    note = f"edited mask of {record['id']} in the Labels & Masks pane"
    return save_new_version(dataset, {mask_rel: editor.png_bytes(), rel: records}, note)


def open_mask_dataset(path: str | Path) -> Dataset:
    """The dataset at `path`, validated with every image and mask decoded (seconds: the pane
    calls this off the GUI thread); raises ForgebenchError naming the first bad record."""
    return load_dataset(path)


def masked_records(dataset: Dataset) -> list[tuple[str, dict]]:
    """(list label, record) of every record that has a mask to edit."""
    return [(f"{r['id']}  ({r.get('label', '')}, {r.get('split', '')})", r)
            for r in dataset.records() if r.get("mask")]


def mask_datasets(paths: list[Path]) -> list[Path]:
    """The dataset folders that hold masks (image-masks kind)."""
    out = []
    for path in paths:
        try:
            kind = json.loads((path / "dataset.json").read_text(encoding="utf-8")).get("kind")
        except (OSError, json.JSONDecodeError):
            continue
        if kind in ("image-masks", "image-boxes"):
            out.append(path)
    return out



def segmentation_evals(run_dirs: list[Path]) -> list[tuple[str, Path]]:
    """(label, folder) of every per-image segmentation eval the runs wrote
    (`evals/<split>-<checkpoint>/per_image.jsonl`, see engine.recipes.image_segment)."""
    found = []
    for run in run_dirs:
        for table in sorted((run / "evals").glob("*/per_image.jsonl")):
            found.append((f"{run.name} · {table.parent.name}", table.parent))
    return found


def read_per_image(folder: Path) -> list[dict]:
    """Per-image scores with panel paths made absolute; worst IoU first."""
    rows = []
    for line in (folder / "per_image.jsonl").read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        panels = row.get("panels") or {}
        row["panels"] = {k: folder / v for k, v in panels.items() if isinstance(v, str)}
        rows.append(row)
    return sorted(rows, key=lambda r: (r.get("iou", 1.0), r.get("boundary_f1", 1.0)))
