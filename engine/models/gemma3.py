"""Gemma 3 decoder as llama.cpp runs it (src/models/gemma3.cpp).

Differences from Llama: embeddings scaled by sqrt(dim) (f32, not rounded to the weight dtype);
per-head q/k RMSNorm; q multiplied by `query_scale` (1/sqrt(head_dim)) before attention;
RMSNorm after attention and after the MLP as well as before; GeGLU (gelu-tanh) MLP; sliding-window
attention on most layers (every `swa_period`-th layer is global) with RoPE base 10000 on local
layers and the file's base (and linear scaling, if any) on global ones. The GGUF converter already
stores Gemma's RMSNorm weights as 1 + w, so the norm multiplies by the stored weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.blocks import (
    Attention,
    GatedMLP,
    KVCache,
    RMSNorm,
    packed_positions,
    rope_tables,
)
from engine.models.native_forward import native_decoder, serves


@dataclass
class Gemma3Config:
    vocab_size: int = 262144
    dim: int = 640
    n_layers: int = 18
    n_heads: int = 4
    n_kv_heads: int = 1
    head_dim: int = 256
    ffn_dim: int = 2048
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0        # global layers
    rope_local_theta: float = 10_000.0     # sliding-window layers
    rope_scale: float = 1.0                # global layers: positions divided by this (linear)
    sliding_window: int = 512
    sliding: list[bool] = field(default_factory=list)   # per layer: True = sliding-window layer
    query_scale: float | None = None       # default 1/sqrt(head_dim)
    max_seq_len: int = 32768
    tie_embeddings: bool = True
    final_softcap: float | None = None

    def __post_init__(self):
        if not self.sliding:
            self.sliding = [(i % 6) < 5 for i in range(self.n_layers)]
        if self.query_scale is None:
            self.query_scale = 1.0 / math.sqrt(self.head_dim)


class Gemma3Block(nn.Module):
    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              qk_norm_eps=cfg.norm_eps)
        self.post_attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.dim, cfg.ffn_dim, "gelu_tanh")
        self.post_mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Gemma3(nn.Module):
    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Gemma3Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.kv_dtype = torch.float32
        self.attn_core = None
        self.numerics = "f32"
        self.rope_type = "neox"

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache.empty(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, self.kv_dtype)

    def hidden(self, tokens: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
               lengths: list[int] | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, T, dim]; `lengths` packs sequences into tokens [1, T]
        (each at positions 0…, attending only within itself); `rows` (bool [B, T]) keeps only
        those positions, [N, dim]: after the last attention nothing reads the others, so the
        last MLP and the norms skip them."""
        if serves(self, tokens, cache, lengths, start_pos) and (fast := native_decoder(self)):
            return fast.hidden(tokens, start_pos, cache, rows)      # the same bits, in C
        c = self.config
        positions = (torch.arange(start_pos, start_pos + tokens.shape[1]) if lengths is None
                     else packed_positions(lengths, tokens.shape[1]))
        libm = self.numerics == "llamacpp"
        rope_local = rope_tables(positions, c.head_dim, c.rope_local_theta, libm=libm)
        rope_global = rope_tables(positions, c.head_dim, c.rope_theta,
                                  freq_scale=1.0 / c.rope_scale, libm=libm)
        h = self.tok_embeddings(tokens) * math.sqrt(c.dim)                      # [B,T,D]
        for i, layer in enumerate(self.layers):
            local = c.sliding[i]
            a = layer.attn(layer.attn_norm(h), rope_local if local else rope_global, self.rope_type,
                           scale=c.query_scale, scale_q_first=True, start_pos=start_pos,
                           cache=cache, layer=i, window=c.sliding_window if local else None,
                           attn_core=self.attn_core, lengths=lengths)
            if rows is not None and i == len(self.layers) - 1:
                h, a = h[rows], a[rows]
            h = h + layer.post_attn_norm(a)
            h = h + layer.post_mlp_norm(layer.mlp(layer.mlp_norm(h)))
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)
        if self.config.final_softcap:
            out = torch.tanh(out / self.config.final_softcap) * self.config.final_softcap
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden(tokens))
