"""Config schema of `lm-pretrain`: a tiny decoder trained from random init, either the
Llama architecture (`model.family = "llama"`, AdamW) or nanochat's GPT (`"nanochat"`,
engine/models/nanochat.py; its MuonAdamW with `optim.kind = "muon"`, or AdamW).

No torch here: the app builds its form from this schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import RecipeConfig, Schema
from engine.recipes.optim_config import (
    Beta2,
    LearningRate,
    LMOptimSection,
    Schedule,
    WarmupSteps,
    WeightDecay,
)
from engine.train.precision import migrate_autocast


class DataSection(Schema):
    dir: str = Field(description="corpus folder: train.txt, val.txt (test.txt) and optionally "
                                 "dataset.json naming them")
    packing: Literal["windows", "bos_bestfit"] = Field(
        "windows", description="training rows: windows = the train split as one stream cut into "
                               "context-long windows; bos_bestfit = nanochat's rows (each line a "
                               "document with <bos> first, packed best-fit, the last cropped)")


class TokenizerSection(Schema):
    kind: Literal["byte", "bpe", "nanochat"] = Field(
        "byte", description="raw UTF-8 bytes, a byte-level BPE trained on the train split, or "
                            "nanochat's (rustbpe's training and tiktoken's encoding, GPT-4 split "
                            "pattern, its 9 special tokens counted in vocab_size)")
    vocab_size: int = Field(512, ge=260, le=65536, description="BPE vocabulary size")

    @model_validator(mode="after")
    def _room_for_nanochat_specials(self) -> "TokenizerSection":
        if self.kind == "nanochat" and self.vocab_size < 265:
            raise ValueError("a nanochat tokenizer needs vocab_size >= 265 (256 bytes and its 9 "
                             "special tokens)")
        return self


NANOCHAT_FIXED = ("ffn_dim", "rope_theta", "norm_eps")   # (its head is untied either way)


class ModelSection(Schema):
    family: Literal["llama", "nanochat"] = Field(
        "llama", description="llama: RMSNorm/SwiGLU/RoPE decoder (exports to GGUF); nanochat: "
                             "karpathy/nanochat's GPT (relu², QK-norm, value embeddings, "
                             "soft-capped logits; no GGUF)")
    depth: int = Field(0, ge=0, description="nanochat: derive dim and heads from the depth as "
                                            "nanochat's base_train does (depth × aspect_ratio, "
                                            "rounded up to head_dim); 0 = use dim and n_heads")
    aspect_ratio: int = Field(64, ge=1, description="nanochat: width per layer of depth")
    head_dim: int = Field(64, ge=2, description="nanochat: channels per attention head (with "
                                                "depth)")
    window_pattern: str = Field(
        "L", pattern="^[SLsl]+$", description="nanochat: attention window per layer, tiled: L = "
                                              "full context, S = a quarter (last layer is L)")
    dim: int = Field(
        128, ge=8, description="model width (embedding size); a multiple of the attention heads")
    n_layers: int = Field(4, ge=1, description="transformer blocks")
    n_heads: int = Field(4, ge=1, description="attention (query) heads")
    n_kv_heads: int = Field(2, ge=1, description="grouped-query attention: key/value heads")
    ffn_dim: int = Field(344, ge=1, description="SwiGLU hidden width")
    context: int = Field(128, ge=2, description="tokens per training window")
    tie_embeddings: bool = Field(
        True, description="llama: the output head shares the input embedding's weights "
                          "(nanochat's head is always its own)")
    rope_theta: float = Field(
        10000.0, gt=0, description="base frequency of the rotary position embedding (RoPE)")
    norm_eps: float = Field(1e-5, gt=0, description="epsilon of the RMSNorm layers")

    @model_validator(mode="after")
    def _heads_fit(self) -> "ModelSection":
        if self.family == "nanochat":
            # a value other than the (llama) default would be silently ignored: refuse it
            fixed = [name for name in NANOCHAT_FIXED
                     if getattr(self, name) != type(self).model_fields[name].default]
            if fixed:
                raise ValueError(f"{', '.join(fixed)} are fixed by nanochat's architecture "
                                 "(4× relu² MLP, rope base 100000, torch's default norm eps): "
                                 "remove them or use family = \"llama\"")
            if self.depth:
                return self
        elif self.depth:
            raise ValueError("depth applies to family = \"nanochat\"; the llama family takes "
                             "dim and n_heads")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of "
                             f"n_kv_heads {self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head size (dim / n_heads) must be even for RoPE")
        return self


class PretrainOptimSection(LMOptimSection):
    kind: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw: one AdamW over every weight; muon: nanochat's MuonAdamW "
                             "(block matrices on Muon at lr, embeddings, head and scalars on "
                             "AdamW at the rates below; nanochat family only)")
    lr: LearningRate = Field(3e-3, description="peak learning rate (muon: Muon's matrix rate)")
    warmup: WarmupSteps = 20
    schedule: Schedule = "cosine"
    weight_decay: WeightDecay = 0.1
    beta2: Beta2 = 0.95
    embedding_lr: float = Field(0.3, gt=0, description="muon: AdamW rate of the token "
                                                       "embedding (value embeddings: half)")
    unembedding_lr: float = Field(0.008, gt=0, description="muon: AdamW rate of the output head")
    scalar_lr: float = Field(0.5, gt=0, description="muon: AdamW rate of the per-layer scalars")
    batch_lr_scaling: bool = Field(
        True, description="muon: scale every rate by sqrt(tokens per step / 2**19) and the "
                          "weight decay as nanochat's base_train does")


class TrainSection(Schema):
    batch_size: int = Field(16, ge=1, description="windows per micro-batch")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    precision: Literal["auto", "f32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast where the CPU multiplies bf16 faster "
                            "than f32 (AVX512-BF16 or AMX, timed), else f32 (the choice is "
                            "recorded in run.json)")

    @model_validator(mode="before")
    @classmethod
    def _read_autocast(cls, values):
        return migrate_autocast(values)


class EvalSection(Schema):
    batch_size: int = Field(32, ge=1, description="windows per evaluation batch")
    max_windows: int = Field(0, ge=0, description="cap on val windows per periodic eval; "
                                                  "0 = the whole split")


class SampleSection(Schema):
    prompts: list[str] = Field(default_factory=lambda: ["Record item"],
                               description="prompts sampled at the end of training")
    max_tokens: int = Field(160, ge=1, description="new tokens generated per prompt")
    temperature: float = Field(
        0.0, ge=0, description="sampling temperature; 0 = greedy (always the likeliest token)")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens only; 0 = off")
    top_p: float = Field(
        1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens with this total "
                                     "probability; 1 = off")
    stop: list[str] = Field(
        default_factory=list,
        description="end a sample at the first of these strings (not included): a base model "
                    "trained on records goes on to write the next record unless told where a "
                    "reply ends, e.g. [\"\\n\"]; empty = run to max_tokens")


class CompareSection(Schema):
    reference_trace: str = Field(
        "", description="a reference loss trace (JSON of step and loss, e.g. made by "
                        "tests/data/nanochat/make_reference_trace.py from this config) that the "
                        "Runs pane draws beside this run's loss, with the largest |Δ loss| over "
                        "the steps both have; relative to the config's folder; empty = none")


class LMPretrainConfig(RecipeConfig):
    recipe: Literal["lm-pretrain"] = "lm-pretrain"
    data: DataSection
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    model: ModelSection = Field(default_factory=ModelSection)
    optim: PretrainOptimSection = Field(default_factory=PretrainOptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    sample: SampleSection = Field(default_factory=SampleSection)
    # display only (training never reads it); added later: an older run's config, without
    # it, resumes as it was started (engine.config.added_since)
    compare: CompareSection = Field(default_factory=CompareSection)

    @model_validator(mode="after")
    def _optimizer_fits_model(self) -> "LMPretrainConfig":
        if self.optim.kind == "muon" and self.model.family != "nanochat":
            raise ValueError("optim.kind = \"muon\" is nanochat's optimizer: it needs "
                             "model.family = \"nanochat\"")
        return self
