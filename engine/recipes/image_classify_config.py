"""Config schema of `image-classify`: a 16/32/64 CNN trained from scratch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.recipes.media_config import ImageSection, MediaRecipeConfig


class ImageClassifyConfig(MediaRecipeConfig):
    recipe: Literal["image-classify"] = "image-classify"
    image: ImageSection = Field(default_factory=ImageSection)
    batch_norm: bool = Field(True, description="batch normalisation after each convolution")
    include_empty: bool = Field(True, description="treat 'empty' scenes as a class of their own")
