"""Vectorized torch dequantization of GGML block formats, element-exact against the `gguf`
package's numpy `dequantize` (same f32 operations in the same order).

Each kernel (`dequantize_<type>`, named in the weight-layout table engine/gguf/layouts.py) takes
the packed bytes as a [n_blocks, type_size] uint8 tensor and returns [n_blocks, block_size] f32.
Layouts: ggml-common.h (block_q4_0 … block_q6_K, block_tq2_0).

Why it is fast: the bit fields are unpacked on int64 words (eight bytes per operation, "SWAR")
into one byte per weight; then one conversion to f32 and one in-place multiply by the scale
(and add/subtract of the min) per value. No float64, no per-block Python. Little-endian hosts.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from engine.errors import ForgebenchError
from engine.gguf.constants import QK_K, SUPPORTED_TYPES, type_size
from engine.gguf.layouts import layout_of


def _every_byte(value: int) -> int:
    """`value` repeated in all eight bytes of a signed int64 (a SWAR mask)."""
    return int.from_bytes(bytes([value]) * 8, "little", signed=True)


LOW_NIBBLES = _every_byte(0x0F)
LOW_BITS = _every_byte(0x01)
LOW_2BITS = _every_byte(0x03)
# byte value b -> int64 whose byte k holds bit k of b, moved to bit 4 (the 5th bit of Q5 values)
_BIT4_OF_BYTE = torch.tensor([sum(((b >> k) & 1) << (8 * k + 4) for k in range(8))
                              for b in range(256)], dtype=torch.int64)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> [n, 1] f32 from little-endian f16."""
    return b.contiguous().view(torch.float16).float()


def _words(b: torch.Tensor) -> torch.Tensor:
    """[n, 8k] bytes -> [n, k] int64 words, copied (a slice of the blocks, even a single row,
    may not sit on an 8-byte stride)."""
    return b.clone(memory_format=torch.contiguous_format).view(torch.int64)


def _nibble_words(w: torch.Tensor) -> torch.Tensor:
    """int64 words [..., k] -> [..., 2, k]: low nibbles then high nibbles, one per byte."""
    out = torch.empty(*w.shape[:-1], 2, w.shape[-1], dtype=torch.int64, device=w.device)
    torch.bitwise_and(w, LOW_NIBBLES, out=out[..., 0, :])
    torch.bitwise_and(w >> 4, LOW_NIBBLES, out=out[..., 1, :])
    return out


def _as_bytes(w: torch.Tensor, n: int) -> torch.Tensor:
    """int64 words -> [n, -1] uint8."""
    return w.view(torch.uint8).reshape(n, -1)


def _q5_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 4] words: bit j of the u32 at bit 4 of byte j."""
    return _BIT4_OF_BYTE.to(qh.device).index_select(0, qh.reshape(-1).int()).view(qh.shape)


def _signed(q: torch.Tensor, offset: int) -> torch.Tensor:
    """Unsigned values below 128 -> int8 values minus `offset` (in place, no overflow)."""
    return q.view(torch.int8).sub_(offset)


def _q4_0_ints(b):
    n = b.shape[0]
    return _signed(_as_bytes(_nibble_words(_words(b[:, 2:])), n), 8)   # [n, 32] int8


def dequantize_q4_0(b):
    return _q4_0_ints(b).float().mul_(_f16(b[:, :2]))


def _q4_1_ints(b):
    n = b.shape[0]
    return _as_bytes(_nibble_words(_words(b[:, 4:])), n)               # [n, 32] 0..15


def dequantize_q4_1(b):
    return _q4_1_ints(b).float().mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q5_0_ints(b):
    n = b.shape[0]
    w = _nibble_words(_words(b[:, 6:])).reshape(n, 4)
    w |= _q5_high_bits(b[:, 2:6])
    return _signed(_as_bytes(w, n), 16)


def dequantize_q5_0(b):
    return _q5_0_ints(b).float().mul_(_f16(b[:, :2]))


def _q5_1_ints(b):
    n = b.shape[0]
    w = _nibble_words(_words(b[:, 8:])).reshape(n, 4)
    w |= _q5_high_bits(b[:, 4:8])
    return _as_bytes(w, n)                                              # [n, 32] 0..31


def dequantize_q5_1(b):
    return _q5_1_ints(b).float().mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q8_0_ints(b):
    return b.view(torch.int8)[:, 2:]


def dequantize_q8_0(b):
    return _q8_0_ints(b).float().mul_(_f16(b[:, :2]))


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins, [n, 8] each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_scales(b):
    """Q4_K/Q5_K per-sub-block scale and min, [n, 8, 1] f32 each."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc.float()).view(n, 8, 1), (dmin * mn.float()).view(n, 8, 1)


