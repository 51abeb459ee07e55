"""Fitted tabular classifiers as plain arrays: predict with numpy alone, save without pickle.

A `TabularModel` turns a feature matrix [n, f] (NaN = missing, columns in the order it was
fitted on) into raw log-odds, then into a probability through an optional Platt calibration
`sigmoid(a * raw + b)`. Three families:

* constant  - the training fault rate for every row (raw = logit(rate));
* logistic  - median imputation plus a missingness flag per feature, standardisation, then a
              linear score; every statistic comes from the training rows only;
* boosting  - the trees of a fitted scikit-learn HistGradientBoostingClassifier, copied node by
              node (feature, raw threshold, which side missing values take, leaf value), so a
              reload needs neither sklearn nor pickle. `from_sklearn_boosting` checks that the
              copy reproduces the estimator's own decision function before it is used.

`save` writes `model.npz` (numeric arrays only, loaded with allow_pickle=False) and returns the
JSON-able description (family, feature names, calibration) that goes beside it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np

FAMILIES = ("constant", "logistic", "boosting")
_NODE_FIELDS = ("feature_idx", "num_threshold", "missing_go_to_left", "left", "right", "is_leaf",
                "value")


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free for large |x|


def logit(p: float) -> float:
    return float(np.log(p) - np.log1p(-p))


@dataclass
class TabularModel:
    family: str
    feature_names: list[str]
    arrays: dict[str, np.ndarray]
    calibration: dict | None = None          # {"a": float, "b": float, ...} or None
    info: dict = field(default_factory=dict)  # hyperparameters, library versions

    # -- prediction -----------------------------------------------------------------------
    def raw(self, features: np.ndarray) -> np.ndarray:
        """Uncalibrated log-odds [n]."""
        features = np.asarray(features, dtype=np.float64)
        if features.ndim != 2 or features.shape[1] != len(self.feature_names):
            raise ValueError(f"expected [n, {len(self.feature_names)}] features in the order "
                             f"{self.feature_names}, got shape {features.shape}")
        if self.family == "constant":
            return np.full(len(features), float(self.arrays["raw"][0]))
        if self.family == "logistic":
            return logistic_design(features, self.arrays) @ self.arrays["coef"] \
                + float(self.arrays["intercept"][0])
        return _boosting_raw(features, self.arrays)

    def uncalibrated(self, features: np.ndarray) -> np.ndarray:
        return sigmoid(self.raw(features))

    def probability(self, features: np.ndarray) -> np.ndarray:
        """The calibrated probability when a calibration was fitted, else the raw one."""
        raw = self.raw(features)
        if self.calibration:
            raw = self.calibration["a"] * raw + self.calibration["b"]
        return sigmoid(raw)

    # -- storage --------------------------------------------------------------------------
    def save(self) -> tuple[bytes, dict]:
        buffer = io.BytesIO()
        np.savez(buffer, **self.arrays)
        return buffer.getvalue(), {"family": self.family, "feature_names": self.feature_names,
                                   "calibration": self.calibration, "info": self.info}

    @classmethod
    def load(cls, npz: bytes, description: dict) -> "TabularModel":
        with np.load(io.BytesIO(npz), allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        return cls(description["family"], list(description["feature_names"]), arrays,
                   description.get("calibration"), description.get("info", {}))


# -- constant -----------------------------------------------------------------------------
def constant_model(target: np.ndarray, feature_names: list[str]) -> TabularModel:
    rate = float(np.clip(target.mean(), 1e-6, 1 - 1e-6))
    return TabularModel("constant", feature_names, {"raw": np.array([logit(rate)])},
                        info={"rate": rate})


# -- logistic -----------------------------------------------------------------------------
def logistic_preprocessing(features: np.ndarray) -> dict[str, np.ndarray]:
    """Training-row medians, then mean and scale of [imputed values, missing flags]."""
    medians = np.nanmedian(features, axis=0)
    medians = np.where(np.isnan(medians), 0.0, medians)  # a column missing in every row
    design = _impute(features, medians)
    mean, scale = design.mean(axis=0), design.std(axis=0)
    return {"medians": medians, "mean": mean, "scale": np.where(scale > 0, scale, 1.0)}


def _impute(features: np.ndarray, medians: np.ndarray) -> np.ndarray:
    missing = np.isnan(features)
    return np.hstack([np.where(missing, medians, features), missing.astype(np.float64)])


def logistic_design(features: np.ndarray, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The standardised [n, 2f] matrix the linear score reads."""
    return (_impute(features, arrays["medians"]) - arrays["mean"]) / arrays["scale"]


