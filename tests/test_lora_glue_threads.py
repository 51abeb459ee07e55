"""A LoRA step with its glue on one thread (engine.models.packed.one_thread_glue): on two
threads, the step's small ops (norms, casts, residual adds and their gradients) run with torch
at one thread while the frozen layers' products, the LM head's shares and the packed attention
get both; the loss and every adapter gradient are the bits of the plain two-thread step.

Tiny GGUF models (Llama, untied head; Gemma 3 with its sliding window, tied head) loaded as
lm-sft loads them, in f32 and under bf16 autocast with a bf16 cache. The twin: products that do
not take the threads back are seen running on one thread."""

from __future__ import annotations

import contextlib

import pytest
import torch
from fixtures_gguf import write_tiny_gguf

from engine.lora import attach_lora
from engine.models import blocks, packed
from engine.models.gguf_model import load_gguf_model, set_numerics
from engine.models.llama import Llama, LlamaConfig
from engine.train.loss import IGNORE, one_thread_glue_serves, supervised_loss


def _model(tmp_path, arch: str, precision: str):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, "Q8_0",
                           tie_embeddings=arch == "gemma3")
    model, _ = load_gguf_model(path, weights="dense-cache", tokenizer=False,
                               cache_dtype=torch.bfloat16 if precision == "bf16" else None)
    adapters = attach_lora(model, targets=("q", "v", "down"), rank=4, alpha=8.0, seed=3)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for adapter in adapters.values():     # B non-zero, so every factor's gradient is live
            adapter.lora_b.copy_(torch.randn(adapter.lora_b.shape, generator=generator) * 0.05)
    model.train()
    return model, adapters


def _batch(vocab: int):
    g = torch.Generator().manual_seed(2)
    lengths = [23, 17, 21]
    inputs = torch.randint(0, vocab, (sum(lengths),), generator=g)
    labels = torch.randint(0, vocab, (sum(lengths),), generator=g)
    start = 0
    for n in lengths:                          # prompts unsupervised
        labels[start:start + n // 3] = IGNORE
        start += n
    return inputs, labels, lengths


def _step(model, adapters, precision: str, glue: bool):
    for adapter in adapters.values():
        adapter.lora_a.grad = adapter.lora_b.grad = None
    inputs, labels, lengths = _batch(model.config.vocab_size)
    with packed.one_thread_glue(glue), torch.autocast("cpu", dtype=torch.bfloat16,
                                                      enabled=precision == "bf16"):
        loss = supervised_loss(model, inputs, labels, lengths)
        loss.backward()
    return loss.detach(), [g for a in adapters.values() for g in (a.lora_a.grad, a.lora_b.grad)]


def _spy(monkeypatch, seen: dict):
    """Record torch's thread count in the layers' products (forward and dx) and in the norms
    (forward, and their gradients through a hook)."""
    for name in ("_packed_matmul", "_frozen_dx_under_threads"):
        original = getattr(packed, name)

        def spied(*args, _original=original, **kwargs):
            seen["products"].add(torch.get_num_threads())
            return _original(*args, **kwargs)
        monkeypatch.setattr(packed, name, spied)
    forward = blocks.RMSNorm.forward

    def norm(self, x):
        seen["glue"].add(torch.get_num_threads())
        y = forward(self, x)
        if y.requires_grad:
            y.register_hook(lambda g: seen["glue"].add(torch.get_num_threads()))
        return y
    monkeypatch.setattr(blocks.RMSNorm, "forward", norm)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_the_glue_on_one_thread_gives_the_two_thread_steps_bits(tmp_path, two_threads,
                                                               monkeypatch, arch, precision):
    if precision == "bf16" and not packed.onednn_bf16():
        pytest.skip("no bf16 oneDNN on this CPU")
    model, adapters = _model(tmp_path, arch, precision)
    assert one_thread_glue_serves(model)
    plain = _step(model, adapters, precision, glue=False)
    seen = {"products": set(), "glue": set()}
    _spy(monkeypatch, seen)
    glued = _step(model, adapters, precision, glue=True)
    assert seen == {"products": {2}, "glue": {1}}
    assert torch.get_num_threads() == 2                   # the count comes back
    assert torch.equal(glued[0], plain[0])
    for a, b in zip(glued[1], plain[1]):
        assert a is not None and a.abs().max() > 0 and torch.equal(a, b)


def test_twin_products_that_keep_one_thread_are_seen(tmp_path, two_threads, monkeypatch):
    model, adapters = _model(tmp_path, "llama", "f32")
    monkeypatch.setattr(packed, "all_step_threads", contextlib.nullcontext)
    seen = {"products": set(), "glue": set()}
    _spy(monkeypatch, seen)
    _step(model, adapters, "f32", glue=True)
    assert seen["products"] == {1}


def test_only_models_whose_products_take_the_threads_back_are_served(tmp_path):
    model, _ = _model(tmp_path, "llama", "f32")
    assert one_thread_glue_serves(model)
    dense = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=48))
    for p in dense.parameters():
        p.requires_grad_(False)
    attach_lora(dense, targets=("q", "v"), rank=4, alpha=8.0, seed=0)
    assert not one_thread_glue_serves(dense)               # nn.Linear layers: torch's products
    set_numerics(model, "llamacpp")
    assert not one_thread_glue_serves(model)               # llama.cpp's products: not raised


def test_outside_the_glue_and_at_one_thread_nothing_changes(two_threads):
    assert packed.step_threads() == 2
    with packed.one_thread_glue():
        assert torch.get_num_threads() == 1 and packed.step_threads() == 2
        with packed.all_step_threads():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with packed.one_thread_glue():                    # nested: as is
            assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with packed.one_thread_glue(enabled=False):
        assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    with packed.one_thread_glue(), packed.all_step_threads():
        assert torch.get_num_threads() == 1 and packed.step_threads() == 1


def test_unspread_attention_gets_both_threads_under_the_glue(tmp_path, two_threads,
                                                            monkeypatch):
    """Sequences not spread over the threads: each core call (forward and backward) takes the
    two threads back, as the plain step runs it, and gives its bits."""
    monkeypatch.setattr(blocks, "SPREAD_ATTENTION", False)
    monkeypatch.setattr(blocks, "ONE_THREAD_ATTENTION", False)
    model, adapters = _model(tmp_path, "gemma3", "f32")
    plain = _step(model, adapters, "f32", glue=False)
    seen = set()
    sdpa = blocks.sdpa

    def core(q, k, v, mask, scale):
        seen.add(torch.get_num_threads())
        q.register_hook(lambda g: seen.add(torch.get_num_threads()))
        return sdpa(q, k, v, mask, scale)
    monkeypatch.setattr(model, "attn_core", core)
    glued = _step(model, adapters, "f32", glue=True)
    assert seen == {2}
    assert torch.equal(glued[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(glued[1], plain[1]))
