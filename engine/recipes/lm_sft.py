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
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from engine.config import recipe_module
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, atomic_write_text, sha256_file
from engine.jobs import Job, run_config
from engine.llm.chat import ChatTemplate, encode_prompt
from engine.llm.sft_data import encode_sft_dataset, load_sft_examples
from engine.lora import (
    ADAPTERS_FILE,
    LoRALinear,
    adapter_bytes,
    attach_lora,
    describe_adapters,
    load_adapters,
)
from engine.recipes.lm_sft_config import LMSFTConfig
from engine.rundir import Checkpoint, RunDir
from engine.sampling import SamplingSettings, generate_tokens
from engine.train.checkpoint import (
    MODEL_FILE,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from engine.train.data_order import DataCursor
from engine.train.loss import IGNORE, supervised_loss
from engine.train.metrics import StepClock, StepUtilisation, WindowLoss, train_row
from engine.train.optim import build_adamw, clip_and_step, lr_at, set_lr
from engine.train.precision import autocast, run_precision

BYTES_PER_FULL_PARAM = 16  # f32 weight + grad + two AdamW moments


def pack(samples: list) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Samples one after another as inputs/labels [T] and their lengths: each attends only
    within itself, so no work goes to padding (a padded batch computes every pad position)."""
    inputs = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)
    labels = torch.tensor([t for s in samples for t in s.labels], dtype=torch.long)
    return inputs, labels, [len(s.input_ids) for s in samples]


# -- the base model -------------------------------------------------------------------------
@dataclass
class Base:
    """A loaded base: the model, its tokenizer and chat template, and the file that pins it."""

    model: nn.Module
    tokenizer: object
    template: ChatTemplate
    path: Path
    dense: bool           # every linear a plain nn.Linear (an lm-pretrain model)


def base_model(config: LMSFTConfig) -> Path:
    """The file that identifies the base (hashed into run.json and the adapter metadata)."""
    if config.model.gguf:
        return config.resolve_path(config.model.gguf, "field 'model.gguf'")
    run = RunDir(config.resolve_path(config.model.run, "field 'model.run'")).require()
    return run.checkpoint(config.model.checkpoint).path / MODEL_FILE


def _size_text(path: Path) -> str:
    try:
        return f"{path.stat().st_size / 1e6:.0f} MB"
    except OSError:
        return path.name


def load_base(config: LMSFTConfig) -> Base:
    path = base_model(config)
    if config.model.gguf:
        from engine.models.gguf_model import (
            load_gguf_model,
            memory_report,
            packed_weights,
        )

        if not path.is_file():
            raise ForgebenchError("base model file not found", path=path,
                                  where="field 'model.gguf'")
        model, tokenizer = load_gguf_model(path, numerics="f32", weights="packed")
        model.weights_mode = weights_mode(config.model.weights, memory_report(model))
        if model.weights_mode == "dense-cache":
            for weight in packed_weights(model):
                weight.cache(torch.float32, lazy=True)   # each filled when it first runs
        return Base(model, tokenizer, ChatTemplate.from_gguf(model.gguf), path, dense=False)
    run = RunDir(config.resolve_path(config.model.run, "field 'model.run'")).require()
    if run.manifest().get("recipe") != "lm-pretrain":
        raise ForgebenchError("model.run must be an lm-pretrain run", path=run.path,
                              where="field 'model.run'")
    # through the registry, not an import: recipes are leaves (docs/architecture.md)
    pretrain = recipe_module("lm-pretrain")
    model, tokenizer, _ = pretrain.load_model(run, run.checkpoint(config.model.checkpoint))
    template = ChatTemplate(PLAIN_TEMPLATE, bos_token="<bos>", eos_token="<eos>",
                            origin="built-in plain template")
    return Base(model, PretrainTokenizer(tokenizer), template, path, dense=True)


AUTO_CACHE_SHARE = 0.25   # "auto" caches densely when the f32 copy fits in this share of RAM


def weights_mode(requested: str, report: dict) -> str:
    """"packed" or "dense-cache": the f32 cache makes every step plain GEMMs (the fastest
    training), so "auto" takes it whenever it is a small part of the available memory."""
    if requested != "auto":
        return requested
    import psutil

    available = psutil.virtual_memory().available
    return "dense-cache" if report["f32_dense_bytes"] <= AUTO_CACHE_SHARE * available else "packed"


# A chat layout for models trained from scratch, which have no template of their own.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


class PretrainTokenizer:
    """An lm-pretrain tokenizer with the GGUF tokenizer's surface the SFT encoder uses:
    `<bos>`/`<eos>` in text parse to their ids, and `<eos>` ends a turn."""

    add_bos = True

    def __init__(self, inner):
        self.inner = inner
        self.bos_id, self.eos_id = inner.bos_id, inner.eos_id
        self.eog_ids = self.eot_ids = (inner.eos_id,)
        self.specials = {"<bos>": inner.bos_id, "<eos>": inner.eos_id}

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        parts = re.split("(<bos>|<eos>)", text) if parse_special else [text]
        ids = [self.bos_id] if add_special else []
        for part in parts:
            ids += [self.specials[part]] if part in self.specials else self.inner.encode(part)
        return ids

    def decode(self, ids) -> str:
        return self.inner.decode(ids)

    def token_piece(self, token: int) -> str:
        specials = {v: k for k, v in self.specials.items()}
        return specials.get(token) or self.inner.decode([token])


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


# -- adapters or full weights ---------------------------------------------------------------
def prepare_trainable(config: LMSFTConfig, base: Base) -> tuple[dict[str, LoRALinear] | None,
                                                                list[tuple[str, nn.Parameter]]]:
    """Attach LoRA (freezing the base) or unfreeze everything for full fine-tuning."""
    model, lora = base.model, config.lora
    if lora.method == "lora":
        adapters = attach_lora(model, targets=lora.targets, rank=lora.rank, alpha=lora.alpha,
                               dropout=lora.dropout, seed=config.seed)
        return adapters, [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    count = parameter_count(model)
    if count > lora.full_max_params:
        raise ForgebenchError(
            f"full fine-tuning {count:,} parameters needs about "
            f"{count * BYTES_PER_FULL_PARAM / 1e9:.1f} GB (weights, gradients and two AdamW "
            f"moments at 4 bytes each); the limit is {lora.full_max_params:,} parameters",
            path=base.path, where="field 'lora.full_max_params'",
            hint="use method = \"lora\", or raise lora.full_max_params if the memory is there")
    if not base.dense:
        densify(model, base.path)
        base.dense = True
    model.float()
    for param in model.parameters():
        param.requires_grad_(True)
    return None, list(model.named_parameters())


def parameter_count(model: nn.Module) -> int:
    """Parameters including the packed GGUF weights (which are not nn.Parameters)."""
    from engine.models.gguf_model import packed_weights

    return (sum(p.numel() for p in model.parameters())
            + sum(w.rows * w.cols for w in packed_weights(model)))


def densify(model: nn.Module, path: Path, quantized_ok: bool = False) -> None:
    """Replace a GGUF's frozen packed linears and embedding by dense modules holding the
    dequantized weights (full fine-tuning needs float weights; gradient checks accept any)."""
    from engine.models.linear import FrozenQuantLinear, PackedEmbedding

    packed = [(name, m) for name, m in model.named_modules()
              if isinstance(m, (FrozenQuantLinear, PackedEmbedding))]
    quantized = sorted({m.weight.ggml_type.name for _, m in packed} - {"F32", "F16", "BF16"})
    if quantized and not quantized_ok:
        raise ForgebenchError(
            "full fine-tuning needs a dense base; this one keeps packed quantized weights ("
            + ", ".join(quantized) + ")", path=path, where="field 'lora.method'",
            hint="use method = \"lora\" (QLoRA) on a quantized GGUF, or start from an "
                 "f32/f16/bf16 GGUF")
    tied = model.output is not None and model.output.weight is model.tok_embeddings.weight
    for name, module in packed:
        if tied and name == "output":
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight = module.weight.rows_f32(0, module.weight.rows)
        if isinstance(module, PackedEmbedding):
            dense = nn.Embedding.from_pretrained(weight, freeze=False)
        else:
            dense = nn.Linear(module.in_features, module.out_features,
                              bias=module.bias is not None, device="meta")
            dense.weight = nn.Parameter(weight)
            if module.bias is not None:
                dense.bias = nn.Parameter(module.bias.detach().clone())
        setattr(parent, attr, dense)
    if tied:
        model.output = None   # logits() then uses the (trainable) embedding matrix


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each attention and MLP block in backward instead of keeping its activations.

    Dropout masks are regenerated from the same (step, micro, layer, target) seeds, so the
    recomputation is exact.
    """
    for layer in model.layers:
        for block in (layer.attn, layer.mlp):
            block.forward = functools.partial(recompute, block.forward, use_reentrant=False)


# -- generation -----------------------------------------------------------------------------
GREEDY = SamplingSettings()


@torch.no_grad()
def answer(base: Base, prompt: str, max_tokens: int, enable_thinking: bool | None = False, *,
           settings: SamplingSettings = GREEDY, seed: int = 0) -> str:
    """The KV-cached answer to one user turn (dropout off): greedy by default, else sampled
    with `settings` from a generator seeded with `seed`."""
    model = base.model
    was_training = model.training
    model.eval()
    ids = encode_prompt(base.tokenizer, base.template.render(
        [{"role": "user", "content": prompt}], enable_thinking=enable_thinking))
    cache = model.new_cache(1, len(ids) + max_tokens)

    def step(new_ids: list[int], start_pos: int) -> torch.Tensor:
        h = model.hidden(torch.tensor([new_ids]), start_pos=start_pos, cache=cache)
        return model.logits(h[0, -1])                                       # [V]

    stops = set(getattr(base.tokenizer, "eot_ids", ()) or ()) | {base.tokenizer.eos_id}
    out = generate_tokens(step, ids, max_new_tokens=max_tokens, settings=settings,
                          generator=torch.Generator().manual_seed(seed),
                          stop_ids=[s for s in stops if s is not None])
    model.train(was_training)
    return base.tokenizer.decode(out)


def write_generations(run: RunDir, name: str, step: int, base: Base, config: LMSFTConfig,
                      identity: dict) -> Path | None:
    """samples/<name>/generations.jsonl (prompt, answer) + generations.json sidecar."""
    if not config.sample.prompts:
        return None
    lines = [{"prompt": p, "answer": answer(base, p, config.sample.max_tokens,
                                            config.data.enable_thinking)}
             for p in config.sample.prompts]
    out = run.samples_dir / name
    path = out / "generations.jsonl"
    atomic_write_text(path, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    atomic_write_json(out / "generations.json", {
        "checkpoint": name, "step": step, "settings": {"greedy": True,
                                                      "max_tokens": config.sample.max_tokens},
        "seed": config.seed, "model": identity})
    run.log_event("sample_written", checkpoint=name, path=str(path.relative_to(run.path)),
                  step=step)
    return path


# -- training -------------------------------------------------------------------------------
def train(job: Job) -> None:
    config: LMSFTConfig = job.config
    run, opt, tr = job.run, config.optim, config.train
    torch.manual_seed(config.seed)
    base_sha = run.manifest()["base_model"]["sha256"]

    job.announce("loading", f"loading base {_size_text(base_model(config))}")
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

    precision = run_precision(run, config)          # "auto" was resolved when the run started
    utilisation = StepUtilisation(precision, job.threads)
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
        utilisation.begin()
        for micro, start in enumerate(range(0, len(window), tr.micro_batch)):
            job.stage = "forward"
            if adapters:
                model.lora_clock.set(step, micro)
            inputs, labels, lengths = pack(window[start:start + tr.micro_batch])   # [T]
            with autocast(precision):
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
        flops = utilisation.step(input_tokens, clock.seconds)
        if step % config.log_every == 0 or step == config.steps:
            run.log_metric(train_row(
                invocation=job.invocation, step=step, loss=loss.value, outcome=outcome,
                skipped_total=skipped_total, lr=lr, elapsed_s=clock.elapsed,
                input_tokens=input_tokens, supervised_tokens=loss.tokens,
                tokens_per_s=tokens_per_s, utilisation=flops))
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
    base_sha = run.manifest()["base_model"]["sha256"]
    base = load_base(config)
    if sha256_file(base.path) != base_sha:
        raise ForgebenchError("the base model file changed since the run was trained",
                              path=base.path, hint="restore the original base model")
    adapters, _ = prepare_trainable(config, base)
    tensors, _, _ = load_checkpoint(checkpoint)
    if adapters:
        load_adapters(checkpoint.path / ADAPTERS_FILE, adapters, base_sha)
    else:
        base.model.load_state_dict(tensors)
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
        with autocast(run_precision(run, config)):
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
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p,
                                args.repetition_penalty)
    text = answer(base, args.prompt, args.max_tokens, config.data.enable_thinking,
                  settings=settings, seed=args.seed)
    return {"prompt": args.prompt, "text": text, "checkpoint": checkpoint.name,
            "seed": args.seed, "settings": settings.as_dict() | {"max_tokens": args.max_tokens}}
