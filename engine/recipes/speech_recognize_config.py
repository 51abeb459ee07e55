"""Config schema of `speech-recognize`: a small CTC recogniser trained from scratch on log-Mel
features of 16 kHz mono speech, greedy and beam decoding, silence/noise/clipping probes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import Schema
from engine.recipes.media_config import MediaRecipeConfig, OptimSection


class SpeechAudioSection(Schema):
    sample_rate: Literal[16000] = Field(16000, description="required sample rate (files are "
                                                           "never resampled here)")
    n_mels: int = Field(40, ge=8, le=128, description="Mel bands of the log-Mel features")


class SpeechModelSection(Schema):
    channels: int = Field(128, ge=8, description="width of every convolution")
    layers: int = Field(6, ge=1, le=24, description="residual blocks (dilations 1, 2, 4, ...)")
    kernel: Literal[3, 5, 7, 9] = Field(5, description="kernel of each block")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout on each residual block's "
                                                          "convolution output while training")


class AugmentSection(Schema):
    gain_db: float = Field(6.0, ge=0, le=30, description="train clips play up to this much "
                                                         "louder or quieter")
    time_masks: int = Field(2, ge=0, description="SpecAugment time masks per clip")
    time_mask_frames: int = Field(8, ge=1, description="longest time mask (10 ms frames)")
    freq_masks: int = Field(2, ge=0, description="SpecAugment frequency masks per clip")
    freq_mask_bands: int = Field(5, ge=1, description="widest frequency mask (Mel bands)")


class DecodeSection(Schema):
    beam: int = Field(8, ge=1, le=256, description="prefix beam width of the beam decoder")
    probes: int = Field(10, ge=0, le=200, description="clips per probe kind (silence, room "
                                                      "tone, music-like noise, clipped, quiet)")


class SpeechRecognizeConfig(MediaRecipeConfig):
    recipe: Literal["speech-recognize"] = "speech-recognize"
    batch_size: int = Field(16, ge=1, description="clips per optimizer step")
    optim: OptimSection = Field(default_factory=lambda: OptimSection(lr=2e-3, weight_decay=0.0,
                                                                     grad_clip=5.0))
    audio: SpeechAudioSection = Field(default_factory=SpeechAudioSection)
    model: SpeechModelSection = Field(default_factory=SpeechModelSection)
    augment: AugmentSection = Field(default_factory=AugmentSection)
    decode: DecodeSection = Field(default_factory=DecodeSection)
