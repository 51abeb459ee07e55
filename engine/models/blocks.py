"""Pieces shared by the decoder families: RMSNorm, RoPE, attention with a KV cache, gated MLP.

Arithmetic follows llama.cpp's graph (ggml) where the choice matters: RMSNorm multiplies by the
stored weight (Gemma's GGUF already holds 1 + w), RoPE angles are built the way ggml builds them
(theta_i = pos * base^(-2i/d), optionally divided by per-frequency factors), and attention masks
use llama.cpp's sliding-window rule (key j is visible from query p when p - j < window).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import fused
from engine.kernels.cpu import torch_threads
from engine.kernels.numerics import cos_sin_f32, fma_f32, gelu_llamacpp, rsqrt_f32, silu_llamacpp
from engine.models.packed import step_threads


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in f32 (one fused pass where
    engine/kernels/fused.py serves it, torch's ops elsewhere).

    `ggml_exact` (set under llama.cpp numerics) follows ggml_compute_forward_rms_norm_f32: the sum
    of squares accumulated in double, 1/sqrtf(mean + eps) in f32 (correctly rounded, as C's
    sqrtf is: rsqrt_f32), then x·scale, then ·weight; bit-identical to llama.cpp's norm output.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ggml_exact = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ggml_exact:
            xf = x.to(torch.promote_types(x.dtype, torch.float32))
            mean = ((xf * xf).double().sum(-1, keepdim=True) / xf.shape[-1]).float()
            scale = rsqrt_f32(mean + torch.tensor(self.eps, dtype=torch.float32))
            return ((xf * scale) * self.weight.float()).to(x.dtype)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        if (done := fused.rms_norm(x, self.weight, self.eps)) is not None:
            return done[0]
        return _rms_norm_torch(x, self.weight, self.eps)[0]


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x in x's dtype, rstd [..., 1]) by torch's ops, in f32 (f64 kept for gradient
    checks): the reference the fused pass (engine/kernels/fused.py) is held to."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(xf.dtype)).to(x.dtype), rstd


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm for training: the forward's arithmetic, and a backward of four elementwise passes
    (dx = rstd·(g − x̂·mean(g·x̂)), g = dy·w) instead of the dozen autograd nodes of pow, mean,
    rsqrt and the products; ~100 norms a step in Gemma. Each direction is one fused pass where
    engine/kernels/fused.py serves it (f32/bf16 on the CPU), torch's ops elsewhere."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        done = fused.rms_norm(x, weight, eps)
        ctx.fused = done is not None
        y, rstd = done if ctx.fused else _rms_norm_torch(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        want_dw = ctx.needs_input_grad[1]
        if ctx.fused:
            dx, dw = fused.rms_norm_backward(x, rstd, weight, dy, want_dw)
            return dx, dw, None
        xf = x.to(rstd.dtype)
        normed, g = xf * rstd, dy.to(rstd.dtype) * weight.to(rstd.dtype)
        dx = (g - normed * (g * normed).mean(-1, keepdim=True)).mul_(rstd)
        dw = (dy * normed).reshape(-1, weight.shape[-1]).sum(0) if want_dw else None
        return dx.to(x.dtype), None if dw is None else dw.to(weight.dtype), None


def rope_tables(positions: torch.Tensor, rot_dim: int, base: float,
                freq_factors: torch.Tensor | None = None, freq_scale: float = 1.0,
                libm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rot_dim/2] for positions [T]:
    angle_i = freq_scale · (pos · base^(-2i/rot_dim)) / ff_i.

    Built as ggml_rope_cache_init builds it, in f32: theta starts at pos and is multiplied by
    powf(base, -2/rot_dim) once per frequency, divided by the frequency factor, then scaled, so
    angles round exactly as llama.cpp's do. `libm` takes cos/sin from the C library's cosf/sinf
    as ggml does (torch's own differ from them in the last bit for ~1% of angles).

    Up to ROPE_CACHE_POSITIONS positions, the tables come from a small cache keyed on the
    positions and settings, so they are shared: callers only read them. Why: the build is a
    loop of rot_dim/2 steps of three ops each, ~770 ops a training step for Gemma's two tables
    (a fifth of the step's top-level ops), for tables that every step of a run with the same
    packing rebuilds bit for bit.
    """
    if positions.numel() > ROPE_CACHE_POSITIONS or positions.device.type != "cpu":
        return _rope_tables(positions, rot_dim, base, freq_factors, freq_scale, libm)
    key = (positions.to(torch.int64).numpy().tobytes(), rot_dim, float(base),
           None if freq_factors is None else freq_factors.detach().float().cpu().numpy().tobytes(),
           float(freq_scale), bool(libm))
    tables = _ROPE_CACHE.get(key)
    if tables is None:
        tables = _rope_tables(positions, rot_dim, base, freq_factors, freq_scale, libm)
        if len(_ROPE_CACHE) >= ROPE_CACHE_ENTRIES:
            _ROPE_CACHE.pop(next(iter(_ROPE_CACHE)))        # the oldest
        _ROPE_CACHE[key] = tables
    return tables


