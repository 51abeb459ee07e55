"""Config schema of `tabular-classify`: constant, logistic and boosting candidates on a table,
the best by validation average precision, Platt-calibrated, with a validation-chosen alert
threshold. Defaults are the handbook's chapter-4 settings but one: the sigmoid is fitted on
out-of-fold train scores (machine folds), not on the 300-row calibration split, because on the
generator's truth set the split's fit raised the calibration error on average and the
cross-fit lowered it (bench/bench_tabular_calibration.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import RecipeConfig, Schema
from engine.recipes.media_config import DataSection

Candidate = Literal["constant", "logistic", "boosting"]


class LogisticSection(Schema):
    C: float = Field(1.0, gt=0, description="inverse regularisation strength (smaller = stronger)")
    max_iter: int = Field(1000, ge=1, description="solver iteration limit")


class BoostingSection(Schema):
    learning_rate: float = Field(0.06, gt=0, le=1, description="each tree's contribution")
    max_iter: int = Field(120, ge=1, description="boosting iterations (trees); early stopping "
                                                 "is off so splits stay group-aware")
    max_leaf_nodes: int = Field(7, ge=2, description="leaves per tree")
    min_samples_leaf: int = Field(25, ge=1, description="rows a leaf needs (discourages tiny "
                                                        "local rules)")
    l2_regularization: float = Field(1.0, ge=0, description="penalty on leaf values")


class ThresholdSection(Schema):
    rule: Literal["f1", "recall_floor", "cost"] = Field(
        "f1", description="chosen on validation: best F1, best precision with recall >= "
                          "min_recall, or least cost_fp*FP + cost_fn*FN")
    min_recall: float = Field(0.8, gt=0, le=1, description="recall_floor: the recall to meet")
    cost_fp: float = Field(1.0, ge=0, description="cost: price of an unneeded inspection")
    cost_fn: float = Field(5.0, ge=0, description="cost: price of a missed fault")


class TabularClassifyConfig(RecipeConfig):
    recipe: Literal["tabular-classify"] = "tabular-classify"
    steps: int = Field(1, ge=1, le=1, description="a tabular fit is one step")
    data: DataSection
    candidates: list[Candidate] = Field(["constant", "logistic", "boosting"], min_length=1,
                                        description="models compared on validation AP")
    logistic: LogisticSection = Field(default_factory=LogisticSection)
    boosting: BoostingSection = Field(default_factory=BoostingSection)
    calibrate: bool = Field(True, description="Platt-scale the chosen model")
    calibration: Literal["cross-fit", "split"] = Field(
        "cross-fit", description="where the sigmoid is fitted: 'cross-fit' = on out-of-fold "
                                 "scores of train, folds grouped by machine (4x the rows of "
                                 "the calibration split); 'split' = on the calibration "
                                 "split's scores of the frozen model (the handbook's)")
    calibration_folds: int = Field(5, ge=2, le=20, description="cross-fit: group folds of train")
    threshold: ThresholdSection = Field(default_factory=ThresholdSection)
    bins: int = Field(10, ge=2, le=100, description="reliability bins (equal width)")
