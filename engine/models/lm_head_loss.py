"""The training loss over a frozen LM head: `linear_cross_entropy`, the cross-entropy of
h·Wᵀ in one pass over W's rows (on several threads, one share of the rows each), W a packed
weight (engine/models/packed.py, cached or not) or a plain tensor; the [N, vocab] logits never
exist beyond one chunk, and dh is accumulated in the same pass."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from engine.kernels import fused
from engine.kernels.cpu import torch_threads
from engine.models.packed import ONEDNN_BLOCK_ROWS, PackedWeight, all_step_threads, step_threads

HEAD_CHUNK_ROWS = 1024   # LM-head rows per step of the fused loss: a chunk (2.6 MB in f32) is
                         # still in cache for its second product; ~7% faster than 4096 rows
HEAD_CHUNK_ROWS_BF16 = ONEDNN_BLOCK_ROWS   # 16384: bf16 products (AMX) are short enough that each
                                           # chunk's fixed cost leads: 0.09 s against 0.13 s at
                                           # 1024 rows (gemma's head); one oneDNN block a chunk


def head_chunk_rows(dtype: torch.dtype) -> int:
    return HEAD_CHUNK_ROWS_BF16 if dtype == torch.bfloat16 else HEAD_CHUNK_ROWS


class _TensorHead:
    """A frozen head given as a plain tensor [V, D], with the part of PackedWeight's surface the
    fused loss uses (rows, chunks, the two products, row lookups), so the pass has one path."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.rows = weight, weight.shape[0]

    def chunks(self, rows: int, lo: int, hi: int):
        for start in range(lo, hi, rows):
            end = min(hi, start + rows)
            yield start, end, self.weight[start:end]

    def product(self, x: torch.Tensor, start: int, end: int, chunk: torch.Tensor) -> torch.Tensor:
        return F.linear(x, chunk)

    def product_t(self, dy: torch.Tensor, start: int, end: int,
                  chunk: torch.Tensor) -> torch.Tensor:
        return dy.mm(chunk)

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.weight[index]

    def fill_layouts(self, start: int, end: int) -> None:
        """Nothing to fill: a tensor's products are torch's own."""

    def _fill(self) -> None:
        """Nothing to fill: the tensor is all there."""


def head_dtype(h: torch.Tensor) -> torch.dtype | None:
    """The dtype of the LM head's products: bf16 under bf16 autocast (as every other linear
    layer is), else None (h's own: f32, or f64 in a gradient check). The logsumexp, the loss
    and dh's accumulation stay in h's dtype either way."""
    device = h.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
        return torch.bfloat16
    return None


class _OnlineSoftmax:
    """The running state of one pass over head rows: max m [N,1], Σ exp(z - m) s [N,1], the
    target logits [N] (zero for targets outside the rows seen) and acc = Σ exp(z - m)·W [N,D]."""

    def __init__(self, h: torch.Tensor, want_grad: bool):
        n = h.shape[0]
        self.m = torch.full((n, 1), -torch.inf, dtype=h.dtype)
        self.s = torch.zeros(n, 1, dtype=h.dtype)
        self.acc = torch.zeros_like(h) if want_grad else None
        self.target_logit = torch.zeros(n, dtype=h.dtype)

    def merge(self, other: "_OnlineSoftmax") -> "_OnlineSoftmax":
        """Both passes' rows as one (rescaled to the larger max); a fixed order of merges gives
        the same bits every time."""
        m = torch.maximum(self.m, other.m)
        mine, theirs = torch.exp(self.m - m), torch.exp(other.m - m)
        self.s = self.s * mine + other.s * theirs
        if self.acc is not None:
            self.acc = self.acc * mine + other.acc * theirs
        self.target_logit = self.target_logit + other.target_logit
        self.m = m
        return self


