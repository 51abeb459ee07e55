"""lm-cartridge: a trained KV prefix (a *cartridge*, Eyuboglu et al., arXiv 2506.06266) that
stands in for a corpus in the context of a frozen GGUF base. No weight of the base changes; the
artifact is `cartridge.safetensors` (per-layer K and V rows, tied to the base's SHA-256).

Reads top to bottom: base model (f32 numerics, frozen) -> corpus (text files, documents JSONL or
text-corpus folders, joined) -> self-study data (engine/cartridge/self_study.py: chunks, the six
seed prompt families, messages and answers sampled with the engine's generator, the teacher's
top-k log-probs; cached in the run folder as `self_study.safetensors`, extended sample by
sample, so a stopped synthesis continues where it was) -> the rows (the prefill KV of the
framed corpus's first p tokens, keys rotated at positions 0..p-1; the first `frozen_rows` kept
as they are: row 0 is BOS, the attention sink) -> AdamW over the rows only -> loop (a window of
conversations per step; each read after the rows, its summed top-k distillation loss divided by
the window's answer tokens; clipped once, one AdamW step) -> checkpoint (the cartridge file,
the optimizer state, trainer_state.json last) -> the held-out comparison.

RoPE: the rows are cache rows, so their keys carry their rotation already; the conversation
after them takes positions p onward (its BOS is row 0: engine/cartridge/prefix.py).

The held-out comparison (`evals/cartridge-<checkpoint>.json` and `.md`): the hand-written
questions of `eval.questions` and the `self_study.held_out` generated ones, each read by the
base without the document, with the whole corpus in context, and with the cartridge: the
reference answer's log-likelihood, a greedy answer, the KV positions (and f16 bytes) of the
document part, and the time to first token. `forgebench eval RUN` writes it again for any
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from engine.cartridge.prefix import (
    CARTRIDGE_FILE,
    CartridgeModel,
    cartridge_bytes,
    leading_bos,
    load_cartridge,
    prefill_rows,
)
from engine.cartridge.self_study import (
    compare,
    context_ids,
    distillation_loss,
    load_conversations,
    report_markdown,
    save_conversations,
    synthesize_one,
)
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_text, sha256_bytes, sha256_file
from engine.jobs import Job, run_config
from engine.llm.sft_data import jsonl_records
from engine.recipes.lm_cartridge_config import LMCartridgeConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.checkpoint import load_checkpoint, save_checkpoint
from engine.train.lm_base import Base, generate_answer, load_base, require_same_base, size_text
from engine.train.lm_loop import LoopState, StepLoop, StepResult, accumulate, optimizer_step
from engine.train.optim import adamw_for

SELF_STUDY_FILE = "self_study.safetensors"


# -- base and corpus ------------------------------------------------------------------------
def base_model(config: LMCartridgeConfig) -> Path:
    return config.resolve_path(config.model.gguf, "field 'model.gguf'")


def corpus_text(config: LMCartridgeConfig) -> str:
    """The corpus: every document of every path, in order, separated by a blank line."""
    from engine.llm.documents import load_documents

    documents = []
    for number, value in enumerate(config.corpus.paths):
        path = config.resolve_path(value, f"field 'corpus.paths' item {number + 1}")
        documents += load_documents(path, config.corpus.text_key)
    return "\n\n".join(d.strip() for d in documents)


def held_out_questions(config: LMCartridgeConfig) -> list[dict]:
    """The hand-written {question, answer} lines of `eval.questions` (checked line by line)."""
    if not config.eval.questions:
        return []
    path = config.resolve_path(config.eval.questions, "field 'eval.questions'")
    out = []
    for number, record in jsonl_records(path, "held-out questions file"):
        for key in ("question", "answer"):
            if not isinstance(record.get(key), str) or not record[key].strip():
                raise ForgebenchError(f"field '{key}' must be a non-empty string", path=path,
                                      where=f"line {number}",
                                      hint='one {"question": "...", "answer": "..."} per line')
        out.append({"question": record["question"], "answer": record["answer"],
                    "source": "hand-written"})
    return out


def data_manifest(config: LMCartridgeConfig) -> dict:
    """The corpus (and held-out questions) with their SHA-256, read and checked before a run
    folder exists."""
    text = corpus_text(config)
    held_out_questions(config)
    files = {}
    for value in config.corpus.paths:
        path = config.resolve_path(value, "field 'corpus.paths'")
        files[f"corpus:{path.name}"] = (sha256_file(path) if path.is_file() else "folder")
    if config.eval.questions:
        path = config.resolve_path(config.eval.questions, "field 'eval.questions'")
        files[f"questions:{path.name}"] = sha256_file(path)
    return {"files": files, "corpus_sha256": sha256_bytes(text.encode("utf-8")),
            "corpus_chars": len(text)}


# -- self-study data ------------------------------------------------------------------------
def self_study_key(config: LMCartridgeConfig, base_sha: str, corpus_sha: str) -> str:
    """What the synthetic data depends on: a cached file with another key is made again."""
    wanted = {"base": base_sha, "corpus": corpus_sha, "seed": config.seed,
              "self_study": config.self_study.model_dump(mode="json", exclude={"samples",
                                                                               "held_out"})}
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()


def serving_model(base: Base):
    """The base as generate and chat serve it (llama.cpp numerics, f32 dense cache, the C
    forward): what samples the self-study conversations and answers the held-out questions."""
    from engine.models.gguf_model import load_gguf_model

    return load_gguf_model(base.path, numerics="llamacpp", weights="dense-cache",
                           tokenizer=False)[0] if not base.dense else base.model


def self_study_data(job: Job, base: Base, sampler, corpus_ids: list[int], key: str) -> list:
    """The run's conversations (training + held out), synthesised once and cached; a cache of
    fewer conversations (a stopped synthesis, or more asked on resume) is extended."""
    config, path = job.config, job.run.path / SELF_STUDY_FILE
    wanted = config.self_study.samples + config.self_study.held_out
    have = []
    if path.is_file():
        have, meta = load_conversations(path)
        if meta.get("key") != key:
            job.run.log_event("self_study_discarded", reason="the base, corpus or settings "
                                                             "changed")
            have = []
    for index in range(len(have), wanted):
        if job.stop_requested:             # keep what is made; a resume goes on from there
            save_conversations(path, have, {"key": key})
            break
        job.announce("self-study", f"synthesising conversation {index + 1} of {wanted}")
        have.append(synthesize_one(base, sampler, corpus_ids, config.self_study, index,
                                   config.seed))
        if (index + 1) % 4 == 0 or index + 1 == wanted:     # a stop loses at most 3
            save_conversations(path, have, {"key": key})
    if len(have) == wanted:
        job.run.log_event("self_study_ready", conversations=wanted,
                          answer_tokens=sum(len(c.answer_ids) for c in have),
                          families={f: sum(c.family == f for c in have)
                                    for f in config.self_study.families})
    return have[:wanted]


# -- the rows -------------------------------------------------------------------------------
class CartridgeRows(torch.nn.Module):
    """The p rows per layer: the first `frozen` kept as buffers, the rest parameters."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], frozen: int):
        super().__init__()
        self.frozen = frozen
        for i, (k, v) in enumerate(zip(keys, values)):            # [n_kv, p, head_dim]
            self.register_buffer(f"k_frozen_{i}", k[:, :frozen].detach().clone())
            self.register_buffer(f"v_frozen_{i}", v[:, :frozen].detach().clone())
            self.register_parameter(f"k_{i}", torch.nn.Parameter(k[:, frozen:].detach().clone()))
            self.register_parameter(f"v_{i}", torch.nn.Parameter(v[:, frozen:].detach().clone()))
        self.layers = len(keys)

    def rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys = [torch.cat([getattr(self, f"k_frozen_{i}"), getattr(self, f"k_{i}")], dim=1)
                for i in range(self.layers)]
        values = [torch.cat([getattr(self, f"v_frozen_{i}"), getattr(self, f"v_{i}")], dim=1)
                  for i in range(self.layers)]
        return keys, values


