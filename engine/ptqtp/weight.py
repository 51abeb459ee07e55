"""A linear layer over a multi-plane weight layout (PTQTP's ternary planes, engine/ptqtp/
gguf_file.py; the layout table's PTQTP_2 row, engine/gguf/layouts.py): W = Σ_p plane_p.

Each plane is a frozen packed weight (a FrozenQuantLinear: dequantized on the fly, products in
the model's numerics); the forward is the sum of the per-plane products, y = Σ_p plane_p·x
(+ bias), which is W·x up to f32 rounding of the sum (the layout's `product`). The planes are no
Parameters, so they carry no gradient: a LoRA adapter wraps this layer like any other frozen
base, and dx flows through every plane.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.gguf.layouts import Layout
from engine.models.packed import FrozenQuantLinear, PackedWeight


class PlaneSumLinear(nn.Module):
    """Linear over a sum of frozen packed planes [out, in] (+ optional f32 bias)."""

    def __init__(self, layout: Layout, planes: list[FrozenQuantLinear],
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.layout = layout
        self.planes = nn.ModuleList(planes)
        self.in_features, self.out_features = planes[0].in_features, planes[0].out_features
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def weight(self):
        """The first plane's packed weight (what code that reads `.weight` for a type sees)."""
        return self.planes[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.planes[0](x)
        for plane in self.planes[1:]:
            y = y + plane(x)
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        """The full f32 weight [out, in], the sum of the planes (for merging/export)."""
        w = self.planes[0].dense_weight().clone()
        for plane in self.planes[1:]:
            w += plane.dense_weight()
        return w

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, layout={self.layout.name}, "
                f"planes={len(self.planes)}")


def frozen_linear(layout: Layout | None, planes: list[PackedWeight],
                  bias: torch.Tensor | None = None) -> nn.Module:
    """The frozen layer over a weight stored in `layout` as `planes` (one packed weight per
    plane, in the layout's order): a FrozenQuantLinear for one plane, else a PlaneSumLinear."""
    if len(planes) == 1:
        return FrozenQuantLinear(planes[0], bias)
    return PlaneSumLinear(layout, [FrozenQuantLinear(p) for p in planes],
                          None if bias is None else bias)
