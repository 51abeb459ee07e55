"""Config schema of `lm-dpo`: preference tuning (DPO) of a language model.

The policy starts from an lm-sft run's checkpoint, which is also the frozen reference: its
adapters (LoRA/QLoRA over a GGUF) or its full weights (a dense GGUF or an lm-pretrain model),
over that run's own base, so lm-dpo covers every base lm-sft does. The adapters keep the SFT
run's rank, alpha and targets; dropout is off (the reference log-probs are computed without
it). The optimizer, batching and sample sections are lm-sft's. No torch here: the app builds
its form from this schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import RecipeConfig, Schema
from engine.recipes.lm_sft_config import SampleSection, TrainSection
from engine.recipes.optim_config import LearningRate, LMOptimSection


class DPOModelSection(Schema):
    sft_run: str = Field(description="the lm-sft run to refine: its checkpoint (adapters or "
                                     "full weights, over its own base) is the starting policy "
                                     "and the reference")
    checkpoint: str = Field("latest", description="which checkpoint of sft_run")
    weights: Literal["auto", "packed", "dense-cache"] = Field(
        "auto", description="frozen GGUF weights: packed, an f32 dense cache, or auto")


class DPODataSection(Schema):
    path: str = Field(description="preference pairs: a JSONL file ({prompt, chosen, rejected}, "
                                  "optional rater, session, rationale, outcome, one per line) "
                                  "or a preferences dataset folder (its train split)")
    val_path: str | None = Field(None, description="pairs read by `forgebench eval --split val`")
    test_path: str | None = Field(None, description="pairs read by `forgebench eval --split test`")
    system: str | None = Field(None, description="system message for pairs without one")
    max_len: int = Field(512, ge=2, description="input tokens per sequence (prompt + response)")
    truncation: Literal["error", "truncate_response", "drop"] = Field(
        "error", description="a longer pair is an error, cut at the end, or dropped (counted)")
    enable_thinking: bool | None = Field(
        False, description="Qwen3-style templates: render with thinking on/off (None: default)")


class DPOSection(Schema):
    beta: float = Field(0.1, gt=0, le=100, description="strength of the pull towards the "
                                                       "reference (the handbook's first value)")
    loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid: DPO's −log σ(β·margin); ipo: the squared IPO loss "
                               "(per-token log-probs), which does not overfit sure preferences")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="sigmoid only: the share of "
                                                                  "pairs assumed mislabelled")
    length_normalized: bool = Field(False, description="divide each sequence log-prob by its "
                                                       "response's token count")

    @model_validator(mode="after")
    def _smoothing_is_sigmoid(self) -> "DPOSection":
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError("label_smoothing applies to the sigmoid loss, not to ipo")
        return self


class DPOGuardSection(Schema):
    """The guardrails of a preference run (engine/train/preference.py: `collapse`)."""

    min_pairs: int = Field(16, ge=1, description="fewer preference pairs than this is warned "
                                                 "about at the start: a few pairs are "
                                                 "memorised in a step or two")
    collapse: Literal["stop", "warn", "off"] = Field(
        "stop", description="when a step collapses (margin running away, or the chosen "
                            "answers losing probability): stop the run, only warn, or ignore")
    max_margin: float = Field(10.0, gt=0, description="collapse: the window's mean reward "
                                                      "margin (β·nats) above this")
    max_chosen_drop: float = Field(20.0, gt=0, description="collapse: the chosen answers' mean "
                                                           "log-prob this many nats below the "
                                                           "reference's")


class DPOOptimSection(LMOptimSection):
    lr: LearningRate = Field(5e-6, description="the handbook's starter value for adapter DPO "
                                               "(5e-6 or 1e-5)")


class DPOTrainSection(TrainSection):
    window: int = Field(8, ge=1, description="pairs per optimizer step; the loss is the mean "
                                             "over the window's pairs")
    micro_batch: int = Field(4, ge=1, description="pairs per forward pass (chosen and rejected "
                                                  "packed together, no padding)")


class LMDPOConfig(RecipeConfig):
    recipe: Literal["lm-dpo"] = "lm-dpo"
    model: DPOModelSection
    data: DPODataSection
    dpo: DPOSection = Field(default_factory=DPOSection)
    guard: DPOGuardSection = Field(default_factory=DPOGuardSection)
    optim: DPOOptimSection = Field(default_factory=DPOOptimSection)
    train: DPOTrainSection = Field(default_factory=DPOTrainSection)
    sample: SampleSection = Field(default_factory=SampleSection)
