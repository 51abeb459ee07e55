"""`forgebench demo`: a tiny language model learns to read a record, in about two minutes.

The task is the record corpus's "Where is X?" question: after
"Record item0421: the red lamp is in the hall. Question: Where is item0421? Answer:" the model
must say "the hall". The demo corpus asks only that question, and the entities it is scored
on are the val split's, which never occur in training: a right answer comes from reading the
record, and a fixed guess gets about 2 of 20. The demo generates the corpus into a workspace,
measures how fast this machine trains the demo model and sets the step target to fill the
time budget, trains (a progress bar with the ETA), then asks the untrained model (BEFORE,
the run's own step-0 weights) and the trained one (AFTER) the same 20 questions and prints
the score, a few BEFORE/AFTER answers and where everything is.
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

DEMO_CONFIG = (Path(__file__).resolve().parents[2] / "resources" / "configs"
               / "lm-pretrain-demo.toml")
DEMO_CORPUS = "where-records"
DEMO_ENTITIES = 20_000          # enough that no room can be memorised per entity
# The model starts reading the room between steps 300 and 600 (measured): a slow machine
# trains longer than the budget rather than stop before that.
MIN_STEPS, MAX_STEPS = 600, 20_000
QUESTIONS = 20
EXAMPLES = 3


def seconds_per_step(config, vocab_size: int) -> float:
    """Time two training steps of the configured model on random tokens (after one warm-up)."""
    import torch
    import torch.nn.functional as F

    from engine.recipes.lm_pretrain import build_model
    from engine.train.optim import build_adamw
    from engine.train.precision import autocast

    torch.manual_seed(0)
    model = build_model(config, vocab_size)
    optimizer = build_adamw(model.named_parameters(), lr=1e-3, weight_decay=0.0)
    tokens = torch.randint(0, vocab_size, (config.train.batch_size, config.model.context + 1))
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


def where_questions(val_text: str, n: int = QUESTIONS) -> list[tuple[str, str]]:
    """(prompt, expected answer) for the first `n` val records: the record, then
    "Question: Where is X? Answer:", expecting "the ROOM"."""
    questions = []
    for line in val_text.splitlines()[:n]:
        record, entity = line.split(" Question:")[0], line.split(":")[0].removeprefix("Record ")
        room = line.split(" is in the ")[1].split(".")[0]
        questions.append((f"{record} Question: Where is {entity}? Answer:", f"the {room}"))
    return questions


def answers(model, tokenizer, questions: list[tuple[str, str]]) -> list[str]:
    """The model's greedy answer to each question, up to its first full stop."""
    from engine.recipes.lm_pretrain import complete
    from engine.sampling import SamplingSettings

    return [complete(model, tokenizer, prompt, max_tokens=16, settings=SamplingSettings(),
                     seed=0, stop=[".", "\n"]).strip() for prompt, _ in questions]


def score(questions: list[tuple[str, str]], said: list[str]) -> int:
    return sum(answer == expected for (_, expected), answer in zip(questions, said))


def untrained_model(config, tokenizer):
    """The run's step-0 weights: lm-pretrain seeds torch with the config's seed, then builds."""
    import torch

    from engine.recipes.lm_pretrain import build_model

    torch.manual_seed(config.seed)
    return build_model(config, tokenizer.vocab_size).eval()


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a valid TOML basic string


def _workspace(args) -> tuple[Path, Path]:
    """(the demo's workspace, its records corpus), made when missing."""
    from engine.data.generators.records import generate_records

    workspace = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="forgebench-demo-"))
    workspace.mkdir(parents=True, exist_ok=True)
    if not (workspace / "workspace.json").exists():
        atomic_write_json(workspace / "workspace.json",
                          {"name": "forgebench demo", "created": time.time(), "version": 1})
    corpus = workspace / "datasets" / DEMO_CORPUS
    if not (corpus / "dataset.json").exists():
        print(f"generating the corpus ({DEMO_ENTITIES} records, one 'Where is X?' each) "
              f"in {corpus}")
        generate_records(corpus, n=DEMO_ENTITIES, questions=("where",))
    return workspace, corpus


