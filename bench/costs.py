"""Where a profiled training step spends its time, by torch op: shared by the training benches
to name each recipe's biggest remaining cost; and the machine's ceilings (read bandwidth, matmul
peak) measured beside a figure, so each reads as a fraction of the machine."""

from __future__ import annotations

import os

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


DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2}
BANDWIDTH_BYTES = 1 << 30   # the bandwidth probe's tensor: 1 GiB, beyond any L3 a VM here reports


def measure_read_bandwidth(threads: int) -> float:
    """Bytes/s read from memory on `threads` threads: the best of 3 sums over a 1 GiB f32
    tensor, after a warm-up pass (a sum does one add per element read, far below the vector
    units' rate, so memory sets its time)."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(BANDWIDTH_BYTES // 4)
        data.sum()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return BANDWIDTH_BYTES / best
    finally:
        torch.set_num_threads(before)


def matmul_roofline(events, peak_flops: float, bandwidth: float) -> dict:
    """The profiled matrix products (events recorded with shapes) against their roofline. A
    product's floor is the longer of its arithmetic (2·m·k·n FLOPs at `peak_flops`) and its
    traffic (m·k + k·n + m·n elements at its first operand's dtype, at `bandwidth`): the skinny
    products of a short batch against a large frozen weight sit on the traffic side.

    Returns the products' count, their measured self time (s), the sum of their floors (s) and
    the part of that floor set by traffic."""
    from engine.train.metrics import matmul_dims

    count, measured, floor, traffic_bound = 0, 0.0, 0.0, 0.0
    for event in events:
        dims = matmul_dims(event.name, event.input_shapes)
        if dims is None:
            continue
        m, k, n = dims
        first = 1 if event.name.startswith("aten::addmm") else 0   # addmm's [0] is the sum
        size = DTYPE_BYTES.get(event.input_dtypes[first], 4)
        compute_s = 2 * m * k * n / peak_flops
        traffic_s = (m * k + k * n + m * n) * size / bandwidth
        count += 1
        measured += event.self_cpu_time_total / 1e6
        floor += max(compute_s, traffic_s)
        traffic_bound += traffic_s if traffic_s > compute_s else 0.0
    return {"count": count, "measured_s": measured, "floor_s": floor,
            "traffic_bound_s": traffic_bound}


# ---- generation ceilings (bench_generate.py, bench_gguf_load.py) -------------------------

def per_token_cost(model: str) -> tuple[int, int]:
    """(bytes, FLOPs) one token costs: every layer's packed weights and the LM head read once
    (the embedding row is negligible), two FLOPs per weight."""
    from engine.gguf.reader import open_gguf

    gf = open_gguf(model)
    head = "output.weight" if "output.weight" in gf.tensors else "token_embd.weight"
    mats = [t for name, t in gf.tensors.items()
            if (name.startswith("blk.") and len(t.shape) == 2) or name == head]
    return sum(t.n_bytes for t in mats), 2 * sum(t.n_elements for t in mats)


def ceilings(threads: int, model: str) -> dict:
    """The machine's ceilings measured now at `threads` threads: read bandwidth (B/s) and f32
    matmul peak (FLOP/s, wall clock), and what they allow this model (decode and prompt
    tok/s)."""
    from engine.train.metrics import measure_peak_matmul_flops

    nbytes, flops = per_token_cost(model)
    bandwidth = measure_read_bandwidth(threads)
    peak = measure_peak_matmul_flops("f32", threads, clock="wall")
    return {"threads": threads, "bandwidth": bandwidth, "peak_flops": peak,
            "bytes_per_token": nbytes, "flops_per_token": flops,
            "decode_ceiling": bandwidth / nbytes, "prompt_ceiling": peak / flops,
            "load": os.getloadavg()[0]}


def ceiling_line(c: dict) -> str:
    return (f"ceilings at {c['threads']} threads (load {c['load']:.2f}): read bandwidth "
            f"{c['bandwidth'] / 1e9:.1f} GB/s over {c['bytes_per_token'] / 1e6:.1f} MB per token "
            f"-> decode <= {c['decode_ceiling']:.1f} tok/s; f32 matmul peak "
            f"{c['peak_flops'] / 1e9:.0f} GFLOP/s over {c['flops_per_token'] / 1e6:.0f} MFLOP "
            f"per token -> prompt <= {c['prompt_ceiling']:.0f} tok/s")
