"""The weight-layout table (engine/gguf/layouts.py): every layout has a byte size, a dequantizer
and product kernels in both numerics, and they agree with independent references.

For each row: a random matrix is stored in the layout (its own quantizer, else the `gguf`
package's, PTQTP's planes from engine/ptqtp); the bytes must have the size the row states and
ggml-common.h's block size (`gguf.GGML_QUANT_SIZES`); the dequantizer must equal the `gguf`
package's dequantization element for element (summed over the planes); the f32 product must
equal x·Wᵀ of that matrix in f64 to f32 rounding, and the llama.cpp-numerics product must equal
the llama.cpp activation values (the row's vec_dot type) times it, within
LLAMACPP_BOUND of Σ|x||w| per output (llama.cpp's integer sums, in its order, differ from an
f64 sum only by f32 rounding), Q8_1_BOUND for Q4_1/Q5_1 (the weight minimum multiplies the
activation block's sum rounded to f16, ggml's block_q8_1.s: 2⁻¹¹ of that term). The twins
store a layout with the wrong dequantizer, the wrong block size or one plane short, and the same
check fails.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants

from engine.gguf.layouts import BY_TYPE, LAYOUTS, PTQTP_2, Layout, plane_suffixes, stored_layout
from engine.kernels.numerics import q8_0_values, q8_k_values, round_f16
from engine.models.packed import PackedWeight
from engine.ptqtp.decompose import decompose
from engine.ptqtp.gguf_file import PACKERS

ROWS, COLS, BATCH = 24, 512, 5
F32_BOUND = 1e-6            # of Σ|x||w| per output: f32 rounding of a 512-term sum (measured
LLAMACPP_BOUND = 1e-6       # at most 9e-8 on every row, both numerics)
Q8_1_BOUND = 5e-4           # measured 1.7e-4


def _store(layout: Layout, values: np.ndarray) -> list[np.ndarray]:
    """The bytes of `values` [ROWS, COLS] in `layout`, one uint8 array per plane."""
    if len(layout.planes) > 1:
        dec = decompose(torch.from_numpy(values), planes=len(layout.planes), iterations=4)
        return [PACKERS[layout.ggml_type](dec.planes[p].numpy(), dec.scales[p].numpy())
                for p in range(len(layout.planes))]
    if layout.quantize_rows is not None:
        return [layout.quantize_rows(values)]
    return [np.ascontiguousarray(quants.quantize(values, layout.ggml_type)).view(np.uint8)]


def _activations(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """What llama.cpp multiplies for the row's vec_dot type (Q8_1 as Q8_0's values)."""
    kind = layout.vec_dot.name if layout.vec_dot is not None else None
    if kind is None:
        return x
    if kind == "F16":
        return round_f16(x)
    if kind == "BF16":
        return x.bfloat16().float()
    return q8_k_values(x) if kind == "Q8_K" else q8_0_values(x)


def layout_problems(layout: Layout, seed: int = 0) -> list[str]:
    """What does not hold for this row (empty: all of it holds)."""
    gen = np.random.default_rng(seed)
    values = (gen.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
    planes = _store(layout, values)
    problems = []
    block = GGML_QUANT_SIZES[layout.ggml_type]
    if layout.block != block:
        problems.append(f"block {layout.block} but ggml-common.h says {block}")
    if sum(p.nbytes for p in planes) != layout.nbytes(ROWS, COLS):
        problems.append(f"{sum(p.nbytes for p in planes)} bytes stored, "
                        f"{layout.nbytes(ROWS, COLS)} stated")
    reference = sum(quants.dequantize(p, layout.ggml_type).reshape(ROWS, COLS).astype(np.float64)
                    for p in planes)
    raws = [torch.from_numpy(p.reshape(ROWS, -1).copy()) for p in planes]
    try:
        dense = layout.dequantize(raws, (ROWS, COLS)).double().numpy()
    except Exception as exc:                     # a wrong kernel may not even fit the bytes
        return [*problems, f"dequantizer failed: {exc}"]
    if not np.array_equal(dense, reference):
        problems.append(f"dequantizer off by {np.abs(dense - reference).max():.3g}")
    if len(raws) != len(layout.planes):
        return [*problems, "plane count"]
    weights = [PackedWeight(r, layout.ggml_type, ROWS, COLS, f"w{i}") for i, r in enumerate(raws)]
    x = torch.from_numpy(gen.standard_normal((BATCH, COLS)).astype(np.float32))
    ref_w = torch.from_numpy(reference)
    q8_1 = layout.vec_dot is not None and layout.vec_dot.name == "Q8_1"
    for numerics, xs, bound in (("f32", x, F32_BOUND),
                                ("llamacpp", _activations(x, layout),
                                 Q8_1_BOUND if q8_1 else LLAMACPP_BOUND)):
        with torch.no_grad():
            y = layout.product(x, weights, numerics).double()
        scale = xs.double().abs() @ ref_w.abs().T
        err = float(((y - xs.double() @ ref_w.T).abs() / scale).max())
        if err > bound:
            problems.append(f"{numerics} product off by {err:.3g} of Σ|x||w| (bound {bound})")
    return problems


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_has_kernels_that_agree(name):
    assert layout_problems(LAYOUTS[name]) == []


def test_twin_a_wrong_dequantizer_fails():
    wrong = dataclasses.replace(BY_TYPE[quants.GGMLQuantizationType.Q5_0],
                                dequantizer="engine.gguf.dequant:dequantize_q4_0")
    assert any("dequantizer" in p for p in layout_problems(wrong))


def test_twin_a_wrong_block_size_fails():
    wrong = dataclasses.replace(BY_TYPE[quants.GGMLQuantizationType.Q4_K], block=(256, 140))
    problems = layout_problems(wrong)
    assert any("ggml-common.h" in p for p in problems)
    assert any("bytes stored" in p for p in problems)


def test_twin_a_two_plane_layout_read_as_one_plane_fails():
    """PTQTP's planes summed is the weight: a row that dropped plane 2 misses it."""
    one_plane = dataclasses.replace(PTQTP_2, planes=("",))
    stored = _store(PTQTP_2, np.random.default_rng(0).standard_normal((ROWS, COLS))
                    .astype(np.float32) * 0.05)
    raws = [torch.from_numpy(p.copy()) for p in stored]
    full = PTQTP_2.dequantize(raws, (ROWS, COLS))
    assert not torch.equal(one_plane.dequantize(raws[:1], (ROWS, COLS)), full)


def test_a_file_with_both_planes_is_read_in_the_two_plane_layout():
    names = {"blk.0.attn_q.weight", "blk.0.attn_q.weight.plane2", "blk.0.ffn_up.weight"}
    tq2 = quants.GGMLQuantizationType.TQ2_0
    assert stored_layout(names, "blk.0.attn_q.weight", tq2) is PTQTP_2
    assert stored_layout(names, "blk.0.ffn_up.weight", tq2) is BY_TYPE[tq2]
    assert stored_layout(names, "blk.0.ffn_up.weight", quants.GGMLQuantizationType.Q4_K) \
        is BY_TYPE[quants.GGMLQuantizationType.Q4_K]
    assert plane_suffixes() == (".plane2",)
