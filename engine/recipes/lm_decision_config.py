"""Config schema of `lm-decision`: an option-pointer head over a frozen GGUF decoder's hidden
states, trained with cross-entropy over each record's options, temperature-calibrated on the
calibration split, with an abstain threshold chosen on validation. Defaults are the handbook's
chapter-24 settings (pointer width 256, head lr 1e-3, weight decay 0.01, a tenth of the steps
as warmup then cosine decay, clip 1.0, max length 512, 201 temperatures from 0.1 to 10).
No torch here: the app builds its form from this schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import RecipeConfig, Schema
from engine.recipes.lm_sft_config import ModelSection
from engine.recipes.optim_config import (
    AdamWSection,
    LearningRate,
    MinLrRatio,
    Schedule,
    WeightDecay,
)


class DataSection(Schema):
    dir: str = Field(description="a `decisions` dataset folder (request, question, options, "
                                 "label; dataset.json declares the option schema)")
    max_len: int = Field(512, ge=8, description="tokens per record including every option and "
                                               "the readout; a longer record is an error, "
                                               "never cut")


class HeadSection(Schema):
    width: int = Field(256, ge=1, le=4096, description="pointer width P of the two "
                                                       "projections (readout and option ends)")


class OptimSection(AdamWSection):
    lr: LearningRate = Field(1e-3, description="AdamW learning rate of the new head")
    schedule: Schedule = Field("cosine", description="after warmup")
    min_lr_ratio: MinLrRatio = 0.0
    weight_decay: WeightDecay = 0.01
    warmup_fraction: float = Field(0.1, ge=0, lt=1, description="share of the steps that "
                                                                "ramps the rate up")


class CalibrationSection(Schema):
    split: Literal["calibration", "val"] = Field(
        "calibration", description="split the temperature is fitted on (the reports before and "
                                   "after are on val: fitting on val makes 'after' in-sample)")
    bins: int = Field(10, ge=2, le=100, description="reliability bins (equal width)")
    max_risk: float = Field(0.1, gt=0, lt=1, description="abstain threshold: the lowest top "
                                                         "probability whose error rate on val "
                                                         "is at most this")


class LMDecisionConfig(RecipeConfig):
    recipe: Literal["lm-decision"] = "lm-decision"
    steps: int = Field(200, ge=1, description="optimizer steps of the head")
    batch: int = Field(8, ge=1, description="records per optimizer step (mean CE over them)")
    model: ModelSection
    data: DataSection
    head: HeadSection = Field(default_factory=HeadSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
