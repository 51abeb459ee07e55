"""lm-pretrain: a tiny Llama-architecture decoder trained from random weights on a text corpus.

Reads top to bottom: corpus -> tokenizer -> windows -> model -> AdamW -> loop (accumulate,
clip, step, log, evaluate, checkpoint) -> final eval and samples. Evaluation reports bits per
byte, which compares models across tokenizers. The test split is read only by
`forgebench eval --split test`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, atomic_write_text, read_json_object, sha256_file
from engine.jobs import Job, run_config
from engine.models.llama import Llama, LlamaConfig
from engine.paths import dataset_file
from engine.recipes.lm_pretrain_config import LMPretrainConfig
from engine.rundir import Checkpoint, RunDir
from engine.sampling import SamplingSettings, generate_tokens
from engine.text_tokenizers import BPETokenizer, ByteTokenizer, tokenizer_from_json
from engine.train import distributed
from engine.train.checkpoint import (
    checkpoint_due,
    load_checkpoint,
    loop_state,
    resume_loop,
    save_checkpoint,
)
from engine.train.data_order import DataCursor
from engine.train.devices import module_device, require_bf16, to_device
from engine.train.metrics import (
    StepClock,
    StepUtilisation,
    WindowLoss,
    train_row,
    write_eval_record,
)
from engine.train.optim import adamw_for, clip_and_step, scheduled_lr, set_lr
from engine.train.precision import autocast, run_precision

CUDA = True            # trains on a GPU (engine/train/devices.py)
MULTI_PROCESS = True   # and on several processes: DDP (engine/train/distributed.py)
SHARDED_BATCH = "train.batch_size"   # split over the ranks: checked before they start
TOKENIZER_FILE = "tokenizer.json"
SPLIT_FILES = {"train": "train.txt", "val": "val.txt", "test": "test.txt"}


# -- data ---------------------------------------------------------------------------------
def corpus_files(config: LMPretrainConfig) -> dict[str, Path]:
    """split -> file. dataset.json may rename them; without it train.txt/val.txt/test.txt."""
    root = config.resolve_path(config.data.dir, "field 'data.dir'")
    if not root.is_dir():
        raise ForgebenchError("corpus folder not found", path=root, where="field 'data.dir'",
                              hint="generate one: forgebench data generate records --out DIR")
    names = dict(SPLIT_FILES)
    if (root / "dataset.json").is_file():
        manifest = read_json_object(root / "dataset.json")
        if manifest.get("kind") != "text-corpus":
            raise ForgebenchError(f"dataset kind is {manifest.get('kind')!r}, lm-pretrain "
                                  "needs 'text-corpus'", path=root / "dataset.json",
                                  where="field 'kind'")
        splits = manifest.get("splits", {})
        if not isinstance(splits, dict) or not all(isinstance(v, dict) for v in splits.values()):
            raise ForgebenchError("must map each split to {\"file\": NAME}",
                                  path=root / "dataset.json", where="field 'splits'")
        names.update({s: v.get("file") for s, v in splits.items()})
    files = {split: dataset_file(root, name, root / "dataset.json", f"splits.{split}.file")
             for split, name in names.items()}
    for split in ("train", "val"):
        if not files[split].is_file():
            raise ForgebenchError(f"the {split} split file is missing", path=files[split],
                                  where="field 'data.dir'",
                                  hint=f"the corpus folder needs {names[split]}")
    return files


def data_manifest(config: LMPretrainConfig) -> dict:
    """The corpus files and their SHA-256: what resume re-validates."""
    files = corpus_files(config)
    root = config.resolve_path(config.data.dir, "field 'data.dir'")
    for split in ("train", "val"):
        read_split(config, split)  # refuse an empty or non-UTF-8 split before the run starts
    hashed = {p.name: sha256_file(p) for p in files.values() if p.is_file()}
    if (root / "dataset.json").is_file():
        hashed["dataset.json"] = sha256_file(root / "dataset.json")
    return {"dataset": str(root), "files": hashed}


def read_split(config: LMPretrainConfig, split: str) -> str:
    path = corpus_files(config)[split]
    if not path.is_file():
        raise ForgebenchError(f"the {split} split file is missing", path=path,
                              where="field 'data.dir'")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ForgebenchError(f"not UTF-8 text (byte {exc.start})", path=path) from None
    if not text.strip():
        raise ForgebenchError(f"the {split} split is empty", path=path, where="field 'data.dir'",
                              hint="put training text in it, or generate a corpus")
    return text


def token_stream(tokenizer, text: str) -> torch.Tensor:
    """<bos> + the text's tokens, so that every byte of the text is predicted once."""
    return torch.tensor([tokenizer.bos_id] + tokenizer.encode(text), dtype=torch.long)