def cartridge_meta(config: LMCartridgeConfig, base: Base, base_sha: str, manifest: dict,
                   step: int) -> dict:
    """What travels in the cartridge file beside the rows."""
    return {"base_sha256": base_sha, "base_name": base.path.name, "tokens":
            config.cartridge.tokens, "frozen_rows": config.cartridge.frozen_rows,
            "leading_bos": leading_bos(base.tokenizer),
            "corpus_sha256": manifest["data"]["corpus_sha256"], "step": step,
            "recipe": "lm-cartridge", "config": config.model_dump(
                mode="json", include={"cartridge", "self_study", "optim", "train", "seed",
                                      "steps"})}


# -- training -------------------------------------------------------------------------------
def initial_rows(job: Job, config: LMCartridgeConfig, base: Base, text: str) -> CartridgeRows:
    """The cartridge before training: the base's keys and values of the corpus's first
    `cartridge.tokens` tokens (Cartridges' prefix initialisation)."""
    initial = context_ids(base.tokenizer, text)[:config.cartridge.tokens]
    if len(initial) < config.cartridge.tokens:
        raise ForgebenchError(f"the corpus gives {len(initial)} tokens; the cartridge wants "
                              f"{config.cartridge.tokens} rows", where="field 'cartridge.tokens'",
                              hint="lower cartridge.tokens or give a longer corpus")
    job.announce("loading", f"initialising {len(initial)} rows from the corpus's prefill")
    keys, values = prefill_rows(base.model, initial)
    return CartridgeRows(keys, values, config.cartridge.frozen_rows)


