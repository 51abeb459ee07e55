"""The supervised loss leaves out the positions after each sequence's last supervised one
(engine.train.loss.without_unsupervised_tail): worked examples of what is cut, and on small
Llama and Gemma decoders (Gemma's sliding window shorter than the sequences, tied and untied
heads) the loss and every gradient of the trimmed step against the whole step: equal up to f32
rounding, since a causal decoder's cut positions reach no label. The twin cuts one supervised
position too many, and the check catches it."""

from __future__ import annotations

import pytest
import torch

from engine.models.gemma3 import Gemma3, Gemma3Config
from engine.models.llama import Llama, LlamaConfig
from engine.train import loss as loss_module
from engine.train.loss import IGNORE, supervised_loss, without_unsupervised_tail

X = IGNORE


def test_packed_sequences_are_cut_after_their_last_supervised_position():
    # three packed sequences: the first ends in two unsupervised positions, the second is
    # supervised to its end, the third has no supervised position at all (left out whole)
    inputs = torch.arange(12)[None]
    labels = torch.tensor([[X, 5, 6, X, X, X, 8, 9, 10, X, X, X]])
    lengths = [5, 4, 3]
    got_inputs, got_labels, got_lengths = without_unsupervised_tail(inputs, labels, lengths)
    assert got_lengths == [3, 4]
    assert got_inputs.tolist() == [[0, 1, 2, 5, 6, 7, 8]]
    assert got_labels.tolist() == [[X, 5, 6, X, 8, 9, 10]]


def test_a_batch_loses_the_columns_after_every_rows_last_supervised_one():
    inputs = torch.arange(12).view(2, 6)
    labels = torch.tensor([[X, 1, X, X, X, X],
                           [X, X, 2, 3, X, X]])
    got_inputs, got_labels, got_lengths = without_unsupervised_tail(inputs, labels, None)
    assert got_lengths is None
    assert got_inputs.tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert got_labels.tolist() == labels[:, :4].tolist()


def test_nothing_supervised_or_nothing_to_cut_keeps_everything():
    inputs = torch.arange(6)[None]
    for labels, lengths in ((torch.full((1, 6), X), [2, 4]),
                            (torch.tensor([[X, 1, 4, X, 2, 3]]), [3, 3]),
                            (torch.tensor([[X, 1, X, X, 2, 3]]), None)):
        got_inputs, got_labels, got_lengths = without_unsupervised_tail(inputs, labels, lengths)
        assert got_inputs is inputs and got_labels is labels and got_lengths == lengths


def _llama(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=48, tie_embeddings=tie, rope_type="neox"))


def _gemma(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Gemma3Config(vocab_size=97, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                       ffn_dim=48, sliding_window=4, sliding=[True, True, False],
                       tie_embeddings=tie)
    return Gemma3(cfg)


def _packed_batch():
    """Three samples packed: each a prompt, a supervised answer, then unsupervised closing
    positions (two, one, three), as a chat template's end-of-turn leaves them."""
    g = torch.Generator().manual_seed(1)
    lengths = [9, 7, 11]
    inputs = torch.randint(0, 97, (sum(lengths),), generator=g)
    labels = torch.full((sum(lengths),), X)
    start = 0
    for n, (first, tail) in zip(lengths, ((3, 2), (2, 1), (4, 3))):
        labels[start + first:start + n - tail] = torch.randint(0, 97, (n - tail - first,),
                                                               generator=g)
        start += n
    return inputs, labels, lengths


def _loss_and_grads(model, trim, monkeypatch, batch):
    monkeypatch.setattr(loss_module, "without_unsupervised_tail", trim)
    model.zero_grad(set_to_none=True)
    loss = supervised_loss(model, *batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _whole(inputs, labels, lengths):
    return inputs, labels, lengths


def _one_too_many(inputs, labels, lengths):
    """The twin: each sequence cut one position short of its last supervised one."""
    inputs, labels, lengths = without_unsupervised_tail(inputs, labels, lengths)
    keep = torch.ones(inputs.shape[1], dtype=torch.bool)
    keep[torch.tensor(lengths).cumsum(0) - 1] = False
    return inputs[:, keep], labels[:, keep], [n - 1 for n in lengths]


@pytest.mark.parametrize("build", [_llama, _gemma])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("packed", [True, False])
def test_the_trimmed_step_gives_the_whole_steps_loss_and_gradients(build, tie, packed,
                                                                    monkeypatch):
    model = build(tie).double()           # f64: the two steps agree to its rounding
    inputs, labels, lengths = _packed_batch()
    if not packed:                         # a padded batch of the three, as [B, T]
        width = max(lengths)
        rows = [t.split(lengths) for t in (inputs, labels)]
        inputs = torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows[0]])
        labels = torch.stack([torch.cat([r, r.new_full((width - len(r),), X)])
                              for r in rows[1]])
        lengths = None
    batch = (inputs, labels, lengths)
    trimmed_inputs = without_unsupervised_tail(inputs.view(-1, inputs.shape[-1]),
                                               labels.view(-1, labels.shape[-1]), lengths)[0]
    assert trimmed_inputs.shape[-1] < inputs.shape[-1]          # the step really cuts
    whole = _loss_and_grads(model, _whole, monkeypatch, batch)
    trimmed = _loss_and_grads(model, without_unsupervised_tail, monkeypatch, batch)
    torch.testing.assert_close(trimmed[0], whole[0], rtol=1e-12, atol=0)
    assert len(trimmed[1]) == len(whole[1])
    for a, b in zip(trimmed[1], whole[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    if packed:      # the twin: one supervised position too few changes the loss
        wrong = _loss_and_grads(model, _one_too_many, monkeypatch, batch)
        assert not torch.allclose(wrong[0], whole[0], rtol=1e-6, atol=0)
