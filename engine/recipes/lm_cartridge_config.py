"""Config schema of `lm-cartridge`: a trained KV prefix (a cartridge) that stands in for a
corpus in the context of a frozen GGUF base, trained by self-study (arXiv 2506.06266).

No torch here: the app builds its form from this schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import RecipeConfig, Schema
from engine.recipes.optim_config import LearningRate, LMOptimSection

Family = Literal["structuring", "summarization", "aggregation", "question", "use_case",
                 "creative"]


class ModelSection(Schema):
    gguf: str = Field(description="base model: a GGUF file (any quantization); it stays frozen "
                                  "and unchanged")
    weights: Literal["auto", "packed", "dense-cache"] = Field(
        "auto", description="frozen GGUF weights: dequantize on the fly (least memory), once "
                            "into an f32 dense cache (fastest), or auto: the cache when it "
                            "takes at most a quarter of the available memory")


class CorpusSection(Schema):
    paths: list[str] = Field(min_length=1, description="the corpus: text files, documents "
                                                       "JSONL ({text} per line) or text-corpus "
                                                       "dataset folders, joined in order")
    text_key: str = Field("text", description="the text field of a documents JSONL")


class CartridgeSection(Schema):
    tokens: int = Field(128, ge=2, le=8192,
                        description="p: KV rows per layer (the paper uses 64-2048); they start "
                                    "as the prefill of the corpus's first p tokens")
    frozen_rows: int = Field(1, ge=0, description="leading rows kept as initialised (row 0 "
                                                  "is BOS: an attention sink)")

    @model_validator(mode="after")
    def _some_rows_train(self) -> "CartridgeSection":
        if self.frozen_rows >= self.tokens:
            raise ValueError(f"frozen_rows ({self.frozen_rows}) must be below tokens "
                             f"({self.tokens}): something has to train")
        return self


class SelfStudySection(Schema):
    samples: int = Field(64, ge=1, description="synthetic conversations to train on")
    held_out: int = Field(4, ge=0, description="further conversations kept out of training: "
                                               "their questions and answers join the held-out "
                                               "comparison")
    chunk_tokens: int = Field(512, ge=16, description="corpus tokens each conversation sees")
    families: list[Family] = Field(
        default_factory=lambda: ["structuring", "summarization", "aggregation", "question",
                                 "use_case", "creative"], min_length=1,
        description="seed prompt families, used in turn")
    question_tokens: int = Field(64, ge=1, description="most tokens of a generated message")
    answer_tokens: int = Field(128, ge=1, description="most tokens of a generated answer")
    question_temperature: float = Field(0.6, ge=0, description="sampling temperature of the "
                                                               "message (paper: 0.6)")
    answer_temperature: float = Field(0.0, ge=0, description="sampling temperature of the "
                                                             "answer (0: greedy, as the paper)")
    top_k: int = Field(20, ge=1, le=1000, description="teacher log-probs kept per token "
                                                      "(paper: 20)")


class CartridgeOptimSection(LMOptimSection):
    lr: LearningRate = Field(2e-2, description="peak learning rate (the paper trains the "
                                               "rows at 2e-2)")


class TrainSection(Schema):
    window: int = Field(4, ge=1, description="conversations per optimizer step; the loss is "
                                             "summed over their answer tokens / that count")


class EvalSection(Schema):
    questions: str | None = Field(None, description="hand-written held-out questions: JSONL of "
                                                    "{question, answer}")
    max_tokens: int = Field(48, ge=1, description="answer length in the held-out comparison")


class LMCartridgeConfig(RecipeConfig):
    recipe: Literal["lm-cartridge"] = "lm-cartridge"
    model: ModelSection
    corpus: CorpusSection
    cartridge: CartridgeSection = Field(default_factory=CartridgeSection)
    self_study: SelfStudySection = Field(default_factory=SelfStudySection)
    optim: CartridgeOptimSection = Field(default_factory=CartridgeOptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