def train(job: Job) -> None:
    config: LMCartridgeConfig = job.config
    run, tr = job.run, config.train
    torch.manual_seed(config.seed)
    manifest = run.manifest()
    base_sha = manifest["base_model"]["sha256"]
    job.announce("loading", f"loading base {size_text(base_model(config))}")
    base = load_base(config, "f32")
    base.model.eval()
    text = corpus_text(config)
    corpus_ids = base.tokenizer.encode(text, add_special=False, parse_special=False)
    sampler = serving_model(base)
    conversations = self_study_data(job, base, sampler, corpus_ids, self_study_key(
        config, base_sha, manifest["data"]["corpus_sha256"]))
    if job.stop_requested:              # stopped while synthesising: nothing to train yet
        return
    samples = conversations[:config.self_study.samples]
    rows = initial_rows(job, config, base, text)
    state = LoopState.fresh(len(samples), config.seed)
    optimizer = adamw_for(list(rows.named_parameters()), config.optim)
    if job.resume_from:
        _, optimizer_state, trainer_state = load_checkpoint(job.resume_from)
        saved = load_cartridge(job.resume_from.path / CARTRIDGE_FILE, base_sha)
        rows = CartridgeRows(saved.keys, saved.values, config.cartridge.frozen_rows)
        optimizer = adamw_for(list(rows.named_parameters()), config.optim)
        optimizer.load_state_dict(optimizer_state)
        state.resume(trainer_state)
    bos = base.tokenizer.bos_id if leading_bos(base.tokenizer) else None

    def save() -> Checkpoint:
        meta = cartridge_meta(config, base, base_sha, manifest, state.step)
        return save_checkpoint(run, state.step, model_tensors={}, optimizer=optimizer,
                               trainer_state=state.trainer_state(
                                   invocation=job.invocation, base_sha256=base_sha,
                                   cartridge={k: meta[k] for k in ("tokens", "frozen_rows")}),
                               keep_last=config.keep_last,
                               extra_files={CARTRIDGE_FILE: cartridge_bytes(*rows.rows(), meta)})

    def micro_step(_micro: int, sample):
        return distillation_loss(CartridgeModel(base.model, *rows.rows(), bos), sample)

    def step(_step: int, lr: float) -> StepResult:
        window = [samples[i] for i in state.cursor.take(tr.window)]
        answer_tokens = sum(len(s.answer_ids) for s in window)
        loss = accumulate(job, window, micro_step, answer_tokens)
        outcome = optimizer_step(job, list(rows.parameters()), optimizer,
                                 config.optim.grad_clip, loss.value)
        return StepResult(loss.value, outcome, loss.tokens, {"answer_tokens": loss.tokens},
                          postfix={"loss": f"{loss.value:.4f}", "lr": f"{lr:.2e}"})

    loop = StepLoop(job, state, save, optim=config.optim, optimizer=optimizer)
    loop.run(step)
    if loop.finished():
        write_comparison(job.run, loop.last, base, sampler, config, conversations, text,
                         job.announce)


