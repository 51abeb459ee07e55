"""The optimizer section of every gradient-trained recipe's config: AdamW with decoupled weight
decay, a global gradient-norm clip and a learning rate that warms up and then stays constant or
decays along a cosine to a floor, as `engine/train/optim.py` applies them.

Each field's bounds and tooltip are stated once, in the `Annotated` types below; a recipe whose
defaults or wording differ subclasses a section and restates only the default (or the
description) that differs, so its TOML keys stay its own. The sections, base first:

- `AdamWSection`: the fields every recipe's optimizer has (lm-decision adds a warmup given as a
  share of the steps);
- `OptimSection`: plus a warmup in steps (the image, audio, speech and retrieval recipes);
- `LMOptimSection`: plus AdamW's epsilon and bf16 moment storage (lm-sft, lm-dpo, lm-pretrain).

The app's form lists a section's fields in this order, base fields first. No torch here: the app
builds its forms from these schemas.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from engine.config import Schema

LearningRate = Annotated[float, Field(gt=0, le=10, description="AdamW learning rate")]
Schedule = Annotated[Literal["cosine", "constant"], Field(
    description="learning rate after warmup: cosine decay to min_lr_ratio × lr, or constant")]
MinLrRatio = Annotated[float, Field(ge=0, le=1, description="cosine floor as a share of lr")]
WeightDecay = Annotated[float, Field(ge=0, description="AdamW's decoupled weight decay")]
Beta2 = Annotated[float, Field(ge=0, lt=1, description="AdamW's second-moment decay, β2")]
WarmupSteps = Annotated[int, Field(ge=0, description="linear warmup steps")]


class AdamWSection(Schema):
    lr: LearningRate = 1e-3
    schedule: Schedule = "constant"
    min_lr_ratio: MinLrRatio = 0.1
    weight_decay: WeightDecay = 1e-4
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment (momentum) decay, β1")
    beta2: Beta2 = 0.999
    grad_clip: float = Field(1.0, ge=0, description="global gradient-norm clip; 0 = off")


class OptimSection(AdamWSection):
    warmup: WarmupSteps = 0


class LMOptimSection(OptimSection):
    lr: LearningRate = Field(1e-3, description="peak learning rate")
    weight_decay: WeightDecay = 0.0
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon, added to the denominator")
    moments: Literal["fp32", "bf16"] = Field("fp32", description="AdamW moment storage")
