"""Qwen2 and Qwen3: the Llama decoder with NeoX-style RoPE (halves), plus
- Qwen2: biases on the q/k/v projections;
- Qwen3: a per-head RMSNorm on q and k before RoPE, and an explicit head_dim (key_length).
Both run on `engine.models.llama.Llama`; this file holds what makes a config a Qwen config."""

from __future__ import annotations

from engine.models.llama import LlamaConfig


def qwen2_config(**fields) -> LlamaConfig:
    return LlamaConfig(rope_type="neox", attn_bias=True, **fields)


def qwen3_config(**fields) -> LlamaConfig:
    return LlamaConfig(rope_type="neox", qk_norm=True, **fields)