# -- the held-out comparison ----------------------------------------------------------------
def comparison_questions(config: LMCartridgeConfig, base: Base, conversations: list) -> list:
    """The hand-written questions, then the held-out generated ones (their teacher's answer as
    the reference)."""
    held = conversations[config.self_study.samples:]
    return held_out_questions(config) + [
        {"question": c.question, "answer": base.tokenizer.decode(c.answer_ids),
         "source": f"generated ({c.family})"} for c in held]


def write_comparison(run: RunDir, checkpoint: Checkpoint, base: Base, server,
                     config: LMCartridgeConfig, conversations: list, text: str,
                     announce) -> dict:
    """evals/cartridge-<checkpoint>.json and .md, and the summary as a metrics line: scored in
    f32 numerics (`base`), answered and timed as served (`server`)."""
    student = cartridge_model(run, checkpoint, base.model, base.tokenizer)
    scoring = {"no document": base.model, "whole document": base.model, "cartridge": student}
    serving = {"no document": server, "whole document": server,
               "cartridge": cartridge_model(run, checkpoint, server, base.tokenizer)}
    questions = comparison_questions(config, base, conversations)
    result = compare(base, scoring, serving, text, questions, config.eval.max_tokens,
                     student.tokens,
                     progress=lambda done, total: announce(
                         "eval", f"held-out comparison: question {done} of {total}"))
    record = {"split": "heldout", "checkpoint": checkpoint.name, "step": checkpoint.step,
              **result}
    run.write_eval(f"cartridge-{checkpoint.name}", record)
    atomic_write_text(run.evals_dir / f"cartridge-{checkpoint.name}.md",
                      report_markdown(result, checkpoint.name))
    flat = {f"{system.replace(' ', '_')}_{name}": value
            for system, values in result["systems"].items() for name, value in values.items()}
    run.log_metric({"split": "heldout", "checkpoint": checkpoint.name, "step": checkpoint.step,
                    **flat})
    return record


def cartridge_model(run: RunDir, checkpoint: Checkpoint, model, tokenizer) -> CartridgeModel:
    """`model` (the run's base) reading the checkpoint's cartridge (refused when it was
    trained on another base)."""
    cartridge = load_cartridge(checkpoint.path / CARTRIDGE_FILE,
                               run.manifest()["base_model"]["sha256"])
    return CartridgeModel.of(model, cartridge, tokenizer)


@torch.no_grad()
def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """`forgebench eval RUN`: the held-out comparison of a checkpoint (any split name)."""
    config = run_config(run)
    base = load_base(config, "f32")
    base.model.eval()
    require_same_base(base.path, run.manifest()["base_model"]["sha256"])
    conversations, _ = load_conversations(run.path / SELF_STUDY_FILE)
    return write_comparison(run, checkpoint, base, serving_model(base), config, conversations,
                            corpus_text(config), lambda *_: None)


# -- serving --------------------------------------------------------------------------------
def load_trained(run: RunDir, checkpoint: Checkpoint, base_path: Path | None = None,
                 precision: str = "f32") -> tuple[Base, LMCartridgeConfig]:
    """The base (or `base_path`, the same file found elsewhere) reading the checkpoint's
    cartridge, as a Base whose model is a CartridgeModel: chat, the server and generate serve
    it as a model of its own."""
    config = run_config(run)
    if base_path is not None:
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"gguf": str(base_path)})})
    base = load_base(config, precision)
    base.model.eval()
    require_same_base(base.path, run.manifest()["base_model"]["sha256"])
    base.model = cartridge_model(run, checkpoint, base.model, base.tokenizer)
    return base, config


def generate(run: RunDir, checkpoint: Checkpoint, args) -> dict:
    """`forgebench generate RUN`: an answer of the base reading the cartridge."""
    base, _ = load_trained(run, checkpoint)
    return generate_answer(base, checkpoint, False, args)