def _online_pass(h: torch.Tensor, hd: torch.Tensor, weight, targets: torch.Tensor, lo: int,
                 hi: int, want_grad: bool, dtype: torch.dtype) -> _OnlineSoftmax:
    """Online logsumexp over head rows [lo, hi): a running max m, sum s = Σ exp(z - m) and (for
    the gradient) acc = Σ exp(z - m)·W, rescaled by exp(m_old - m_new) when the max grows."""
    state = _OnlineSoftmax(h, want_grad)
    rows = head_chunk_rows(dtype)
    by_chunk: dict[int, list[int]] = {}                             # chunk start -> positions
    for position, target in enumerate(targets.tolist()):
        if lo <= target < hi:
            by_chunk.setdefault(lo + (target - lo) // rows * rows, []).append(position)
    m, s, acc = state.m, state.s, state.acc
    for start, end, w in weight.chunks(rows, lo, hi):
        if w is None and dtype != torch.bfloat16:        # layouts serve bf16 products alone
            w = weight.cached_rows(start, end)
        w = None if w is None else w.to(dtype)
        if want_grad and w is None:                      # both products of this block ahead
            weight.fill_layouts(start, end)
        z = weight.product(hd, start, end, w)                       # [N, rows], in dtype
        positions = by_chunk.get(start)
        if positions:
            positions = torch.tensor(positions)
            state.target_logit[positions] = z[positions, targets[positions] - start].to(h.dtype)
        # m, s and z (to exp(z - m)) in place, in one pass over the chunk; else torch's chain
        rescale = fused.softmax_chunk(z, m, s) if h.dtype == torch.float32 else None
        if rescale is None:
            z = z.to(h.dtype)
            m_new = torch.maximum(m, z.amax(1, keepdim=True))
            rescale = torch.exp(m - m_new)
            z.sub_(m_new).exp_()
            s.mul_(rescale).add_(z.sum(1, keepdim=True))
            m.copy_(m_new)
        if want_grad:
            if dtype == h.dtype:
                acc.mul_(rescale).addmm_(z, w)
            else:                                                   # a bf16 product, f32 sum
                acc.mul_(rescale).add_(weight.product_t(z.to(dtype), start, end, w).to(h.dtype))
    return state


HEAD_SHARE_MIN_ROWS = 8192   # a thread's share of the head: 8 chunks at least, so its ~0.1 ms
                             # handoff stays small beside its products


def head_shares(vocab: int, rows: int, threads: int) -> list[tuple[int, int]]:
    """The head's rows [0, vocab) as contiguous ranges [lo, hi) of whole `rows` chunks, one per
    thread (fewer where a share would hold under HEAD_SHARE_MIN_ROWS)."""
    chunks = -(-vocab // rows)
    shares = max(1, min(threads, vocab // HEAD_SHARE_MIN_ROWS, chunks))
    bounds = [i * chunks // shares * rows for i in range(shares + 1)]
    return [(lo, min(hi, vocab)) for lo, hi in zip(bounds, bounds[1:])]


@functools.cache
def _head_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="forgebench-head")


# a forked child holds the pool but not its threads: work handed to it would never run
os.register_at_fork(after_in_child=_head_pool.cache_clear)


def _share_pass(*args) -> _OnlineSoftmax:
    torch.set_num_threads(1)
    with torch.no_grad():           # a fresh thread's grad mode is on
        return _online_pass(*args)


def _threaded_pass(h, hd, weight, targets, want_grad: bool, dtype: torch.dtype) -> _OnlineSoftmax:
    """The online pass with the head's rows split into one share per torch thread, each share
    on a thread of its own with one-thread products, merged in share order (the same bits on
    every run with the same thread count).

    Why: the head's products are skinny (N supervised rows, a few dozen, against a chunk) and
    scale poorly when torch splits one product across threads; a share of the vocabulary per
    thread keeps every core on one-thread products (gemma's head, 70 rows, 2 cores: the two
    halves side by side took 0.235-0.29 s against 0.25-0.32 s for torch's split products; a
    pirate LoRA step 0.97 s -> 0.91 s, medians of 18)."""
    shares = head_shares(weight.rows, head_chunk_rows(dtype),
                         step_threads() if h.device.type == "cpu" else 1)
    if len(shares) == 1:
        with all_step_threads():
            return _online_pass(h, hd, weight, targets, 0, weight.rows, want_grad, dtype)
    weight._fill()                                 # a lazy cache fills once, before the threads
    with torch_threads(1):
        others = [_head_pool(len(shares) - 1).submit(_share_pass, h, hd, weight, targets, lo, hi,
                                                     want_grad, dtype)
                  for lo, hi in shares[1:]]
        state = _online_pass(h, hd, weight, targets, *shares[0], want_grad, dtype)
        with record_function("LM head: waiting for the other shares"):   # in a profile's head
            for other in others:
                state = state.merge(other.result())
    return state


def _linear_cross_entropy_pass(h: torch.Tensor, weight, targets: torch.Tensor, want_grad: bool,
                               dtype: torch.dtype | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(CE of h·Wᵀ against targets per row [N], dCE/dh or None) in one pass over W's row chunks;
    the products run in `dtype` (default h's; bf16 with the logits taken back to h's dtype).

    dCE/dh = acc / s - W[target], with acc and s from the online pass; the target logit is
    taken from its chunk's logits.
    """
    dtype = dtype or h.dtype
    if not isinstance(weight, PackedWeight):
        weight = _TensorHead(weight)
    state = _threaded_pass(h, h.to(dtype), weight, targets, want_grad, dtype)
    loss = state.m.squeeze(1) + state.s.log().squeeze(1) - state.target_logit
    if not want_grad:
        return loss, None
    target_rows = weight.take_rows(targets).to(dtype).to(h.dtype)  # W as the products saw it
    return loss, state.acc.div_(state.s).sub_(target_rows)


class _LinearCrossEntropy(torch.autograd.Function):
    """CE of h·Wᵀ for a frozen W, summed or per row; the [N, vocab] logits never exist beyond
    one chunk, and dh is accumulated in the same pass, so W is read (or dequantized) once per
    step."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, h, weight, targets, per_row, dtype):
        loss, grad = _linear_cross_entropy_pass(h, weight, targets, want_grad=True, dtype=dtype)
        ctx.save_for_backward(grad)
        ctx.per_row = per_row
        return loss if per_row else loss.sum()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, d_loss):
        grad, = ctx.saved_tensors
        return grad * (d_loss[:, None] if ctx.per_row else d_loss), None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: "PackedWeight | torch.Tensor",
                         targets: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """Summed cross-entropy of logits h [N, D] · weight [V, D]ᵀ against targets [N], or with
    `per_row` each row's cross-entropy [N] (what per-sequence log-probabilities sum).

    `weight` is frozen (a PackedWeight, cached or not, or a tensor without grad). Equals
    F.cross_entropy(F.linear(h, W), targets, reduction="sum" or "none") in exact arithmetic,
    at the cost of one pass over W instead of three (forward, softmax backward, dh). Under bf16
    autocast the products are bf16 (`head_dtype`), as autocast would run F.linear.
    """
    dtype = head_dtype(h)
    if torch.is_grad_enabled() and h.requires_grad:
        return _LinearCrossEntropy.apply(h, weight, targets, per_row, dtype)
    with torch.autocast(h.device.type, enabled=False):
        loss = _linear_cross_entropy_pass(h.float() if h.dtype == torch.bfloat16 else h,
                                          weight, targets, want_grad=False, dtype=dtype)[0]
    return loss if per_row else loss.sum()
