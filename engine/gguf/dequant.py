"""Vectorized torch dequantization of GGML block formats, element-exact against the `gguf`
package's numpy `dequantize` (same f32 operations in the same order).

Each kernel takes the packed bytes as a [n_blocks, type_size] uint8 tensor and returns
[n_blocks, block_size] f32. Layouts: ggml-common.h (block_q4_0 … block_q6_K).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from engine.errors import ForgebenchError
from engine.gguf.constants import QK_K, SUPPORTED_TYPES, type_size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> [n, 1] f32 from little-endian f16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32]: low nibbles then high nibbles (q4_0 element order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 4] bytes of a little-endian u32 -> its 32 bits [n_blocks, 32] (bit j = byte j//8)."""
    return ((qh.unsqueeze(-1) >> _SHIFTS) & 1).reshape(qh.shape[0], 32)


def _q4_0(b):
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:]).view(torch.int8) - 8
    return d * q.float()


def _q4_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:]).float() + m


def _q5_0(b):
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return d * (q.view(torch.int8) - 16).float()


def _q5_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return d * q.float() + m


def _q8_0(b):
    return b.view(torch.int8)[:, 2:].float() * _f16(b[:, :2])


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins, [n, 8] each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    qs = b[:, 16:].reshape(n, 4, 1, 32)                           # 4 chunks of 32 bytes -> 64 values
    q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    qh = b[:, 16:48].reshape(n, 1, 32)
    qs = b[:, 48:].reshape(n, 4, 1, 32)
    ql = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32)
    hi = (qh >> _SHIFTS.view(1, 8, 1)) & 1                        # [n, 8, 32]
    q = (ql | (hi << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    dl = (d * scales).view(n, 16, 1)
    lo = ql.reshape(n, 2, 1, 64)
    lo = torch.cat((lo & 0x0F, lo >> 4), dim=2).reshape(n, 8, 32)
    hi = qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    hi = (hi & 0x03).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


_KERNELS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
            T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def dequantize(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...] | torch.Size,
               name: str = "tensor") -> torch.Tensor:
    """Packed bytes (uint8, any shape, C order) of `ggml_type` -> f32 tensor of `shape`."""
    ggml_type = T(ggml_type)
    flat = raw.reshape(-1)
    if ggml_type == T.F32:
        out = flat.view(torch.float32)
    elif ggml_type == T.F16:
        out = flat.view(torch.float16).float()
    elif ggml_type == T.BF16:
        out = flat.view(torch.bfloat16).float()
    elif ggml_type in _KERNELS:
        blocks = flat.view(-1, type_size(ggml_type))
        out = _KERNELS[ggml_type](blocks)
    else:
        raise ForgebenchError(f"{name}: quant type {ggml_type.name} is not supported",
                              where=name, hint="supported: " + ", ".join(t.name for t in SUPPORTED_TYPES))
    n = 1
    for s in shape:
        n *= int(s)
    if out.numel() != n:
        raise ForgebenchError(f"{name}: {raw.numel()} bytes of {ggml_type.name} hold {out.numel()} values, "
                              f"not the {n} its shape {tuple(shape)} needs", where=name)
    return out.reshape(tuple(shape))


__all__ = ["dequantize"]
