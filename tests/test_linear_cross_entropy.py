"""The fused LM-head loss (one pass over the head, online logsumexp, dh accumulated in the same
pass) against F.cross_entropy over full logits in f64, for a plain frozen matrix and for packed
Q8_0 blocks (dequantized by the `gguf` package as the reference), cached densely or not; and
the same pass split across threads, one share of the head's rows each."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import quants

from engine.models import lm_head_loss
from engine.models.lm_head_loss import linear_cross_entropy
from engine.models.packed import PackedWeight

torch.set_num_threads(1)
VOCAB, DIM, N = 2 * lm_head_loss.HEAD_CHUNK_ROWS + 300, 64, 9   # a ragged last chunk


def _case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, DIM, generator=generator) * 0.3
    h = torch.randn(N, DIM, generator=generator) * 2
    # several targets in one chunk, one in the ragged last chunk, one at each edge
    chunk = lm_head_loss.HEAD_CHUNK_ROWS
    targets = torch.tensor([0, 5, 17, chunk - 1, chunk, chunk + 3, VOCAB - 1, VOCAB - 300, 5])
    return weight, h, targets


def _reference(weight: torch.Tensor, h: torch.Tensor, targets: torch.Tensor):
    """(loss, dloss/dh) over full logits in f64."""
    h64 = h.double().requires_grad_(True)
    loss = F.cross_entropy(F.linear(h64, weight.double()), targets, reduction="sum")
    loss.backward()
    return loss.detach(), h64.grad


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_matches_full_logits_cross_entropy_for_a_frozen_matrix():
    weight, h, targets = _case()
    ref_loss, ref_grad = _reference(weight, h, targets)
    x = h.clone().requires_grad_(True)
    loss = linear_cross_entropy(x, weight, targets)
    (loss * 0.5).backward()                                   # the upstream gradient is applied
    assert _relative(loss.detach(), ref_loss) < 1e-6
    assert _relative(x.grad, 0.5 * ref_grad) < 1e-6
    with torch.no_grad():                                     # evaluation: the loss alone
        assert float(linear_cross_entropy(h, weight, targets)) == pytest.approx(float(loss),
                                                                               rel=1e-7)


def test_is_exact_in_f64():
    weight, h, targets = _case(1)
    ref_loss, ref_grad = _reference(weight, h, targets)
    x = h.double().requires_grad_(True)
    loss = linear_cross_entropy(x, weight.double(), targets)
    loss.backward()
    assert _relative(loss.detach(), ref_loss) < 1e-13
    assert _relative(x.grad, ref_grad) < 1e-13


@pytest.mark.parametrize("cached", [False, True])
def test_matches_for_packed_q8_0_blocks(cached):
    weight, h, targets = _case(2)
    raw = quants.quantize(weight.numpy(), T.Q8_0)                        # [VOCAB, row bytes]
    dequantized = torch.from_numpy(quants.dequantize(raw, T.Q8_0).astype(np.float32))
    packed = PackedWeight(torch.from_numpy(raw), T.Q8_0, VOCAB, DIM, "token_embd.weight")
    if cached:
        packed.cache(torch.float32)
    ref_loss, ref_grad = _reference(dequantized, h, targets)
    x = h.clone().requires_grad_(True)
    loss = linear_cross_entropy(x, packed, targets)
    loss.backward()
    assert _relative(loss.detach(), ref_loss) < 1e-6
    assert _relative(x.grad, ref_grad) < 1e-6


def _bf16_reference(weight: torch.Tensor, h: torch.Tensor, targets: torch.Tensor):
    """(loss, dloss/dh) of what bf16 autocast computes: logits of bf16(h)·bf16(W)ᵀ summed
    exactly and rounded once to bf16, the cross-entropy and its gradient in f64 (dh passes
    the rounding of h straight through)."""
    w16 = weight.bfloat16().double()
    logits = (h.bfloat16().double() @ w16.T).bfloat16().double()
    loss = F.cross_entropy(logits, targets, reduction="sum")
    grad = (torch.softmax(logits, 1) - F.one_hot(targets, VOCAB).double()) @ w16
    return loss, grad


# the logits agree with the reference's bf16 roundings but where f32 accumulation tips one
# (1e-7 relative in the loss seen), and dh sums one bf16-rounded product per chunk (2^-9
# relative each: 7e-4 to 1e-3 seen); the f32 head is 1e-4 and 6e-3 away
BF16_LOSS_REL, BF16_GRAD_REL = 1e-5, 2e-3


@pytest.mark.parametrize("cache", [None, torch.float32, torch.bfloat16])
def test_under_bf16_autocast_the_head_multiplies_in_bf16(cache, monkeypatch):
    """Under bf16 autocast the head's products are bf16, as autocast runs every other linear
    layer, with the logsumexp and the loss in f32; the same numbers from the bytes, an f32
    cache or a bf16 one. The f32 head outside autocast is farther from the bf16 reference than
    the tolerance: the check sees which one ran. A bf16 cache held as oneDNN's layouts
    (where this CPU has them) takes dh through its Wᵀ blocks, one per chunk."""
    chunk = lm_head_loss.HEAD_CHUNK_ROWS
    monkeypatch.setattr(lm_head_loss, "HEAD_CHUNK_ROWS_BF16", chunk)             # 3 chunks
    monkeypatch.setattr("engine.models.packed.ONEDNN_BLOCK_ROWS", chunk)      # a block each
    weight, h, targets = _case(3)
    raw = quants.quantize(weight.numpy(), T.Q8_0)
    dequantized = torch.from_numpy(quants.dequantize(raw, T.Q8_0).astype(np.float32))
    packed = PackedWeight(torch.from_numpy(raw), T.Q8_0, VOCAB, DIM, "token_embd.weight")
    packed.cache(cache)
    ref_loss, ref_grad = _bf16_reference(dequantized, h, targets)
    x = h.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, packed, targets)
        with torch.no_grad():
            evaluated = linear_cross_entropy(h, packed, targets)
    loss.backward()
    if packed.in_layouts:
        blocks = list(range(0, VOCAB, lm_head_loss.HEAD_CHUNK_ROWS))
        assert sorted(packed._onednn) == sorted(packed._onednn_t) == blocks
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert _relative(loss.detach(), ref_loss) < BF16_LOSS_REL
    assert float(evaluated) == float(loss.detach())
    assert _relative(x.grad, ref_grad) < BF16_GRAD_REL
    y = h.clone().requires_grad_(True)
    f32_loss = linear_cross_entropy(y, packed, targets)        # outside autocast: f32 products
    f32_loss.backward()
    assert _relative(f32_loss.detach(), ref_loss) > 10 * BF16_LOSS_REL
    assert _relative(y.grad, ref_grad) > 2 * BF16_GRAD_REL


def test_head_shares_cover_the_vocabulary_in_whole_chunks(monkeypatch):
    monkeypatch.setattr(lm_head_loss, "HEAD_SHARE_MIN_ROWS", 8)
    shares = lm_head_loss.head_shares(vocab=103, rows=10, threads=3)
    assert shares == [(0, 30), (30, 70), (70, 103)]            # 11 chunks as 3, 4 and 4 (ragged)
    assert lm_head_loss.head_shares(vocab=103, rows=10, threads=64) == [
        (start, min(start + 10, 103)) for start in range(0, 103, 10)]  # never under a chunk
    monkeypatch.setattr(lm_head_loss, "HEAD_SHARE_MIN_ROWS", 50)             # 103 rows hold two
    assert lm_head_loss.head_shares(vocab=103, rows=10, threads=3) == [(0, 50), (50, 103)]
    assert lm_head_loss.head_shares(vocab=103, rows=10, threads=1) == [(0, 103)]


@pytest.mark.parametrize("cache", [None, "lazy"])
def test_split_across_threads_matches_repeats_bit_for_bit_and_keeps_the_thread_count(
        cache, monkeypatch):
    """With the head's rows in one share per torch thread (here three, each on a thread of
    its own), the merged pass still equals full-logits cross-entropy, gives the same bits on
    every run, and leaves torch's thread count as it found it. The shares are seen running on
    the pool's threads, so the check covers the split path, not the one-thread pass."""
    monkeypatch.setattr(lm_head_loss, "HEAD_SHARE_MIN_ROWS", lm_head_loss.HEAD_CHUNK_ROWS // 2)
    weight, h, targets = _case(4)
    raw = quants.quantize(weight.numpy(), T.Q8_0)
    dequantized = torch.from_numpy(quants.dequantize(raw, T.Q8_0).astype(np.float32))
    packed = PackedWeight(torch.from_numpy(raw), T.Q8_0, VOCAB, DIM, "token_embd.weight")
    if cache:
        packed.cache(torch.float32, lazy=True)               # filled once, before the threads
    ran_on = []
    online_pass = lm_head_loss._online_pass

    def recording_pass(*args):
        ran_on.append((threading.current_thread().name, args[4], torch.get_num_threads()))
        return online_pass(*args)

    monkeypatch.setattr(lm_head_loss, "_online_pass", recording_pass)
    ref_loss, ref_grad = _reference(dequantized, h, targets)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        runs = []
        for _ in range(2):
            x = h.clone().requires_grad_(True)
            loss = linear_cross_entropy(x, packed, targets)
            loss.backward()
            runs.append((loss.detach(), x.grad))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    shares = sorted((start, name.startswith("forgebench-head"), n) for name, start, n in ran_on)
    assert shares == 2 * [(0, False, 1)] + 2 * [(lm_head_loss.HEAD_CHUNK_ROWS, True, 1)] + 2 * [
        (2 * lm_head_loss.HEAD_CHUNK_ROWS, True, 1)]                # each share on one thread
    assert _relative(runs[0][0], ref_loss) < 1e-6
    assert _relative(runs[0][1], ref_grad) < 1e-6
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert (packed.dense is None) == (cache is None)          # the lazy cache was filled


def test_split_is_exact_in_f64(monkeypatch):
    monkeypatch.setattr(lm_head_loss, "HEAD_SHARE_MIN_ROWS", lm_head_loss.HEAD_CHUNK_ROWS)
    weight, h, targets = _case(5)
    ref_loss, ref_grad = _reference(weight, h, targets)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert len(lm_head_loss.head_shares(VOCAB, lm_head_loss.HEAD_CHUNK_ROWS, 2)) == 2
        x = h.double().requires_grad_(True)
        loss = linear_cross_entropy(x, weight.double(), targets)
        loss.backward()
    finally:
        torch.set_num_threads(before)
    assert _relative(loss.detach(), ref_loss) < 1e-13
    assert _relative(x.grad, ref_grad) < 1e-13


def test_a_forked_child_splits_the_head_on_threads_of_its_own(monkeypatch):
    """A child forked after the head's pool started holds the pool but none of its threads;
    it gets a pool of its own, so its split pass finishes with the parent's bits."""
    monkeypatch.setattr(lm_head_loss, "HEAD_SHARE_MIN_ROWS", lm_head_loss.HEAD_CHUNK_ROWS)
    weight, h, targets = _case(6)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parent = lm_head_loss._linear_cross_entropy_pass(h, weight, targets, want_grad=True)
        pid = os.fork()
        if pid == 0:                                            # the child
            child = lm_head_loss._linear_cross_entropy_pass(h, weight, targets, want_grad=True)
            os._exit(0 if all(torch.equal(a, b) for a, b in zip(parent, child)) else 1)
    finally:
        torch.set_num_threads(before)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's split head pass never finished")
    assert os.waitstatus_to_exitcode(done[1]) == 0