ROPE_CACHE_POSITIONS = 4096   # tables of more positions are built each call: one entry of 4096
ROPE_CACHE_ENTRIES = 8        # positions at rot_dim 256 is 4 MB, the cache 32 MB at most
_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_tables(positions: torch.Tensor, rot_dim: int, base: float,
                 freq_factors: torch.Tensor | None, freq_scale: float,
                 libm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_tables, built (no cache)."""
    scale = torch.tensor(base ** (-2.0 / rot_dim), dtype=torch.float32)
    theta = positions.to(torch.float32).clone()
    angles = torch.empty(len(positions), rot_dim // 2, dtype=torch.float32)
    for i in range(rot_dim // 2):
        angles[:, i] = theta
        theta = theta * scale
    if freq_factors is not None:
        angles = angles / freq_factors.float()
    if freq_scale != 1.0:
        angles = torch.tensor(freq_scale, dtype=torch.float32) * angles
    return cos_sin_f32(angles) if libm else (angles.cos(), angles.sin())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str,
               fused: bool = False) -> torch.Tensor:
    """Rotate x [B, H, T, hd] by cos/sin [T, hd/2].

    "norm" rotates adjacent pairs (x0,x1),(x2,x3)… (llama.cpp's LLAMA arch); "neox" rotates
    (x_i, x_{i+hd/2}) (Qwen, Gemma, HF layout). `fused` rounds as ggml's compiled rotate_pairs
    does: fma(x0, cos, -(x1·sin)) and fma(x0, sin, x1·cos).
    """
    if rope_type == "norm":
        x1, x2 = x[..., 0::2], x[..., 1::2]
    elif rope_type == "neox":
        x1, x2 = x.split(x.shape[-1] // 2, dim=-1)     # backward: one cat, as packed_attention
    else:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    if fused:
        r1, r2 = fma_f32(x1, cos, -(x2 * sin)), fma_f32(x1, sin, x2 * cos)
    else:
        r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    if rope_type == "norm":
        return torch.stack((r1, r2), dim=-1).flatten(-2)
    return torch.cat((r1, r2), dim=-1)


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str,
               scale: float = 1.0, ggml_rounding: bool = False) -> torch.Tensor:
    """RoPE of x [B, T, H, hd] times `scale`, as [B, H, T, hd]: one fused pass each way (with
    the transpose) where engine/kernels/fused.py serves it, else apply_rope on the transpose
    (always under llama.cpp numerics, `ggml_rounding`)."""
    if not ggml_rounding and fused.serves_rope(x, cos, sin, rope_type):
        return _Rope.apply(x, cos, sin, rope_type, scale)
    out = apply_rope(x.transpose(1, 2), cos, sin, rope_type, ggml_rounding)
    return out if scale == 1.0 else out * scale


class _Rope(torch.autograd.Function):
    """rope_heads as one pass forward and one backward (the rotation by −angle, times scale)."""

    @staticmethod
    def forward(ctx, x, cos, sin, rope_type, scale):
        ctx.save_for_backward(cos, sin)
        ctx.rope_type, ctx.scale, ctx.x_dtype = rope_type, scale, x.dtype
        return fused.rope(x, cos, sin, rope_type, scale)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return fused.rope_backward(g, cos, sin, ctx.rope_type, ctx.scale, ctx.x_dtype), \
            None, None, None, None


@dataclass
class KVCache:
    """Keys/values per layer, [B, n_kv_heads, max_len, head_dim] each.

    `dtype=torch.float16` reproduces llama.cpp's default f16 cache (values are rounded on write).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def empty(cls, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
              dtype: torch.dtype = torch.float32) -> "KVCache":
        shape = (batch, n_kv_heads, max_len, head_dim)
        return cls([torch.zeros(shape, dtype=dtype) for _ in range(n_layers)],
                   [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)])

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        """Write k/v [B, n_kv, T, hd] at start_pos; return the cached keys/values [.., :end, ..]."""
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked for {end}")
        self.k[layer][:, :, start_pos:end] = k.to(self.k[layer].dtype)
        self.v[layer][:, :, start_pos:end] = v.to(self.v[layer].dtype)
        return self.k[layer][:, :, :end].to(k.dtype), self.v[layer][:, :, :end].to(v.dtype)


