"""lm-pretrain: a tiny decoder (Llama architecture, or nanochat's GPT) trained from random
weights on a text corpus.

Reads top to bottom: corpus -> tokenizer -> windows -> model -> optimizer (AdamW, or nanochat's
MuonAdamW) -> loop (accumulate, clip, step, log, evaluate, checkpoint) -> final eval and
samples. Evaluation reports bits per
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
from engine.jobs import Job
from engine.models.llama import Llama
from engine.nanochat_tokenizer import NanochatTokenizer
from engine.paths import dataset_file
from engine.recipes.lm_pretrain_config import LMPretrainConfig
from engine.rundir import Checkpoint, RunDir
from engine.sampling import SamplingSettings, generate_tokens
from engine.text_tokenizers import BPETokenizer, ByteTokenizer, tokenizer_from_json
from engine.train import distributed
from engine.train.bos_bestfit import bos_bestfit_rows, document_batches, text_documents
from engine.train.checkpoint import load_checkpoint, save_checkpoint
from engine.train.devices import module_device, require_bf16, to_device
from engine.train.lm_loop import LoopState, StepLoop, StepResult, accumulate, optimizer_step
from engine.train.metrics import write_eval_record
from engine.train.muon import pretrain_optimizer, schedule_muon
from engine.train.optim import adamw_for
from engine.train.precision import autocast, run_precision
from engine.train.pretrain_model import (  # noqa: F401 (load_model: the export hook)
    TOKENIZER_FILE,
    build_model,
    load_model,
)

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
                            settings=settings, seed=seed + i, stop=s.stop)
            lines.append({"prompt": prompt, "seed": seed + i, "text": text})
    out = Path(out_dir) if out_dir else run.samples_dir / checkpoint.name
    path = out / "samples.jsonl"
    atomic_write_text(path, "".join(json.dumps(x) + "\n" for x in lines))
    atomic_write_json(out / "samples.json", {
        "checkpoint": checkpoint.name, "step": checkpoint.step, "run": str(run.path),
        "settings": settings.as_dict(), "max_tokens": s.max_tokens, "stop": s.stop, "seed": seed,
        "model": {"recipe": "lm-pretrain", **config.model.model_dump()},
        "tokenizer": tokenizer.kind})
    run.log_event("sample_written", checkpoint=checkpoint.name, path=str(path))
    return [path]


def sample(run: RunDir, checkpoint: Checkpoint, args) -> list[Path]:
    model, tokenizer, config = load_model(run, checkpoint)
    return write_samples(run, checkpoint, model, tokenizer, config, args.seed, args.n,
                         Path(args.out) if args.out else None)


# -- training -----------------------------------------------------------------------------
def train_tokenizer(job: Job, train_text: str):
    """(tokenizer, its JSON): trained once at the start, then always read back from the
    checkpoint."""
    config, run = job.config, job.run
    if job.resume_from:
        tokenizer_json = (job.resume_from.path / TOKENIZER_FILE).read_text("utf-8")
        return tokenizer_from_json(tokenizer_json, job.resume_from.path / TOKENIZER_FILE), \
            tokenizer_json
    trainers = {"bpe": BPETokenizer.train, "nanochat": NanochatTokenizer.train}
    tokenizer = (trainers[config.tokenizer.kind]([train_text], config.tokenizer.vocab_size)
                 if config.tokenizer.kind in trainers else ByteTokenizer())
    tokenizer_json = tokenizer.to_json()
    if job.world.is_main:     # every rank trained the same tokenizer; rank 0 owns the run
        atomic_write_text(run.path / TOKENIZER_FILE, tokenizer_json)
    return tokenizer, tokenizer_json


def train_windows_of(config: LMPretrainConfig, tokenizer, train_text: str) -> torch.Tensor:
    """The training windows [N, T+1]; refuses a split shorter than one window."""
    if config.data.packing == "bos_bestfit":
        return packed_rows(config, tokenizer, train_text)
    found = windows(token_stream(tokenizer, train_text), config.model.context)
    if len(found) == 0:
        raise ForgebenchError(
            f"the train split holds fewer than {config.model.context + 1} tokens, not one "
            "training window", path=corpus_files(config)["train"],
            hint="add text or lower model.context")
    return found


def packed_rows(config: LMPretrainConfig, tokenizer, train_text: str) -> torch.Tensor:
    """nanochat's BOS-aligned best-fit rows [N, T+1] (engine/train/bos_bestfit.py, at its
    loader's defaults: 1000 buffered documents, tokenized 128 at a time), as many as the split's
    tokens fill (at least one); the sampler then draws them as it draws windows."""
    docs = [[tokenizer.bos_id] + tokenizer.encode(d) for d in text_documents(train_text)]
    if not docs:
        raise ForgebenchError("the train split has no non-blank line, no document to pack",
                              path=corpus_files(config)["train"], hint="add text")
    capacity = config.model.context + 1
    n = max(sum(len(d) for d in docs) // capacity, 1)
    rows = bos_bestfit_rows(document_batches(docs, 128), 1, config.model.context, 1000)
    return torch.cat([next(rows) for _ in range(n)])


def train(job: Job) -> None:
    config: LMPretrainConfig = job.config
    run, opt = job.run, config.optim
    device, world = job.device, job.world
    precision = run_precision(run, config)          # "auto" was resolved when the run started
    require_bf16(precision, device, "field 'train.precision'")
    torch.manual_seed(config.seed)
    train_text, val_text = read_split(config, "train"), read_split(config, "val")
    tokenizer, tokenizer_json = train_tokenizer(job, train_text)
    train_windows = train_windows_of(config, tokenizer, train_text)
    model = build_model(config, tokenizer.vocab_size, precision).to(device)
    optimizer = build_optimizer(config, model)
    state = LoopState.fresh(len(train_windows), config.seed)
    if job.resume_from:
        tensors, optimizer_state, trainer_state = load_checkpoint(job.resume_from)
        model.load_state_dict(tensors)
        optimizer.load_state_dict(optimizer_state)
        state.resume(trainer_state)

    def save() -> Checkpoint:
        best = state.best
        return save_checkpoint(run, state.step, model_tensors=model.state_dict(),
                               optimizer=optimizer,
                               trainer_state=state.trainer_state(best=best,
                                                                 invocation=job.invocation),
                               extra_files={TOKENIZER_FILE: tokenizer_json.encode("utf-8")},
                               keep_last=config.keep_last,
                               protect=(best["checkpoint"],) if best else ())

    # DDP over the ranks (each trains its share of every micro-batch); the model itself alone
    trained = distributed.data_parallel(model, world, device)
    loop = StepLoop(job, state, save, val_evaluator(job, state, model, tokenizer, val_text),
                    opt, optimizer, precision=precision, last=job.resume_from)
    model.train()
    loop.run(pretrain_step(job, state, model, trained, train_windows, optimizer))
    if loop.finished() and loop.last is not None and world.is_main:
        job.stage = "sample"
        model.eval()
        write_samples(run, loop.last, model, tokenizer, config, config.seed)


def build_optimizer(config: LMPretrainConfig, model):
    """AdamW over every weight, or nanochat's MuonAdamW (optim.kind = "muon")."""
    opt, tr = config.optim, config.train
    if opt.kind == "muon":
        tokens_per_step = tr.batch_size * tr.grad_accum * config.model.context
        return pretrain_optimizer(model, opt, tokens_per_step, config.steps)
    return adamw_for(model.named_parameters(), opt)


