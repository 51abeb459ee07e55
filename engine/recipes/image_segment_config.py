"""Config schema of `image-segment`: TinyUNet, BCE + soft Dice, threshold tuned on val."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.recipes.media_config import ImageSection, MediaRecipeConfig


class ImageSegmentConfig(MediaRecipeConfig):
    recipe: Literal["image-segment"] = "image-segment"
    image: ImageSection = Field(default_factory=ImageSection)
    width: int = Field(16, ge=4, description="base channels (width, 2·width, 4·width)")
    batch_norm: bool = Field(True, description="batch normalisation after each convolution")
    boundary_tolerance: int = Field(2, ge=0, description="boundary F1 tolerance in pixels")
    thresholds: list[float] = Field(
        default_factory=lambda: [round(0.1 * k, 1) for k in range(1, 10)],
        description="candidate probability thresholds; the best val IoU is frozen")
    contour_epsilon: float = Field(1.0, ge=0, description="polygon simplification in pixels")
    panels: int = Field(64, ge=0, description="images per eval that get input/probability/"
                                              "prediction/target panels and contour files")
