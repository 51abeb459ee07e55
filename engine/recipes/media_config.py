"""Config sections shared by the image and audio recipes (no torch: the app builds forms)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import RecipeConfig, Schema


class DataSection(Schema):
    dir: str = Field(description="dataset folder holding dataset.json")


class OptimSection(Schema):
    lr: float = Field(1e-3, gt=0, le=10, description="AdamW learning rate")
    warmup: int = Field(0, ge=0, description="linear warmup steps")
    schedule: Literal["cosine", "constant"] = Field(
        "constant", description="learning rate after warmup: cosine decay to min_lr_ratio × lr, or "
                                "constant")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a share of lr")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW's decoupled weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment (momentum) decay, β1")
    beta2: float = Field(0.999, ge=0, lt=1, description="AdamW's second-moment decay, β2")
    grad_clip: float = Field(1.0, ge=0, description="global gradient-norm clip; 0 = off")


class MediaRecipeConfig(RecipeConfig):
    """Fields every image/audio recipe has."""

    data: DataSection
    optim: OptimSection = Field(default_factory=OptimSection)
    batch_size: int = Field(32, ge=1, description="examples per optimizer step")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16 autocast for the forward pass (weights and optimizer stay "
                            "fp32); auto: bf16 where the CPU has AVX512-BF16 or AMX, else fp32")


class ImageSection(Schema):
    size: int = Field(64, ge=16, description="side length the network sees")
    resize: Literal["none", "stretch", "pad"] = Field(
        "none", description="none: images must already be size×size; stretch: bilinear resize "
                            "ignoring aspect; pad: keep aspect, pad with black to a square")
    hflip: bool = Field(True, description="random horizontal flips (only if they keep labels)")
    rot90: bool = Field(True, description="random 90° rotations (only if they keep labels)")