def val_evaluator(job: Job, state: LoopState, model: Llama, tokenizer, val_text: str):
    """The loop's evaluation: bits per byte on val (up to eval.max_windows), a val row, and
    the best checkpoint so far (lowest val loss)."""
    config, run = job.config, job.run
    precision = run_precision(run, config)

    def evaluate_val() -> None:
        model.eval()
        result = bits_per_byte(model, tokenizer, val_text, config, config.eval.max_windows,
                               precision)
        model.train()
        run.log_metric({"invocation": job.invocation, "step": state.step, "split": "val",
                        "loss": result.loss, "bpb": result.bpb, "tokens": result.tokens,
                        "bytes": result.bytes, "elapsed_s": state.elapsed})
        if state.best is None or result.loss < state.best["loss"]:
            state.best = {"checkpoint": f"step-{state.step:06d}", "loss": result.loss,
                          "bpb": result.bpb}
            run.set_status(run.status().get("state", "running"),
                           best_checkpoint=state.best["checkpoint"])

    return evaluate_val


def pretrain_step(job: Job, state: LoopState, model: Llama, trained, train_windows,
                  optimizer):
    """One step of lm-pretrain: `grad_accum` micro-batches of windows (this rank's share of
    each), the summed CE divided by the step's tokens over every rank."""
    config, device, world = job.config, job.device, job.world
    tr, precision = config.train, run_precision(job.run, config)
    tokens_per_step = tr.batch_size * tr.grad_accum * config.model.context

    def micro_step(_micro: int, mine: list[int]):
        batch = to_device(train_windows[mine], device)             # [B / ranks, T+1]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast(precision, device.type):
            logits = trained(inputs)                               # [B, T, V]
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                               reduction="sum"), targets.numel()

    def step(step_index: int, lr: float) -> StepResult:
        if config.optim.kind == "muon":
            schedule_muon(optimizer, step_index)      # Muon's momentum and weight decay
        batches = [distributed.shard(state.cursor.take(tr.batch_size), world, "micro-batch",
                                     "field 'train.batch_size'") for _ in range(tr.grad_accum)]
        # token-weighted over the whole window of every rank (gradients are summed)
        window = accumulate(job, batches, micro_step, tokens_per_step, trained)
        outcome = optimizer_step(job, model.parameters(), optimizer, config.optim.grad_clip,
                                 window.value)
        return StepResult(window.value, outcome, window.tokens,
                          {"input_tokens": tokens_per_step, "supervised_tokens": window.tokens},
                          flops_work=window.tokens,
                          postfix={"loss": f"{window.value:.3f}", "lr": f"{lr:.2e}"})

    return step
