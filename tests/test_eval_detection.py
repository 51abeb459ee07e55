"""Detection and classification metrics against hand-computed cases."""

import numpy as np
import pytest

from engine.eval.classification import classification_report, confusion_matrix, macro_f1
from engine.eval.detection import box_iou, detection_report


def test_box_iou_by_hand():
    assert box_iou([0, 0, 2, 2], [1, 1, 3, 3]) == pytest.approx(1 / 7)
    assert box_iou([0.2, 0.2, 0.7, 0.6], [0.2, 0.2, 0.7, 0.6]) == pytest.approx(1.0)
    assert box_iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0.0


def test_detection_report_counts():
    target = [0.1, 0.1, 0.5, 0.5]
    scores = [0.9, 0.9, 0.2, 0.8, 0.1]
    boxes = [target, [0.3, 0.3, 0.7, 0.7], target, target, target]
    targets = [target, target, target, None, None]
    report = detection_report(scores, boxes, targets)
    # emitted: images 0, 1, 3. True positives: image 0 only (image 1 IoU = 0.04/0.28 < 0.5).
    assert report["precision"] == pytest.approx(1 / 3)
    assert report["recall"] == pytest.approx(1 / 3)
    assert report["false_alarm_rate"] == pytest.approx(1 / 2)
    assert report["mean_iou"] == pytest.approx((1 + 0.04 / 0.28 + 1) / 3)


def test_macro_f1_weights_classes_equally():
    # 8 of class 0 all right; class 1 (2 examples) always predicted as 0.
    targets = [0] * 8 + [1] * 2
    predictions = [0] * 10
    matrix = confusion_matrix(targets, predictions, 2)
    assert matrix.tolist() == [[8, 0], [2, 0]]
    f1_class0 = 2 * 0.8 * 1.0 / 1.8
    assert macro_f1(matrix) == pytest.approx((f1_class0 + 0) / 2)
    report = classification_report(targets, predictions, ["a", "b"])
    assert report["accuracy"] == pytest.approx(0.8)
    assert report["per_class"]["b"]["recall"] == 0.0


def test_macro_f1_matches_a_direct_computation():
    rng = np.random.default_rng(0)
    t, p = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
    f1s = []
    for k in range(4):
        tp = np.sum((t == k) & (p == k))
        prec, rec = tp / np.sum(p == k), tp / np.sum(t == k)
        f1s.append(2 * prec * rec / (prec + rec))
    assert macro_f1(confusion_matrix(t, p, 4)) == pytest.approx(np.mean(f1s))
