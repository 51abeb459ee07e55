"""One-object detection metrics: box IoU, detection precision/recall and false alarms.

A detection is emitted when objectness >= `threshold`; it is correct only when the image holds
an object and the box overlaps it with IoU >= `iou_threshold`. Mean IoU is over all positive
images (whether or not a box was emitted), so a detector cannot raise it by staying silent.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two [x0, y0, x1, y1] boxes (max edges exclusive)."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def detection_report(scores: Sequence[float], boxes: Sequence[Sequence[float]],
                     targets: Sequence[Sequence[float] | None], threshold: float = 0.5,
                     iou_threshold: float = 0.5) -> dict:
    """Summary over images; `targets[i]` is None for an empty image."""
    ious, per_image = [], []
    true_pos = emitted = positives = empties = false_alarms = 0
    for score, box, target in zip(scores, boxes, targets):
        emit = score >= threshold
        emitted += emit
        record = {"score": float(score), "emitted": bool(emit), "box": [float(v) for v in box]}
        if target is None:
            empties += 1
            false_alarms += emit
        else:
            positives += 1
            overlap = box_iou(box, target)
            ious.append(overlap)
            record["iou"] = overlap
            true_pos += emit and overlap >= iou_threshold
        per_image.append(record)
    return {
        "n": len(per_image), "positives": positives, "empty_images": empties,
        "threshold": threshold, "iou_threshold": iou_threshold,
        "mean_iou": float(np.mean(ious)) if ious else None,
        "precision": true_pos / emitted if emitted else None,
        "recall": true_pos / positives if positives else None,
        "false_alarm_rate": false_alarms / empties if empties else None,
        "false_alarms": int(false_alarms),
        "per_image": per_image,
    }