def logistic_model(preprocessing: dict, coef: np.ndarray, intercept: float,
                   feature_names: list[str], info: dict) -> TabularModel:
    arrays = dict(preprocessing, coef=np.asarray(coef, dtype=np.float64).ravel(),
                  intercept=np.array([float(intercept)]))
    return TabularModel("logistic", feature_names, arrays, info=info)


# -- boosting -----------------------------------------------------------------------------
def from_sklearn_boosting(estimator, feature_names: list[str], check_rows: np.ndarray,
                          info: dict) -> TabularModel:
    """Copy a fitted binary HistGradientBoostingClassifier's trees into arrays.

    Reads the estimator's fitted trees (`_predictors`, `_baseline_prediction`: the attributes
    its own predict uses); a library change that moved them would make the copy disagree with
    `decision_function`, which is checked on `check_rows` and raised as an error, never
    ignored."""
    trees = [predictors[0].nodes for predictors in estimator._predictors]
    if any(np.any(nodes["is_categorical"]) for nodes in trees):
        raise ValueError("categorical splits are not supported by the portable copy")
    offsets = np.cumsum([0] + [len(nodes) for nodes in trees])
    arrays = {name: np.concatenate([nodes[name] for nodes in trees]) for name in _NODE_FIELDS}
    for name in ("left", "right"):  # node indices are per tree; make them global
        arrays[name] = (arrays[name].astype(np.int64)
                        + np.repeat(offsets[:-1], [len(n) for n in trees]))
    arrays = {"roots": offsets[:-1].astype(np.int64),
              "baseline": np.asarray(estimator._baseline_prediction, dtype=np.float64).ravel(),
              "feature_idx": arrays["feature_idx"].astype(np.int64),
              "num_threshold": arrays["num_threshold"].astype(np.float64),
              "missing_go_to_left": arrays["missing_go_to_left"].astype(bool),
              "left": arrays["left"], "right": arrays["right"],
              "is_leaf": arrays["is_leaf"].astype(bool),
              "value": arrays["value"].astype(np.float64)}
    model = TabularModel("boosting", feature_names, arrays, info=info)
    expected = estimator.decision_function(check_rows)
    got = model.raw(check_rows)
    if not np.allclose(got, expected, rtol=1e-9, atol=1e-9):
        raise ValueError("the portable tree copy disagrees with the estimator (max difference "
                         f"{np.max(np.abs(got - expected)):.3g})")
    return model


def _boosting_raw(features: np.ndarray, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Walk every row down every tree at once: [n, trees] node indices until all are leaves."""
    node = np.broadcast_to(arrays["roots"], (len(features), len(arrays["roots"]))).copy()
    rows = np.arange(len(features))[:, None]
    while not arrays["is_leaf"][node].all():
        inner = ~arrays["is_leaf"][node]
        value = features[rows, arrays["feature_idx"][node]]
        # sklearn's rule: missing follows missing_go_to_left, else x <= threshold goes left
        go_left = np.where(np.isnan(value), arrays["missing_go_to_left"][node],
                           value <= arrays["num_threshold"][node])
        step = np.where(go_left, arrays["left"][node], arrays["right"][node])
        node = np.where(inner, step, node)
    return arrays["value"][node].sum(axis=1) + arrays["baseline"][0]


# -- calibration --------------------------------------------------------------------------
def fit_platt(raw: np.ndarray, target: np.ndarray, iterations: int = 100) -> dict:
    """Platt scaling: a, b minimising the log loss of sigmoid(a * raw + b) on held-out rows.

    The targets are Platt's prior-smoothed ones, (positives + 1) / (positives + 2) for a
    positive and 1 / (negatives + 2) for a negative, as in Platt (1999) and scikit-learn's
    `CalibratedClassifierCV(method="sigmoid")`, the handbook's calibrator: on 300 rows a
    0/1 target lets a bin of confident rows pull the sigmoid to the extremes. Newton's method
    on the two parameters (the loss is convex in them), started at a = 0 and the smoothed
    base rate as sklearn does."""
    raw = np.asarray(raw, dtype=np.float64)
    target = np.asarray(target)
    positives = float(np.sum(target > 0))
    negatives = len(target) - positives
    soft = np.where(target > 0, (positives + 1) / (positives + 2), 1 / (negatives + 2))
    design = np.column_stack([raw, np.ones_like(raw)])
    params = np.array([0.0, np.log((positives + 1) / (negatives + 1))])
    for _ in range(iterations):
        p = sigmoid(design @ params)
        gradient = design.T @ (p - soft)
        hessian = design.T @ (design * (p * (1 - p))[:, None]) + 1e-12 * np.eye(2)
        update = np.linalg.solve(hessian, gradient)
        params -= update
        if np.max(np.abs(update)) < 1e-12:
            break
    return {"a": float(params[0]), "b": float(params[1]), "rows": int(len(target))}
