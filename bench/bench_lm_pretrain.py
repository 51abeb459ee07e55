"""Training throughput and model FLOPs utilisation of the demo lm-pretrain model on this CPU.

For each precision (f32, and bf16 autocast; "auto" is marked) prints tokens/s, the FLOPs per
step as the engine counts them (engine.train.metrics.StepFlops: matmuls and attention, forward
and backward), the achieved GFLOP/s, the MFU against this machine's matmul peak for that dtype
(in wall time, measured between the timed steps under the same load; and the cached CPU-time
peak the recipe's metrics rows use), and the
biggest remaining costs of a profiled step by kind of op.

    python bench/bench_lm_pretrain.py [--threads N] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import tomllib
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.costs import print_costs  # noqa: E402
from engine.config import validate_config  # noqa: E402
from engine.recipes.lm_pretrain import build_model  # noqa: E402
from engine.train.metrics import (  # noqa: E402
    StepFlops,
    measure_peak_matmul_flops,
    peak_matmul_flops,
)
from engine.train.optim import build_adamw, clip_and_step  # noqa: E402
from engine.train.precision import autocast, resolve_precision  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "resources" / "configs" / "lm-pretrain.toml"


def measure(config, precision: str, steps: int, threads: int) -> dict:
    torch.manual_seed(0)
    model = build_model(config, 258)
    optimizer = build_adamw(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    batch = torch.randint(0, 256, (config.train.batch_size, config.model.context + 1))

    def step() -> None:
        with autocast(precision):
            logits = model(batch[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        clip_and_step(model.parameters(), optimizer, 1.0, "skip")

    step()
    with StepFlops() as count:
        step()
    times, peaks = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        peaks.append(measure_peak_matmul_flops(precision, threads, clock="wall"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        profiled = time.perf_counter() - start
    per_step = statistics.median(times)
    return {"tokens_s": batch[:, 1:].numel() / per_step, "flops": count.total,
            "flops_s": count.total / per_step, "peak": statistics.median(peaks),
            "cached_peak": peak_matmul_flops(precision, threads), "prof": prof,
            "profiled_s": profiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = validate_config(tomllib.loads(CONFIG.read_text()), CONFIG)
    m = config.model
    model = build_model(config, 258)
    auto = resolve_precision("auto")
    print(f"demo model: dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads "
          f"({m.n_kv_heads} kv), ffn {m.ffn_dim}, context {m.context}, vocab 258, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
    print(f"batch: {config.train.batch_size} x {m.context} tokens, {args.threads} thread(s), "
          f"median of {args.steps} steps; load average {os.getloadavg()[0]:.1f}")
    print(f"precision auto: {auto.precision} ({auto.reason})")
    for precision in ("f32", "bf16"):
        r = measure(config, precision, args.steps, args.threads)
        mark = "  <- auto" if precision == auto.precision else ""
        print(f"{precision:>5}: {r['tokens_s']:9,.0f} tokens/s, {r['flops'] / 1e9:.2f} GFLOP/step,"
              f" {r['flops_s'] / 1e9:6.1f} GFLOP/s; MFU {r['flops_s'] / r['peak']:.0%} of the "
              f"{r['peak'] / 1e9:.0f} GFLOP/s {precision} matmul peak measured alongside "
              f"({r['flops_s'] / r['cached_peak']:.0%} of the cached "
              f"{r['cached_peak'] / 1e9:.0f}){mark}")
        print_costs(r["prof"], r["profiled_s"])


if __name__ == "__main__":
    main()
