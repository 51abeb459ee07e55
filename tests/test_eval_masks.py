"""Mask metrics and contours against hand computations and the handbook's worked example."""

import numpy as np
import pytest

from engine.eval.contours import extract_contours, signed_area
from engine.eval.masks import boundary, boundary_f1, iou


def square(size=128, side=96, top=16, left=16):
    mask = np.zeros((size, size), dtype=bool)
    mask[top:top + side, left:left + side] = True
    return mask


def test_one_pixel_shift_of_a_96_square_is_the_handbook_example():
    target, shifted = square(), square(left=17)
    # Hand computation: overlap 96×95, union 96×97.
    assert iou(shifted, target) == pytest.approx(96 * 95 / (96 * 97))
    assert round(iou(shifted, target), 3) == 0.979
    # Exact-pixel boundary: top and bottom rows share 95 of 380 pixels each -> P = R = 0.5.
    assert np.count_nonzero(boundary(target)) == 4 * 96 - 4
    assert boundary_f1(shifted, target, tolerance=0) == pytest.approx(0.5)
    # The 2-px tolerance forgives the shift entirely.
    assert boundary_f1(shifted, target, tolerance=2) == pytest.approx(1.0)


def test_boundary_f1_tolerance_is_chebyshev():
    target = square(64, 20, 20, 20)
    diagonal = square(64, 20, 22, 22)  # shifted 2 px in x and y: Chebyshev 2, Euclidean 2.8
    assert boundary_f1(diagonal, target, tolerance=2) == pytest.approx(1.0)
    assert boundary_f1(diagonal, target, tolerance=1) < 1.0


def test_empty_mask_conventions():
    empty = np.zeros((32, 32), dtype=bool)
    full = square(32, 8, 4, 4)
    assert boundary_f1(empty, empty) == 1.0 and iou(empty, empty) == 1.0
    assert boundary_f1(full, empty) == 0.0 and boundary_f1(empty, full) == 0.0
    assert iou(full, empty) == 0.0


def test_uint8_png_masks_threshold_at_half():
    """A uint8 mask is foreground above 127 and a float one above 0.5: a square of 128 inside
    a border of 127 is the square alone (a threshold at 0 would take the border too)."""
    inner = square(32, 8, 4, 4)
    outer = square(32, 12, 2, 2)
    mask = np.where(inner, 128, np.where(outer, 127, 0)).astype(np.uint8)
    assert iou(mask, inner) == 1.0
    assert iou(mask, outer) < 1.0
    assert iou(np.where(inner, 0.51, np.where(outer, 0.5, 0.0)), inner) == 1.0


def _inside_even_odd(contours, x, y):
    """Even-odd point-in-polygon over all rings (pixel centres never lie on an edge)."""
    inside = False
    for contour in contours:
        pts = contour["points"]
        for (x1, y1), (x2, y2) in zip(pts, pts[1:] + pts[:1]):
            if (y1 > y) != (y2 > y) and x < x1 + (y - y1) * (x2 - x1) / (y2 - y1):
                inside = not inside
    return inside


def _ring_mask():
    mask = np.zeros((24, 24), dtype=bool)
    mask[2:20, 2:20] = True        # object
    mask[5:17, 5:17] = False       # its hole
    mask[8:12, 8:12] = True        # an island inside the hole
    mask[21:23, 21:23] = True      # a second top-level object
    mask[0, 23] = True
    mask[1, 22] = True             # diagonal pair: one 8-connected object
    return mask


def test_contours_keep_the_hole_hierarchy():
    result = extract_contours(_ring_mask())
    contours = result["contours"]
    assert len(contours) == 5
    by_depth = {}
    for c in contours:
        by_depth.setdefault(c["depth"], []).append(c)
    assert len(by_depth[0]) == 3 and not any(c["is_hole"] for c in by_depth[0])
    (hole,) = by_depth[1]
    (island,) = by_depth[2]
    assert hole["is_hole"] and not island["is_hole"]
    assert island["parent"] == hole["id"] and hole["id"] in contours[hole["parent"]]["children"]
    assert hole["area_px"] == 12 * 12 and island["area_px"] == 16
    # Exact polygons: signed areas sum to the pixel count.
    assert sum(signed_area(c["points"]) for c in contours) == pytest.approx(_ring_mask().sum())


def test_exact_contours_rasterise_back_to_the_mask():
    rng = np.random.default_rng(3)
    mask = rng.random((20, 20)) < 0.45
    contours = extract_contours(mask)["contours"]
    rebuilt = np.array([[_inside_even_odd(contours, c + 0.5, r + 0.5) for c in range(20)]
                        for r in range(20)])
    assert (rebuilt == mask).all()


def test_simplification_drops_vertices_of_a_staircase():
    mask = np.tril(np.ones((30, 30), dtype=bool))
    exact = extract_contours(mask, epsilon_px=0)["contours"][0]["points"]
    simple = extract_contours(mask, epsilon_px=1)["contours"][0]["points"]
    assert len(exact) > 50 and len(simple) <= 4
    assert abs(signed_area(simple) - mask.sum()) < 0.1 * mask.sum()
