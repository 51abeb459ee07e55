"""Polygon outlines of a binary mask with their hole hierarchy (what OpenCV's RETR_TREE gives).

Foreground is 8-connected and background 4-connected, so every hole is a closed region and
diagonal pixels of one object stay one object. Each outline follows pixel edges (vertex
coordinates are pixel corners: x to the right, y down), so with no simplification the polygons
enclose exactly the mask's pixels: outer contours run clockwise on screen (positive shoelace
area), holes counter-clockwise (negative), and the signed areas sum to the foreground pixel
count. Depth alternates: objects at even depth, holes at odd depth, islands in holes deeper.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np

from engine.eval.masks import as_bool_mask
from engine.fsutil import atomic_write_json

# direction index -> (dx, dy); turning right is +1, left is -1 (y points down)
_STEPS = ((1, 0), (0, 1), (-1, 0), (0, -1))
_N8 = [(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1) if dr or dc]
_N4 = [(-1, 0), (1, 0), (0, -1), (0, 1)]


def label_components(mask: np.ndarray, value: bool, neighbours) -> tuple[np.ndarray, int]:
    """Label the connected pixels equal to `value`; 0 = not part of any, labels start at 1."""
    h, w = mask.shape
    labels = np.zeros((h, w), dtype=np.int32)
    count = 0
    for r0, c0 in zip(*np.nonzero(mask == value)):
        if labels[r0, c0]:
            continue
        count += 1
        labels[r0, c0] = count
        queue = deque([(r0, c0)])
        while queue:
            r, c = queue.popleft()
            for dr, dc in neighbours:
                rr, cc = r + dr, c + dc
                if 0 <= rr < h and 0 <= cc < w and not labels[rr, cc] and mask[rr, cc] == value:
                    labels[rr, cc] = count
                    queue.append((rr, cc))
    return labels, count


def _ahead(x: int, y: int, d: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(row, col) of the pixels ahead-right and ahead-left of vertex (x, y) facing d."""
    if d == 0:
        return (y, x), (y - 1, x)
    if d == 1:
        return (y, x - 1), (y, x)
    if d == 2:
        return (y - 1, x - 1), (y, x - 1)
    return (y - 1, x), (y - 1, x - 1)


def trace_outline(region: np.ndarray, eight_connected: bool) -> list[tuple[int, int]]:
    """Corner vertices of the outer boundary of one connected region, region on the right.

    Starts on the top edge of the region's first pixel in raster order, which always lies on
    the outer boundary. At a diagonal (saddle) vertex an 8-connected region turns left to keep
    its diagonal pixels together; a 4-connected region turns right.
    """
    h, w = region.shape

    def inside(rc: tuple[int, int]) -> bool:
        r, c = rc
        return 0 <= r < h and 0 <= c < w and bool(region[r, c])

    rows, cols = np.nonzero(region)
    start = (int(cols[0]), int(rows[0]))
    x, y, d = start[0], start[1], 0
    points = [start]
    while True:
        x, y = x + _STEPS[d][0], y + _STEPS[d][1]
        ahead_right, ahead_left = _ahead(x, y, d)
        right_in, left_in = inside(ahead_right), inside(ahead_left)
        if right_in and not left_in:
            turn = 0
        elif not right_in and not left_in:
            turn = 1
        elif right_in and left_in:
            turn = -1
        else:
            turn = -1 if eight_connected else 1
        new_d = (d + turn) % 4
        if (x, y) == start and new_d == 0:
            return points
        if new_d != d:
            points.append((x, y))
        d = new_d


def signed_area(points: list[tuple[float, float]]) -> float:
    """Shoelace area; positive for clockwise-on-screen rings (y down)."""
    pts = np.asarray(points, dtype=np.float64)
    x, y = pts[:, 0], pts[:, 1]
    return float(0.5 * (np.dot(x, np.roll(y, -1)) - np.dot(np.roll(x, -1), y)))


