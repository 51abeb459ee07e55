"""lm-sft: supervised fine-tuning of a language model — LoRA over a frozen (packed) GGUF base,
or full fine-tuning of a dense base (an f32/f16/bf16 GGUF or an lm-pretrain run's model).

Reads top to bottom: base model -> SFT samples (prompt masked) -> adapters or full weights ->
AdamW -> BEFORE generations -> loop (one token-weighted window per step: summed CE over the
window / its supervised tokens, clipped once, one AdamW step) -> checkpoint -> AFTER
generations. The LM head and cross-entropy run only at supervised positions, fused into one pass
over the frozen head (`linear_cross_entropy`): no [N, vocab] logits, and dh comes out of the
same pass. GGUF weights default to an f32 dense cache when it is small next to the RAM.

A LoRA checkpoint holds `adapters.safetensors` (rank, alpha, targets and the base's SHA-256 in
its metadata), the optimizer state and `trainer_state.json` (data cursor, RNG, step) last.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.jobs import Job, run_config
from engine.llm.sft_data import encode_sft_dataset, load_sft_examples
from engine.lora import ADAPTERS_FILE, adapter_bytes, describe_adapters, load_adapters
from engine.recipes.lm_sft_config import LMSFTConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from engine.train.data_order import DataCursor
from engine.train.lm_base import (
    Base,
    base_model,
    checkpoint_activations,
    generate_answer,
    load_base,
    load_policy,
    pack,
    prepare_trainable,
    size_text,
    write_generations,
)
from engine.train.loss import IGNORE, supervised_loss
from engine.train.metrics import StepClock, WindowLoss, train_row
from engine.train.optim import build_adamw, clip_and_step, lr_at, set_lr
from engine.train.precision import autocast


# -- data -----------------------------------------------------------------------------------
def data_source(config: LMSFTConfig, split: str = "train") -> Path:
    """The JSONL file of a split, or the text-sft dataset folder that holds every split."""
    field_name = {"train": "path", "val": "val_path", "test": "test_path"}[split]
    value = getattr(config.data, field_name)
    data_path = config.resolve_path(config.data.path, "field 'data.path'")
    if value is None and split != "train" and data_path.is_dir():
        value = config.data.path                # a dataset folder carries its own splits
    if value is None:
        raise ForgebenchError(f"the config names no {split} data",
                              where=f"field 'data.{field_name}'",
                              hint=f"add data.{field_name} = \"FILE.jsonl\"")
    path = config.resolve_path(value, f"field 'data.{field_name}'")
    if not path.exists():
        raise ForgebenchError("SFT data not found", path=path, where=f"field 'data.{field_name}'",
                              hint="a JSONL file, or a text-sft dataset folder")
    return path


def data_manifest(config: LMSFTConfig) -> dict:
    """The data files and their SHA-256: what resume re-validates."""
    from engine.data.dataset import load_dataset

    files = {}
    for split in ("train", "val", "test"):
        if split != "train" and not getattr(config.data, f"{split}_path"):
            continue
        path = data_source(config, split)
        if path.is_dir():
            dataset = load_dataset(path, check_media=False)
            files.update({f"{path.name}/{name}": digest
                          for name, digest in dataset.files_manifest().items()})
        else:
            files[f"{split}:{path.name}"] = sha256_file(path)
    return {"files": files}


def encode_samples(config: LMSFTConfig, base: Base, split: str = "train"):
    """(encoded samples, summary counts) of one split, rendered with the base's template."""
    d = config.data
    path = data_source(config, split)
    examples = load_sft_examples(path, d, d.system, split=split if path.is_dir() else None)
    render = functools.partial(base.template.render, enable_thinking=d.enable_thinking)
    samples, summary = encode_sft_dataset(examples, base.tokenizer, render, d.max_len,
                                          d.truncation)
    if not samples:
        raise ForgebenchError("no sample is left to train on (all were dropped as too long)",
                              path=path, where="field 'data.truncation'", hint="raise data.max_len")
    return samples, summary.as_dict()


