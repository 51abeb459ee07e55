"""Frozen GGUF weights kept in their stored block format, dequantized on the fly.

`FrozenQuantLinear` dequantizes its weight (in row chunks, so a large matrix never exists in f32
at once) for the forward pass and again in the backward pass for the input gradient dx = dy·W;
the weight itself carries no gradient, so LoRA adapters beside it train while it stays packed.
`weights="dense-cache"` keeps a per-layer dequantized copy (f32 or bf16) for speed when memory
allows. Under llama.cpp numerics the activations are quantized the way llama.cpp's matmul does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from torch import nn

from engine.gguf.dequant import dequantize
from engine.llm.numerics import activation_values

CHUNK_ELEMENTS = 1 << 22          # dequantize at most ~4M weights (16 MB f32) at a time


class PackedWeight:
    """A [rows, cols] matrix as packed bytes [rows, row_bytes] (a view of the GGUF memory map)."""

    def __init__(self, raw: torch.Tensor, ggml_type: T, rows: int, cols: int, name: str = ""):
        self.raw = raw.reshape(rows, -1)
        self.ggml_type, self.rows, self.cols, self.name = T(ggml_type), rows, cols, name
        self.dense: torch.Tensor | None = None       # optional dense cache
        self.lazy_dtype: torch.dtype | None = None   # fill the cache on first use in this dtype

    @property
    def packed_bytes(self) -> int:
        return self.raw.numel()

    @property
    def cache_bytes(self) -> int:
        return 0 if self.dense is None else self.dense.numel() * self.dense.element_size()

    def cache(self, dtype: torch.dtype | None, lazy: bool = False) -> None:
        """Keep a dense copy in `dtype` (None drops it); `lazy` defers it to the first use, so
        loading stays instant and a layer is dequantized once, when it first runs."""
        self.dense, self.lazy_dtype = None, (dtype if lazy else None)
        if dtype is not None and not lazy:
            self.dense = self.rows_f32(0, self.rows).to(dtype)

    def _fill(self) -> None:
        if self.lazy_dtype is not None and self.dense is None:
            dtype, self.lazy_dtype = self.lazy_dtype, None
            self.dense = self.rows_f32(0, self.rows).to(dtype)

    def rows_f32(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as f32 [end-start, cols]."""
        if self.dense is not None:
            return self.dense[start:end].float()
        return dequantize(self.raw[start:end], self.ggml_type, (end - start, self.cols), self.name)

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows at `index` (any shape) as f32 [..., cols] (embedding lookup)."""
        flat = index.reshape(-1)
        if self.dense is not None:
            out = self.dense[flat].float()
        else:
            out = dequantize(self.raw[flat], self.ggml_type, (flat.numel(), self.cols), self.name)
        return out.reshape(*index.shape, self.cols)

    def chunks(self):
        self._fill()
        step = max(1, CHUNK_ELEMENTS // max(1, self.cols))
        if self.dense is not None:
            step = self.rows
        for start in range(0, self.rows, step):
            end = min(self.rows, start + step)
            yield start, end, self.rows_f32(start, end)


def packed_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [..., cols] · Wᵀ -> [..., rows], W dequantized chunk by chunk."""
    parts = [F.linear(x, chunk) for _, _, chunk in w.chunks()]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class _DequantMatmul(torch.autograd.Function):
    """y = x·Wᵀ with W re-dequantized for dx = dy·W; W gets no gradient and is never saved."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w_holder):
        ctx.w = w_holder.weight
        return packed_matmul(x, ctx.w)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")   # backward under forward's autocast (bf16 dy)
    def backward(ctx, dy):
        dx = None
        for start, end, chunk in ctx.w.chunks():
            part = dy[..., start:end].matmul(chunk)
            dx = part if dx is None else dx + part
        return dx, None


class FrozenQuantLinear(nn.Module):
    """Linear layer over a frozen packed GGUF weight [out, in] (+ optional f32 bias)."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight              # not a Parameter: never trained, never in an optimizer
        self.in_features, self.out_features = weight.cols, weight.rows
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.numerics = "f32"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics == "llamacpp":
            y = packed_matmul(activation_values(x, self.weight.ggml_type), self.weight)
        elif torch.is_grad_enabled() and x.requires_grad:
            y = _DequantMatmul.apply(x, self)
        else:
            y = packed_matmul(x, self.weight)
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        """The full f32 weight [out, in] (for merging/export; allocates it)."""
        return self.weight.rows_f32(0, self.weight.rows)

    def extra_repr(self) -> str:
        w = self.weight
        return (f"in={self.in_features}, out={self.out_features}, type={w.ggml_type.name}, "
                f"cache={'none' if w.dense is None else str(w.dense.dtype)}")


class PackedEmbedding(nn.Module):
    """Token embedding over a frozen packed weight: only the looked-up rows are dequantized."""

    def __init__(self, weight: PackedWeight):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.take_rows(tokens)
