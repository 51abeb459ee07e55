"""Binary-classifier metrics in numpy: ranking, probability quality, and an alert threshold.

Definitions (the ones scikit-learn uses, so its functions serve as the test oracle):

* average precision = sum over distinct score thresholds t (descending) of
  (recall(t) - recall(previous t)) * precision(t); no interpolation.
* ROC-AUC = probability a random positive scores above a random negative, ties counted half.
* reliability bins: `bins` equal-width bins over [0, 1] (p = 1 falls in the last); each gives
  its count, mean predicted probability and observed positive fraction. ECE = sum over
  non-empty bins of count / n * |mean probability - positive fraction|.
* equal-mass ECE: the same sum over `bins` bins of (nearly) equal row counts, cut in the
  order of the sorted probabilities (ties kept in row order), so no bin is nearly empty.
* ECE noise floor: the mean ECE the same probabilities would show if they were perfectly
  calibrated, i.e. over `draws` label sets drawn as Bernoulli(probability) with a fixed seed.
  On a few hundred rows it is several hundredths: an ECE near it is indistinguishable from
  a calibrated model, and a change smaller than it is not evidence either way.
* an alert fires when probability >= threshold. `choose_threshold` picks it on one split's
  labels (the validation split: never the test labels) by the highest F1, by the highest
  precision whose recall meets a floor, or by the lowest cost_fp * FP + cost_fn * FN.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-15


def sweep(target: np.ndarray, score: np.ndarray):
    """Distinct thresholds (descending) with the TP and FP counts of `score >= threshold`."""
    order = np.argsort(-score, kind="mergesort")
    score, target = score[order], target[order]
    last_of_run = np.r_[np.nonzero(np.diff(score))[0], len(score) - 1]
    tp = np.cumsum(target)[last_of_run].astype(np.float64)
    fp = (last_of_run + 1) - tp
    return score[last_of_run], tp, fp


def pr_curve(target: np.ndarray, score: np.ndarray) -> dict[str, np.ndarray]:
    thresholds, tp, fp = sweep(np.asarray(target), np.asarray(score, dtype=np.float64))
    positives = max(tp[-1], 1.0)
    return {"threshold": thresholds, "precision": tp / (tp + fp), "recall": tp / positives}


def average_precision(target: np.ndarray, score: np.ndarray) -> float:
    curve = pr_curve(target, score)
    recall_steps = np.diff(np.r_[0.0, curve["recall"]])
    return float(np.sum(recall_steps * curve["precision"]))


def roc_auc(target: np.ndarray, score: np.ndarray) -> float:
    target = np.asarray(target).astype(bool)
    score = np.asarray(score, dtype=np.float64)
    n_pos, n_neg = int(target.sum()), int((~target).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    sorted_scores = score[order]
    # average rank within ties: each run of equal scores shares the mean of its ranks
    starts = np.r_[0, np.nonzero(np.diff(sorted_scores))[0] + 1]
    ends = np.r_[starts[1:], len(score)]
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2.0
    return float((ranks[target].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier(target: np.ndarray, probability: np.ndarray) -> float:
    return float(np.mean((np.asarray(probability) - np.asarray(target)) ** 2))


def log_loss(target: np.ndarray, probability: np.ndarray) -> float:
    p = np.clip(np.asarray(probability, dtype=np.float64), EPS, 1 - EPS)
    y = np.asarray(target)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def reliability(target: np.ndarray, probability: np.ndarray, bins: int = 10) -> dict:
    """Per-bin counts, mean probability, positive fraction, and the ECE over them."""
    probability = np.asarray(probability, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    index = np.minimum((probability * bins).astype(np.int64), bins - 1)
    rows, ece = [], 0.0
    for b in range(bins):
        members = index == b
        count = int(members.sum())
        mean_p = float(probability[members].mean()) if count else None
        positive = float(target[members].mean()) if count else None
        if count:
            ece += count / len(probability) * abs(mean_p - positive)
        rows.append({"low": b / bins, "high": (b + 1) / bins, "count": count,
                     "mean_probability": mean_p, "positive_fraction": positive})
    return {"bins": rows, "ece": float(ece)}


def equal_mass_ece(target: np.ndarray, probability: np.ndarray, bins: int = 10) -> float:
    probability = np.asarray(probability, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    order = np.argsort(probability, kind="mergesort")
    return float(sum(len(part) / len(order) * abs(probability[part].mean() - target[part].mean())
                     for part in np.array_split(order, bins) if len(part)))


def ece_noise_floor(probability: np.ndarray, bins: int = 10, draws: int = 200,
                    seed: int = 0) -> float:
    probability = np.asarray(probability, dtype=np.float64)
    rng = np.random.default_rng(seed)
    labels = rng.random((draws, len(probability))) < probability
    return float(np.mean([reliability(row, probability, bins)["ece"] for row in labels]))


def confusion(target: np.ndarray, probability: np.ndarray, threshold: float) -> dict:
    """Counts and rates of the alert `probability >= threshold`."""
    target = np.asarray(target).astype(bool)
    alert = np.asarray(probability) >= threshold
    tp, fp = int(np.sum(alert & target)), int(np.sum(alert & ~target))
    fn, tn = int(np.sum(~alert & target)), int(np.sum(~alert & ~target))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"threshold": float(threshold), "tn": tn, "fp": fp, "fn": fn, "tp": tp,
            "precision": precision, "recall": recall, "f1": f1}


def choose_threshold(target: np.ndarray, probability: np.ndarray, rule: str = "f1", *,
                     min_recall: float = 0.8, cost_fp: float = 1.0, cost_fn: float = 1.0) -> dict:
    """The threshold `rule` prefers among the distinct probabilities; ties go to the highest
    threshold (fewer alerts for the same score). Returns `confusion` at it plus the rule."""
    target = np.asarray(target)
    thresholds, tp, fp = sweep(target, np.asarray(probability, dtype=np.float64))
    positives = float(target.sum())
    fn = positives - tp
    recall = tp / max(positives, 1.0)
    precision = tp / (tp + fp)
    if rule == "f1":
        objective = 2 * tp / (2 * tp + fp + fn)
    elif rule == "recall_floor":
        objective = np.where(recall >= min_recall, precision, -1.0)
    elif rule == "cost":
        objective = -(cost_fp * fp + cost_fn * fn)
    else:
        raise ValueError(f"unknown threshold rule {rule!r}")
    best = int(np.argmax(objective))  # first maximum = highest threshold
    return dict(confusion(target, probability, thresholds[best]), rule=rule)
