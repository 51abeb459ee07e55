"""Training components against hand computations: the lr schedule, clipping, token-weighted
loss, data order, sampling and the tokenizers."""

from __future__ import annotations

import math
import subprocess
import sys
import types

import pytest
import torch

from engine.sampling import (
    SamplingSettings,
    TokenStream,
    apply_repetition_penalty,
    filter_top_k,
    filter_top_p,
    generate_tokens,
    next_token,
)
from engine.text_tokenizers import BPETokenizer, ByteTokenizer, tokenizer_from_json
from engine.train.data_order import DataCursor, epoch_permutation
from engine.train.metrics import StepClock, WindowLoss, peak_rss_mb
from engine.train.optim import (
    AdamW,
    NonFiniteError,
    adamw_for,
    build_adamw,
    clip_and_step,
    lr_at,
    scheduled_lr,
)


# -- learning-rate schedule ----------------------------------------------------------------
def test_lr_schedule_worked_numbers():
    kw = dict(lr=1.0, warmup=4, total=14, min_lr_ratio=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine from step 4 (lr) to step 13 (floor); halfway (step 8.5) would be 0.55
    assert lr_at(13, **kw) == pytest.approx(0.1, abs=1e-15)
    assert lr_at(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))
    assert lr_at(100, **kw) == pytest.approx(0.1)
    assert lr_at(10, lr=2e-3, warmup=0, total=20, schedule="constant") == 2e-3


def test_a_config_section_sets_the_optimizer_and_the_schedule():
    """adamw_for / scheduled_lr read every field the section has: the LM section's eps and bf16
    moments reach the optimizer, a media section (which has neither) gets build_adamw's own."""
    from engine.recipes.lm_decision_config import OptimSection as DecisionOptim
    from engine.recipes.lm_pretrain_config import PretrainOptimSection
    from engine.recipes.optim_config import OptimSection

    layer = torch.nn.Linear(4, 4)
    lm = adamw_for(layer.named_parameters(), PretrainOptimSection(eps=1e-6, moments="bf16"))
    assert isinstance(lm, AdamW) and lm.moment_dtype == torch.bfloat16
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in lm.param_groups] == [
        (3e-3, (0.9, 0.95), 1e-6, 0.1), (3e-3, (0.9, 0.95), 1e-6, 0.0)]   # bias: no decay
    media = adamw_for(layer.named_parameters(), OptimSection(lr=2e-4, weight_decay=0.0))
    assert not isinstance(media, AdamW)
    assert [(g["lr"], g["betas"], g["eps"]) for g in media.param_groups] == [
        (2e-4, (0.9, 0.999), 1e-8)] * 2
    section = PretrainOptimSection(lr=1.0, warmup=4, min_lr_ratio=0.1)
    assert [scheduled_lr(section, s, 14) for s in (0, 3, 13)] == [
        lr_at(s, lr=1.0, warmup=4, total=14, min_lr_ratio=0.1) for s in (0, 3, 13)]
    decision = DecisionOptim()                # warmup as a share of the steps, passed in steps
    assert scheduled_lr(decision, 0, 20, warmup=2) == pytest.approx(5e-4)


# -- clipping and the non-finite policy ----------------------------------------------------
def _params_with_grads(grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_clip_and_step_reports_the_norm_before_clipping():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0], [4.0]])]  # global norm 5
    params = _params_with_grads(grads)
    sgd = torch.optim.SGD(params, lr=1.0)
    outcome = clip_and_step(params, sgd, max_norm=1.0, nonfinite_policy="skip")
    assert outcome.grad_norm == pytest.approx(5.0) and outcome.clipped and not outcome.skipped
    # SGD with lr 1 moved each parameter by -grad * (1/5) (clip factor max_norm / norm)
    assert torch.allclose(params[0].detach(), torch.tensor([-0.6, 0.0]), atol=1e-6)
    assert torch.allclose(params[1].detach(), torch.tensor([[0.0], [-0.8]]), atol=1e-6)
    assert all(p.grad is None for p in params)

    params = _params_with_grads(grads)
    outcome = clip_and_step(params, torch.optim.SGD(params, lr=1.0), 10.0, "skip")
    assert not outcome.clipped and torch.equal(params[0].detach(), torch.tensor([-3.0, 0.0]))


