"""Config schema of `lm-es`: gradient-free fine-tuning of a GGUF language model by evolution
strategies (seed 000 §15.8). The data and sample sections are lm-sft's. No torch here: the app
builds its form from this schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import RecipeConfig, Schema
from engine.recipes.lm_sft_config import DataSection, SampleSection


class ModelSection(Schema):
    gguf: str = Field(description="base model: a GGUF file (LoRA: any quantization; full: "
                                  "f32/f16/bf16 weights only)")
    weights: Literal["packed", "dense-cache"] = Field(
        "dense-cache", description="frozen GGUF weights (LoRA): dequantized on the fly, or once "
                                   "into an f32 cache (the fastest forwards)")


class ParamsSection(Schema):
    mode: Literal["lora", "full"] = Field(
        "lora", description="perturb LoRA adapters beside the frozen (possibly quantized) base, "
                            "or every float weight of a dense base")
    rank: int = Field(8, ge=1, description="rank of the perturbed LoRA adapters (mode lora)")
    alpha: float = Field(16.0, gt=0, description="the delta is scaled by alpha / rank")
    targets: list[Literal["q", "k", "v", "o", "gate", "up", "down"]] = Field(
        default_factory=lambda: ["q", "v"], min_length=1,
        description="projections whose adapters are perturbed: attention q/k/v/o, MLP "
                    "gate/up/down")

    @model_validator(mode="after")
    def _distinct_targets(self) -> "ParamsSection":
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets repeat an entry: {self.targets}")
        return self


class ESSection(Schema):
    population: int = Field(16, ge=2, description="members per iteration (even when antithetic)")
    sigma: float = Field(0.02, gt=0, description="noise scale σ of a member's perturbation")
    lr: float = Field(0.01, gt=0, description="step size of θ ← θ + lr·g")
    antithetic: bool = Field(True, description="members in ±ε pairs (halves the noise draws)")
    shaping: Literal["centered_ranks", "none"] = Field(
        "centered_ranks", description="rewards → weights: ranks mapped onto [−½, ½], or raw")
    batch: int = Field(8, ge=1, description="samples per iteration; every member scores the "
                                            "same batch")
    micro_batch: int = Field(8, ge=1, description="samples per forward pass (packed)")
    anchor_decay: Literal["none", "l1", "l2"] = Field(
        "none", description="pull toward the starting weights: θ −= lr·λ·sign(θ−θ₀) or (θ−θ₀)")
    decay: float = Field(0.0, ge=0, description="λ of the anchored decay")

    @model_validator(mode="after")
    def _even_for_antithetic(self) -> "ESSection":
        if self.antithetic and self.population % 2:
            raise ValueError(f"population {self.population} is odd; antithetic sampling pairs "
                             "every +ε member with its −ε twin: use an even population or "
                             "antithetic = false")
        return self


class RewardSection(Schema):
    kind: Literal["rule", "acc", "nll"] = Field(
        "acc", description="acc: token accuracy + ce_weight·exp(−CE); nll: −CE; rule: unigram "
                           "F1 of greedy answers + a bonus inside the envelope")
    ce_weight: float = Field(0.1, ge=0, description="acc: weight of exp(−mean CE)")
    prefix: str = Field("Ahoy!", description="rule: the answer should start with this")
    suffix: str = Field("matey.", description="rule: … and end with this")
    envelope_bonus: float = Field(0.1, ge=0, description="rule: reward for the envelope")
    max_tokens: int = Field(32, ge=1, description="rule: greedy tokens per answer")


class LMESConfig(RecipeConfig):
    recipe: Literal["lm-es"] = "lm-es"
    model: ModelSection
    data: DataSection
    params: ParamsSection = Field(default_factory=ParamsSection)
    es: ESSection = Field(default_factory=ESSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    sample: SampleSection = Field(default_factory=SampleSection)
