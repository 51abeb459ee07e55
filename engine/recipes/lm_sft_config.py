"""Config schema of `lm-sft`: supervised fine-tuning of a language model (chat samples, tool
conversations), or continued pretraining on raw documents (`mode = "cpt"`).

LoRA / QLoRA over a GGUF base (kept packed and frozen) or over an lm-pretrain run's model, or
full fine-tuning of a dense base. No torch here: the app builds its form from this schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import RecipeConfig, Schema
from engine.recipes.optim_config import LearningRate, LMOptimSection
from engine.train.precision import migrate_autocast


class ModelSection(Schema):
    gguf: str | None = Field(None, description="base model: a GGUF file (any quantization)")
    run: str | None = Field(None, description="base model: an lm-pretrain run directory (a "
                                              "nanochat GPT with nanochat's tokenizer trains in "
                                              "nanochat's conversation format)")
    checkpoint: str = Field("latest", description="which checkpoint of `run` to start from")
    weights: Literal["auto", "packed", "dense-cache"] = Field(
        "auto", description="frozen GGUF weights: dequantize on the fly (least memory), once "
                            "into an f32 dense cache (fastest), or auto: the cache when it "
                            "takes at most a quarter of the available memory")

    @model_validator(mode="after")
    def _one_base(self) -> "ModelSection":
        if (self.gguf is None) == (self.run is None):
            raise ValueError("give exactly one base: model.gguf = \"FILE.gguf\" or "
                             "model.run = \"RUN_DIR\"")
        return self


class DataSection(Schema):
    path: str = Field(description="training JSONL ({instruction, response} pairs or "
                                  "{messages: [...]} conversations, one per line), or a "
                                  "text-sft dataset folder (its train split; cpt: a "
                                  "text-corpus folder)")
    val_path: str | None = Field(None, description="JSONL read by `forgebench eval --split val` "
                                                   "and the held-out reports (a dataset folder "
                                                   "in data.path: its val split)")
    test_path: str | None = Field(None, description="JSONL read by `forgebench eval --split test`")
    format: Literal["auto", "pairs", "messages", "tools"] = Field(
        "auto", description="record shape: pairs, {messages: [...]}, tool conversations "
                            "({tools: [...], messages: [...]} with tool calls and results), "
                            "or any of them")
    instruction_key: str = Field(
        "instruction", description="record field holding the prompt of an instruction/response "
                                   "pair")
    response_key: str = Field(
        "response", description="record field holding the answer of an instruction/response pair")
    system_key: str = Field("system", description="record field holding an optional system prompt")
    messages_key: str = Field(
        "messages", description="record field holding a conversation (a list of role/content "
                                "messages)")
    system: str | None = Field(None, description="system message for records without one")
    control_path: str | None = Field(
        None, description="cpt: general text whose held-out perplexity measures forgetting "
                          "(JSONL of {text} or a plain text file)")
    text_key: str = Field("text", description="cpt: the text field of a documents JSONL")
    max_len: int = Field(512, ge=2, description="input tokens per sample (prompt + response; "
                                                "cpt: per packed block)")
    truncation: Literal["error", "truncate_response", "drop"] = Field(
        "error", description="a longer sample is an error, cut at the end, or dropped (counted)")
    enable_thinking: bool | None = Field(
        False, description="Qwen3-style templates: render with thinking on/off (None: default)")


class LoraSection(Schema):
    method: Literal["lora", "full"] = Field(
        "lora", description="train adapters beside the frozen base, or every weight (dense "
                            "bases only)")
    rank: int = Field(
        8, ge=1, description="adapter rank r: each adapted weight W gets a trainable B·A of rank r")
    alpha: float = Field(16.0, gt=0, description="the delta is scaled by alpha / rank")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapters' input while training; 0 = off")
    targets: list[Literal["q", "k", "v", "o", "gate", "up", "down"]] = Field(
        default_factory=lambda: ["q", "v"], min_length=1,
        description="projections that get adapters: attention q/k/v/o, MLP gate/up/down")
    full_max_params: int = Field(
        1_000_000_000, ge=1, description="full fine-tuning refuses a model larger than this "
                                         "(weights + grads + AdamW moments ≈ 16 bytes/param)")

    @model_validator(mode="after")
    def _distinct_targets(self) -> "LoraSection":
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets repeat an entry: {self.targets}")
        return self


class TrainSection(Schema):
    window: int = Field(8, ge=1, description="samples per optimizer step; the loss is summed CE "
                                             "over the window / its supervised tokens")
    micro_batch: int = Field(8, ge=1, description="samples per forward pass (packed, no padding)")
    precision: Literal["auto", "f32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast where the CPU multiplies bf16 faster "
                            "than f32 (AVX512-BF16 or AMX, timed), else f32 (the choice is "
                            "recorded in run.json)")
    activation_checkpointing: bool = Field(False, description="recompute each layer in backward")

    @model_validator(mode="before")
    @classmethod
    def _read_autocast(cls, values):
        return migrate_autocast(values)


class SampleSection(Schema):
    prompts: list[str] = Field(default_factory=list,
                               description="held prompts answered greedily BEFORE and AFTER")
    max_tokens: int = Field(32, ge=1, description="new tokens generated per prompt")


class SFTOptimSection(LMOptimSection):
    lr: LearningRate = Field(1e-3, description="peak learning rate (a nanochat base pretrained "
                                               "with Muon: Muon's matrix rate, the other "
                                               "groups at their pretraining share of it, as "
                                               "nanochat's chat_sft)")


class LMSFTConfig(RecipeConfig):
    recipe: Literal["lm-sft"] = "lm-sft"
    mode: Literal["sft", "cpt"] = Field(
        "sft", description="sft: supervised chat samples; cpt: continued pretraining on raw "
                           "documents (packed with EOS, every token a target)")
    model: ModelSection
    data: DataSection
    lora: LoraSection = Field(default_factory=LoraSection)
    optim: SFTOptimSection = Field(default_factory=SFTOptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    sample: SampleSection = Field(default_factory=SampleSection)

    @model_validator(mode="after")
    def _mode_fits_data(self) -> "LMSFTConfig":
        if self.mode == "cpt" and self.data.format not in ("auto",):
            raise ValueError("mode \"cpt\" reads raw documents: leave data.format at \"auto\"")
        if self.data.control_path and self.mode != "cpt":
            raise ValueError("data.control_path is for mode = \"cpt\"")
        return self