# -- training -------------------------------------------------------------------------------
def train(job: Job) -> None:
    config: LMSFTConfig = job.config
    run, opt, tr = job.run, config.optim, config.train
    torch.manual_seed(config.seed)
    base_sha = run.manifest()["base_model"]["sha256"]

    job.announce("loading", f"loading base {size_text(base_model(config))}")
    base = load_base(config)
    if not base.dense:        # what each weight mode costs, and the one this run uses
        from engine.models.gguf_model import memory_report

        run.log_event("base_weights", mode=base.model.weights_mode, **memory_report(base.model))
    job.announce("encoding", "encoding the training samples")
    samples, report = encode_samples(config, base)
    run.log_event("data_encoded", **report)
    adapters, trainable = prepare_trainable(config, base)
    model = base.model
    identity = {"recipe": "lm-sft", "base": str(base.path), "base_sha256": base_sha,
                "method": config.lora.method,
                **(describe_adapters(adapters) if adapters else {})}
    optimizer = build_adamw(trainable, lr=opt.lr, weight_decay=opt.weight_decay,
                            betas=(opt.beta1, opt.beta2), eps=opt.eps, moments=opt.moments)
    params = [p for _, p in trainable]
    cursor = DataCursor(len(samples), config.seed)
    step, skipped_total, elapsed_before = 0, 0, 0.0
    if job.resume_from:
        tensors, optimizer_state, state = load_checkpoint(job.resume_from)
        if adapters:
            load_adapters(job.resume_from.path / ADAPTERS_FILE, adapters, base_sha)
        else:
            model.load_state_dict(tensors)
        optimizer.load_state_dict(optimizer_state)
        cursor = DataCursor.from_state(state["cursor"])
        set_rng_state(state["rng"])
        step, skipped_total = state["step"], state["skipped_total"]
        elapsed_before = state["elapsed_s"]
    elif config.sample.prompts:
        job.announce("sample", f"answering {len(config.sample.prompts)} prompt(s) with the "
                               "base (BEFORE)")
        write_generations(run, "step-000000", 0, base, config, identity)   # BEFORE = the base
    if tr.activation_checkpointing:
        checkpoint_activations(model)

    def checkpoint_now() -> Checkpoint:
        job.stage = "save"
        trainer_state = {"cursor": cursor.state(), "rng": rng_state(),
                         "skipped_total": skipped_total, "elapsed_s": clock.elapsed,
                         "invocation": job.invocation, "base_sha256": base_sha,
                         "lora": config.lora.model_dump(mode="json"), "data": report}
        if adapters:
            return save_checkpoint(run, step, model_tensors={}, optimizer=optimizer,
                                   trainer_state=trainer_state, keep_last=config.keep_last,
                                   extra_files={ADAPTERS_FILE: adapter_bytes(adapters, base_sha)})
        return save_checkpoint(run, step, model_tensors=model.state_dict(), optimizer=optimizer,
                               trainer_state=trainer_state, keep_last=config.keep_last)

    clock = StepClock(elapsed_before)
    model.train()
    bar = job.progress(config.steps, initial=step)
    while step < config.steps and not job.stop_requested:
        lr = lr_at(step, lr=opt.lr, warmup=opt.warmup, total=config.steps,
                   schedule=opt.schedule, min_lr_ratio=opt.min_lr_ratio)
        set_lr(optimizer, lr)
        window = [samples[i] for i in cursor.take(tr.window)]
        supervised = sum(s.n_supervised for s in window)
        loss, input_tokens = WindowLoss(), 0
        for micro, start in enumerate(range(0, len(window), tr.micro_batch)):
            job.stage = "forward"
            if adapters:
                model.lora_clock.set(step, micro)
            inputs, labels, lengths = pack(window[start:start + tr.micro_batch])   # [T]
            with autocast(config.train.autocast):
                loss_sum = supervised_loss(model, inputs, labels, lengths)
            job.stage = "backward"
            (loss_sum / supervised).backward()   # token-weighted over the whole window
            loss.add(float(loss_sum.detach()), int((labels != IGNORE).sum()))
            input_tokens += sum(len(s.input_ids) for s in window[start:start + tr.micro_batch])
        job.stage = "optimizer"
        outcome = clip_and_step(params, optimizer, opt.grad_clip, config.nonfinite,
                                loss=loss.value)
        skipped_total += outcome.skipped
        step += 1
        tokens_per_s = clock.tick(loss.tokens)
        if step % config.log_every == 0 or step == config.steps:
            run.log_metric(train_row(
                invocation=job.invocation, step=step, loss=loss.value, outcome=outcome,
                skipped_total=skipped_total, lr=lr, elapsed_s=clock.elapsed,
                input_tokens=input_tokens, supervised_tokens=loss.tokens,
                tokens_per_s=tokens_per_s))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.value:.4f}", lr=f"{lr:.2e}")
        job.step_done(step)
        if (step == config.steps or job.stop_requested
                or (config.save_every and step % config.save_every == 0)):
            last = checkpoint_now()
    bar.close()

    if step == config.steps and not job.stop_requested and config.sample.prompts:
        job.stage = "sample"
        write_generations(run, last.name, step, base, config, identity)   # AFTER


# -- evaluation and generation from a run ---------------------------------------------------
def load_trained(run: RunDir, checkpoint: Checkpoint) -> tuple[Base, LMSFTConfig]:
    """The base with the checkpoint's adapters (or full weights) applied, in eval mode."""
    config = run_config(run)
    base, _, _ = load_policy(config, checkpoint, run.manifest()["base_model"]["sha256"])
    base.model.eval()
    return base, config


@torch.no_grad()
def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Token-weighted CE of a checkpoint on a split of the dataset; writes evals/ + a metric."""
    base, config = load_trained(run, checkpoint)
    samples, report = encode_samples(config, base, split=split)
    total = WindowLoss()
    for start in range(0, len(samples), config.train.micro_batch):
        inputs, labels, lengths = pack(samples[start:start + config.train.micro_batch])
        with autocast(config.train.autocast):
            total.add(float(supervised_loss(base.model, inputs, labels, lengths)),
                      int((labels != IGNORE).sum()))
    record = {"split": split, "checkpoint": checkpoint.name, "step": checkpoint.step,
              "loss": total.value, "supervised_tokens": total.tokens,
              "samples": len(samples), "source": "forgebench eval"}
    run.write_eval(f"{split}-{checkpoint.name}", record)
    run.log_metric(record)
    return record


def generate(run: RunDir, checkpoint: Checkpoint, args) -> dict:
    base, config = load_trained(run, checkpoint)
    return generate_answer(base, checkpoint, config.data.enable_thinking, args)
