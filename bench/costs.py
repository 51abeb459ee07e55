"""Where a profiled training step spends its time, by torch op: shared by the training benches
to name each recipe's biggest remaining cost."""

from __future__ import annotations

# aten ops grouped into what they are; anything else keeps its own name
KINDS = {
    "matmuls": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
                "mkldnn::_linear_pointwise"),
    "convolutions": ("aten::mkldnn_convolution", "aten::convolution_backward",
                     "aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward",
                     "aten::native_batch_norm", "aten::native_batch_norm_backward"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "optimizer (foreach AdamW)": ("aten::_foreach_", "aten::_fused_adamw"),
    "elementwise (norms, activations, casts)": ("aten::mul", "aten::add", "aten::sub",
                                                "aten::div", "aten::pow", "aten::rsqrt",
                                                "aten::gelu", "aten::silu", "aten::copy_",
                                                "aten::to", "aten::_to_copy", "aten::exp",
                                                "aten::sum", "aten::mean", "aten::fill_",
                                                "aten::cat", "aten::where", "aten::neg"),
    "softmax / cross-entropy": ("aten::_log_softmax", "aten::_softmax", "aten::nll_loss",
                                "aten::_log_softmax_backward_data", "aten::nll_loss_backward",
                                "aten::_softmax_backward_data"),
}


def kind_of(op: str) -> str:
    """The kind of an aten op: its in-place form counts as the op, a name ending in "_" in
    KINDS as a prefix (aten::_foreach_mul_, ...)."""
    plain = op.removesuffix("_")
    for kind, names in KINDS.items():
        if any(n in (op, plain) or (n.endswith("_") and op.startswith(n)) for n in names):
            return kind
    return op


def cost_table(prof, wall_s: float, top: int = 6) -> list[tuple[str, float]]:
    """(kind, share of `wall_s`) of the profiled aten ops' self time, biggest first, plus the
    time spent outside any op (Python, the autograd engine's bookkeeping)."""
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            kind = kind_of(event.key)
            totals[kind] = totals.get(kind, 0.0) + event.self_cpu_time_total / 1e6
    inside = sum(totals.values())
    totals["outside ops (Python, autograd bookkeeping)"] = max(wall_s - inside, 0.0)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [(kind, seconds / wall_s) for kind, seconds in ranked]


def print_costs(prof, wall_s: float, indent: str = "    ") -> None:
    table = cost_table(prof, wall_s)
    print(f"{indent}biggest remaining cost: {table[0][0]} ({table[0][1]:.0%} of the step); "
          + ", ".join(f"{kind} {share:.0%}" for kind, share in table[1:]))
