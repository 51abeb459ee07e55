"""lm-pretrain tokens/s on 1 vs 2 CPU processes (torch.distributed, gloo), and the share of a
2-process step spent on communication.

Two measurements, both on the demo model (resources/configs/lm-pretrain.toml, batch 16 x 128):

1. End to end, through the product: `forgebench run --nproc P --threads T` for
   (P, T) = (1, C), (2, C / 2) and (1, 1), C the cores given (default 2); the median of the
   per-step `tokens_per_s` rows after the first steps. The scaling ratio is the 2-process
   figure over the 1-process figure on the same cores.
2. Communication share: the same DDP step on 2 ranks timed with the gradient all-reduce and
   without it (`no_sync`); share = 1 - t(no all-reduce) / t(with). DDP overlaps the all-reduce
   with the backward pass, so this is the communication the step actually waits for.

    python bench/bench_distributed.py [--cores 2] [--steps 30]

Report the load (`uptime`) it ran under: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "resources" / "configs" / "lm-pretrain.toml"
WARMUP_STEPS = 5


def run_tokens_per_s(root: Path, corpus: Path, processes: int, threads: int,
                     steps: int) -> float:
    """Median tokens/s of a real `forgebench run` with that many processes and threads."""
    text = CONFIG.read_text().replace('dir = "datasets/records"', f'dir = "{corpus}"')
    text = text.replace("eval_every = 100", "eval_every = 0").replace(
        "save_every = 100", "save_every = 0").replace("max_tokens = 100", "max_tokens = 1")
    config = root / "bench.toml"
    config.write_text(text)
    out = root / f"run-{processes}x{threads}"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    subprocess.run([sys.executable, "-m", "engine", "run", str(config), "--out", str(out),
                    "--steps", str(steps), "--threads", str(threads), "--nproc",
                    str(processes)], cwd=REPO, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows
             if r.get("split") == "train" and r["step"] > WARMUP_STEPS]
    return statistics.median(rates)


def communication_worker(steps: int) -> None:
    """Under torchrun: median DDP step time with and without the gradient all-reduce."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from engine.config import load_config
    from engine.recipes.lm_pretrain import build_model
    from engine.train import distributed
    from engine.train.optim import build_adamw, clip_and_step

    world = distributed.World.from_env()
    device = torch.device("cpu")
    distributed.init(world, device)
    config = load_config(CONFIG)
    torch.manual_seed(0)
    model = build_model(config, 258)
    ddp = distributed.data_parallel(model, world, device)
    optimizer = build_adamw(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    share = config.train.batch_size // world.size
    batch = torch.randint(0, 256, (share, config.model.context + 1))

    def step(sync: bool) -> float:
        start = time.perf_counter()
        with distributed.accumulating(ddp, last=sync):
            logits = ddp(batch[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        clip_and_step(model.parameters(), optimizer, 1.0, "skip")
        distributed.barrier(world)          # both ranks end the step together
        return time.perf_counter() - start

    timings = {True: [], False: []}
    for i in range(steps + WARMUP_STEPS):
        for sync in (True, False):
            seconds = step(sync)
            if i >= WARMUP_STEPS:
                timings[sync].append(seconds)
    if world.is_main:
        with_comm = statistics.median(timings[True])
        without = statistics.median(timings[False])
        print(json.dumps({"step_s_with_allreduce": with_comm, "step_s_without": without,
                          "communication_share": 1 - without / with_comm}))
    dist.destroy_process_group()


def communication_share(threads: int, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", __file__, "--worker", "--steps", str(steps)],
                            cwd=REPO, env=env, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        communication_worker(args.steps)
        return
    from engine.data.generators.records import generate_records

    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average), {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = generate_records(root / "corpus", n=400, seed=1)
        half = max(args.cores // 2, 1)
        one_all = run_tokens_per_s(root, corpus, 1, args.cores, args.steps)
        two = run_tokens_per_s(root, corpus, 2, half, args.steps)
        one_single = run_tokens_per_s(root, corpus, 1, 1, args.steps)
        comm = communication_share(half, args.steps)
    print(f"1 process  x {args.cores} threads: {one_all:9.0f} tokens/s")
    print(f"2 processes x {half} threads: {two:9.0f} tokens/s   "
          f"scaling ratio {two / one_all:.2f} (same {args.cores} cores)")
    print(f"1 process  x 1 thread:  {one_single:9.0f} tokens/s   "
          f"2 processes / 1 process on one core each: {two / one_single:.2f}")
    print(f"2-process step: {comm['step_s_with_allreduce'] * 1e3:.1f} ms with the gradient "
          f"all-reduce, {comm['step_s_without'] * 1e3:.1f} ms without: communication "
          f"{comm['communication_share']:.0%} of the step")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