def attention_mask(start_pos: int, q_len: int, kv_len: int,
                   window: int | None = None) -> torch.Tensor:
    """Boolean [q_len, kv_len]: True where query (start_pos+i) may attend key j (causal,
    windowed)."""
    qpos = torch.arange(start_pos, start_pos + q_len)[:, None]
    kpos = torch.arange(kv_len)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= (qpos - kpos) < window
    return mask


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if not cap else torch.tanh(x / cap) * cap


class Attention(nn.Module):
    """Grouped-query attention with optional q/k bias (Qwen2) and per-head q/k RMSNorm (Qwen3,
    Gemma3)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 bias: bool = False,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.ggml_exact = False           # llama.cpp numerics: ggml's rounding in RoPE

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rope_type: str, *,
                scale: float, start_pos: int = 0, cache: KVCache | None = None, layer: int = 0,
                window: int | None = None, attn_core=None, scale_q_first: bool = False,
                lengths: list[int] | None = None) -> torch.Tensor:
        """`scale_q_first` multiplies q by `scale` before attention (Gemma, as llama.cpp does)
        instead of scaling the scores. `lengths` splits x [1, T] into packed sequences that each
        attend only within themselves (no cache)."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.head_dim)                     # [B,T,H,hd]
        k = self.k(x).view(B, T, self.n_kv_heads, self.head_dim)                  # [B,T,Hkv,hd]
        v = self.v(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope_heads(q, *rope, rope_type, scale if scale_q_first else 1.0,
                       self.ggml_exact)                                           # [B,H,T,hd]
        k = rope_heads(k, *rope, rope_type, 1.0, self.ggml_exact)                 # [B,Hkv,T,hd]
        v = v.transpose(1, 2)
        if scale_q_first:
            scale = 1.0
        core = attn_core or sdpa
        if lengths is not None:
            if cache is not None or B != 1:
                raise ValueError("packed sequences need a batch of one and no KV cache")
            out = packed_attention(core, q, k, v, lengths, scale, window)
        else:
            if cache is not None:
                k, v = cache.update(layer, start_pos, k, v)                       # [B,Hkv,S,hd]
            mask = attention_mask(start_pos, T, k.shape[2], window).to(x.device)
            out = core(q, k, v, mask, scale)                                      # [B,H,T,hd]
        return self.o(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def packed_attention(core, q, k, v, lengths: list[int], scale: float, window: int | None):
    """Attention over sequences packed along T (q [1,H,T,hd], k/v [1,Hkv,T,hd]), each causal
    within itself: one core call per sequence, so no score is spent across sequences or on
    padding.

    On several CPU threads each core call (forward and backward) runs on one thread, the
    sequences in turn (ONE_THREAD_ATTENTION, the default); with SPREAD_ATTENTION, where the
    sequences can share the threads out evenly (`spread_sequences`), side by side on the
    threads (`_SpreadCores`); with neither, each call on all the threads, in turn."""
    if core is sdpa and q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # sdpa computes in f32 under CPU autocast: one cast of each operand (and one of each
        # gradient back) for all the sequences, not one a sequence
        q, k, v = q.float(), k.float(), v.float()
    # sdpa takes a sequence the window does not cut as plain causal (mask None, `sdpa`)
    masks = [None if core is sdpa and (window is None or n <= window)
             else _sequence_mask(n, window, q.device) for n in lengths]
    threads = step_threads() if q.device.type == "cpu" else 1
    groups = spread_sequences(lengths, threads) if SPREAD_ATTENTION else None
    if groups is not None:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _SpreadCores.apply(core, masks, scale, groups, lengths, q, k, v)
        return torch.cat(_spread_forward(core, masks, scale, groups, lengths, q, k, v,
                                         grad=False)[0], dim=2)
    outs = []
    # one thread each (ONE_THREAD_ATTENTION), or all of them where the step's glue runs on one
    # (packed.one_thread_glue) and torch is at one; else torch's own count as it stands
    core_threads = (1 if ONE_THREAD_ATTENTION and threads > 1
                    else threads if threads != torch.get_num_threads() else None)
    # split, not slices: its backward is one cat of the pieces' gradients, where each slice's
    # would write its piece into a zeroed copy of the whole and then sum those copies
    for mask, qs, ks, vs in zip(masks, *(t.split(lengths, dim=2) for t in (q, k, v))):
        if core_threads is None:
            outs.append(core(qs, ks, vs, mask, scale))
        elif torch.is_grad_enabled() and any(t.requires_grad for t in (qs, ks, vs)):
            outs.append(_CoreOnThreads.apply(core, mask, scale, core_threads, qs, ks, vs))
        else:
            with torch_threads(core_threads):
                outs.append(core(qs, ks, vs, mask, scale))
    return torch.cat(outs, dim=2)


# FORGEBENCH_ATTN_ONE_THREAD (default 1): a packed sequence's attention (a few dozen tokens) on
# one torch thread, forward and backward, the sequences in turn on the calling thread: the bits
# torch computes at one thread. On the Sapphire Rapids those equal its threaded bits; on a Zen 4
# EPYC torch's threaded SDPA backward differs from its one-thread backward by about 1 ulp
# (tests/test_lora_threads.py says which holds). With 0, each sequence runs on all the threads.
# On a 2-core Sapphire Rapids a pirate LoRA step at 2 threads, interleaved, took 0.273 s wall /
# 0.456 s CPU one thread each against 0.258 / 0.469 s threaded at load 1.5 (5% slower), but
# 1.00 s / 0.65 s against 2.42 s / 1.11 s at load 6.5, where a tiny parallel call waits on a
# descheduled partner thread.
ONE_THREAD_ATTENTION = os.environ.get("FORGEBENCH_ATTN_ONE_THREAD", "1") == "1"
# FORGEBENCH_ATTN_SPREAD=1 spreads the sequences over the threads instead (`spread_sequences`,
# _SpreadCores): the same one-thread bits, the second thread busy too, but each layer hands a
# share to a pool thread and back, and the two Python threads' small ops contend. Off by
# default: on the 2-core Zen 4 EPYC a pirate LoRA step at 2 threads, steps alternating in one
# process, took 426 ms wall / 832 ms CPU in turn against 450 / 881 ms spread (the fastest of
# 14 each, load 1.4-2.7), medians 2.46 s against 2.67 s under a loaded machine (load 4-5, both
# cores busy beside it), and torch.profiler put the spread's forward and backward at 54 ms of
# a 445 ms step where the same calls took 36 ms in turn on one thread. (Whether the spread
# pays on the Sapphire Rapids was not measured.)
SPREAD_ATTENTION = os.environ.get("FORGEBENCH_ATTN_SPREAD", "0") == "1"
SPREAD_IMBALANCE = 1.25   # spread only where the busiest thread's share of the attention work
                          # is at most this times an even share: one long sequence among short
                          # ones is faster on all threads at once


def spread_sequences(lengths: list[int], threads: int) -> list[list[int]] | None:
    """The packed sequences (their indices) shared out over `threads` threads, a list each,
    the first for the calling thread, or None where spreading does not pay: one thread, one
    sequence, or shares that cannot be made even within SPREAD_IMBALANCE.

    A sequence of n tokens costs n² (its scores); the longest go first, each to the thread with
    the least work so far (ties to the lower thread), so the same lengths always give the same
    shares. Each sequence is computed whole on one thread, so its bits do not depend on the
    shares."""
    if threads < 2 or len(lengths) < 2:
        return None
    workers = min(threads, len(lengths))
    groups: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        least = min(range(workers), key=lambda w: (load[w], w))
        groups[least].append(index)
        load[least] += lengths[index] ** 2
    if max(load) * workers > SPREAD_IMBALANCE * sum(load):
        return None
    return [sorted(group) for group in groups]


@functools.cache
def _attention_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="forgebench-attn")


# a forked child holds the pool but not its threads: work handed to it would never run
os.register_at_fork(after_in_child=_attention_pool.cache_clear)


def _on_threads(groups: list[list[int]], run) -> list:
    """run(group) for every group, the first on this thread and the others on the pool, each
    on one torch thread; the results in group order. The thread count comes back after."""
    threads = torch.get_num_threads()
    autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    grad = torch.is_grad_enabled()

    def on_pool(group):
        torch.set_num_threads(1)
        # grad mode and autocast are per thread: the caller's, as its own share runs under
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=autocast[1],
                                                          enabled=autocast[0]):
            return run(group)

    try:
        torch.set_num_threads(1)
        others = [_attention_pool(len(groups) - 1).submit(on_pool, group)
                  for group in groups[1:]]
        results = [run(groups[0])]
        results += [other.result() for other in others]
    finally:
        torch.set_num_threads(threads)
    return results


