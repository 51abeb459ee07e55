"""Quantizers whose bytes equal ggml's reference quantizer (`ggml/src/ggml-quants.c`).

llama-quantize without an importance matrix calls the `quantize_row_*_ref` paths; each function
here is that path, vectorized over blocks. Byte equality needs ggml's float32 arithmetic
reproduced operation by operation: every intermediate stays float32 (numpy float32 ops round like
C's `float` on x86-64 SSE, and ggml-base is built without FMA), running sums are accumulated in
ggml's element order, and ggml's rounding helpers are mirrored exactly (`nearest_int` rounds half
to even, `roundf` half away from zero, `(int8_t)` casts truncate).

`quantize` runs the same reference paths in C (engine/hf/kquants.c) where a C compiler is
available; this numpy port (`quantize_numpy`) is what the C is tested against and what runs
without one.

Arrays inside the encoders are laid out element-major, `[elements_per_group, groups]`, so that a
sequential sum over a group's elements is a loop of contiguous vector adds.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from engine.gguf.layouts import BLOCK_LAYOUTS

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
BLOCKS_PER_CHUNK = 1 << 14  # bounds the encoders' working memory to a few hundred MB

# the types the weight-layout table gives a quantizer (engine/gguf/layouts.py)
QUANTIZED_TYPES = tuple(layout.ggml_type for layout in BLOCK_LAYOUTS if layout.quantizer)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 (round to nearest even) as little-endian bytes, [2, blocks]."""
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2).T


