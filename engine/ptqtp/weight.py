"""A linear layer over PTQTP's ternary planes (engine/ptqtp/gguf_file.py): W = Σ_p plane_p.

Each plane is a frozen packed TQ2_0 weight (a FrozenQuantLinear: dequantized on the fly, f32
products); the forward is the sum of the per-plane products, y = Σ_p plane_p·x (+ bias), which is
W·x up to f32 rounding of the sum. The planes are no Parameters, so they carry no gradient: a LoRA
adapter wraps this layer like any other frozen base, and dx flows through every plane.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.linear import FrozenQuantLinear


class PlaneSumLinear(nn.Module):
    """Linear over a sum of frozen packed planes [out, in] (+ optional f32 bias)."""

    def __init__(self, planes: list[FrozenQuantLinear], bias: torch.Tensor | None = None):
        super().__init__()
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
        return f"in={self.in_features}, out={self.out_features}, planes={len(self.planes)}"


def with_extra_planes(gf, name: str, linear: FrozenQuantLinear, packed) -> nn.Module:
    """`linear` (plane 1 of tensor `name`) summed with the file's `name.plane2` when the file is
    a 2-plane PTQTP model; `packed(gf, name, shape)` reads a packed weight as the loader does."""
    from engine.ptqtp.gguf_file import PLANE2_SUFFIX

    extra = name + PLANE2_SUFFIX
    if extra not in gf.tensors:
        return linear
    shape = (linear.out_features, linear.in_features)
    bias, linear.bias = linear.bias, None
    second = FrozenQuantLinear(packed(gf, extra, shape))
    return PlaneSumLinear([linear, second], None if bias is None else bias.data)