def _q4_k_ints(b):
    """[n, 8, 32] unsigned 4-bit values, sub-block by sub-block."""
    n = b.shape[0]
    return _as_bytes(_nibble_words(_words(b[:, 16:]).view(n, 4, 4)), n).view(n, 8, 32)


def dequantize_q4_k(b):
    dl, ml = _k_scales(b)
    return _q4_k_ints(b).float().mul_(dl).sub_(ml).reshape(b.shape[0], QK_K)


def _q5_k_ints(b):
    """[n, 8, 32] unsigned 5-bit values, sub-block by sub-block."""
    n = b.shape[0]
    w = _nibble_words(_words(b[:, 48:]).view(n, 4, 4)).view(n, 8, 4)   # sub-block s: nibbles
    qh = _words(b[:, 16:48]).view(n, 1, 4)                              # bit s of each qh byte
    shifts = torch.arange(8, dtype=torch.int64, device=b.device).view(1, 8, 1)
    w |= ((qh >> shifts) & LOW_BITS) << 4
    return _as_bytes(w, n).view(n, 8, 32)


def dequantize_q5_k(b):
    dl, ml = _k_scales(b)
    return _q5_k_ints(b).float().mul_(dl).sub_(ml).reshape(b.shape[0], QK_K)


def _q6_k_ints(b):
    """[n, 256] unsigned 6-bit values (the stored q + 32) in element order."""
    n = b.shape[0]
    lo = _nibble_words(_words(b[:, :128]).view(n, 2, 8)).view(n, 2, 2, 2,
                                                              4)   # [n, half, nib, row, 4]
    qh = _words(b[:, 128:192]).view(n, 2, 1, 4)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int64, device=b.device).view(1, 1, 4, 1)
    hi = ((qh >> shifts) & LOW_2BITS) << 4                                        # [n, half, 4, 4]
    return _as_bytes(lo.view(n, 2, 4, 4) | hi, n)


