"""The language-model base a fine-tuning recipe starts from, shared by lm-sft and lm-dpo.

Loading a base (a GGUF file, kept packed or with an f32 dense cache, an lm-pretrain run's
Llama with a plain chat layout, or, for lm-sft, an lm-pretrain run of nanochat's GPT with
nanochat's tokenizer and conversation format), making it trainable (LoRA adapters over the
frozen base, or every weight for full fine-tuning), applying a checkpoint's adapters or
weights, packing samples for one forward pass, recomputing blocks in backward, saving a
checkpoint's adapters or weights and applying them again, and the greedy BEFORE/AFTER
generations a run writes into `samples/`. A nanochat base keeps nanochat's ways: its
conversation rendering and training mask, its MuonAdamW as chat_sft sets it up, and its
Engine's calculator in the answers. lm-es and lm-decision use the loaded-base and checkpoint
pieces too. Recipes call these; none of them imports a recipe (an lm-pretrain base is loaded
by engine/train/pretrain_model.py, which lm-pretrain itself uses).
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
from engine.models.nanochat import NanochatGPT
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
    # a nanochat base: the lm-pretrain run's config (its optimizer and rates, which lm-sft
    # continues as nanochat's chat_sft does); None for every other base
    nanochat: object = None


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
    from engine.jobs import run_config

    if run_config(run).model.family == "nanochat":
        return load_nanochat(config, run, path)
    model, tokenizer, _ = load_model(run, run.checkpoint(config.model.checkpoint))
    template = ChatTemplate(PLAIN_TEMPLATE, bos_token="<bos>", eos_token="<eos>",
                            origin="built-in plain template")
    return Base(model, PretrainTokenizer(tokenizer), template, path, dense=True)


class PackedNanochat(NanochatGPT):
    """nanochat's GPT with the packed-samples surface the supervised loss calls (the Llama
    family's `hidden(inputs, lengths=, rows=)`): each of the samples packed one after another
    runs alone from position 0 (its own smear, rotary positions and attention), as a
    conversation that starts a row of nanochat's chat_sft is computed; `rows` keeps the
    supervised positions only. Parameters and state_dict are NanochatGPT's, so a checkpoint
    resumes, chats and loads in nanochat's code as one."""

    def hidden(self, idx: torch.Tensor, start_pos: int = 0, cache=None, trace=None,
               lengths: list[int] | None = None,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        if lengths is None:
            h = NanochatGPT.hidden(self, idx, start_pos, cache, trace)
        else:
            h = torch.cat([NanochatGPT.hidden(self, piece)
                           for piece in torch.split(idx, lengths, dim=1)], dim=1)
        return h if rows is None else h[rows]                            # [B, T, C] or [N, C]


def load_nanochat(config, run: RunDir, path: Path) -> Base:
    """An lm-pretrain run of nanochat's GPT as lm-sft's base: its checkpoint's weights and
    tokenizer, and nanochat's conversation format (engine/llm/nanochat_chat.py). Only lm-sft
    fine-tunes it (nanochat's chat_sft is supervised fine-tuning), and only with nanochat's
    tokenizer, whose special tokens mark the turns and the calculator calls."""
    from engine.jobs import run_config
    from engine.llm.nanochat_chat import NanochatFormat
    from engine.text_tokenizers import tokenizer_from_json
    from engine.train.pretrain_model import TOKENIZER_FILE, nanochat_config

    pretrain = run_config(run)
    if config.recipe != "lm-sft":
        raise ForgebenchError(f"{config.recipe} does not start from nanochat's GPT; lm-sft "
                              "fine-tunes it", path=run.path, where="field 'model.run'",
                              hint="pick a run with model.family = \"llama\", or use lm-sft")
    checkpoint = run.checkpoint(config.model.checkpoint)
    tokenizer = tokenizer_from_json((checkpoint.path / TOKENIZER_FILE).read_text("utf-8"),
                                    checkpoint.path / TOKENIZER_FILE)
    if getattr(tokenizer, "kind", None) != "nanochat":
        raise ForgebenchError(
            "a nanochat GPT is fine-tuned in nanochat's conversation format, whose turns and "
            f"calculator calls are its tokenizer's special tokens; this run's tokenizer is "
            f"{getattr(tokenizer, 'kind', '?')!r}", path=run.path, where="field 'model.run'",
            hint="pretrain with tokenizer.kind = \"nanochat\"")
    model = PackedNanochat(nanochat_config(pretrain, tokenizer.vocab_size))
    tensors, _, _ = load_checkpoint(checkpoint)
    model.load_state_dict(tensors)
    return Base(model, tokenizer, NanochatFormat(tokenizer), path, dense=True,
                nanochat=pretrain)


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
    if base.nanochat is not None:
        raise ForgebenchError(
            "LoRA targets the Llama family's projections (q, k, v, o, gate, up, down); "
            "nanochat's GPT is fine-tuned whole, as nanochat's chat_sft does",
            path=base.path, where="field 'lora.method'", hint="set lora.method = \"full\"")
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
    if isinstance(model, NanochatGPT):
        raise ForgebenchError("activation checkpointing recomputes the Llama family's blocks; "
                              "nanochat's GPT trains without it",
                              where="field 'train.activation_checkpointing'",
                              hint="set train.activation_checkpointing = false")
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


# -- nanochat: its conversations, its optimizer ---------------------------------------------
def encode_nanochat(config, base: Base, split: str = "train") -> tuple[list, dict]:
    """(encoded samples, summary counts) of one split of an lm-sft config's conversations, as
    nanochat's chat_sft renders them (engine.nanochat_tokenizer.render_conversation): <|bos|>,
    the turns between their special tokens, and the training mask nanochat uses (the
    assistant's text, its calculator calls and <|assistant_end|>; not the user's turns nor the
    calculator's output). An assistant turn writes its calls in text, as a chat transcript
    does: "<|python_start|>6*7<|python_end|><|output_start|>42<|output_end|>". A sample holds
    at most the model's context (or data.max_len, if shorter) of input tokens; a longer one
    follows data.truncation."""
    from engine.llm.nanochat_chat import conversation_of
    from engine.llm.sft_data import SFTSummary, finish_sample, split_examples
    from engine.llm.tool_data import ToolExample
    from engine.nanochat_tokenizer import render_conversation

    d = config.data
    if getattr(config, "mode", "sft") == "cpt":
        raise ForgebenchError("nanochat's GPT continues pretraining in lm-pretrain; lm-sft "
                              "fine-tunes it on conversations", where="field 'mode'",
                              hint="set mode = \"sft\", or resume the lm-pretrain run")
    max_len = min(d.max_len, base.model.config.sequence_len)
    examples = split_examples(config, split)
    samples, summary = [], SFTSummary(examples=len(examples))
    for example in examples:
        if isinstance(example, ToolExample):
            raise ForgebenchError(
                "nanochat's calculator calls are part of the assistant's text, not tool "
                "messages with schemas", path=example.source, where=example.where,
                hint="write a call as <|python_start|>EXPR<|python_end|><|output_start|>"
                     "RESULT<|output_end|> inside the assistant's content")
        try:
            ids, mask = render_conversation(base.tokenizer, conversation_of(example.messages),
                                            max_tokens=None)
        except ForgebenchError as exc:
            raise ForgebenchError(exc.message, path=example.source, where=example.where,
                                  hint=exc.hint) from None
        sample = finish_sample(ids, [bool(m) for m in mask], example, max_len, d.truncation)
        if summary.add(sample, example.line):
            samples.append(sample)
    if not samples:
        raise ForgebenchError("no sample is left to train on (all were dropped as too long)",
                              where="field 'data.truncation'", hint="raise data.max_len")
    return samples, {**summary.as_dict(), "format": "nanochat", "max_len": max_len}


def encode_for(config, base: Base, split: str = "train") -> tuple[list, dict]:
    """The samples of a split in the base's own format: nanochat's for a nanochat base, the
    chat template's otherwise (engine.llm.sft_data.encode_samples)."""
    if base.nanochat is not None:
        return encode_nanochat(config, base, split)
    from engine.llm.sft_data import encode_samples

    return encode_samples(config, base, split)


def sft_optimizer(config, base: Base, trainable: list,
                  precision: str = "f32") -> torch.optim.Optimizer:
    """lm-sft's optimizer: AdamW over the trainable parameters, or, for a nanochat base that
    was pretrained with nanochat's MuonAdamW, that optimizer as nanochat's chat_sft sets it up:
    GPT.setup_optimizer's groups at the pretrain run's rates (Muon's matrix rate, the
    embedding and head rates; not batch-scaled, as chat_sft passes them) with weight decay 0
    (pretraining decayed it to 0). `optim.lr` is Muon's matrix rate and every other group keeps
    its pretraining proportion to it (chat_sft starts at 0.8 of the pretrain rates). In a bf16
    run (`precision`, the run's) Muon orthogonalises in bf16, as nanochat's does when its
    compute dtype is bf16."""
    from engine.train.optim import adamw_for

    pretrain = base.nanochat
    if pretrain is None or pretrain.optim.kind != "muon":
        return adamw_for(trainable, config.optim)
    from engine.train.muon import MuonAdamW, nanochat_groups
    from engine.train.precision import torch_dtype

    p = pretrain.optim
    optimizer = MuonAdamW(nanochat_groups(base.model, unembedding_lr=p.unembedding_lr,
                                          embedding_lr=p.embedding_lr, matrix_lr=p.lr,
                                          weight_decay=0.0),
                          compute_dtype=torch_dtype(precision))
    for group in optimizer.param_groups:
        group["lr_ratio"] = group["initial_lr"] / p.lr
        group["lr"] = config.optim.lr * group["lr_ratio"]
    return optimizer


def sft_muon_momentum(step: int) -> float:
    """chat_sft's Muon momentum: 0.85 rising linearly to 0.95 over the first 300 steps."""
    frac = min(step / 300, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def schedule_sft(optimizer: torch.optim.Optimizer, step: int) -> None:
    """The per-step settings chat_sft gives MuonAdamW besides the rate (none for AdamW)."""
    for group in optimizer.param_groups:
        if group.get("kind") == "muon":
            group["momentum"] = sft_muon_momentum(step)


# -- generation -----------------------------------------------------------------------------
GREEDY = SamplingSettings()


@torch.no_grad()
def answer(base: Base, prompt: str, max_tokens: int, enable_thinking: bool | None = False, *,
           settings: SamplingSettings = GREEDY, seed: int = 0) -> str:
    """The KV-cached answer to one user turn (dropout off): greedy by default, else sampled
    with `settings` from a generator seeded with `seed`. A nanochat base answers as nanochat's
    Engine does, its calculator run inside the reply (engine/llm/nanochat_chat.py); the
    answer keeps the calls as their special tokens' text."""
    if base.nanochat is not None:
        return nanochat_answer(base, prompt, max_tokens, settings=settings, seed=seed)
    return complete(base, base.template.render([{"role": "user", "content": prompt}],
                                               enable_thinking=enable_thinking),
                    max_tokens, settings=settings, seed=seed)


@torch.no_grad()
def nanochat_answer(base: Base, prompt: str, max_tokens: int, *,
                    settings: SamplingSettings = GREEDY, seed: int = 0) -> str:
    from engine.llm.nanochat_chat import generate_reply, prompt_ids

    model, tokenizer = base.model, base.tokenizer
    was_training = model.training
    model.eval()
    ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    room = model.config.sequence_len - len(ids)
    reply = generate_reply(model, tokenizer, ids, max_tokens=max(min(max_tokens, room), 0),
                           settings=settings, seed=seed)
    model.train(was_training)
    return tokenizer.decode_with_specials(reply.ids)


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
