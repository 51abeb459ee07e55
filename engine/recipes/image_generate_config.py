"""Config schema of `image-generate`: class-conditional tiny DDPM at 32×32."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import Schema
from engine.recipes.media_config import ImageSection, MediaRecipeConfig


class DiffusionSection(Schema):
    levels: int = Field(256, ge=2, description="noise levels of the cosine schedule")
    channels: list[int] = Field(default_factory=lambda: [32, 64, 128],
                                description="U-Net channels per resolution level")
    emb_dim: int = Field(
        64, ge=8, description="width of the noise-level and class embedding fed to every U-Net "
                              "block")
    attention: bool = Field(
        False, description="self-attention at the U-Net's lowest resolution (after its block "
                           "and the middle block), so every position sees the whole image")
    cond_dropout: float = Field(0.1, ge=0, lt=1, description="share of labels replaced by the "
                                                             "learned null class")
    min_snr_gamma: float | None = Field(
        None, gt=0, description="weight each example's noise MSE by min(SNR, gamma) / SNR "
                                "(Min-SNR): the nearly clean levels weigh less; off when unset")
    ema: float = Field(0.999, ge=0, lt=1, description="EMA decay of the sampling weights")
    ema_warmup: bool = Field(True, description="decay min(ema, (1+step)/(10+step)) so short "
                                               "runs are not dominated by the random init")


class SampleSection(Schema):
    seed: int = Field(17, ge=0, le=2**32 - 1,
                      description="fixed seed of the per-checkpoint sample grid")
    per_class: int = Field(4, ge=1, description="grid samples per class")
    cfg: float = Field(4.0, ge=0, description="classifier-free guidance scale (1 = off)")
    steps: int = Field(64, ge=1, description="sampler steps (respaced from the levels)")
    grid_every_checkpoint: bool = Field(
        True, description="sample the fixed grid at every checkpoint (else only at the end)")


class ImageGenerateConfig(MediaRecipeConfig):
    recipe: Literal["image-generate"] = "image-generate"
    image: ImageSection = Field(default_factory=lambda: ImageSection(
        size=32, resize="stretch", hflip=True, rot90=True))
    diffusion: DiffusionSection = Field(default_factory=DiffusionSection)
    sample: SampleSection = Field(default_factory=SampleSection)
