"""`forgebench demo`: the whole lm-pretrain road in one command.

Generates the record corpus into a workspace, measures how fast this machine trains the demo
model, sets the step target to fill the time budget, trains, evaluates on val, samples text,
and prints where everything is.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

import tomllib

from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, atomic_write_text

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "resources" / "configs" / "lm-pretrain.toml"
MIN_STEPS, MAX_STEPS = 60, 3000


def seconds_per_step(config) -> float:
    """Time two training steps of the configured model on random tokens (after one warm-up)."""
    import torch
    import torch.nn.functional as F

    from engine.recipes.lm_pretrain import build_model
    from engine.train.optim import build_adamw
    from engine.train.precision import autocast

    torch.manual_seed(0)
    model = build_model(config, 258)
    optimizer = build_adamw(model.named_parameters(), lr=1e-3, weight_decay=0.0)
    tokens = torch.randint(0, 256, (config.train.batch_size, config.model.context + 1))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(config.train.grad_accum):
            with autocast(config.train.precision):
                logits = model(tokens[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def where_accuracy(model, tokenizer, val_text: str, n: int = 20) -> tuple[int, int]:
    """Ask 'Where is X?' right after each of the first `n` val records (entities the model
    never saw) and count answers that name the record's room."""
    from engine.recipes.lm_pretrain import complete
    from engine.sampling import SamplingSettings

    right = total = 0
    for line in val_text.splitlines()[:n]:
        record, entity = line.split(" Question:")[0], line.split(":")[0].removeprefix("Record ")
        room = line.split(" is in the ")[1].split(".")[0]
        answer = complete(model, tokenizer, f"{record} Question: Where is {entity}? Answer:",
                          max_tokens=16, settings=SamplingSettings(), seed=0, stop=["."])
        right += answer.strip() == f"the {room}"
        total += 1
    return right, total


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a valid TOML basic string


def cmd_demo(args) -> int:
    from engine.config import validate_config
    from engine.data.generators.records import generate_records
    from engine.jobs import default_threads, execute, start_run
    from engine.recipes.lm_pretrain import complete, load_model
    from engine.rundir import RunDir
    from engine.sampling import SamplingSettings

    workspace = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="forgebench-demo-"))
    workspace.mkdir(parents=True, exist_ok=True)
    if not (workspace / "workspace.json").exists():
        atomic_write_json(workspace / "workspace.json",
                          {"name": "forgebench demo", "created": time.time(), "version": 1})
    corpus = workspace / "datasets" / "records"
    if not (corpus / "dataset.json").exists():
        print(f"generating the record corpus in {corpus}")
        generate_records(corpus)

    if not DEMO_CONFIG.is_file():
        raise ForgebenchError("the demo config is missing from this installation",
                              path=DEMO_CONFIG)
    data = tomllib.loads(DEMO_CONFIG.read_text("utf-8"))
    data["base_dir"] = str(workspace)
    threads = getattr(args, "threads", None) or default_threads()
    import torch

    torch.set_num_threads(threads)
    config = validate_config(data, DEMO_CONFIG)
    steps = getattr(args, "steps", None)
    if steps is None:
        per_step = seconds_per_step(config)
        steps = max(MIN_STEPS, min(MAX_STEPS, int(args.seconds * 0.85 / per_step)))
        print(f"this machine: {per_step:.3f} s per step with {threads} threads; "
              f"training {steps} steps to fit about {args.seconds:.0f} s")
    data["steps"] = steps
    data["eval_every"] = data["save_every"] = max(steps // 3, 1)
    config = validate_config(data, DEMO_CONFIG)

    run_path = workspace / "runs" / f"lm-pretrain-{time.strftime('%Y%m%d-%H%M%S')}"
    config_path = workspace / "configs" / "lm-pretrain.toml"
    text = DEMO_CONFIG.read_text("utf-8")
    text = text.replace('dir = "datasets/records"', f"dir = {_toml_string(str(corpus))}")
    for key in ("steps", "eval_every", "save_every"):  # the copy says what the demo ran
        text = re.sub(rf"^{key} = \d+$", f"{key} = {data[key]}", text, count=1, flags=re.M)
    atomic_write_text(config_path, text)

    run = start_run(config, run_path, ["forgebench", "demo"], threads=threads)
    status = execute(run, config, None, threads=threads, argv=["forgebench", "demo"])
    run = RunDir(run_path)
    vals = [m for m in run.metrics() if m.get("split") == "val"]
    checkpoint = run.latest_checkpoint()
    model, tokenizer, _ = load_model(run, checkpoint)
    prompt = config.sample.prompts[0]
    answer = complete(model, tokenizer, prompt, max_tokens=24,
                      settings=SamplingSettings(), seed=0, stop=["."])
    right, total = where_accuracy(model, tokenizer, (corpus / "val.txt").read_text("utf-8"))

    print()
    print(f"run {status['state']} after {status['step']} steps")
    if vals:
        print(f"val bits per byte: {vals[-1]['bpb']:.3f} (a uniform guess is 8.0)")
    print(f"greedy answer: {prompt}{answer}.")
    print(f"'Where is X?' on {total} unseen val records: {right}/{total} right "
          f"(one fixed room would get about {total // 10})")
    print(f"workspace:   {workspace}")
    print(f"corpus:      {corpus}")
    print(f"config:      {config_path}")
    print(f"run:         {run.path}")
    print(f"checkpoint:  {checkpoint.path}")
    print(f"samples:     {run.samples_dir / checkpoint.name / 'samples.jsonl'}")
    print(f"metrics:     {run.path / 'metrics.jsonl'}")
    print(f"next: forgebench generate {run.path} --prompt \"Record item\" --temperature 0.8")
    print(f"      forgebench eval {run.path} --split test")
    return 0 if status["state"] == "completed" else 1