def _spread_forward(core, masks, scale, groups, lengths, q, k, v, grad: bool):
    """Every sequence's core call on one thread, the groups side by side (`_on_threads`):
    (outputs in sequence order, and with `grad` each sequence's (inputs, output) to
    differentiate, else None)."""
    pieces = list(zip(*(t.split(lengths, dim=2) for t in (q, k, v))))
    wants = [t.requires_grad for t in (q, k, v)]

    def run(group):
        done = []
        with torch.set_grad_enabled(grad):
            for index in group:
                inputs = [t.detach().requires_grad_(w and grad)
                          for t, w in zip(pieces[index], wants)]
                done.append((index, inputs, core(*inputs, masks[index], scale)))
        return done

    by_index = {index: (inputs, out) for result in _on_threads(groups, run)
                for index, inputs, out in result}
    outs = [by_index[i][1] if not grad else by_index[i][1].detach() for i in range(len(pieces))]
    return outs, ([by_index[i] for i in range(len(pieces))] if grad else None)


class _SpreadCores(torch.autograd.Function):
    """packed_attention's core calls spread over the threads (`spread_sequences`), forward and
    backward: each sequence's own small graph is kept from the forward and differentiated in
    the backward on the thread its group runs on, with one torch thread, so every sequence gets
    the bits torch computes at one thread (as _CoreOnThreads at one), at any thread count.

    Why: a packed sequence is a few dozen tokens, too little for torch to split over threads
    (its parallel regions cost more than they save, and wait on a descheduled partner on a
    busy machine); whole sequences side by side keep every thread on one-thread calls."""

    @staticmethod
    def forward(ctx, core, masks, scale, groups, lengths, q, k, v):
        outs, graphs = _spread_forward(core, masks, scale, groups, lengths, q, k, v, grad=True)
        ctx.graphs, ctx.groups, ctx.lengths = graphs, groups, lengths
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, grad):
        graphs, groups, lengths = ctx.graphs, ctx.groups, ctx.lengths
        ctx.graphs = None
        grads = grad.split(lengths, dim=2)

        def run(group):
            done = []
            for index in group:
                inputs, out = graphs[index]
                needs = [t for t in inputs if t.requires_grad]
                got = iter(torch.autograd.grad(out, needs, grads[index]) if needs else ())
                done.append((index, [next(got) if t.requires_grad else None for t in inputs]))
            return done

        by_index = dict(pair for result in _on_threads(groups, run) for pair in result)
        per_input = []
        for which in range(3):
            parts = [by_index[i][which] for i in range(len(lengths))]
            per_input.append(None if parts[0] is None else torch.cat(parts, dim=2))
        return (None, None, None, None, None, *per_input)


