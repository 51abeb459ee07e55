"""Config sections shared by the image and audio recipes (no torch: the app builds forms)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import RecipeConfig, Schema
from engine.recipes.optim_config import OptimSection


class DataSection(Schema):
    dir: str = Field(description="dataset folder holding dataset.json")


class MediaRecipeConfig(RecipeConfig):
    """Fields every image/audio recipe has."""

    data: DataSection
    optim: OptimSection = Field(default_factory=OptimSection)
    batch_size: int = Field(32, ge=1, description="examples per optimizer step")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16 autocast for the forward pass (weights and optimizer stay "
                            "fp32); auto: bf16 where the CPU multiplies bf16 faster than "
                            "fp32 (AVX512-BF16 or AMX, timed), else fp32")


class ImageSection(Schema):
    size: int = Field(64, ge=16, description="side length the network sees")
    resize: Literal["none", "stretch", "pad"] = Field(
        "none", description="none: images must already be size×size; stretch: bilinear resize "
                            "ignoring aspect; pad: keep aspect, pad with black to a square")
    hflip: bool = Field(True, description="random horizontal flips (only if they keep labels)")
    rot90: bool = Field(True, description="random 90° rotations (only if they keep labels)")
