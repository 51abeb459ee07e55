"""The LoRA step's short paths give the bits of the general ones they stand in for.

- A frozen layer whose bf16 cache is one oneDNN block (every decoder projection of the models
  the engine trains) multiplies straight through that block's layout under bf16 autocast
  (`packed._whole_layout`): its output and its dx are the general block walk's
  (`PackedWeight.product`, `product_t`) bit for bit, and within a bf16 rounding of the f64
  product of the bf16-rounded operands.
- An adapter's backward puts the delta's scale on the rank-wide factors: at a power-of-two
  scale the gradients of x, A and B are those of scaling dy first (PEFT's order) bit for bit;
  at any other scale within a bf16 rounding of them.
- A packed sequence that the sliding window does not cut runs SDPA as is_causal: the bits of
  its boolean causal mask.
Each with a twin that shows the check can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from engine.models import blocks
from engine.models.packed import FrozenQuantLinear, PackedWeight, onednn_bf16

ROWS, COLS, TOKENS = 96, 64, 37

needs_onednn = pytest.mark.skipif(not onednn_bf16(),
                                  reason="this CPU has no bf16 oneDNN: torch's plain product runs")


def _weight(dense: torch.Tensor) -> PackedWeight:
    packed = PackedWeight(dense.contiguous().view(torch.uint8), T.F32, *dense.shape, "w")
    packed.cache(torch.bfloat16)
    return packed


def _dense(seed: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed)) * 0.2


def _forward_and_dx(layer: FrozenQuantLinear, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad


@needs_onednn
def test_a_one_block_layer_multiplies_as_the_block_walk():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, TOKENS, COLS, generator=generator)
    dy = torch.randn(1, TOKENS, ROWS, generator=generator).bfloat16()
    layer = FrozenQuantLinear(_weight(_dense()))
    y, dx = _forward_and_dx(layer, x, dy)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
    weight = layer.weight
    assert 0 in weight._onednn and 0 in weight._onednn_t          # the short path's layouts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        walked_y = weight.product(x, 0, ROWS, None)                # the general walk
        walked_dx = weight.product_t(dy, 0, ROWS, None)
    assert torch.equal(y, walked_y)
    assert torch.equal(dx, walked_dx.float())
    # and both are the product of the bf16-rounded operands, to a bf16 rounding of the result
    rows = _dense().bfloat16().double()
    for got, reference in ((y, x.bfloat16().double() @ rows.t()), (dx, dy.double() @ rows)):
        allowed = reference.abs() * 2.0 ** -8 + 1e-6 * reference.abs().max()
        assert float(((got.double() - reference).abs() / allowed).max()) <= 1.0
    # twin: a weight off by 0.25 in one element gives other bits through the same path
    nudged = _dense()
    nudged[3, 5] += 0.25
    nudged_y, nudged_dx = _forward_and_dx(FrozenQuantLinear(_weight(nudged)), x, dy)
    assert nudged_y[..., 3].ne(y[..., 3]).any() and not torch.equal(nudged_dx, dx)


def _adapter_grads(alpha: float, rank: int, formula: bool):
    """(y, dx, dA, dB) of a LoRA layer over a one-block frozen weight under bf16 autocast: the
    engine's node, or with `formula` the gradients as scaling dy first computes them from the
    same bf16 operands."""
    from engine.lora import LoRALinear

    torch.manual_seed(3)
    layer = LoRALinear(FrozenQuantLinear(_weight(_dense())), rank=rank, alpha=alpha)
    torch.nn.init.normal_(layer.lora_b, std=0.5)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(1, TOKENS, COLS, generator=generator, requires_grad=True)
    dy = torch.randn(1, TOKENS, ROWS, generator=generator).bfloat16()
    if not formula:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        return (y.detach(), *torch.autograd.grad(y, [x, layer.lora_a, layer.lora_b], dy))
    xc, a, b = (t.detach().bfloat16() for t in (x, layer.lora_a, layer.lora_b))
    t = xc @ a.t()
    ds = dy * layer.scale                                          # dy scaled first
    dt = ds @ b
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base_dx = layer.base.weight.product_t(dy, 0, ROWS, None)
    dx = base_dx.float() + (dt @ a).float()
    grad_a = dt.reshape(-1, rank).t() @ xc.reshape(-1, COLS)
    grad_b = ds.reshape(-1, ROWS).t() @ t.reshape(-1, rank)
    return None, dx, grad_a.float(), grad_b.float()


@needs_onednn
def test_an_adapters_scale_on_its_factors_gives_scaled_dy_bits_at_a_power_of_two():
    ours = _adapter_grads(alpha=16.0, rank=8, formula=False)       # scale 2
    reference = _adapter_grads(alpha=16.0, rank=8, formula=True)
    for got, want in zip(ours[1:], reference[1:]):
        assert torch.equal(got, want)
    # at scale 3 the roundings part: within a bf16 rounding, not the same bits (the twin)
    ours = _adapter_grads(alpha=12.0, rank=4, formula=False)
    reference = _adapter_grads(alpha=12.0, rank=4, formula=True)
    assert any(not torch.equal(got, want) for got, want in zip(ours[1:], reference[1:]))
    for got, want in zip(ours[1:], reference[1:]):
        torch.testing.assert_close(got, want, rtol=2.0 ** -7,
                                   atol=2.0 ** -7 * float(want.abs().max()))


@pytest.mark.parametrize("autocast", [False, True])
def test_a_packed_sequence_the_window_does_not_cut_is_its_causal_mask(autocast):
    lengths = [7, 30, 19]
    generator = torch.Generator().manual_seed(5)
    total = sum(lengths)
    q, k, v = (torch.randn(1, heads, total, 32, generator=generator, requires_grad=True)
               for heads in (4, 2, 2))
    weights = torch.randn(1, 4, total, 32, generator=generator)

    def attend(window):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = blocks.packed_attention(blocks.sdpa, q, k, v, lengths, 0.125, window)
        return (out.detach(), *torch.autograd.grad((out * weights).sum(), (q, k, v)))

    def masked(window):
        """Each sequence through F.scaled_dot_product_attention with its boolean mask."""
        outs = []
        for n, qs, ks, vs in zip(lengths, *(t.split(lengths, dim=2) for t in (q, k, v))):
            outs.append(F.scaled_dot_product_attention(
                qs.float(), ks.float(), vs.float(), scale=0.125, enable_gqa=True,
                attn_mask=blocks.attention_mask(0, n, n, window)))
        out = torch.cat(outs, dim=2)
        return (out.detach(), *torch.autograd.grad((out * weights).sum(), (q, k, v)))

    for window in (None, 30):                                      # no sequence is cut
        for got, want in zip(attend(window), masked(window)):
            assert torch.equal(got, want)
    # twin: a window of 8 cuts two sequences; their plain causal attention differs
    cut = attend(8)
    assert torch.equal(cut[0], masked(8)[0])
    assert not torch.equal(cut[0], masked(None)[0])
