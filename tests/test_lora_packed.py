"""A LoRA step over samples packed into one sequence (what lm-sft trains), on two threads: the
packed sequences' attention spread over the threads (engine.models.blocks.SPREAD_ATTENTION)
gives the loss and adapter gradients of one-thread attention bit for bit, and PEFT's (padded
batch, eager attention) within test_peft_parity's 1e-5; and the RoPE tables a step reads come
from a cache that returns what a fresh build returns."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models import blocks
from engine.train.loss import IGNORE, supervised_loss


def _packed_step(mode: tuple[bool, bool], monkeypatch, tie: bool):
    """(loss, adapters, peft_model) after one backward of the packed batch, attention in `mode`
    (ONE_THREAD_ATTENTION, SPREAD_ATTENTION), at two threads."""
    from tests.test_peft_parity import _batch, _models

    monkeypatch.setattr(blocks, "ONE_THREAD_ATTENTION", mode[0])
    monkeypatch.setattr(blocks, "SPREAD_ATTENTION", mode[1])
    engine, adapters, peft_model = _models(tie)
    ours, hf_ids, hf_labels, hf_mask = _batch()
    inputs = torch.cat([tokens for tokens, _ in ours])
    labels = torch.cat([target for _, target in ours])
    lengths = [len(tokens) for tokens, _ in ours]
    supervised = int((labels != IGNORE).sum())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loss = supervised_loss(engine, inputs, labels, lengths) / supervised
        loss.backward()
    finally:
        torch.set_num_threads(threads)
    return loss, adapters, (peft_model, hf_ids, hf_labels, hf_mask)


def _grads(adapters) -> list[torch.Tensor]:
    return [p.grad for a in adapters.values() for p in (a.lora_a, a.lora_b)]


@pytest.mark.peft
@pytest.mark.parametrize("tie", [False, True])
def test_spread_packed_step_is_one_thread_bits_and_matches_peft(monkeypatch, tie):
    from tests.test_peft_parity import worst_adapter_grad_difference

    # the two sequences (20 and 13 tokens: 400 against 169) are x1.41 an even share, over
    # SPREAD_IMBALANCE; allowed here, so the batch really spreads
    monkeypatch.setattr(blocks, "SPREAD_IMBALANCE", 1.5)
    assert blocks.spread_sequences([20, 13], 2) == [[0], [1]]
    loss, adapters, (peft_model, ids, labels, mask) = _packed_step((False, True), monkeypatch,
                                                                   tie)
    single_loss, single, _ = _packed_step((True, False), monkeypatch, tie)
    assert torch.equal(loss, single_loss)
    assert all(torch.equal(a, b) for a, b in zip(_grads(adapters), _grads(single)))
    reference = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    worst_adapter_grad_difference(adapters, peft_model)
    # the twin: a step with one packed sequence's attention scaled differently is caught
    sdpa = blocks.sdpa
    monkeypatch.setattr(blocks, "sdpa", lambda q, k, v, mask, scale: sdpa(q, k, v, mask,
                                                                          scale * 1.01))
    other_loss, other, _ = _packed_step((False, True), monkeypatch, tie)
    assert not torch.equal(other_loss, loss)
    assert not all(torch.equal(a, b) for a, b in zip(_grads(other), _grads(adapters)))


def test_rope_tables_come_from_the_cache_as_built_and_match_f64(monkeypatch):
    monkeypatch.setattr(blocks, "_ROPE_CACHE", {})
    positions = blocks.packed_positions([5, 9, 3], 17)
    cos, sin = blocks.rope_tables(positions, 64, 10000.0, freq_scale=0.5)
    again = blocks.rope_tables(positions.clone(), 64, 10000.0, freq_scale=0.5)
    assert again[0] is cos and again[1] is sin                  # served from the cache
    built = blocks._rope_tables(positions, 64, 10000.0, None, 0.5, False)
    assert torch.equal(cos, built[0]) and torch.equal(sin, built[1])
    # against the formula in f64: angle_i = freq_scale · pos · base^(-2i/d)
    angles = torch.tensor([[0.5 * p * 10000.0 ** (-2 * i / 64) for i in range(32)]
                           for p in positions.tolist()], dtype=torch.float64)
    torch.testing.assert_close(cos.double(), angles.cos(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin.double(), angles.sin(), rtol=0, atol=1e-5)
    # the twin: other settings or other positions are other entries, not the cached one
    other = blocks.rope_tables(positions, 64, 10000.0)
    assert not torch.equal(other[0], cos)
    moved = blocks.rope_tables(blocks.packed_positions([6, 8, 3], 17), 64, 10000.0,
                               freq_scale=0.5)
    assert not torch.equal(moved[0], cos)
    factors = torch.linspace(1.0, 4.0, 32)
    scaled = blocks.rope_tables(positions, 64, 10000.0, factors, freq_scale=0.5)
    assert torch.equal(scaled[0], blocks._rope_tables(positions, 64, 10000.0, factors, 0.5,
                                                      False)[0])
    assert not torch.equal(scaled[0], cos)
    assert len(blocks._ROPE_CACHE) == 4
    assert math.isclose(float(cos[0, 0]), 1.0)


def test_rope_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(blocks, "_ROPE_CACHE", {})
    for start in range(blocks.ROPE_CACHE_ENTRIES + 3):
        blocks.rope_tables(torch.arange(start, start + 4), 16, 10000.0)
    assert len(blocks._ROPE_CACHE) == blocks.ROPE_CACHE_ENTRIES
    long = torch.arange(blocks.ROPE_CACHE_POSITIONS + 1)
    blocks.rope_tables(long, 16, 10000.0)                    # built, not kept
    assert len(blocks._ROPE_CACHE) == blocks.ROPE_CACHE_ENTRIES
