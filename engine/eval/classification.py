"""Confusion matrix and macro-F1: every class counts equally, so a rare class cannot hide."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def confusion_matrix(targets: Sequence[int], predictions: Sequence[int],
                     num_classes: int) -> np.ndarray:
    """`[true, predicted]` counts, shape [num_classes, num_classes]."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (np.asarray(targets, dtype=np.int64),
                       np.asarray(predictions, dtype=np.int64)), 1)
    return matrix


def per_class_scores(matrix: np.ndarray) -> list[dict]:
    """Precision, recall, F1 and support per class; an undefined ratio (0/0) counts as 0."""
    matrix = np.asarray(matrix, dtype=np.float64)
    true_pos = np.diag(matrix)
    predicted = matrix.sum(axis=0)
    support = matrix.sum(axis=1)
    scores = []
    for k in range(matrix.shape[0]):
        precision = true_pos[k] / predicted[k] if predicted[k] else 0.0
        recall = true_pos[k] / support[k] if support[k] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        scores.append({"precision": float(precision), "recall": float(recall),
                       "f1": float(f1), "support": int(support[k])})
    return scores


def macro_f1(matrix: np.ndarray) -> float:
    """Unweighted mean F1 over the classes that occur in the targets or the predictions."""
    matrix = np.asarray(matrix)
    present = (matrix.sum(axis=0) + matrix.sum(axis=1)) > 0
    scores = [s["f1"] for s, keep in zip(per_class_scores(matrix), present) if keep]
    return float(np.mean(scores)) if scores else 0.0


def classification_report(targets: Sequence[int], predictions: Sequence[int],
                          classes: Sequence[str]) -> dict:
    """The JSON-ready summary the classify recipe writes into evals/."""
    matrix = confusion_matrix(targets, predictions, len(classes))
    total = int(matrix.sum())
    return {
        "classes": list(classes),
        "n": total,
        "accuracy": float(np.trace(matrix) / total) if total else 0.0,
        "macro_f1": macro_f1(matrix),
        "per_class": dict(zip(classes, per_class_scores(matrix))),
        "confusion_matrix": matrix.tolist(),
        "confusion_matrix_axes": "rows = true class, columns = predicted class",
    }
