"""Llama-family decoder (Llama 2/3, SmolLM, TinyLlama; Qwen2/Qwen3 via the bias and q/k-norm
switches): RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied embeddings, KV cache.

Dense and trainable when built from a `LlamaConfig`; `engine.models.gguf_model` swaps the linears
for frozen packed-quant ones when loading a GGUF. RoPE "norm" rotates adjacent pairs like
llama.cpp's LLAMA architecture, so a from-scratch model exports to a llama GGUF unpermuted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 688
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 512
    tie_embeddings: bool = True
    rope_type: str = "norm"          # "norm" (adjacent pairs, llama) | "neox" (halves, qwen)
    head_dim: int | None = None      # default dim // n_heads
    attn_bias: bool = False          # Qwen2: bias on q/k/v
    qk_norm: bool = False            # Qwen3: per-head RMSNorm on q and k before RoPE

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.rope_type not in ("norm", "neox"):
            raise ValueError(f"rope_type must be 'norm' or 'neox', not {self.rope_type!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads "
                             f"{self.n_kv_heads}")


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              bias=cfg.attn_bias,
                              qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.dim, cfg.ffn_dim, "silu")


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope_freq_factors: torch.Tensor | None = None   # Llama 3.x "rope_freqs" from GGUF
        self.kv_dtype = torch.float32                        # f16 under llama.cpp numerics
        self.attn_core = None                                # None = plain f32 attention
        self.numerics = "f32"                                # set_numerics switches both
        self._init_weights()

    def _init_weights(self):
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2·n_layers)."""
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("attn.o.weight", "mlp.down.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache.empty(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, self.kv_dtype)

    def hidden(self, tokens: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
               lengths: list[int] | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, T, dim] for tokens [B, T] at positions start_pos…;
        `lengths` packs sequences into tokens [1, T] (each at positions 0…, attending only
        within itself); `rows` (bool [B, T]) keeps only those positions, [N, dim]: after the
        last attention nothing reads the others, so the last MLP and the norm skip them."""
        if serves(self, tokens, cache, lengths, start_pos) and (fast := native_decoder(self)):
            return fast.hidden(tokens, start_pos, cache, rows)      # the same bits, in C
        c = self.config
        positions = (torch.arange(start_pos, start_pos + tokens.shape[1]) if lengths is None
                     else packed_positions(lengths, tokens.shape[1]))
        rope = rope_tables(positions, c.head_dim, c.rope_theta, self.rope_freq_factors,
                           libm=self.numerics == "llamacpp")
        scale = 1.0 / math.sqrt(c.head_dim)
        h = self.tok_embeddings(tokens)                                           # [B,T,D]
        for i, layer in enumerate(self.layers):
            h = h + layer.attn(layer.attn_norm(h), rope, c.rope_type, scale=scale,
                               start_pos=start_pos, cache=cache, layer=i, attn_core=self.attn_core,
                               lengths=lengths)
            if rows is not None and i == len(self.layers) - 1:
                h = h[rows]
            h = h + layer.mlp(layer.mlp_norm(h))
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head [..., vocab] — apply only where needed (e.g. supervised positions)."""
        if self.output is not None:
            return self.output(h)
        return F.linear(h, self.tok_embeddings.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden(tokens))
