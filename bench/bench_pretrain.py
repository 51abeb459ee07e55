"""nanochat on this CPU: our step against nanochat's own, and Muon against AdamW.

1. Step throughput. nanochat's d6 (runs/runcpu.sh: depth 6, width 384, 6 heads of 64, context
   512, nanochat's vocabulary of 32768) trains one step (forward, backward, MuonAdamW step) on
   the same batch, in fp32 and in bf16:
   - ours: engine.models.nanochat + engine.train.muon (bf16 = what lm-pretrain trains a
     nanochat model with in bf16: the model and MuonAdamW built with compute_dtype bf16,
     nanochat's own scheme, no autocast);
   - nanochat: its own gpt.py + optim.py at commit 92d63d4, imported from a nanochat git
     directory given with --nanochat (copied to a temporary folder; nothing of it is kept),
     its compute dtype set by NANOCHAT_DTYPE as its docs say (bf16: its own casts, embeddings
     stored in bf16). Both eager: nanochat's torch.compile of the model and of its optimizer
     kernels is off (TORCHDYNAMO_DISABLE=1), since compiling needs minutes per shape on this
     machine; say --compile to let nanochat compile (its first steps are excluded either way).
   Each side runs in its own process (nanochat reads its dtype at import); they take turns one
   step at a time, so a shared machine's load falls on both alike. Prints tokens/s (median of
   the timed steps' wall time), the ratio ours / nanochat, the same ratio in CPU time (each
   worker's own process time, which other processes' load stretches less), load and CPU flags.

2. Muon against AdamW on the sample corpus (resources/sample-workspace/datasets/records, byte
   tokens): the same small nanochat model (dim 64, 4 layers, context 64) trained by AdamW
   with lm-pretrain's default optimizer settings (the baseline), by AdamW at lr 1e-2 (a
   stronger baseline), and by nanochat's MuonAdamW
   (the template's settings, with and without nanochat's batch scaling of the rates), both
   with lm-pretrain's warmup + cosine schedule, evaluated on the val split every --eval-every
   steps. Prints both curves and the steps Muon needs to reach the baseline's final val bpb,
   as a share of the baseline's steps.

    python bench/bench_pretrain.py [--nanochat DIR] [--steps 3] [--threads 2]
        [--curve-steps 200] [--curve-dim 64] [--curve-context 64] [--skip-throughput]
        [--skip-curves]
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

PINNED = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"
VOCAB, BATCH, CONTEXT = 32768, 2, 512


def uptime() -> str:
    out = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return out or "load average %.2f %.2f %.2f" % os.getloadavg()


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
                    if f in flags)


# -- 1. throughput: one worker process per side and dtype ----------------------------------
def reference_package(nanochat: str) -> str:
    """nanochat's `nanochat/` package at the pinned commit, in a temporary folder."""
    git = ["git", "-C", nanochat] if (Path(nanochat) / ".git").exists() else \
        ["git", "--git-dir", nanochat]
    tmp = tempfile.mkdtemp(prefix="nanochat-ref-")
    archive = subprocess.run(git + ["archive", PINNED, "nanochat"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return tmp


def batch(torch):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def worker(side: str, dtype: str, package: str | None) -> None:
    """Build the side's model and optimizer, then step each time a line arrives on stdin,
    answering with the step's seconds."""
    import torch
    torch.manual_seed(0)
    x, y = batch(torch)
    if side == "nanochat":
        sys.path.insert(0, package)
        from nanochat.gpt import GPT, GPTConfig
        cfg = GPTConfig(sequence_len=CONTEXT, vocab_size=VOCAB, n_layer=6, n_head=6,
                        n_kv_head=6, n_embd=384, window_pattern="L")
        with torch.device("meta"):
            model = GPT(cfg)
        model.to_empty(device="cpu")
        model.init_weights()
        optimizer = model.setup_optimizer()
        run = model

        def loss_of():
            return run(x, y)
    else:
        from engine.models.nanochat import NanochatConfig, NanochatGPT
        from engine.train.muon import MuonAdamW, nanochat_groups
        own = torch.bfloat16 if dtype == "bf16" else torch.float32
        model = NanochatGPT(NanochatConfig.d6(VOCAB), compute_dtype=own)
        optimizer = MuonAdamW(nanochat_groups(model), compute_dtype=own)

        def loss_of():
            return model(x, y)
    print("@@ready", flush=True)     # nanochat prints its own lines too: ours start with @@
    for _ in sys.stdin:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = loss_of()
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        print("@@" + json.dumps({"s": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                                 "loss": loss.item()}), flush=True)


def answer_of(proc) -> str:
    """The worker's next own line (nanochat's own prints skipped)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {proc.args[3]} exited early (see its stderr above)")
        if line.startswith("@@"):
            return line[2:].strip()


def throughput(args) -> None:
    if not args.nanochat or not Path(args.nanochat).exists():
        print("throughput: skipped, no nanochat git directory (give --nanochat DIR, a clone "
              "of karpathy/nanochat holding commit 92d63d4)")
        return
    package = reference_package(args.nanochat)
    tokens = BATCH * CONTEXT
    print(f"step throughput: nanochat d6 (vocab {VOCAB}), batch {BATCH} x {CONTEXT} = {tokens} "
          f"tokens, forward + backward + MuonAdamW step, {args.threads} threads, "
          f"{args.warmup} warm-up + {args.steps} timed steps per side")
    print(f"  load before: {uptime()}")
    rows = []
    for dtype in ("fp32", "bf16"):
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(args.threads),
                   NANOCHAT_DTYPE={"fp32": "float32", "bf16": "bfloat16"}[dtype])
        if not args.compile:
            env["TORCHDYNAMO_DISABLE"] = "1"
        procs = {side: subprocess.Popen(
            [sys.executable, __file__, "--worker", side, "--dtype", dtype, "--package", package],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for side in ("ours", "nanochat")}
        for p in procs.values():
            assert answer_of(p) == "ready"
        times: dict[str, list[float]] = {side: [] for side in procs}
        cpu: dict[str, list[float]] = {side: [] for side in procs}
        losses: dict[str, float] = {}
        for i in range(args.warmup + args.steps):
            order = list(procs) if i % 2 == 0 else list(procs)[::-1]
            for side in order:
                procs[side].stdin.write("step\n")
                procs[side].stdin.flush()
                answer = json.loads(answer_of(procs[side]))
                if i == 0:
                    losses[side] = answer["loss"]
                if i >= args.warmup:
                    times[side].append(answer["s"])
                    cpu[side].append(answer["cpu"])
        for p in procs.values():
            p.stdin.close()
            p.wait()
        rate = {side: tokens / statistics.median(t) for side, t in times.items()}
        cpu_ratio = statistics.median(cpu["nanochat"]) / statistics.median(cpu["ours"])
        rows.append((dtype, rate["ours"], rate["nanochat"], losses))
        print(f"  {dtype}: ours {rate['ours']:8.0f} tok/s   nanochat {rate['nanochat']:8.0f} "
              f"tok/s   ratio {rate['ours'] / rate['nanochat']:.2f}x (CPU time "
              f"{cpu_ratio:.2f}x)   first-step loss ours {losses['ours']:.4f} nanochat "
              f"{losses['nanochat']:.4f}   ({uptime()})")


# -- 2. Muon against AdamW on the sample corpus ---------------------------------------------
def curves(args) -> None:
    import torch
    import torch.nn.functional as F

    from engine.config import validate_config
    from engine.recipes.lm_pretrain import (
        bits_per_byte,
        build_model,
        build_optimizer,
        token_stream,
        windows,
    )
    from engine.text_tokenizers import ByteTokenizer
    from engine.train.muon import schedule_muon
    from engine.train.optim import clip_and_step, scheduled_lr, set_lr

    # one thread: these small matrices gain nothing from a second, and on a loaded machine
    # OpenMP's spinning makes two several times slower
    torch.set_num_threads(1)
    corpus = REPO / "resources/sample-workspace/datasets/records"
    tok = ByteTokenizer()
    train = windows(token_stream(tok, (corpus / "train.txt").read_text("utf-8")),
                    args.curve_context)
    val_text = (corpus / "val.txt").read_text("utf-8")

    def config(kind: str, scaling: bool = True, lr: float = 3e-3):
        optim = ({"kind": "adamw", "lr": lr} if kind == "adamw" else
                 {"kind": "muon", "lr": 0.02, "weight_decay": 0.28, "grad_clip": 0.0,
                  "batch_lr_scaling": scaling, "min_lr_ratio": 0.05})
        return validate_config({
            "recipe": "lm-pretrain", "seed": 0, "steps": args.curve_steps,
            "data": {"dir": str(corpus)}, "tokenizer": {"kind": "byte"},
            "model": {"family": "nanochat", "dim": args.curve_dim, "n_layers": 4,
                      "n_heads": 4, "n_kv_heads": 4, "context": args.curve_context},
            "optim": optim, "train": {"batch_size": 16, "precision": "f32"},
            "eval": {"max_windows": 32}}, corpus / "bench.toml")

    def train_curve(cfg) -> list[tuple[int, float]]:
        torch.manual_seed(0)
        model = build_model(cfg, tok.vocab_size)
        optimizer = build_optimizer(cfg, model)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
        curve, t0 = [], time.perf_counter()
        for step in range(cfg.steps):
            set_lr(optimizer, scheduled_lr(cfg.optim, step, cfg.steps))
            if cfg.optim.kind == "muon":
                schedule_muon(optimizer, step)
            idx = order[(step * 16 + torch.arange(16)) % len(train)]
            b = train[idx]
            loss = F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
            loss.backward()
            clip_and_step(model.parameters(), optimizer, cfg.optim.grad_clip)
            if (step + 1) % args.eval_every == 0 or step + 1 == cfg.steps:
                model.eval()
                bpb = bits_per_byte(model, tok, val_text, cfg, cfg.eval.max_windows).bpb
                model.train()
                curve.append((step + 1, bpb))
        print(f"    ({time.perf_counter() - t0:.0f} s, {uptime()})", flush=True)
        return curve

    print(f"\nMuon vs AdamW: nanochat model dim {args.curve_dim} x 4 layers, context "
          f"{args.curve_context}, batch 16 windows ({16 * args.curve_context} byte tokens), "
          f"{args.curve_steps} steps, val bpb on 32 val windows every {args.eval_every} steps, "
          "1 thread", flush=True)
    runs = {"adamw (lm-pretrain defaults: lr 3e-3, wd 0.1, clip 1)": config("adamw"),
            "adamw lr 1e-2 (a stronger baseline)": config("adamw", lr=1e-2),
            "muon (nanochat rates, batch-scaled)": config("muon", True),
            "muon (nanochat rates, unscaled)": config("muon", False)}
    results = {}
    for name, cfg in runs.items():
        print(f"  training {name} ...", flush=True)
        results[name] = train_curve(cfg)
    names = list(results)
    print("  step  " + "  ".join(f"{n[:34]:>34}" for n in names))
    for i, (step, _) in enumerate(results[names[0]]):
        print(f"  {step:4d}  " + "  ".join(f"{results[n][i][1]:34.4f}" for n in names))
    for base in names[:2]:
        target = results[base][-1][1]
        print(f"  baseline {base}: final val bpb {target:.4f} at step {args.curve_steps}")
        for name in names[2:]:
            reached = next((s for s, bpb in results[name] if bpb <= target), None)
            share = f"{reached / args.curve_steps:.2f}x the steps" if reached else "not reached"
            print(f"    {name}: reaches it at step {reached} -> {share} (goal <= 0.75x; "
                  f"resolution {args.eval_every} steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanochat", default=os.environ.get("NANOCHAT_DIR"),
                    help="karpathy/nanochat git directory (or NANOCHAT_DIR)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--curve-steps", type=int, default=200)
    ap.add_argument("--curve-dim", type=int, default=64)
    ap.add_argument("--curve-context", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-curves", action="store_true")
    ap.add_argument("--worker", choices=["ours", "nanochat"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    ap.add_argument("--package", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.dtype, args.package)
        return
    import torch
    print(f"torch {torch.__version__}; cpu flags: {cpu_flags()}; {os.cpu_count()} cpus")
    if not args.skip_throughput:
        throughput(args)
    if not args.skip_curves:
        curves(args)


if __name__ == "__main__":
    main()
