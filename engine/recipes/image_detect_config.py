"""Config schema of `image-detect`: one-object grid detector (objectness + one box)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.recipes.media_config import ImageSection, MediaRecipeConfig


class ImageDetectConfig(MediaRecipeConfig):
    recipe: Literal["image-detect"] = "image-detect"
    image: ImageSection = Field(default_factory=ImageSection)
    box_weight: float = Field(5.0, ge=0, description="loss = BCE + box_weight × smooth-L1")
    threshold: float = Field(0.5, gt=0, lt=1, description="objectness needed to emit a box")
    iou_threshold: float = Field(0.5, gt=0, le=1, description="IoU for a correct detection")
    overlays: int = Field(8, ge=0, description="prediction overlays written per eval")
