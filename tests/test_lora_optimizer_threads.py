"""The clipped optimizer step of a LoRA (engine.train.optim.clip_and_step) runs on one torch
thread where every trained tensor is small (`one_thread_serves`: LoRA's factors), with the
bits of the threaded step, and keeps every thread for larger tensors.

References: the threaded step itself (what the one-thread path stands in for, bit for bit) and
AdamW's first update worked by hand (clip to the global norm, decay, then lr·ĝ/(|ĝ|+eps) with
the bias-corrected moments of one step). Each check has a twin that shows it can fail."""

from __future__ import annotations

import pytest
import torch

from engine.train import optim
from engine.train.optim import NonFiniteError, build_adamw, clip_and_step

# gemma-3-270m's LoRA factors on q and v (rank 8): A [8, 640], B [1024, 8] and B [256, 8]
SHAPES = [(8, 640), (1024, 8), (8, 640), (256, 8)] * 3
LR, DECAY, EPS = 1e-3, 0.01, 1e-8


def _params(shapes=SHAPES, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.01) for s in shapes]


def _grads(params, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def _train(steps: int = 4, nudge: bool = False) -> list[torch.Tensor]:
    """`steps` clipped AdamW steps (the global norm is ~100, so every step clips to 1.0)."""
    params = _params()
    optimizer = build_adamw([(f"p{i}", p) for i, p in enumerate(params)], lr=LR,
                            weight_decay=DECAY, betas=(0.9, 0.999), eps=EPS, moments="fp32")
    for step in range(steps):
        for p, grad in zip(params, _grads(params, 100 + step)):
            p.grad = grad
        if nudge and step == steps - 1:        # one gradient value 0.1% up
            params[0].grad[0, 0] *= 1.001
        outcome = clip_and_step(params, optimizer, 1.0)
        assert outcome.clipped and not outcome.skipped
    return [p.detach().clone() for p in params]


def _threads_in_step(params) -> int:
    """The torch thread count that optimizer.step saw inside clip_and_step."""
    seen = []
    optimizer = torch.optim.SGD(params, lr=0.1)
    step = optimizer.step
    optimizer.step = lambda *a, **k: (seen.append(torch.get_num_threads()), step(*a, **k))[1]
    for p in params:
        p.grad = torch.ones_like(p)
    clip_and_step(params, optimizer, 1.0)
    return seen[0]


def test_a_lora_sized_step_runs_on_one_thread_and_the_count_comes_back(two_threads):
    assert optim.one_thread_serves(_params())
    assert _threads_in_step(_params()) == 1
    assert torch.get_num_threads() == 2


def test_twin_a_tensor_above_the_grain_keeps_every_thread(two_threads):
    params = _params(SHAPES + [(optim.SMALL_TENSOR + 1,)])
    assert not optim.one_thread_serves(params)
    assert _threads_in_step(params) == 2


def test_one_thread_gives_the_threaded_steps_bits(two_threads, monkeypatch):
    one_thread = _train()
    monkeypatch.setattr(optim, "SMALL_TENSOR", 0)          # every tensor "large": threaded
    threaded = _train()
    assert all(torch.equal(a, b) for a, b in zip(one_thread, threaded))
    # twin: one gradient value 0.1% apart in the last step is seen
    nudged = _train(nudge=True)
    assert not all(torch.equal(a, b) for a, b in zip(threaded, nudged))


def test_the_first_update_is_adamws_worked_by_hand(two_threads):
    trained = _train(steps=1)
    before, grads = _params(), _grads(_params(), 100)
    norm = torch.cat([g.double().flatten() for g in grads]).norm()
    expected = []
    for p, g in zip(before, grads):
        clipped = g.double() * (1.0 / (norm.item() + 1e-6))   # torch's clip coefficient
        # step 1: bias-corrected moments are g and g², so the update is lr·g/(|g| + eps)
        expected.append(p.detach().double() * (1 - LR * DECAY)
                        - LR * clipped / (clipped.abs() + EPS))
    for got, want in zip(trained, expected):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-7)
    # twin: the same check against twice the learning rate fails
    doubled = before[0].detach().double() * (1 - LR * DECAY) \
        - 2 * LR * grads[0].double() / (grads[0].double().abs() + EPS)
    assert not torch.allclose(trained[0].double(), doubled, rtol=0, atol=2e-7)


def test_a_nonfinite_gradient_still_stops_and_the_count_comes_back(two_threads):
    params = _params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    for p in params:
        p.grad = torch.zeros_like(p)
    params[1].grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        clip_and_step(params, optimizer, 1.0, "stop")
    assert torch.get_num_threads() == 2
