"""Multi-class decision metrics in numpy: probabilities over a closed option set, temperature
calibration, and a selective (abstaining) policy. The binary pieces are reused, not copied:
top-label reliability is `binary.reliability` of "was the top option right" against its
probability, and the risk-coverage sweep is `binary.sweep` over the same pair.

Definitions:

* logits are rows of a padded [N, K] array with a boolean mask of real options (records may
  offer different numbers of options); a padded option gets probability exactly 0.
* temperature scaling: softmax(logits / T) with one T > 0, chosen from `TEMPERATURES` (201
  log-spaced values from 0.1 to 10, the handbook's chapter-24 grid) as the one with the lowest
  mean NLL on the calibration data (the first on ties). A T at either end of the grid is flagged
  `at_edge`: the best value may lie outside and needs a look. A positive T never changes which
  option is on top, so accuracy is the same before and after.
* accuracy: top option right; NLL: mean -ln p(right option); Brier: mean over records of the
  squared error summed over the record's options (one-hot target), so it lies in [0, 2].
* reliability bins / ECE: equal-width bins of the top-option probability, each with its count,
  mean probability and observed fraction right (`binary.reliability`).
* risk-coverage: the policy "answer when the top probability >= t, else abstain"; for each
  distinct t, coverage = answered / N and risk = wrong answers / answered.
  `choose_abstain_threshold` takes the lowest t whose risk is at most `max_risk` (the most
  coverage within the error budget), chosen on validation, never on the test labels.
"""

from __future__ import annotations

import numpy as np

from engine.eval import binary

TEMPERATURES = np.logspace(-1.0, 1.0, 201)