def _point_line_distance(points: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ab = b - a
    length = np.hypot(*ab)
    if length == 0:
        return np.hypot(*(points - a).T)
    return np.abs(ab[0] * (points[:, 1] - a[1]) - ab[1] * (points[:, 0] - a[0])) / length


def _douglas_peucker(points: np.ndarray, epsilon: float) -> np.ndarray:
    if len(points) < 3:
        return points
    distances = _point_line_distance(points[1:-1], points[0], points[-1])
    k = int(np.argmax(distances)) + 1
    if distances[k - 1] <= epsilon:
        return points[[0, -1]]
    left = _douglas_peucker(points[:k + 1], epsilon)
    return np.concatenate([left[:-1], _douglas_peucker(points[k:], epsilon)])


def simplify_ring(points: list[tuple[int, int]], epsilon: float) -> list[tuple[float, float]]:
    """Douglas-Peucker on a closed ring, split at the vertex farthest from the first one."""
    if epsilon <= 0 or len(points) <= 4:
        return [tuple(p) for p in points]
    pts = np.asarray(points, dtype=np.float64)
    far = int(np.argmax(np.hypot(*(pts - pts[0]).T)))
    first = _douglas_peucker(pts[:far + 1], epsilon)
    second = _douglas_peucker(np.concatenate([pts[far:], pts[:1]]), epsilon)
    ring = np.concatenate([first[:-1], second[:-1]])
    if len(ring) < 3:  # a sliver collapsed to a line: keep the exact outline
        return [tuple(p) for p in points]
    return [tuple(float(v) for v in p) for p in ring]


def _parent(kind: str, ring, ids: dict, fg_labels: np.ndarray, bg_labels: np.ndarray,
            touches_border: set) -> int | None:
    """The id of the contour enclosing a ring: the pixel just above a region's first (top-left)
    pixel lies in the enclosing region (a hole's object, an object's hole; none at the top
    level)."""
    x0, y0 = min(ring, key=lambda p: (p[1], p[0]))
    if y0 == 0:
        return None
    if kind == "hole":
        return ids[("object", int(fg_labels[y0 - 1, x0]))]
    around = int(bg_labels[y0 - 1, x0])
    return None if around in touches_border else ids[("hole", around)]


def extract_contours(mask: np.ndarray, epsilon_px: float = 0.0) -> dict:
    """All object outlines and holes of a mask as a JSON-ready tree.

    Each contour: id, parent (None at top level), children, depth, is_hole, points [[x, y]...],
    area_px (unsigned area of the exact, unsimplified ring).
    """
    mask = as_bool_mask(mask)
    h, w = mask.shape
    fg_labels, n_fg = label_components(mask, True, _N8)
    bg_labels, n_bg = label_components(mask, False, _N4)
    touches_border = set(np.unique(np.concatenate(
        [bg_labels[0], bg_labels[-1], bg_labels[:, 0], bg_labels[:, -1]])).tolist()) - {0}

    items = []  # (kind, label, exact ring, first pixel)
    for label in range(1, n_fg + 1):
        region = fg_labels == label
        items.append(("object", label, trace_outline(region, eight_connected=True)))
    for label in range(1, n_bg + 1):
        if label in touches_border:
            continue
        region = bg_labels == label
        ring = trace_outline(region, eight_connected=False)[::-1]  # foreground on the right
        items.append(("hole", label, ring))

    ids = {(kind, label): i for i, (kind, label, _) in enumerate(items)}
    contours = []
    for i, (kind, _label, ring) in enumerate(items):
        parent = _parent(kind, ring, ids, fg_labels, bg_labels, touches_border)
        contours.append({"id": i, "parent": parent, "children": [], "depth": 0,
                         "is_hole": kind == "hole", "area_px": abs(signed_area(ring)),
                         "points": [list(p) for p in simplify_ring(ring, epsilon_px)]})
    for contour in contours:
        if contour["parent"] is not None:
            contours[contour["parent"]]["children"].append(contour["id"])
    for contour in contours:
        depth, parent = 0, contour["parent"]
        while parent is not None:
            depth, parent = depth + 1, contours[parent]["parent"]
        contour["depth"] = depth
    return {
        "width": w, "height": h, "epsilon_px": epsilon_px,
        "coordinates": "pixel corners; x to the right, y down; objects clockwise, holes "
                       "counter-clockwise on screen",
        "connectivity": "foreground 8-connected, background 4-connected",
        "contours": contours,
    }


def write_contours(mask: np.ndarray, path: str | Path, epsilon_px: float = 1.0) -> dict:
    result = extract_contours(mask, epsilon_px)
    atomic_write_json(path, result)
    return result
