"""`PackedWeight.product` and `product_t`: a bf16 dense cache multiplied through oneDNN's
prepacked layouts (W, and Wᵀ for the input gradient) against an f64 product of the same bf16
roundings, for one row and a step's worth of rows, under bf16 autocast and outside it, over
row ranges that cross the reordered blocks; and the bookkeeping: the cache held as the layouts
alone (no plain copy), one reordered copy per block whatever ranges ask, counted in
`layout_bytes`, dropped with the cache. Where this CPU has no bf16 oneDNN the same numbers come
from torch's plain product over a plain bf16 cache and the layout checks skip, saying so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from engine.models.packed import FrozenQuantLinear, PackedWeight, onednn_bf16

ROWS, COLS, BLOCK = 130, 96, 48        # three blocks, the last one ragged
needs_onednn = pytest.mark.skipif(not onednn_bf16(),
                                  reason="this CPU has no bf16 oneDNN: torch's plain product runs")


def _weight(seed: int = 0) -> PackedWeight:
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(ROWS, COLS, generator=generator) * 0.2
    packed = PackedWeight(dense.contiguous().view(torch.uint8), T.F32, ROWS, COLS, "w")
    packed.cache(torch.bfloat16)
    return packed


def _chunk(weight: PackedWeight, start: int, end: int) -> torch.Tensor | None:
    """Rows [start, end) as `chunks` yields them to a product (None for a cache held as
    layouts)."""
    return next(weight.chunks(end - start, start, end))[2]


def _bf16_error(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> float:
    """The largest error of y against x·rowsᵀ in f64 over the bf16 roundings of both, in units
    of the bf16 rounding a correct product gets (2^-8 of each value, plus f32 summation noise)."""
    reference = F.linear(x.bfloat16().double(), rows.double())
    allowed = reference.abs() * 2.0 ** -8 + 1e-6 * reference.abs().max()
    return float(((y.double() - reference).abs() / allowed).max())


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr("engine.models.packed.ONEDNN_BLOCK_ROWS", BLOCK)


@pytest.fixture(params=["layouts", "plain"])
def held(request, monkeypatch):
    """Both ways a bf16 cache is held: as oneDNN's layouts (where oneDNN multiplies bf16), and
    as a plain copy multiplied by torch (a CPU without it, as this one is made to look)."""
    if request.param == "layouts" and not onednn_bf16():
        pytest.skip("this CPU has no bf16 oneDNN: a bf16 cache is a plain copy here")
    if request.param == "plain":
        monkeypatch.setattr("engine.models.packed.onednn_bf16", lambda: False)
    return request.param


@pytest.mark.parametrize("tokens", [1, 7, 148])
@pytest.mark.parametrize("start,end", [(0, ROWS), (40, 100), (96, ROWS), (0, BLOCK)])
def test_a_bf16_cache_multiplies_as_bf16_with_f32_sums(tokens, start, end, held):
    weight = _weight()
    assert weight.in_layouts == (held == "layouts")
    assert (weight.dense is None) == (held == "layouts")
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(tokens))
    rows = weight.cached_rows(start, end)
    assert torch.equal(rows, weight.rows_f32(start, end).bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = weight.product(x, start, end, _chunk(weight, start, end))
    outside = weight.product(x, start, end, _chunk(weight, start, end))   # x to bf16 and back
    assert under_autocast.dtype == torch.bfloat16 and outside.dtype == torch.float32
    assert under_autocast.shape == outside.shape == (tokens, end - start)
    assert _bf16_error(under_autocast, x, rows) <= 1
    assert torch.equal(outside, under_autocast.float())
    # the twin: the same check sees a product over another weight's rows
    other = _weight(seed=1)
    assert _bf16_error(other.product(x, start, end, _chunk(other, start, end)), x, rows) > 1


@pytest.mark.parametrize("tokens", [1, 148])
def test_the_input_gradient_product_multiplies_as_bf16_over_whole_blocks(tokens, held):
    """dy·W for the whole matrix (a layer's dx) sums one product per block; a range that is not
    whole blocks takes torch's product, with the same numbers."""
    weight = _weight()
    generator = torch.Generator().manual_seed(tokens)
    dy = torch.randn(tokens, ROWS, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = weight.product_t(dy, 0, ROWS, _chunk(weight, 0, ROWS))
        part = weight.product_t(dy[:, 40:100], 40, 100, _chunk(weight, 40, 100))
    dense = weight.cached_rows(0, ROWS)
    reference = dy.bfloat16().double() @ dense.double()
    scale = float(reference.abs().max())
    # three bf16 block products summed in bf16: a few bf16 roundings of the largest value
    assert float((whole.double() - reference).abs().max()) <= 2.0 ** -6 * scale
    part_reference = dy[:, 40:100].bfloat16().double() @ dense[40:100].double()
    assert float((part.double() - part_reference).abs().max()) <= 2.0 ** -7 * scale
    other = _weight(seed=1)                                    # the twin: another weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrong = other.product_t(dy, 0, ROWS, _chunk(other, 0, ROWS))
    assert float((wrong.double() - reference).abs().max()) > 2.0 ** -6 * scale
    assert sorted(weight._onednn_t) == ([0, BLOCK, 2 * BLOCK] if held == "layouts" else [])


@needs_onednn
def test_one_reordered_copy_per_block_whatever_ranges_ask():
    """The cache is the layouts alone: nothing plain beside them, nothing until a product asks."""
    weight = _weight()
    assert weight.in_layouts and weight.cache_dtype == torch.bfloat16
    assert weight.cache_bytes == weight.layout_bytes == 0 and weight.dense is None
    x = torch.randn(5, COLS)
    for start, end in [(0, ROWS), (40, 100), (96, ROWS), (0, 10), (50, 51)]:
        weight.product(x, start, end, _chunk(weight, start, end))
    assert sorted(weight._onednn) == [0, BLOCK, 2 * BLOCK]
    reordered = sum(t.numel() * t.element_size() for t in weight._onednn.values())
    assert reordered >= ROWS * COLS * 2 and weight.layout_bytes == reordered
    weight.product_t(torch.randn(5, ROWS), 0, ROWS, _chunk(weight, 0, ROWS))
    assert weight.layout_bytes == reordered + sum(t.numel() * t.element_size()
                                                  for t in weight._onednn_t.values())
    assert weight.cache_bytes == 0
    weight.cache(torch.bfloat16)                               # a new cache: the layout goes
    assert weight._onednn == weight._onednn_t == {} and weight.layout_bytes == 0
    weight.cache(None)
    assert weight.cache_bytes == weight.layout_bytes == 0


@needs_onednn
def test_gradients_and_f32_caches_stay_on_torch():
    """A product that autograd must differentiate, or an f32 cache, never reaches oneDNN; a frozen
    layer's forward and dx under autocast do (its autograd function runs both without grad)."""
    weight = _weight()
    x = torch.randn(4, COLS, requires_grad=True)
    y = weight.product(x, 0, ROWS, _chunk(weight, 0, ROWS))
    assert weight._onednn == {} and y.requires_grad             # torch's product, on cached rows
    f32 = _weight()
    f32.cache(torch.float32)
    f32.product(torch.randn(4, COLS), 0, ROWS, f32.dense)
    assert f32._onednn == {}
    layer = FrozenQuantLinear(weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert sorted(weight._onednn) == [0, BLOCK, 2 * BLOCK]
    dense = weight.cached_rows(0, ROWS)
    assert _bf16_error(y.detach(), x.detach(), dense) <= 1
    dy = torch.randn_like(y, dtype=torch.float32)
    y.backward(dy)
    assert sorted(weight._onednn_t) == [0, BLOCK, 2 * BLOCK]       # dx through oneDNN too
    reference = dy.bfloat16().double() @ dense.double()
    error = float((x.grad.double() - reference).abs().max())
    assert error <= 2.0 ** -7 * float(reference.abs().max())


@needs_onednn
def test_both_layouts_filled_at_once_multiply_as_the_lazy_ones():
    """`fill_layouts` builds W and Wᵀ of the blocks holding a row range from one dequantization
    (a layer's forward before its dx, the head's pass): the same products as layouts built one
    at a time; a cache not held as layouts is left alone."""
    lazy, filled = _weight(), _weight()
    filled.fill_layouts(40, 96)                                # rows 40-95: blocks 0 and 48
    assert sorted(filled._onednn) == sorted(filled._onednn_t) == [0, BLOCK]
    x, dy = torch.randn(5, COLS), torch.randn(5, ROWS)
    assert torch.equal(filled.product(x, 0, ROWS, None), lazy.product(x, 0, ROWS, None))
    assert torch.equal(filled.product_t(dy, 0, ROWS, None), lazy.product_t(dy, 0, ROWS, None))
    assert sorted(filled._onednn_t) == [0, BLOCK, 2 * BLOCK]
    f32 = _weight()
    f32.cache(torch.float32)
    f32.fill_layouts(0, ROWS)
    assert f32._onednn == f32._onednn_t == {}


@pytest.mark.parametrize("bf16_autocast", [False, True])
@pytest.mark.parametrize("x_needs_grad", [True, False])
def test_a_lora_layer_as_one_node_matches_its_two_paths(held, bf16_autocast, x_needs_grad):
    """A LoRA layer over a frozen packed weight runs as one autograd node (_AdaptedMatmul):
    its output and the gradients of x, A and B are the two paths' (base(x) + delta(x)) to the
    rounding of the dtype the products run in; with B at zero it is the base layer, bit for bit."""
    from engine.lora import LoRALinear

    torch.manual_seed(7)
    layer = LoRALinear(FrozenQuantLinear(_weight()), rank=4, alpha=8.0)
    x = torch.randn(2, 5, COLS, requires_grad=x_needs_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        at_start = layer(x)
        assert at_start.grad_fn.name() == "_AdaptedMatmulBackward"
        with torch.no_grad():
            assert torch.equal(at_start, layer.base(x))                # B = 0: the base layer
        torch.nn.init.normal_(layer.lora_b, std=0.5)
        dy = torch.randn(2, 5, ROWS)

        def grads(y):
            wrt = [layer.lora_a, layer.lora_b] + ([x] if x_needs_grad else [])
            return [y.detach(), *torch.autograd.grad(y, wrt, dy)]

        one_node = grads(layer(x))
        two_paths = grads(layer.base(x) + layer.delta(x))
    rtol = 2.0 ** -7 if bf16_autocast else 1e-5
    for got, ref in zip(one_node, two_paths):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref.float(), rtol=rtol,
                                   atol=rtol * float(ref.abs().max()))
    # twin: the tolerance rejects a delta with its scale forgotten
    unscaled = layer.base(x) + layer.delta(x) / layer.scale
    assert not torch.allclose(one_node[0].float(), unscaled.detach().float(), rtol=rtol,
                              atol=rtol * float(two_paths[0].abs().max()))
