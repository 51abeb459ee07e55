"""Config schema of `audio-generate`: a 1-D U-Net DDPM on 8192-sample 16 kHz waveforms."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import Schema
from engine.recipes.image_generate_config import DiffusionSection, SampleSection
from engine.recipes.media_config import MediaRecipeConfig, OptimSection


class AudioSection(Schema):
    sample_rate: int = Field(16000, description="required sample rate (files are never "
                                                "resampled)")
    samples: int = Field(8192, ge=64, description="required clip length in samples")


def _audio_diffusion() -> DiffusionSection:
    return DiffusionSection(channels=[16, 32, 64, 64])


class AudioGenerateConfig(MediaRecipeConfig):
    recipe: Literal["audio-generate"] = "audio-generate"
    batch_size: int = Field(4, ge=1, description="clips per optimizer step")
    optim: OptimSection = Field(default_factory=lambda: OptimSection(lr=2e-4, weight_decay=0.0))
    audio: AudioSection = Field(default_factory=AudioSection)
    diffusion: DiffusionSection = Field(default_factory=_audio_diffusion)
    sample: SampleSection = Field(default_factory=lambda: SampleSection(
        cfg=1.0, per_class=2, steps=256, grid_every_checkpoint=False))
