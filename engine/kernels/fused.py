"""The training step's fused elementwise passes (train_kernels.c) called on torch tensors.

A forward pass runs where the library is built and the operands suit it (CPU, contiguous, f32
or bf16 as the C file reads them: `usable`, `serves_gated`, `serves_rope`); `softmax_chunk` and
`rms_norm` return None otherwise. The caller then runs torch's op chain, which stays the
reference (tests/test_fused_kernels.py holds the two together). A backward runs for what its
forward served. Nothing here is autograd-aware: engine/models/blocks.py and
engine/models/lm_head_loss.py wrap these in their autograd Functions.

Reading order: `usable` (when a pass may run), then one wrapper per C pass: the LM head's
softmax step, RMSNorm, the gated activation, RoPE.
"""

from __future__ import annotations

import torch

from engine.kernels.native import train_kernels

DTYPES = {torch.float32: 0, torch.bfloat16: 1}      # the C file's FB_F32 / FB_BF16
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}            # FB_SILU / FB_GELU_TANH
ROPE_TYPES = {"norm": 0, "neox": 1}                  # fb_rope's `neox` flag


def usable(*tensors: torch.Tensor):
    """The library where every tensor is a contiguous f32/bf16 CPU tensor, else None."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in DTYPES or not t.is_contiguous():
            return None
    return train_kernels()


def softmax_chunk(z: torch.Tensor, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
    """One online-logsumexp step over a head chunk's logits z [N, C], in place: m [N, 1] becomes
    max(m, rowmax z), z becomes exp(z - m), s [N, 1] becomes s·exp(m_old - m) + Σ z. Returns that
    rescale [N, 1] (f32), or None (z, m and s untouched) where the pass cannot run."""
    lib = usable(z, m, s)
    if lib is None or m.dtype != torch.float32 or s.dtype != torch.float32:
        return None
    rescale = torch.empty_like(m)
    lib.fb_softmax_chunk(z.shape[0], z.shape[1], z.data_ptr(), DTYPES[z.dtype], m.data_ptr(),
                         s.data_ptr(), rescale.data_ptr())
    return rescale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x / sqrt(mean(x²) + eps) · weight in x's dtype, rstd [..., 1] f32), computed in f32, or
    None. weight is f32 [n], x [..., n]."""
    lib = usable(x, weight)
    if lib is None or weight.dtype != torch.float32:
        return None
    n = x.shape[-1]
    y, rstd = torch.empty_like(x), torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    lib.fb_rmsnorm_fwd(x.numel() // n, n, x.data_ptr(), DTYPES[x.dtype], weight.data_ptr(), eps,
                       y.data_ptr(), DTYPES[y.dtype], rstd.data_ptr())
    return y, rstd


def rms_norm_backward(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      dy: torch.Tensor, want_dw: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype, dweight f32 or None) from dy, for what rms_norm served."""
    dy = dy.to(x.dtype).contiguous()
    n = x.shape[-1]
    dx = torch.empty_like(x)
    dw = torch.zeros(n, dtype=torch.float32) if want_dw else None
    train_kernels().fb_rmsnorm_bwd(x.numel() // n, n, x.data_ptr(), DTYPES[x.dtype],
                                   rstd.data_ptr(), weight.data_ptr(), dy.data_ptr(),
                                   DTYPES[dy.dtype], dx.data_ptr(), DTYPES[dx.dtype],
                                   None if dw is None else dw.data_ptr())
    return dx, dw


def serves_gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> bool:
    """Whether gated_activation runs for these operands: silu or gelu-tanh, one shape and dtype."""
    return (activation in ACTIVATIONS and gate.dtype == up.dtype and gate.shape == up.shape
            and usable(gate, up) is not None)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) · up in their dtype, for operands serves_gated accepts."""
    out = torch.empty_like(gate)
    train_kernels().fb_glu_fwd(gate.numel(), ACTIVATIONS[activation], gate.data_ptr(),
                               up.data_ptr(), DTYPES[gate.dtype], out.data_ptr())
    return out


def gated_activation_backward(gate: torch.Tensor, up: torch.Tensor, d_out: torch.Tensor,
                              activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of gated_activation from d_out."""
    d_out = d_out.to(gate.dtype).contiguous()
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    train_kernels().fb_glu_bwd(gate.numel(), ACTIVATIONS[activation], gate.data_ptr(),
                               up.data_ptr(), d_out.data_ptr(), DTYPES[gate.dtype],
                               d_gate.data_ptr(), d_up.data_ptr())
    return d_gate, d_up


def serves_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str) -> bool:
    """Whether rope runs for x [B, T, H, hd] and f32 cos/sin [T, hd/2]."""
    return (rope_type in ROPE_TYPES and x.dim() == 4 and x.shape[3] % 2 == 0
            and cos.dtype == sin.dtype == torch.float32
            and cos.shape == sin.shape == (x.shape[1], x.shape[3] // 2)
            and usable(x, cos, sin) is not None)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str, scale: float
         ) -> torch.Tensor:
    """x [B, T, H, hd] rotated by cos/sin and times scale, as [B, H, T, hd] f32 (the heads moved
    ahead of the positions), for operands serves_rope accepts."""
    B, T, H, hd = x.shape
    out = torch.empty(B, H, T, hd, dtype=torch.float32)
    train_kernels().fb_rope_fwd(B, T, H, hd, x.data_ptr(), DTYPES[x.dtype], cos.data_ptr(),
                                sin.data_ptr(), scale, ROPE_TYPES[rope_type], out.data_ptr())
    return out


def rope_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str,
                  scale: float, x_dtype: torch.dtype) -> torch.Tensor:
    """dx [B, T, H, hd] in x's dtype from g [B, H, T, hd], for what rope served."""
    g = g.float().contiguous()
    B, H, T, hd = g.shape
    dx = torch.empty(B, T, H, hd, dtype=x_dtype)
    train_kernels().fb_rope_bwd(B, T, H, hd, g.data_ptr(), cos.data_ptr(), sin.data_ptr(), scale,
                                ROPE_TYPES[rope_type], dx.data_ptr(), DTYPES[x_dtype])
    return dx