class _CoreOnThreads(torch.autograd.Function):
    """core(q, k, v, mask, scale) with its forward and its backward on `threads` torch threads
    (one for ONE_THREAD_ATTENTION: the same kernels on the same operands, each output row one
    thread's work at any count), its own small graph kept from the forward and differentiated
    in the backward."""

    @staticmethod
    def forward(ctx, core, mask, scale, threads, q, k, v):
        wants = [t.requires_grad for t in (q, k, v)]
        with torch.enable_grad(), torch_threads(threads):
            inputs = [t.detach().requires_grad_(w) for t, w in zip((q, k, v), wants)]
            out = core(*inputs, mask, scale)
        ctx.inputs, ctx.out, ctx.threads = inputs, out, threads
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.inputs, ctx.out
        ctx.inputs = ctx.out = None
        needs = [t for t in inputs if t.requires_grad]
        with torch_threads(ctx.threads):
            grads = iter(torch.autograd.grad(out, needs, grad) if needs else ())
        return (None, None, None, None,
                *[next(grads) if t.requires_grad else None for t in inputs])


@functools.lru_cache(maxsize=256)
def _sequence_mask(n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """attention_mask(0, n, n, window), built once for every layer and step that packs a
    sequence of n tokens (the cores only read it)."""
    return attention_mask(0, n, n, window).to(device)


def packed_positions(lengths: list[int], total: int) -> torch.Tensor:
    """Positions [total] of sequences packed one after another: each restarts at 0."""
    if sum(lengths) != total:
        raise ValueError(f"packed lengths {lengths} do not add up to {total} positions")
    return torch.cat([torch.arange(n) for n in lengths])


def sdpa(q, k, v, mask, scale):
    """softmax(q·kᵀ·scale + mask)·v with GQA heads shared; q [B,H,T,hd], k/v [B,Hkv,S,hd].
    The kernel shares k/v across a group itself: no repeated copies, no summing them back.
    A mask of None is causal over square scores (a packed sequence from its own start): the
    same bits as its boolean mask (torch 2.13 CPU flash attention, forward and gradients, 28-100
    tokens), without the mask's conversion to additive form at every call (~25 us of a 30-token
    sequence's ~300 us forward and backward, 90 such calls a pirate LoRA step).

    Under CPU autocast it runs in f32: torch's CPU kernel took 0.81 ms in bf16 against 0.39 ms
    in f32 for a 30-token sequence's forward and backward (4 heads of 256, 2 threads, AMX),
    where the casts outweigh the products; on CUDA autocast keeps it in bf16."""
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                  attn_mask=mask, is_causal=mask is None,
                                                  scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=gqa)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_llamacpp": gelu_llamacpp,     # ggml's f16-table GELU (llama.cpp numerics)
    "silu_llamacpp": silu_llamacpp,     # ggml_v_silu's expf polynomial (llama.cpp numerics)
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) for Llama/Qwen, GeGLU (gelu-tanh) for Gemma."""

    def __init__(self, dim: int, ffn_dim: int, activation: str = "silu"):
        super().__init__()
        self.gate = nn.Linear(dim, ffn_dim, bias=False)
        self.up = nn.Linear(dim, ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, dim, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gated_activation(self.gate(x), self.up(x), self.activation))


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) · up: one fused pass each way where engine/kernels/fused.py serves it (silu and
    gelu-tanh, f32/bf16 on the CPU), else torch's ops (ggml's llama.cpp activations among them)."""
    if fused.serves_gated(gate, up, activation):
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _GatedActivation.apply(gate, up, activation)
        return fused.gated_activation(gate, up, activation)
    return ACTIVATIONS[activation](gate) * up


class _GatedActivation(torch.autograd.Function):
    """act(gate)·up as one pass forward and one backward (d_gate = d·up·act'(gate),
    d_up = d·act(gate)): the three torch ops and their backward nodes, in f32 arithmetic with
    one rounding per result (torch rounds a bf16 value after each op)."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return fused.gated_activation(gate, up, activation)

    @staticmethod
    def backward(ctx, d_out):
        gate, up = ctx.saved_tensors
        return (*fused.gated_activation_backward(gate, up, d_out, ctx.activation), None)