def test_nonfinite_gradient_skips_or_stops():
    grads = [torch.tensor([1.0, float("nan")])]
    params = _params_with_grads(grads)
    outcome = clip_and_step(params, torch.optim.SGD(params, lr=1.0), 1.0, "skip")
    assert outcome.skipped and math.isnan(outcome.grad_norm)
    assert torch.equal(params[0].detach(), torch.zeros(2)) and params[0].grad is None
    params = _params_with_grads([torch.ones(2)])
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        clip_and_step(params, torch.optim.SGD(params, lr=1.0), 1.0, "stop", loss=float("inf"))


def test_bf16_moments_track_fp32_adamw():
    torch.manual_seed(0)
    a = torch.nn.Linear(16, 16)
    b = torch.nn.Linear(16, 16)
    b.load_state_dict(a.state_dict())
    opt_a = build_adamw(a.named_parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = build_adamw(b.named_parameters(), lr=1e-2, weight_decay=0.1, moments="bf16")
    x = torch.randn(32, 16)
    for _ in range(5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert opt_b.state[b.weight]["exp_avg"].dtype == torch.bfloat16
    assert torch.allclose(a.weight, b.weight, atol=2e-3)
    assert not torch.equal(a.weight, b.weight)  # the moments really are rounded


# -- metrics -------------------------------------------------------------------------------
def test_window_loss_is_token_weighted_not_a_mean_of_means():
    uneven = WindowLoss()
    uneven.add(4.0, 2)   # mean 2.0 over 2 tokens
    uneven.add(6.0, 6)   # mean 1.0 over 6 tokens
    assert uneven.value == pytest.approx(10 / 8)  # a mean of means would say 1.5
    assert math.isnan(WindowLoss().value)


def test_clock_and_memory(monkeypatch):
    """On a stepped fake clock: elapsed = earlier invocations + this one's wall time, and each
    tick's rate is its tokens over the time since the previous tick."""
    from engine.train import metrics

    now = [10.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    clock = StepClock(elapsed_before=100.0)
    now[0] = 12.5
    assert clock.elapsed == 102.5
    assert clock.tick(1000) == 400.0 and clock.seconds == 2.5
    now[0] = 13.0
    assert clock.tick(50) == 100.0 and clock.elapsed == 103.0
    assert clock.tick(50) == 0.0               # no time passed: no rate, not a division by 0
    assert 10 < peak_rss_mb() < 1_000_000


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_reports_its_own_peak_not_its_parents():
    """A job started by a big process (the app, a bench holding a dense model) reports its own
    memory: ru_maxrss would start at the parent's peak across fork + exec."""
    ballast = bytearray(600 * 1024 * 1024)                     # touched: 600 MB resident
    ballast[::4096] = b"x" * len(ballast[::4096])
    child = subprocess.run([sys.executable, "-c", "from engine.train.metrics import peak_rss_mb; "
                            "print(peak_rss_mb())"], capture_output=True, text=True, check=True,
                           close_fds=False, preexec_fn=lambda: None)      # a real fork, as Qt's
    assert float(child.stdout) < 300
    del ballast


# -- data order ----------------------------------------------------------------------------
def test_epoch_permutation_is_a_pure_function():
    a = epoch_permutation(7, 0, 50)
    assert a == epoch_permutation(7, 0, 50) and sorted(a) == list(range(50))
    assert a != epoch_permutation(7, 1, 50) and a != epoch_permutation(8, 0, 50)


def test_cursor_resumes_mid_epoch_and_rolls_over():
    straight = DataCursor(n=10, seed=3)
    expected = [straight.take(4) for _ in range(6)]  # 24 indices: 2.4 epochs
    cursor = DataCursor(n=10, seed=3)
    got = [cursor.take(4) for _ in range(2)]
    resumed = DataCursor.from_state(cursor.state())
    assert resumed.state() == {"n": 10, "seed": 3, "epoch": 0, "position": 8}
    got += [resumed.take(4) for _ in range(4)]
    assert got == expected
    flat = sum(expected, [])
    assert flat[:10] == epoch_permutation(3, 0, 10) and flat[10:20] == epoch_permutation(3, 1, 10)


# -- sampling ------------------------------------------------------------------------------
def test_greedy_top_k_top_p_and_penalty_by_hand():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert next_token(logits, SamplingSettings()) == 1
    assert torch.isinf(filter_top_k(logits, 2)[[0, 3]]).all()
    assert torch.equal(filter_top_k(logits, 2)[[1, 2]], logits[[1, 2]])
    # probabilities of [1,3,2,-1]: 0.0871, 0.6439, 0.2369, 0.0321
    kept = ~torch.isinf(filter_top_p(logits, 0.7))
    assert kept.tolist() == [False, True, True, False]  # 0.644 < 0.7 needs the second token
    assert (~torch.isinf(filter_top_p(logits, 0.6))).tolist() == [False, True, False, False]
    penalised = apply_repetition_penalty(logits, [1, 3], 2.0)
    assert penalised.tolist() == [1.0, 1.5, 2.0, -2.0]
    assert next_token(logits, SamplingSettings(repetition_penalty=2.0), previous=[1]) == 2


def test_temperature_sampling_follows_the_softmax_and_the_seed():
    logits = torch.tensor([0.0, 1.0, 2.0])
    settings = SamplingSettings(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    draws = [next_token(logits, settings, g) for _ in range(6000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3) / 6000
    assert torch.allclose(freq, torch.softmax(logits, 0), atol=0.02)
    again = torch.Generator().manual_seed(0)
    assert [next_token(logits, settings, again) for _ in range(50)] == draws[:50]
    top1 = SamplingSettings(temperature=5.0, top_k=1)
    assert {next_token(logits, top1, g) for _ in range(20)} == {2}


def test_generate_tokens_feeds_only_new_tokens_and_stops():
    fed = []

    def step(ids, start_pos):
        fed.append((list(ids), start_pos))
        nxt = (ids[-1] + 1) % 5
        return torch.nn.functional.one_hot(torch.tensor(nxt), 5).float()

    out = generate_tokens(step, [0, 1], max_new_tokens=10, settings=SamplingSettings(),
                          stop_ids=[4])
    assert out == [2, 3] and fed == [([0, 1], 0), ([2], 2), ([3], 3)]


def test_token_stream_ends_as_generate_tokens_does():
    """Streams stepped together (a batch decoder's loop) end on each of generate_tokens' three
    conditions and give its tokens; max_new_tokens 0 samples nothing."""
    def logits_after(token):
        return torch.nn.functional.one_hot(torch.tensor((token + 1) % 5), 5).float()

    cases = [dict(max_new_tokens=10, stop_ids=[4]),            # a stop token
             dict(max_new_tokens=2),                           # the length
             dict(max_new_tokens=10, should_stop=lambda out: out[-1] == 3),
             dict(max_new_tokens=0)]
    streams = [TokenStream([0, 1], settings=SamplingSettings(), **case) for case in cases]
    live, logits = list(range(len(cases))), [logits_after(1)] * len(cases)
    positions = []
    while live:
        live = [i for i, row in zip(live, logits) if streams[i].take(row)]
        positions += [streams[i].position for i in live]
        logits = [logits_after(streams[i].out[-1]) for i in live]
    alone = [generate_tokens(lambda ids, _pos: logits_after(ids[-1]), [0, 1],
                             settings=SamplingSettings(), **case) for case in cases]
    assert [s.out for s in streams] == alone == [[2, 3], [2, 3], [2, 3], []]
    assert positions == [2, 2, 2, 3] and all(s.done for s in streams)
    seen = []                       # should_stop sees every token, the one that ends it too
    generate_tokens(lambda ids, _pos: logits_after(ids[-1]), [0, 1], max_new_tokens=3,
                    settings=SamplingSettings(), should_stop=lambda out: seen.append(out[-1]))
    assert seen == [2, 3, 4]
    assert not streams[0].take(logits_after(0))          # a finished stream samples no more


# -- tokenizers ----------------------------------------------------------------------------
TEXT = "Record item0042: the blue lamp is in the office. Ünïcode ✓ too.\n"


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids + [tok.eos_id]) == TEXT
    assert sum(tok.byte_lengths()[i] for i in ids) == len(TEXT.encode("utf-8"))
    assert isinstance(tokenizer_from_json(tok.to_json()), ByteTokenizer)


def test_bpe_tokenizer_trains_round_trips_and_saves():
    corpus = [TEXT * 3, "the red mug is in the kitchen. " * 20]
    tok = BPETokenizer.train(corpus, vocab_size=300)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and len(ids) < len(TEXT.encode("utf-8"))
    assert sum(tok.byte_lengths()[i] for i in ids) == len(TEXT.encode("utf-8"))
    assert tok.vocab_size == 300 and {tok.bos_id, tok.eos_id} == {0, 1}
    again = tokenizer_from_json(tok.to_json())
    assert again.encode(TEXT) == ids and again.to_json() == tok.to_json()
