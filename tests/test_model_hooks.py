"""The two extension hooks beside LoRA and full weights: the attention prefix
(engine/models/kv_prefix.py: a KV cache seeded with rows, the tokens after it at positions
offset by their count) and the trainable-parameter table (engine/train/lm_base.py:
`TRAINABLE`, which `prepare_trainable` dispatches on)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from engine.errors import ForgebenchError
from engine.models.kv_prefix import prefix_cache, prefix_rows
from engine.models.llama import Llama, LlamaConfig
from engine.train import lm_base

torch.set_num_threads(1)


def tiny_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=64, max_seq_len=32)).eval()


def test_a_seeded_prefix_continues_as_the_whole_sequence_does():
    """Rows of a real prefix, seeded into a fresh cache: the tail's hidden states equal those
    of the whole sequence run at once (the reference); without the position offset they do
    not (the twin: the check can fail)."""
    model = tiny_model()
    tokens = torch.tensor([[3, 14, 15, 9, 2, 6, 5, 35, 8, 9]])
    prefix, tail = tokens[:, :6], tokens[:, 6:]
    with torch.no_grad():
        whole = model.hidden(tokens)[:, 6:]
        source = model.new_cache(1, 16)
        model.hidden(prefix, cache=source)
        cache, start = prefix_cache(model, *prefix_rows(source, 6), max_len=16)
        seeded = model.hidden(tail, start_pos=start, cache=cache)
        cache, _ = prefix_cache(model, *prefix_rows(source, 6), max_len=16)
        unshifted = model.hidden(tail, start_pos=0, cache=cache)
    assert start == 6
    torch.testing.assert_close(seeded, whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unshifted, whole, atol=1e-3)


def test_trained_prefix_rows_get_gradients_that_match_finite_differences():
    """Rows as parameters: the cache keeps them in the graph, and d(loss)/d(row) matches a
    central finite difference in float64."""
    model = tiny_model().double()
    model.kv_dtype = torch.float64
    keys = [torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    values = [torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
              for _ in range(2)]
    tail = torch.tensor([[4, 7, 1]])

    def loss() -> torch.Tensor:
        cache, start = prefix_cache(model, keys, values, max_len=8)
        return model.hidden(tail, start_pos=start, cache=cache).pow(2).sum()

    loss().backward()
    for tensor, index in ((keys[0], (0, 1, 2, 5)), (values[1], (0, 0, 1, 3))):
        eps = 1e-6
        with torch.no_grad():
            tensor[index] += eps
            up = float(loss())
            tensor[index] -= 2 * eps
            down = float(loss())
            tensor[index] += eps
        assert tensor.grad[index] != 0
        assert float(tensor.grad[index]) == pytest.approx((up - down) / (2 * eps), rel=1e-5)


def test_prefix_rows_of_the_wrong_shape_are_refused():
    model = tiny_model()
    rows = [torch.zeros(1, 2, 3, 8)] * 2
    with pytest.raises(ValueError, match="rows for each of the 2 layers"):
        prefix_cache(model, rows[:1], rows[:1], max_len=8)
    with pytest.raises(ValueError, match=r"layer 0: prefix rows must be \[1, 2, 3, 8\]"):
        prefix_cache(model, [torch.zeros(1, 4, 3, 8)] * 2, rows, max_len=8)


def norms_only(config, base):
    """A method of the hook's own: only the RMSNorm weights train."""
    for name, param in base.model.named_parameters():
        param.requires_grad_("norm" in name)
    return None, [(n, p) for n, p in base.model.named_parameters() if p.requires_grad]


def fake_config(method: str):
    lora = types.SimpleNamespace(method=method, targets=["q", "v"], rank=2, alpha=4.0,
                                 dropout=0.0, full_max_params=10**9)
    return types.SimpleNamespace(lora=lora, seed=0)


def test_prepare_trainable_dispatches_on_the_method_table(monkeypatch):
    """A registered method decides what trains: one AdamW step on a loss moves exactly the
    parameters it returned; the built-in "lora" returns only adapter factors; an unknown
    method is refused naming the field."""
    base = lm_base.Base(tiny_model().train(), None, None, Path("tiny"), dense=True)
    monkeypatch.setitem(lm_base.TRAINABLE, "norms", norms_only)
    adapters, trainable = lm_base.prepare_trainable(fake_config("norms"), base)
    names = {n for n, _ in trainable}
    assert adapters is None and names and all("norm" in n for n in names)
    before = {n: p.detach().clone() for n, p in base.model.named_parameters()}
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=0.1)
    base.model.hidden(torch.tensor([[1, 2, 3, 4]])).sum().backward()
    optimizer.step()
    moved = {n for n, p in base.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == names

    lora_base = lm_base.Base(tiny_model().train(), None, None, Path("tiny"), dense=True)
    adapters, trainable = lm_base.prepare_trainable(fake_config("lora"), lora_base)
    assert adapters and all(".lora_" in n for n, _ in trainable)
    with pytest.raises(ForgebenchError, match="unknown training method 'prefix'") as info:
        lm_base.prepare_trainable(fake_config("prefix"), base)
    assert "lora.method" in info.value.render()
