"""Training throughput of the demo lm-pretrain model on this CPU, fp32 vs bf16 autocast.

Prints supervised tokens/s, the model size, the FLOPs per token that implies, and the achieved
GFLOP/s. FLOPs per token = 6 x (matmul parameters, LM head included) + 6 x layers x context x
dim (attention scores and mixing, forward + backward; Kaplan et al. 2020).

    python bench/bench_lm_pretrain.py [--threads N] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import tomllib
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import validate_config  # noqa: E402
from engine.recipes.lm_pretrain import build_model  # noqa: E402
from engine.train.optim import build_adamw, clip_and_step  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "resources" / "configs" / "lm-pretrain.toml"


def flops_per_token(model, layers: int, context: int, dim: int) -> tuple[int, int]:
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.tok_embeddings.weight.numel() if model.output is None else 0
    return 6 * (matmul + head) + 6 * layers * context * dim, matmul + head


def measure(config, autocast: bool, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model(config, 258)
    optimizer = build_adamw(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    batch = torch.randint(0, 256, (config.train.batch_size, config.model.context + 1))
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(batch[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        clip_and_step(model.parameters(), optimizer, 1.0, "skip")
        times.append(time.perf_counter() - start)
    per_step = sorted(times[2:])[len(times[2:]) // 2]  # median after two warm-up steps
    return batch[:, 1:].numel() / per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = tomllib.loads(CONFIG.read_text())
    config = validate_config(data, CONFIG)
    m = config.model
    model = build_model(config, 258)
    params = sum(p.numel() for p in model.parameters())
    flops, matmul = flops_per_token(model, m.n_layers, m.context, m.dim)
    print(f"demo model: dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads "
          f"({m.n_kv_heads} kv), ffn {m.ffn_dim}, context {m.context}, vocab 258")
    print(f"parameters: {params:,} ({matmul:,} in matmuls incl. the tied LM head)")
    print(f"training FLOPs per token: {flops / 1e6:.2f} MFLOP")
    print(f"batch: {config.train.batch_size} x {m.context} tokens, {args.threads} threads, "
          f"median of {args.steps} steps")
    for name, autocast in (("fp32", False), ("bf16 autocast", True)):
        rate = measure(config, autocast, args.steps)
        print(f"{name:>14}: {rate:10,.0f} supervised tokens/s = "
              f"{rate * flops / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
