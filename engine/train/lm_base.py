"""The language-model base a fine-tuning recipe starts from, shared by lm-sft and lm-dpo.

Loading a base (a GGUF file, kept packed or with an f32 dense cache, or an lm-pretrain run's
model with a plain chat layout), making it trainable (LoRA adapters over the frozen base, or
every weight for full fine-tuning), applying a checkpoint's adapters or weights, packing
samples for one forward pass, recomputing blocks in backward, saving a checkpoint's adapters
or weights and applying them again, and the greedy BEFORE/AFTER generations a run writes into
`samples/`. lm-es and lm-decision use the loaded-base and checkpoint pieces too. Recipes call
these; none of them imports a recipe (an lm-pretrain base is loaded by
engine/train/pretrain_model.py, which lm-pretrain itself uses).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, atomic_write_text, sha256_file
from engine.llm.chat import ChatTemplate, encode_prompt
from engine.lora import ADAPTERS_FILE, LoRALinear, adapter_bytes, attach_lora, load_adapters
from engine.model_library import BYTES_PER_FULL_PARAM
from engine.models.llama import Llama
from engine.rundir import Checkpoint, RunDir
from engine.sampling import SamplingSettings, generate_tokens
from engine.train.checkpoint import MODEL_FILE, load_checkpoint, save_checkpoint
from engine.train.devices import module_device
from engine.train.precision import torch_dtype
from engine.train.pretrain_model import load_model


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


def base_model(config) -> Path:
    """The file that identifies the base (hashed into run.json and the adapter metadata)."""
    if config.model.gguf:
        return config.resolve_path(config.model.gguf, "field 'model.gguf'")
    run = RunDir(config.resolve_path(config.model.run, "field 'model.run'")).require()
    return run.checkpoint(config.model.checkpoint).path / MODEL_FILE


def with_base_file(config, base_path: Path | None):
    """The run's config with its GGUF base read from `base_path` instead: the same file found
    elsewhere (a model library's copy, matched by its SHA-256, which loading checks again).
    Unchanged without one, or for a base that is an lm-pretrain run."""
    if base_path is None or not config.model.gguf:
        return config
    return config.model_copy(update={"model": config.model.model_copy(
        update={"gguf": str(base_path)})})


def size_text(path: Path) -> str:
    try:
        return f"{path.stat().st_size / 1e6:.0f} MB"
    except OSError:
        return path.name


def load_base(config, precision: str = "f32") -> Base:
    """The config's base model and tokenizer. A GGUF base's dense cache (weights "dense-cache",
    or "auto" where it fits) holds the dequantized weights in the run's compute dtype: f32, or
    bf16 for a bf16 run, whose products would cast an f32 cache to bf16 at every step (the same
    rounding, so the same numbers, at half the memory). Lookups and merges read exact f32."""
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
                weight.cache(torch_dtype(precision), lazy=True)   # filled when it first runs
        return Base(model, tokenizer, ChatTemplate.from_gguf(model.gguf), path, dense=False)
    run = RunDir(config.resolve_path(config.model.run, "field 'model.run'")).require()
    if run.manifest().get("recipe") != "lm-pretrain":
        raise ForgebenchError("model.run must be an lm-pretrain run", path=run.path,
                              where="field 'model.run'")
    model, tokenizer, _ = load_model(run, run.checkpoint(config.model.checkpoint))
    if not isinstance(model, Llama):
        raise ForgebenchError("fine-tuning starts from an lm-pretrain run of the llama family; "
                              "this run trained nanochat's GPT", path=run.path,
                              where="field 'model.run'",
                              hint="pick a run with model.family = \"llama\"")
    template = ChatTemplate(PLAIN_TEMPLATE, bos_token="<bos>", eos_token="<eos>",
                            origin="built-in plain template")
    return Base(model, PretrainTokenizer(tokenizer), template, path, dense=True)


AUTO_CACHE_SHARE = 0.25   # "auto" caches densely when the f32 copy fits in this share of RAM


def weights_mode(requested: str, report: dict) -> str:
    """"packed" or "dense-cache": the f32 cache makes every step plain GEMMs (the fastest
    training), so "auto" takes it whenever it is a small part of the available memory (a bf16
    cache held as oneDNN's layouts, W and Wᵀ, comes to at most the f32 copy)."""
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


# -- adapters or full weights ---------------------------------------------------------------
Trainable = tuple[dict[str, LoRALinear] | None, list[tuple[str, nn.Parameter]]]


def lora_trainable(config, base: Base) -> Trainable:
    """LoRA adapters on the configured targets; the base frozen."""
    lora = config.lora
    adapters = attach_lora(base.model, targets=lora.targets, rank=lora.rank, alpha=lora.alpha,
                           dropout=lora.dropout, seed=config.seed)
    return adapters, [(n, p) for n, p in base.model.named_parameters() if p.requires_grad]


def full_trainable(config, base: Base) -> Trainable:
    """Every weight, densified and in f32, within `lora.full_max_params`."""
    model, lora = base.model, config.lora
    count = parameter_count(model)
    if count > lora.full_max_params:
        raise ForgebenchError(
            f"full fine-tuning {count:,} parameters needs about "
            f"{count * BYTES_PER_FULL_PARAM / 1e9:.1f} GB (weights, gradients and two AdamW "
            f"moments at 4 bytes each); the limit is {lora.full_max_params:,} parameters",
            path=base.path, where="field 'lora.full_max_params'",
            hint="use method = \"lora\", or raise lora.full_max_params if the memory is there")
    if not base.dense:
        from engine.models.gguf_model import densify

        densify(model, base.path)
        base.dense = True
    model.float()
    for param in model.parameters():
        param.requires_grad_(True)
    return None, list(model.named_parameters())


# The trainable-parameter hook: `lora.method` -> what trains. A new method (a trained KV prefix,
# norms only, ...) is one entry: a function (config, base) -> (adapters or None, the named
# parameters the optimizer steps), which freezes what it does not train. Without adapters a
# checkpoint holds the model's state_dict (`save_weights`), so a method's parameters belong to
# the model.
TRAINABLE: dict[str, Callable[..., Trainable]] = {"lora": lora_trainable,
                                                  "full": full_trainable}


def prepare_trainable(config, base: Base) -> Trainable:
    """What trains, by `config.lora.method` (`TRAINABLE`): LoRA over the frozen base, or every
    weight for full fine-tuning."""
    method = config.lora.method
    if method not in TRAINABLE:
        raise ForgebenchError(f"unknown training method {method!r}", where="field 'lora.method'",
                              hint="one of: " + ", ".join(TRAINABLE))
    return TRAINABLE[method](config, base)


def parameter_count(model: nn.Module) -> int:
    """Parameters including the packed GGUF weights (which are not nn.Parameters)."""
    from engine.models.gguf_model import packed_weights

    return (sum(p.numel() for p in model.parameters())
            + sum(w.rows * w.cols for w in packed_weights(model)))


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each attention and MLP block in backward instead of keeping its activations.

    Dropout masks are regenerated from the same (step, micro, layer, target) seeds, so the
    recomputation is exact.
    """
    for layer in model.layers:
        for block in (layer.attn, layer.mlp):
            block.forward = functools.partial(recompute, block.forward, use_reentrant=False)


def load_policy(config, checkpoint: Checkpoint, base_sha: str, lora=None,
                precision: str = "f32"):
    """An lm-sft config's base with a checkpoint's adapters (or full weights) applied:
    (base, adapters or None, trainable parameters). `lora` overrides the config's LoRA section
    (same rank, alpha and targets; e.g. no dropout). Refuses a base file whose SHA-256 is no
    longer `base_sha`, and adapters trained on another base (engine.lora.load_adapters)."""
    base = load_base(config, precision)
    require_same_base(base.path, base_sha)
    if lora is not None:
        config = config.model_copy(update={"lora": lora})
    adapters, trainable = prepare_trainable(config, base)
    apply_weights(checkpoint, base.model, adapters, base_sha)
    return base, adapters, trainable


def require_same_base(path: Path, base_sha: str) -> None:
    """Refuse a base file whose SHA-256 is no longer the one the run was trained on."""
    if sha256_file(path) != base_sha:
        raise ForgebenchError("the base model file changed since the run was trained",
                              path=path, hint="restore the original base model")


def save_weights(run: RunDir, step: int, model: nn.Module,
                 adapters: dict[str, LoRALinear] | None, base_sha: str, *, trainer_state: dict,
                 keep_last: int, optimizer: torch.optim.Optimizer | None = None) -> Checkpoint:
    """A checkpoint of a fine-tune, what `apply_weights` reads back: the adapters (tied to
    `base_sha`; the frozen base is not copied) or, without adapters, every weight."""
    if adapters:
        return save_checkpoint(run, step, model_tensors={}, optimizer=optimizer,
                               trainer_state=trainer_state, keep_last=keep_last,
                               extra_files={ADAPTERS_FILE: adapter_bytes(adapters, base_sha)})
    return save_checkpoint(run, step, model_tensors=model.state_dict(), optimizer=optimizer,
                           trainer_state=trainer_state, keep_last=keep_last)


def apply_weights(checkpoint: Checkpoint, model: nn.Module,
                  adapters: dict[str, LoRALinear] | None, base_sha: str) -> tuple[dict, dict]:
    """Copy a checkpoint's adapters (checked against `base_sha`) or full weights into the
    model; return its optimizer state and trainer state (what a resume restores next)."""
    tensors, optimizer_state, state = load_checkpoint(checkpoint)
    if adapters:
        load_adapters(checkpoint.path / ADAPTERS_FILE, adapters, base_sha)
    else:
        model.load_state_dict(tensors)
    return optimizer_state, state


# -- generation -----------------------------------------------------------------------------
GREEDY = SamplingSettings()


@torch.no_grad()
def answer(base: Base, prompt: str, max_tokens: int, enable_thinking: bool | None = False, *,
           settings: SamplingSettings = GREEDY, seed: int = 0) -> str:
    """The KV-cached answer to one user turn (dropout off): greedy by default, else sampled
    with `settings` from a generator seeded with `seed`."""
    return complete(base, base.template.render([{"role": "user", "content": prompt}],
                                               enable_thinking=enable_thinking),
                    max_tokens, settings=settings, seed=seed)


@torch.no_grad()
def complete(base: Base, text: str, max_tokens: int, *, settings: SamplingSettings = GREEDY,
             seed: int = 0) -> str:
    """The KV-cached continuation of a rendered prompt up to an end of turn (dropout off)."""
    model = base.model
    was_training = model.training
    model.eval()
    ids = encode_prompt(base.tokenizer, text)
    cache = model.new_cache(1, len(ids) + max_tokens)
    device = module_device(model)

    def step(new_ids: list[int], start_pos: int) -> torch.Tensor:
        h = model.hidden(torch.tensor([new_ids], device=device), start_pos=start_pos,
                         cache=cache)
        return model.logits(h[0, -1]).cpu()                                 # [V]

    stops = set(getattr(base.tokenizer, "eot_ids", ()) or ()) | {base.tokenizer.eos_id}
    out = generate_tokens(step, ids, max_new_tokens=max_tokens, settings=settings,
                          generator=torch.Generator().manual_seed(seed),
                          stop_ids=[s for s in stops if s is not None])
    model.train(was_training)
    return base.tokenizer.decode(out)


def write_generations(run: RunDir, name: str, step: int, base: Base, config,
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


def write_before(job, base: Base, identity: dict, model_words: str = "the base") -> None:
    """samples/step-000000: the BEFORE answers of the starting model (`model_words` names it in
    the stage line)."""
    prompts = job.config.sample.prompts
    if prompts:
        job.announce("sample", f"answering {len(prompts)} prompt(s) with {model_words} (BEFORE)")
        write_generations(job.run, "step-000000", 0, base, job.config, identity)


def write_after(job, step: int, last: Checkpoint, base: Base, identity: dict,
                force: bool = False) -> None:
    """The AFTER answers beside the last checkpoint, once the run has reached its last step (a
    stopped run writes them when a resume finishes it), or with `force` at once (a run its
    guard stopped: lm-dpo's collapse)."""
    config = job.config
    finished = step == config.steps and not job.stop_requested
    if (finished or force and last is not None) and config.sample.prompts:
        job.stage = "sample"
        write_generations(job.run, last.name, step, base, config, identity)


def generate_answer(base: Base, checkpoint: Checkpoint, enable_thinking: bool | None,
                    args) -> dict:
    """`forgebench generate RUN` on a loaded checkpoint: one answer with the command's
    sampling flags (greedy by default), as the JSON result the command prints."""
    settings = SamplingSettings(args.temperature, args.top_k, args.top_p,
                                args.repetition_penalty)
    text = answer(base, args.prompt, args.max_tokens, enable_thinking, settings=settings,
                  seed=args.seed)
    return {"prompt": args.prompt, "text": text, "checkpoint": checkpoint.name,
            "seed": args.seed, "settings": settings.as_dict() | {"max_tokens": args.max_tokens}}