def dequantize_q6_k(b):
    n = b.shape[0]
    dl = (_f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    q = _signed(_q6_k_ints(b), 32).view(n, 16, 16)
    return q.float().mul_(dl).reshape(n, QK_K)


def unpack_blocks(raw: torch.Tensor, ggml_type: T) -> dict[str, torch.Tensor]:
    """The integer parts of packed blocks, for kernels that multiply in integers as ggml does.

    raw [rows, row_bytes] uint8 -> per type, with nb blocks per row:
    Q8_0/Q5_0/Q4_0: q [rows, nb, 32] int8, d [rows, nb] f32;
    Q4_1/Q5_1: q [rows, nb, 32] uint8 (0..15 / 0..31), d and dmin (the block's min m) [rows, nb];
    Q4_K/Q5_K: q [rows, nb, 8, 32] (0..15 / 0..31), scales/mins [rows, nb, 8] (0..63), d/dmin
    [rows, nb] f32;
    Q6_K: q [rows, nb, 256] (0..63, i.e. stored value + 32), scales [rows, nb, 16] int8,
    d [rows, nb].
    """
    ggml_type = T(ggml_type)
    rows = raw.shape[0]
    b = raw.reshape(-1, type_size(ggml_type))
    nb = b.shape[0] // rows
    if ggml_type in (T.Q8_0, T.Q5_0, T.Q4_0):
        ints = {T.Q8_0: _q8_0_ints, T.Q5_0: _q5_0_ints, T.Q4_0: _q4_0_ints}[ggml_type](b)
        return {"q": ints.reshape(rows, nb, 32), "d": _f16(b[:, :2]).view(rows, nb)}
    if ggml_type in (T.Q4_1, T.Q5_1):
        ints = _q4_1_ints(b) if ggml_type == T.Q4_1 else _q5_1_ints(b)
        return {"q": ints.reshape(rows, nb, 32), "d": _f16(b[:, :2]).view(rows, nb),
                "dmin": _f16(b[:, 2:4]).view(rows, nb)}
    if ggml_type in (T.Q4_K, T.Q5_K):
        sc, mn = _k_scale_min(b[:, 4:16])
        ints = _q4_k_ints(b) if ggml_type == T.Q4_K else _q5_k_ints(b)
        return {"q": ints.view(rows, nb, 8, 32), "scales": sc.view(rows, nb, 8),
                "mins": mn.view(rows, nb, 8), "d": _f16(b[:, :2]).view(rows, nb),
                "dmin": _f16(b[:, 2:4]).view(rows, nb)}
    if ggml_type == T.Q6_K:
        return {"q": _q6_k_ints(b).view(rows, nb, QK_K),
                "scales": b[:, 192:208].view(torch.int8).view(rows, nb, 16),
                "d": _f16(b[:, 208:210]).view(rows, nb)}
    raise ValueError(f"no integer unpacking for {ggml_type.name}")


def dequantize_tq2_0(b):
    # llama.cpp's TQ2_0: 64 bytes of 2-bit trits + 1 (element 32·l + n of each 128-element half
    # j sits at bits 2l of byte 32·j + n), then the f16 scale
    n = b.shape[0]
    qs = b[:, :64].view(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    q = ((qs >> shifts) & 3).reshape(n, QK_K).float().sub_(1)
    return q.mul_(_f16(b[:, 64:66]).view(n, 1))


_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)


def dequantize_tq1_0(b):
    # llama.cpp's TQ1_0: 48 bytes of 5 trits each, 4 bytes of 4 trits, the f16 scale. A byte holds
    # ceil(256·q/243) for q = Σ t_k·3^(4-k) (t + 1 ∈ {0,1,2}); trit k is (byte·3^k mod 256)·3 >> 8.
    # Element order: byte n of the first 32 holds elements n, 32 + n, ..., 128 + n; of the next
    # 16, 160 + n, 176 + n, ...; of the last 4, 240 + n, 244 + n, 248 + n, 252 + n.
    n = b.shape[0]
    pow3 = _POW3.to(b.device)
    q = b[:, :52].int()
    qs0 = (q[:, None, :32] * pow3.view(1, 5, 1)).reshape(n, 160)
    qs1 = (q[:, None, 32:48] * pow3.view(1, 5, 1)).reshape(n, 80)
    qh = (q[:, None, 48:52] * pow3[:4].view(1, 4, 1)).reshape(n, 16)
    trits = ((torch.cat((qs0, qs1, qh), dim=1) & 0xFF) * 3 >> 8).float().sub_(1)
    return trits.mul_(_f16(b[:, 52:54]).view(n, 1))


def dequantize_f32(b):
    return b.view(torch.float32)


def dequantize_f16(b):
    return b.view(torch.float16).float()


def dequantize_bf16(b):
    return b.view(torch.bfloat16).float()


def dequantize(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...] | torch.Size,
               name: str = "tensor") -> torch.Tensor:
    """Packed bytes (uint8, any shape, C order) of `ggml_type` -> f32 tensor of `shape`, on
    the bytes' device (a GPU dequantizes its packed weights itself, chunk by chunk), with the
    type's dequantizer from the weight-layout table."""
    ggml_type = T(ggml_type)
    flat = raw.reshape(-1)
    layout = layout_of(ggml_type)
    if layout is not None:
        out = layout.dequantize_blocks(flat.view(-1, layout.block_bytes)).reshape(-1)
    else:
        raise ForgebenchError(f"{name}: quant type {ggml_type.name} is not supported",
                              where=name,
                              hint="supported: " + ", ".join(t.name for t in SUPPORTED_TYPES))
    n = 1
    for s in shape:
        n *= int(s)
    if out.numel() != n:
        raise ForgebenchError(
            f"{name}: {raw.numel()} bytes of {ggml_type.name} hold {out.numel()} values, "
            f"not the {n} its shape {tuple(shape)} needs",
            where=name,
        )
    return out.reshape(tuple(shape))


__all__ = ["dequantize", "unpack_blocks"]  # and the dequantize_<type> kernels