def _demo_config(args, workspace: Path):
    """(the validated config, its data, threads): the steps measured to fit `--seconds`
    unless `--steps` is given."""
    from engine.config import validate_config
    from engine.jobs import default_threads

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
        vocab = config.tokenizer.vocab_size if config.tokenizer.kind == "bpe" else 258
        per_step = seconds_per_step(config, vocab)
        steps = max(MIN_STEPS, min(MAX_STEPS, int(args.seconds * 0.85 / per_step)))
        print(f"this machine: {per_step:.3f} s per step with {threads} threads; "
              f"training {steps} steps to fit about {args.seconds:.0f} s")
    data["steps"] = steps
    data["eval_every"] = data["save_every"] = max(steps // 3, 1)
    return validate_config(data, DEMO_CONFIG), data, threads


def _write_config_copy(config_path: Path, corpus: Path, data: dict) -> None:
    """configs/lm-pretrain-demo.toml: the demo config as it ran (its corpus, steps, cadence)."""
    text = DEMO_CONFIG.read_text("utf-8")
    text = text.replace(f'dir = "datasets/{DEMO_CORPUS}"', f"dir = {_toml_string(str(corpus))}")
    for key in ("steps", "eval_every", "save_every"):  # the copy says what the demo ran
        text = re.sub(rf"^{key} = \d+$", f"{key} = {data[key]}", text, count=1, flags=re.M)
    atomic_write_text(config_path, text)


def cmd_demo(args) -> int:
    from engine.jobs import execute, start_run
    from engine.recipes.lm_pretrain import TOKENIZER_FILE, load_model
    from engine.rundir import RunDir
    from engine.text_tokenizers import tokenizer_from_json

    started = time.monotonic()
    workspace, corpus = _workspace(args)
    config, data, threads = _demo_config(args, workspace)
    run_path = workspace / "runs" / f"lm-pretrain-demo-{time.strftime('%Y%m%d-%H%M%S')}"
    config_path = workspace / "configs" / "lm-pretrain-demo.toml"
    _write_config_copy(config_path, corpus, data)

    run = start_run(config, run_path, ["forgebench", "demo"], threads=threads)
    status = execute(run, config, None, threads=threads, argv=["forgebench", "demo"])
    run = RunDir(run_path)
    vals = [m for m in run.metrics() if m.get("split") == "val"]
    checkpoint = run.latest_checkpoint()
    model, tokenizer, _ = load_model(run, checkpoint)
    questions = where_questions((corpus / "val.txt").read_text("utf-8"))
    before = answers(untrained_model(config, tokenizer_from_json(
        (checkpoint.path / TOKENIZER_FILE).read_text("utf-8"))), tokenizer, questions)
    after = answers(model, tokenizer, questions)
    right, total = score(questions, after), len(questions)

    print()
    print(f"run {status['state']} after {status['step']} steps "
          f"({time.monotonic() - started:.0f} s in all)")
    if vals:
        print(f"val bits per byte: {vals[-1]['bpb']:.3f} (a uniform guess is 8.0)")
    _print_questions(questions, before, after, total, right)
    print(f"score: {right}/{total}")
    print(f"workspace:   {workspace}")
    print(f"corpus:      {corpus}")
    print(f"config:      {config_path}")
    print(f"run:         {run.path}")
    print(f"checkpoint:  {checkpoint.path}")
    print(f"samples:     {run.samples_dir / checkpoint.name / 'samples.jsonl'}")
    print(f"metrics:     {run.path / 'metrics.jsonl'}")
    print(f"next: forgebench generate {run.path} --prompt \"{questions[0][0]}\"")
    print(f"      forgebench eval {run.path} --split test")
    return 0 if status["state"] == "completed" else 1


def _print_questions(questions, before: list[str], after: list[str], total: int,
                     right: int) -> None:
    print(f"'Where is X?' on {total} records of entities it never saw:")
    print(f"  BEFORE training: {score(questions, before)}/{total} right")
    print(f"  AFTER training:  {right}/{total} right (one fixed room would get about "
          f"{total // 10})")
    for (prompt, expected), was, now in list(zip(questions, before, after))[:EXAMPLES]:
        print()
        print(f"  {prompt}")
        print(f"    expected: {expected}")
        print(f"    BEFORE:   {was!r}")
        print(f"    AFTER:    {now!r} {'✓' if now == expected else '✗'}")
    print()