def _f16_roundtrip(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(F32)


def _nearest_int(values: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5*2^23 and read the mantissa, i.e. round half to even."""
    return np.rint(values).astype(np.int32)


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """sum over axis 0 in index order with float32 rounding after every add, like a C loop."""
    total = terms[0].copy()
    for term in terms[1:]:
        total += term
    return total


def _abs_argmax_value(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude (the first on ties), as ggml's `if (amax < fabsf(v))`;
    +0.0 for an all-zero group, whose running max never leaves its initial 0."""
    index = np.argmax(np.abs(x), axis=0)
    value = np.take_along_axis(x, index[None, :], axis=0)[0]
    return np.where(value == 0, F32(0), value)


def _first_extreme(x: np.ndarray, extreme: np.ndarray) -> np.ndarray:
    """The first element equal to `extreme` per group: keeps the sign of a zero min/max as a
    C loop with a strict comparison does."""
    index = np.argmax(x == extreme, axis=0)
    return np.take_along_axis(x, index[None, :], axis=0)[0]


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


def _pack_nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (low.astype(np.uint8) & 0xF) | ((high.astype(np.uint8) & 0xF) << 4)


def _fifth_bits(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Bit 4 of each quant gathered into a little-endian u32 (low half j, high half j+16)."""
    bits = np.concatenate([(low >> 4) & 1, (high >> 4) & 1]).astype(np.uint32)
    qh = np.zeros(bits.shape[1], dtype=np.uint32)
    for j in range(32):
        qh |= bits[j] << np.uint32(j)
    return qh.view(np.uint8).reshape(-1, 4).T


# ---------------------------------------------------------------- legacy 32-element blocks

def _q8_0(x: np.ndarray) -> list[np.ndarray]:
    amax = np.abs(x).max(axis=0)
    d = amax / F32(127)
    scaled = x * _inverse(d)
    # roundf: half away from zero; float64 holds |v| + 0.5 exactly for float32 v
    q = np.copysign(np.floor(np.abs(scaled.astype(np.float64)) + 0.5), scaled)
    return [_f16_bytes(d), q.astype(np.int8).view(np.uint8)]


def _q4_0(x: np.ndarray) -> list[np.ndarray]:
    d = _abs_argmax_value(x) / F32(-8)
    scaled = x * _inverse(d)
    q = np.minimum(15, np.trunc(scaled + F32(8.5)).astype(np.int32))
    return [_f16_bytes(d), _pack_nibbles(q[:16], q[16:])]


def _q4_1(x: np.ndarray) -> list[np.ndarray]:
    lo, hi = _first_extreme(x, x.min(axis=0)), _first_extreme(x, x.max(axis=0))
    d = (hi - lo) / F32(15)
    scaled = (x - lo) * _inverse(d)
    q = np.minimum(15, np.trunc(scaled + F32(0.5)).astype(np.int32))
    return [_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q[:16], q[16:])]


def _q5_0(x: np.ndarray) -> list[np.ndarray]:
    d = _abs_argmax_value(x) / F32(-16)
    scaled = x * _inverse(d)
    q = np.minimum(31, np.trunc(scaled + F32(16.5)).astype(np.int32))
    return [_f16_bytes(d), _fifth_bits(q[:16], q[16:]), _pack_nibbles(q[:16], q[16:])]


def _q5_1(x: np.ndarray) -> list[np.ndarray]:
    lo, hi = _first_extreme(x, x.min(axis=0)), _first_extreme(x, x.max(axis=0))
    d = (hi - lo) / F32(31)
    scaled = (x - lo) * _inverse(d)
    q = np.trunc(scaled + F32(0.5)).astype(np.int32) & 0xFF  # (uint8_t) cast, no clamp in ggml
    return [_f16_bytes(d), _f16_bytes(lo), _fifth_bits(q[:16], q[16:]),
            _pack_nibbles(q[:16], q[16:])]


# ---------------------------------------------------------------- k-quant helpers

def _make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float,
                      rdelta: float, nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml make_qkx2_quants (use_mad=false) over groups: x, weights [n, groups].

    Returns (L [n, groups] int32, scale [groups], the_min [groups]).
    """
    lo = np.minimum(x.min(axis=0), F32(0))
    hi = x.max(axis=0)
    flat = hi == lo
    sum_w = _seq_sum(weights)
    sum_x = _seq_sum(weights * x)

    def levels_for(iscale: np.ndarray, shift: np.ndarray) -> np.ndarray:
        """clamp(nearest_int(iscale * (x - shift)), 0, nmax), kept as float32."""
        q = x - shift
        q *= iscale
        np.rint(q, out=q)
        return np.clip(q, F32(0), F32(nmax), out=q)

    iscale = F32(nmax) / np.where(flat, F32(1), hi - lo)
    scale = F32(1) / iscale
    diff = scale * levels_for(iscale, lo) + lo - x
    best_error = _seq_sum(weights * (diff * diff))
    best_min = lo
    # the kept levels are recomputed at the end from the (iscale, min) that produced them
    best_iscale, best_shift = iscale, lo

    for step in range(nstep + 1):
        # ggml keeps searching around the best min found so far (its `min` is overwritten)
        shift = best_min
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / \
            np.where(flat, F32(1), hi - shift)
        lf = levels_for(iscale, shift)
        wl = weights * lf
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * lf), _seq_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive_min = this_min > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = np.where(positive_min, sum_xl / sum_l2, this_scale)
        this_min = np.where(positive_min, F32(0), this_min)
        diff = lf
        diff *= this_scale
        diff += this_min
        diff -= x
        cur_error = _seq_sum(weights * (diff * diff))
        better = ok & (cur_error < best_error)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        best_min = np.where(better, this_min, best_min)
        best_iscale = np.where(better, iscale, best_iscale)
        best_shift = np.where(better, shift, best_shift)

    levels = np.where(flat, 0, levels_for(best_iscale, best_shift).astype(np.int32))
    scale = np.where(flat, F32(0), scale)
    best_min = np.where(flat, lo, best_min)
    return levels, scale.astype(F32), (-best_min).astype(F32)


def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml make_qx_quants with rmse_type=1 and no importance weights: x [n, groups].

    Returns (L [n, groups] in [0, 2*nmax), scale [groups]).
    """
    peak = _abs_argmax_value(x)
    zero = np.abs(peak) < GROUP_MAX_EPS
    peak = np.where(zero, F32(1), peak)
    weights = x * x
    wx = weights * x

    def levels_for(iscale: np.ndarray) -> np.ndarray:
        """clamp(nearest_int(iscale * x), -nmax, nmax - 1), kept as float32."""
        q = x * iscale
        np.rint(q, out=q)
        return np.clip(q, F32(-nmax), F32(nmax - 1), out=q)

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lf = levels_for(iscale)
        return _seq_sum(wx * lf), _seq_sum((weights * lf) * lf)

    best_iscale = F32(-nmax) / peak
    sumlx, suml2 = sums(best_iscale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(F32(nmax) + F32(0.1) * F32(step)) / peak
        sumlx, suml2 = sums(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_iscale = np.where(better, iscale, best_iscale)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    levels = levels_for(best_iscale).astype(np.int32) + nmax
    return np.where(zero, 0, levels), np.where(zero, F32(0), scale).astype(F32)


def _pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """The 12-byte 6-bit scale/min packing of Q4_K and Q5_K: ls, lm [8, blocks] -> [12, blocks]."""
    out = np.zeros((12, ls.shape[1]), dtype=np.uint8)
    out[0:4] = ls[0:4] | ((ls[4:8] >> 4) << 6)
    out[4:8] = lm[0:4] | ((lm[4:8] >> 4) << 6)
    out[8:12] = (ls[4:8] & 0xF) | ((lm[4:8] & 0xF) << 4)
    return out


def _k_scales_and_levels(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Shared body of quantize_row_q4_K_ref / q5_K_ref: x [256, blocks].

    Returns (d f32 [blocks], dmin f32 [blocks], packed scales [12, blocks], L [256, blocks]).
    """
    blocks = x.shape[1]
    groups = x.reshape(8, 32, blocks).transpose(1, 0, 2).reshape(32, 8 * blocks)
    av_x = np.sqrt(_seq_sum(groups * groups) / F32(32))
    weights = av_x + np.abs(groups)
    levels, scales, mins = _make_qkx2_quants(groups, weights, nmax, rmin, rdelta, nstep)
    scales = scales.reshape(8, blocks)
    mins = mins.reshape(8, blocks)
    max_scale = np.maximum(scales.max(axis=0), F32(0))
    max_min = np.maximum(mins.max(axis=0), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    ls = np.minimum(_nearest_int(inv_scale * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min * mins) & 0xFF, 63).astype(np.uint8)
    d = max_scale / F32(63)
    dmin = max_min / F32(63)

    group_d = _f16_roundtrip(d) * ls.astype(F32)          # [8, blocks]
    group_dm = _f16_roundtrip(dmin) * lm.astype(F32)
    live = group_d != 0
    safe_d = np.where(live, group_d, F32(1))
    xg = x.reshape(8, 32, blocks)
    fresh = np.clip(_nearest_int((xg + group_dm[:, None, :]) / safe_d[:, None, :]), 0, nmax)
    kept = levels.reshape(32, 8, blocks).transpose(1, 0, 2)
    final = np.where(live[:, None, :], fresh, kept).reshape(256, blocks)
    return d, dmin, _pack_k_scales(ls, lm), final


# ---------------------------------------------------------------- k-quants

def _q4_k(x: np.ndarray) -> list[np.ndarray]:
    d, dmin, scales, levels = _k_scales_and_levels(x, 15, -1.0, 0.1, 20)
    lv = levels.reshape(4, 2, 32, -1)                    # [chunk of 64, half, 32, blocks]
    qs = _pack_nibbles(lv[:, 0], lv[:, 1]).reshape(128, -1)
    return [_f16_bytes(d), _f16_bytes(dmin), scales, qs]


def _q5_k(x: np.ndarray) -> list[np.ndarray]:
    d, dmin, scales, levels = _k_scales_and_levels(x, 31, -0.5, 0.1, 15)
    lv = levels.reshape(4, 2, 32, -1)
    qs = _pack_nibbles(lv[:, 0], lv[:, 1]).reshape(128, -1)
    high = (lv >> 4) & 1                                  # bit 4 of each level
    qh = np.zeros((32, levels.shape[1]), dtype=np.uint8)
    for chunk in range(4):
        qh |= (high[chunk, 0] << (2 * chunk)).astype(np.uint8)
        qh |= (high[chunk, 1] << (2 * chunk + 1)).astype(np.uint8)
    return [_f16_bytes(d), _f16_bytes(dmin), scales, qh, qs]


def _q6_k(x: np.ndarray) -> list[np.ndarray]:
    blocks = x.shape[1]
    groups = x.reshape(16, 16, blocks).transpose(1, 0, 2).reshape(16, 16 * blocks)
    levels, scales = _make_qx_quants_rmse1(groups, 32)
    scales = scales.reshape(16, blocks)
    peak = _abs_argmax_value(scales)
    zero_block = np.abs(peak) < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(zero_block, F32(1), peak)
    d = np.where(zero_block, F32(0), F32(1) / iscale).astype(F32)
    sc = np.minimum(127, _nearest_int(iscale * scales)).astype(np.int8)
    sc = np.where(zero_block, np.int8(0), sc)

    group_d = _f16_roundtrip(d) * sc.astype(F32)          # [16, blocks]
    live = group_d != 0
    safe_d = np.where(live, group_d, F32(1))
    xg = x.reshape(16, 16, blocks)
    fresh = np.clip(_nearest_int(xg / safe_d[:, None, :]), -32, 31) + 32
    kept = levels.reshape(16, 16, blocks).transpose(1, 0, 2)
    final = np.where(live[:, None, :], fresh, kept)
    final = np.where(zero_block[None, None, :], 0, final).reshape(256, blocks).astype(np.uint8)

    lv = final.reshape(2, 4, 32, blocks)                  # [half of 128, quarter, 32, blocks]
    ql = np.concatenate([_pack_nibbles(lv[:, 0], lv[:, 2]), _pack_nibbles(lv[:, 1], lv[:, 3])],
                        axis=1).reshape(128, blocks)
    qh = ((lv[:, 0] >> 4) | ((lv[:, 1] >> 4) << 2) | ((lv[:, 2] >> 4) << 4)
          | ((lv[:, 3] >> 4) << 6)).reshape(64, blocks)
    return [ql, qh, sc.view(np.uint8), _f16_bytes(d)]


ENCODERS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
            T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def quantize(data: np.ndarray, ggml_type: T) -> np.ndarray:
    """Quantize float values to `ggml_type`, byte-identical to ggml's reference quantizer.

    `data` has its rows on the last axis (ggml's ne[0]); the row length must be a multiple of the
    type's block size. Returns uint8 with the same leading shape and the row's byte size last.
    Runs ggml's C (engine/hf/kquants.c, built on first use) where it can be built, else this
    module's numpy port (`quantize_numpy`): the same bytes, the C ~10-50x sooner.
    """
    from engine.hf.kquants import quantize_rows

    # f16 values (an f16 file's tensor) go to the C as they are: no f32 copy of the tensor
    half = isinstance(data, np.ndarray) and data.dtype == np.float16
    values = _checked(data, ggml_type, np.float16 if half else F32)
    native = quantize_rows(values, ggml_type)
    return native if native is not None else quantize_numpy(values, ggml_type)


def _checked(data: np.ndarray, ggml_type: T, dtype=F32) -> np.ndarray:
    """`data` as contiguous `dtype` whose rows fill whole blocks of a type with an encoder."""
    ggml_type = T(ggml_type)
    if ggml_type not in ENCODERS:
        raise ValueError(f"no quantizer for {ggml_type.name}")
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    values = np.ascontiguousarray(data, dtype=dtype)
    row = values.shape[-1] if values.ndim else 1
    if row % block_size:
        raise ValueError(f"{ggml_type.name} needs rows that are a multiple of {block_size} "
                         f"values; this tensor's rows hold {row}")
    return values


def quantize_numpy(data: np.ndarray, ggml_type: T) -> np.ndarray:
    """`quantize` by the numpy port alone (the reference the C build is tested against)."""
    values = _checked(data, ggml_type)
    ggml_type = T(ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    row = values.shape[-1] if values.ndim else 1
    blocks = values.reshape(-1, block_size)
    out = np.empty((blocks.shape[0], type_size), dtype=np.uint8)
    encode = ENCODERS[ggml_type]
    for start in range(0, blocks.shape[0], BLOCKS_PER_CHUNK):
        chunk = np.ascontiguousarray(blocks[start:start + BLOCKS_PER_CHUNK].T)
        with np.errstate(over="ignore", invalid="ignore"):
            parts = encode(chunk)
        out[start:start + chunk.shape[1]] = np.concatenate(parts, axis=0).T
    return out.reshape(*values.shape[:-1], row // block_size * type_size)
