"""Training throughput and model FLOPs utilisation of the demo lm-pretrain model on this CPU.

f32 and bf16 autocast steps of the same model and batch are taken in turns (the order swapped
every round, so a change in a shared machine's load falls on both), each timed step right after
an untimed one of its own precision: a step that directly follows one in the other precision
pays for the switch (caches and oneDNN's primitives of the other dtype), which no run fixed to
one precision does (`--alternate` times those steps instead, to see the difference; the
precision trial of engine.train.precision takes its steps the same way). Prints for each the
median
step in wall and process CPU time (the steadier one under load), tokens/s, the FLOPs per step as
the engine counts them (engine.train.metrics.StepFlops), the MFU against this machine's matmul
peak for that dtype (measured after, and the cached CPU-time peak the recipe's metrics rows
use), the load average, the CPU's instruction sets and bf16 units, what "auto" resolves to here
and why, and auto's speed over the best fixed precision's. `--profile` adds the biggest costs of
a profiled step by kind of op.

    [FORGEBENCH_SIMD=avx2] python bench/bench_lm_pretrain.py [--threads N] [--steps N]
        [--alternate] [--profile]

Under FORGEBENCH_SIMD=avx2 the process computes as an AVX2-only CPU would (ATen, MKL and oneDNN
capped at AVX2 by engine/__init__.py, "auto" seeing no bf16 units): torch's bf16 matmul then takes
ATen's own fallback, as on a CPU without AVX-512, not oneDNN's bf16 kernels.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# engine first: under FORGEBENCH_SIMD=avx2 it caps torch's libraries, which read the caps as
# torch loads
engine = importlib.import_module("engine")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

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

PRECISIONS = ("f32", "bf16")
CONFIG = Path(__file__).resolve().parents[1] / "resources" / "configs" / "lm-pretrain.toml"


def trainer(config, precision: str):
    """One training step of the demo model in `precision` (a fresh model, seed 0 each)."""
    torch.manual_seed(0)
    model = build_model(config, 258)
    optimizer = build_adamw(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    batch = torch.randint(0, 256, (config.train.batch_size, config.model.context + 1))

    def step() -> None:
        with autocast(precision):
            logits = model(batch[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        clip_and_step(model.parameters(), optimizer, 1.0, "skip")

    return step, batch[:, 1:].numel()


def interleaved(config, steps: int, alternate: bool = False) -> dict:
    """f32 and bf16 steps taken in turns (order swapped every round, so a change in the
    machine's load falls on both), each timed one after an untimed one of its own precision
    (`alternate`: without it, each timed step right after one in the other precision): wall and
    process-CPU seconds of each step, and its FLOPs."""
    sides = {p: trainer(config, p) for p in PRECISIONS}
    out = {p: {"wall": [], "cpu": [], "tokens": sides[p][1]} for p in PRECISIONS}
    for p in PRECISIONS:
        sides[p][0]()                           # warm-up: allocations, oneDNN's kernel choice
        with StepFlops() as count:
            sides[p][0]()
        out[p]["flops"] = count.total
    for i in range(steps):
        for p in PRECISIONS if i % 2 == 0 else PRECISIONS[::-1]:
            if not alternate:
                sides[p][0]()                   # untimed: the timed step follows its own kind
            wall, cpu = time.perf_counter(), time.process_time()
            sides[p][0]()
            out[p]["cpu"].append(time.process_time() - cpu)
            out[p]["wall"].append(time.perf_counter() - wall)
    return out


def profiled(config, precision: str):
    step = trainer(config, precision)[0]
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        took = time.perf_counter() - start
    return prof, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=10, help="timed steps per precision")
    parser.add_argument("--alternate", action="store_true",
                        help="time steps that follow one in the other precision (no untimed "
                             "step of their own before each)")
    parser.add_argument("--profile", action="store_true",
                        help="print the biggest costs of a profiled step in each precision")
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
          f"{args.steps} steps each, f32 and bf16 in turns"
          f"{', each after the other' if args.alternate else ', each after one of its own'}"
          f", medians; CPU {simd_line()}")
    print(f"precision auto: {auto.precision} ({auto.reason})")
    load = os.getloadavg()[0]
    r = interleaved(config, args.steps, args.alternate)
    load = f"{load:.1f}-{os.getloadavg()[0]:.1f}"
    med = {p: {k: statistics.median(r[p][k]) for k in ("wall", "cpu")} for p in PRECISIONS}
    for p in PRECISIONS:
        peak = measure_peak_matmul_flops(p, args.threads, clock="wall")
        cached = peak_matmul_flops(p, args.threads)
        flops_s = r[p]["flops"] / med[p]["wall"]
        mark = "  <- auto" if p == auto.precision else ""
        print(f"{p:>5}: {med[p]['wall'] * 1e3:7.1f} ms/step wall, {med[p]['cpu'] * 1e3:7.1f} ms "
              f"CPU, {r[p]['tokens'] / med[p]['wall']:9,.0f} tokens/s, "
              f"{r[p]['flops'] / 1e9:.2f} GFLOP/step; MFU {flops_s / peak:.0%} of the "
              f"{peak / 1e9:.0f} GFLOP/s {p} matmul peak measured after "
              f"({r[p]['flops'] / (med[p]['cpu'] / args.threads) / cached:.0%} in CPU time of "
              f"the cached {cached / 1e9:.0f}); load {load}{mark}")
    for clock in ("wall", "cpu"):
        best = min(PRECISIONS, key=lambda p: med[p][clock])
        print(f"auto ({auto.precision}) / best fixed ({best}), {clock} time: "
              f"{med[best][clock] / med[auto.precision][clock]:.2f}x the best's speed; "
              f"bf16 / f32 speed: {med['f32'][clock] / med['bf16'][clock]:.2f}x")
    if args.profile:
        for p in PRECISIONS:
            print(f"{p}, one profiled step:")
            print_costs(*profiled(config, p))


def simd_line() -> str:
    from engine.kernels.cpu import detected
    from engine.train.precision import cpu_bf16_features

    simd = ", ".join(sorted(f for f in detected()[0] if f.startswith(("avx", "amx"))))
    caps = ", ".join(f"{k}={os.environ[k]}" for k in engine.AVX2_LIBRARY_CAPS
                     if k in os.environ) or "none"
    return (f"{simd}; bf16 units: {', '.join(sorted(cpu_bf16_features())) or 'none'}; torch "
            f"{torch.__version__} kernels {torch.backends.cpu.get_cpu_capability()}; library "
            f"caps: {caps}")


if __name__ == "__main__":
    main()