def windows(stream: torch.Tensor, context: int) -> torch.Tensor:
    """Non-overlapping windows [N, context + 1]; window i predicts stream[i*c+1 : i*c+c+1]."""
    n = max((len(stream) - 1) // context, 0)
    if n == 0:
        return torch.empty(0, context + 1, dtype=torch.long)
    return torch.stack([stream[i * context: i * context + context + 1] for i in range(n)])


# -- model --------------------------------------------------------------------------------
def build_model(config: LMPretrainConfig, vocab_size: int) -> Llama:
    m = config.model
    return Llama(LlamaConfig(vocab_size=vocab_size, dim=m.dim, n_layers=m.n_layers,
                             n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, ffn_dim=m.ffn_dim,
                             norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                             max_seq_len=m.context, tie_embeddings=m.tie_embeddings,
                             rope_type="norm"))


def load_model(run: RunDir, checkpoint: Checkpoint) -> tuple[Llama, object, LMPretrainConfig]:
    """(model in eval mode, tokenizer, config) from a committed checkpoint."""
    config = run_config(run)
    tokenizer = tokenizer_from_json((checkpoint.path / TOKENIZER_FILE).read_text("utf-8"),
                                    checkpoint.path / TOKENIZER_FILE)
    model = build_model(config, tokenizer.vocab_size)
    tensors, _, _ = load_checkpoint(checkpoint)
    model.load_state_dict(tensors)
    return model.eval(), tokenizer, config


# -- evaluation ---------------------------------------------------------------------------
@dataclass
class EvalResult:
    loss: float      # nats per token
    bpb: float       # bits per byte of the original text
    tokens: int
    bytes: int


@torch.no_grad()
def bits_per_byte(model: Llama, tokenizer, text: str, config: LMPretrainConfig,
                  max_windows: int = 0, precision: str = "f32") -> EvalResult:
    """Sum of next-token cross-entropy over the text (in context windows) / ln 2 / bytes,
    computed in `precision` (the run's: engine.train.precision.run_precision).

    Every token after <bos> is predicted exactly once, so over a whole split the bytes counted
    equal the text's UTF-8 length whatever the tokenizer.
    """
    stream = token_stream(tokenizer, text)
    byte_len = torch.tensor(tokenizer.byte_lengths(), dtype=torch.long)
    context = config.model.context
    pieces = [stream[s: s + context + 1] for s in range(0, len(stream) - 1, context)]
    if max_windows:
        pieces = pieces[:max_windows]
    full = [p for p in pieces if len(p) == context + 1]
    batches = [torch.stack(full[i: i + config.eval.batch_size])
               for i in range(0, len(full), config.eval.batch_size)]
    batches += [p[None] for p in pieces if len(p) != context + 1]  # the ragged last window
    nats, tokens, n_bytes = 0.0, 0, 0
    device = module_device(model)
    for batch in batches:                                          # [B, T+1]
        batch = to_device(batch, device)
        with autocast(precision, device.type):
            logits = model(batch[:, :-1])                          # [B, T, V]
        targets = batch[:, 1:]
        nats += float(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                      reduction="sum"))
        tokens += targets.numel()
        n_bytes += int(byte_len[targets.cpu()].sum())
    return EvalResult(nats / tokens, nats / math.log(2) / n_bytes, tokens, n_bytes)


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Bits per byte of a checkpoint on the whole val or test split; writes
    evals/<split>-<checkpoint>.json and a metrics line."""
    model, tokenizer, config = load_model(run, checkpoint)
    result = bits_per_byte(model, tokenizer, read_split(config, split), config,
                           precision=run_precision(run, config))
    return write_eval_record(run, checkpoint, split, {
        "loss": result.loss, "bpb": result.bpb, "tokens": result.tokens, "bytes": result.bytes})


# -- generation ---------------------------------------------------------------------------
@torch.no_grad()
def complete(model: Llama, tokenizer, prompt: str, *, max_tokens: int,
             settings: SamplingSettings, seed: int, stop: list[str] = ()) -> str:
    """KV-cached continuation of `prompt` (the window is the trained context length)."""
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    context = model.config.max_seq_len
    if len(ids) >= context:
        raise ForgebenchError(f"prompt is {len(ids)} tokens; the model sees {context}",
                              where="--prompt", hint="shorten the prompt")
    max_tokens = min(max_tokens, context - len(ids))
    cache = model.new_cache(1, len(ids) + max_tokens)

    device = module_device(model)

    def step(new_ids: list[int], start_pos: int) -> torch.Tensor:
        h = model.hidden(torch.tensor([new_ids], device=device), start_pos=start_pos,
                         cache=cache)
        return model.logits(h[0, -1]).cpu()                            # [V]

    def hit_stop(out: list[int]) -> bool:
        return any(s in tokenizer.decode(out) for s in stop)

    generator = torch.Generator().manual_seed(seed)
    out = generate_tokens(step, ids, max_new_tokens=max_tokens, settings=settings,
                          generator=generator, stop_ids=[tokenizer.eos_id],
                          should_stop=hit_stop if stop else None)
    text = tokenizer.decode(out)
    for s in stop:
        text = text.split(s)[0] if s in text else text
    return text


def generate(run: RunDir, checkpoint: Checkpoint, args) -> dict:
    model, tokenizer, _ = load_model(run, checkpoint)
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p,
                                args.repetition_penalty)
    text = complete(model, tokenizer, args.prompt, max_tokens=args.max_tokens,
                    settings=settings, seed=args.seed, stop=args.stop)
    return {"prompt": args.prompt, "text": text, "checkpoint": checkpoint.name,
            "seed": args.seed, "settings": settings.as_dict()}


def write_samples(run: RunDir, checkpoint: Checkpoint, model: Llama, tokenizer,
                  config: LMPretrainConfig, seed: int, n: int = 1,
                  out_dir: Path | None = None) -> list[Path]:
    """samples/<checkpoint>/samples.jsonl (prompt, seed, text per line) + its JSON sidecar."""
    s = config.sample
    settings = SamplingSettings(s.temperature, s.top_k, s.top_p)
    lines = []
    for prompt in s.prompts:
        for i in range(n):
            text = complete(model, tokenizer, prompt, max_tokens=s.max_tokens,
                            settings=settings, seed=seed + i)
            lines.append({"prompt": prompt, "seed": seed + i, "text": text})
    out = Path(out_dir) if out_dir else run.samples_dir / checkpoint.name
    path = out / "samples.jsonl"
    atomic_write_text(path, "".join(json.dumps(x) + "\n" for x in lines))
    atomic_write_json(out / "samples.json", {
        "checkpoint": checkpoint.name, "step": checkpoint.step, "run": str(run.path),
        "settings": settings.as_dict(), "max_tokens": s.max_tokens, "seed": seed,
        "model": {"recipe": "lm-pretrain", **config.model.model_dump()},
        "tokenizer": tokenizer.kind})
    run.log_event("sample_written", checkpoint=checkpoint.name, path=str(path))
    return [path]


def sample(run: RunDir, checkpoint: Checkpoint, args) -> list[Path]:
    model, tokenizer, config = load_model(run, checkpoint)
    return write_samples(run, checkpoint, model, tokenizer, config, args.seed, args.n,
                         Path(args.out) if args.out else None)


# -- training -----------------------------------------------------------------------------
def train(job: Job) -> None:
    config: LMPretrainConfig = job.config
    run, opt, tr = job.run, config.optim, config.train
    device, world = job.device, job.world
    precision = run_precision(run, config)          # "auto" was resolved when the run started
    require_bf16(precision, device, "field 'train.precision'")
    torch.manual_seed(config.seed)

    # Tokenizer: trained once at the start, then always read back from the checkpoint.
    train_text = read_split(config, "train")
    val_text = read_split(config, "val")
    if job.resume_from:
        tokenizer_json = (job.resume_from.path / TOKENIZER_FILE).read_text("utf-8")
        tokenizer = tokenizer_from_json(tokenizer_json, job.resume_from.path / TOKENIZER_FILE)
    else:
        tokenizer = (BPETokenizer.train([train_text], config.tokenizer.vocab_size)
                     if config.tokenizer.kind == "bpe" else ByteTokenizer())
        tokenizer_json = tokenizer.to_json()
        if world.is_main:     # every rank trained the same tokenizer; rank 0 owns the run
            atomic_write_text(run.path / TOKENIZER_FILE, tokenizer_json)

    train_windows = windows(token_stream(tokenizer, train_text), config.model.context)
    if len(train_windows) == 0:  # [N, T+1]
        raise ForgebenchError(
            f"the train split holds fewer than {config.model.context + 1} tokens, not one "
            "training window", path=corpus_files(config)["train"],
            hint="add text or lower model.context")
    model = build_model(config, tokenizer.vocab_size).to(device)
    optimizer = adamw_for(model.named_parameters(), opt)
    cursor = DataCursor(len(train_windows), config.seed)
    step, skipped_total, elapsed_before, best = 0, 0, 0.0, None
    if job.resume_from:
        tensors, optimizer_state, state = load_checkpoint(job.resume_from)
        model.load_state_dict(tensors)
        optimizer.load_state_dict(optimizer_state)
        cursor, step, skipped_total, elapsed_before = resume_loop(state)
        best = state["best"]

    def checkpoint_now() -> Checkpoint:
        job.stage = "save"
        trainer_state = {**loop_state(cursor, skipped_total, clock.elapsed),
                         "best": best, "invocation": job.invocation}
        return save_checkpoint(run, step, model_tensors=model.state_dict(), optimizer=optimizer,
                               trainer_state=trainer_state,
                               extra_files={TOKENIZER_FILE: tokenizer_json.encode("utf-8")},
                               keep_last=config.keep_last,
                               protect=(best["checkpoint"],) if best else ())

    def evaluate_val() -> None:
        nonlocal best
        job.stage = "eval"
        model.eval()
        result = bits_per_byte(model, tokenizer, val_text, config, config.eval.max_windows,
                               precision)
        model.train()
        run.log_metric({"invocation": job.invocation, "step": step, "split": "val",
                        "loss": result.loss, "bpb": result.bpb, "tokens": result.tokens,
                        "bytes": result.bytes, "elapsed_s": clock.elapsed})
        if best is None or result.loss < best["loss"]:
            best = {"checkpoint": f"step-{step:06d}", "loss": result.loss, "bpb": result.bpb}
            run.set_status(run.status().get("state", "running"),
                           best_checkpoint=best["checkpoint"])

    utilisation = StepUtilisation(precision, job.threads)
    clock = StepClock(elapsed_before)
    last = job.resume_from
    tokens_per_step = tr.batch_size * tr.grad_accum * config.model.context
    # DDP over the ranks (each trains its share of every micro-batch); the model itself alone
    trained = distributed.data_parallel(model, world, device)
    model.train()
    bar = job.progress(config.steps, initial=step)
    while step < config.steps and not job.stop_requested:
        lr = scheduled_lr(opt, step, config.steps)
        set_lr(optimizer, lr)
        window = WindowLoss()
        utilisation.begin()
        for micro in range(tr.grad_accum):
            job.stage = "forward"
            mine = distributed.shard(cursor.take(tr.batch_size), world, "micro-batch",
                                     "field 'train.batch_size'")
            batch = to_device(train_windows[mine], device)             # [B / ranks, T+1]
            inputs, targets = batch[:, :-1], batch[:, 1:]
            with distributed.accumulating(trained, last=micro == tr.grad_accum - 1):
                with autocast(precision, device.type):
                    logits = trained(inputs)                           # [B, T, V]
                loss_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                           reduction="sum")
                job.stage = "backward"
                # token-weighted over the whole window of every rank (gradients are summed)
                (loss_sum / tokens_per_step).backward()
            window.add(loss_sum.detach().double(), targets.numel())   # no host sync here
        window = distributed.reduce_window(window, world, device)
        job.stage = "optimizer"
        outcome = clip_and_step(model.parameters(), optimizer, opt.grad_clip, config.nonfinite,
                                loss=window.value)
        skipped_total += outcome.skipped
        step += 1
        tokens_per_s = clock.tick(window.tokens)
        flops = utilisation.step(window.tokens, clock.seconds)
        if step % config.log_every == 0 or step == config.steps:
            run.log_metric(train_row(
                invocation=job.invocation, step=step, loss=window.value, outcome=outcome,
                skipped_total=skipped_total, lr=lr, elapsed_s=clock.elapsed,
                input_tokens=tokens_per_step, supervised_tokens=window.tokens,
                tokens_per_s=tokens_per_s, utilisation=flops,
                **distributed.rank_throughput(tokens_per_s, world)))
        bar.update(1)
        bar.set_postfix(loss=f"{window.value:.3f}", lr=f"{lr:.2e}")
        job.step_done(step)
        eval_due = config.eval_every and step % config.eval_every == 0
        if (eval_due or step == config.steps) and world.is_main:
            evaluate_val()
        if checkpoint_due(config, step, job.stop_requested, eval_due):
            last = checkpoint_now()
    bar.close()

    if step == config.steps and last is not None and not job.stop_requested and world.is_main:
        job.stage = "sample"
        model.eval()
        write_samples(run, last, model, tokenizer, config, config.seed)