def pad_logits(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged per-record logits -> (logits [N, Kmax], mask [N, Kmax]); padding is 0 / False."""
    width = max(len(r) for r in rows)
    logits = np.zeros((len(rows), width))
    mask = np.zeros((len(rows), width), dtype=bool)
    for i, row in enumerate(rows):
        logits[i, :len(row)] = row
        mask[i, :len(row)] = True
    return logits, mask


def softmax(logits: np.ndarray, mask: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Row-wise softmax of logits / T over the real options (stable: the row max is removed)."""
    z = np.where(mask, np.asarray(logits, dtype=np.float64) / temperature, -np.inf)
    z = z - z.max(axis=1, keepdims=True)
    e = np.where(mask, np.exp(z), 0.0)
    return e / e.sum(axis=1, keepdims=True)


def nll(logits: np.ndarray, mask: np.ndarray, target: np.ndarray,
        temperature: float = 1.0) -> float:
    """Mean -ln softmax(logits / T)[target], by log-sum-exp (no underflow at small T)."""
    z = np.where(mask, np.asarray(logits, dtype=np.float64) / temperature, -np.inf)
    top = z.max(axis=1)
    log_norm = top + np.log(np.where(mask, np.exp(z - top[:, None]), 0.0).sum(axis=1))
    return float(np.mean(log_norm - z[np.arange(len(z)), target]))


def fit_temperature(logits: np.ndarray, mask: np.ndarray, target: np.ndarray,
                    grid: np.ndarray = TEMPERATURES) -> dict:
    """The grid temperature with the lowest mean NLL, the NLL there and at T = 1."""
    losses = np.array([nll(logits, mask, target, t) for t in grid])
    best = int(np.argmin(losses))
    return {"temperature": float(grid[best]), "nll": float(losses[best]),
            "nll_at_1": nll(logits, mask, target, 1.0), "grid": {
                "low": float(grid[0]), "high": float(grid[-1]), "count": len(grid),
                "spacing": "log"},
            "at_edge": best in (0, len(grid) - 1), "examples": int(len(target))}


def probability_report(probability: np.ndarray, mask: np.ndarray, target: np.ndarray,
                       bins: int) -> dict:
    """Accuracy, NLL, Brier and the top-label reliability bins with their ECE."""
    n = len(target)
    right = probability[np.arange(n), target]
    top = probability.argmax(axis=1)
    correct = (top == target).astype(np.float64)
    confidence = probability.max(axis=1)
    one_hot = np.zeros_like(probability)
    one_hot[np.arange(n), target] = 1.0
    brier = float(np.mean(np.sum(np.where(mask, (probability - one_hot) ** 2, 0.0), axis=1)))
    calibration = binary.reliability(correct, confidence, bins)
    return {"examples": int(n), "accuracy": float(correct.mean()),
            "nll": float(np.mean(-np.log(np.maximum(right, 1e-300)))), "brier": brier,
            "ece": calibration["ece"], "reliability": calibration["bins"],
            "mean_confidence": float(confidence.mean())}


def risk_coverage(probability: np.ndarray, target: np.ndarray) -> dict[str, np.ndarray]:
    """Per distinct top probability t (descending): coverage and risk of answering at >= t."""
    n = len(target)
    correct = (probability.argmax(axis=1) == target).astype(np.int64)
    thresholds, right, wrong = binary.sweep(correct, probability.max(axis=1))
    answered = right + wrong
    return {"threshold": thresholds, "coverage": answered / n, "risk": wrong / answered}


def area_under_risk_coverage(curve: dict[str, np.ndarray]) -> float:
    """Mean risk over the coverage steps (each threshold weighted by the coverage it adds)."""
    steps = np.diff(np.r_[0.0, curve["coverage"]])
    return float(np.sum(steps * curve["risk"]))


def choose_abstain_threshold(probability: np.ndarray, target: np.ndarray,
                             max_risk: float) -> dict:
    """The lowest threshold whose risk is at most `max_risk`, with its coverage and risk; when
    no threshold meets the budget, one above every probability (abstain on everything)."""
    curve = risk_coverage(probability, target)
    meets = np.nonzero(curve["risk"] <= max_risk)[0]
    if len(meets) == 0:
        return {"threshold": float(np.nextafter(curve["threshold"][0], np.inf)),
                "coverage": 0.0, "risk": 0.0, "max_risk": max_risk, "met": False}
    best = int(meets[-1])
    return {"threshold": float(curve["threshold"][best]),
            "coverage": float(curve["coverage"][best]), "risk": float(curve["risk"][best]),
            "max_risk": max_risk, "met": True}


def selective(probability: np.ndarray, target: np.ndarray, threshold: float) -> dict:
    """Coverage and risk of answering only when the top probability >= `threshold`."""
    answered = probability.max(axis=1) >= threshold
    correct = probability.argmax(axis=1) == target
    count = int(answered.sum())
    return {"threshold": float(threshold), "answered": count, "abstained": int(len(target) - count),
            "coverage": count / len(target),
            "risk": float(np.mean(~correct[answered])) if count else 0.0}


def by_slice(values: list[str], probability: np.ndarray, target: np.ndarray) -> dict:
    """Count, accuracy and mean top probability of the records sharing each slice value (e.g.
    clear / mixed / vague evidence): a low average error can hide a bad slice."""
    values = np.asarray(values)
    correct = probability.argmax(axis=1) == target
    confidence = probability.max(axis=1)
    return {str(v): {"count": int((values == v).sum()),
                     "accuracy": float(correct[values == v].mean()),
                     "mean_confidence": float(confidence[values == v].mean())}
            for v in sorted(set(values.tolist()))}


def order_sensitivity(probability: np.ndarray, reversed_probability: np.ndarray,
                      mask: np.ndarray) -> dict:
    """How much the answer depends on where the options stand: the same records scored with
    their options in reverse order (row i of `reversed_probability` lists option k-1 first).
    A causal reader sees earlier options from later ones but not the reverse, so an order-free
    answer is not given: it is measured. Returns the share of records whose top option is the
    same both ways and the mean and largest change of any option's probability."""
    back = np.zeros_like(probability)
    for i, k in enumerate(mask.sum(axis=1)):
        back[i, :k] = reversed_probability[i, :k][::-1]
    change = np.abs(np.where(mask, probability - back, 0.0)).max(axis=1)
    return {"top_agreement": float(np.mean(probability.argmax(1) == back.argmax(1))),
            "mean_max_change": float(change.mean()), "max_change": float(change.max())}
