"""lm-dpo: preference tuning (DPO) of a language model, starting from an lm-sft run.

Reads top to bottom: the starting policy (an lm-sft run's checkpoint over that run's own base,
adapters on, dropout off) -> preference pairs (ties and skips left
out, counted), each side encoded with the base's chat template, prompt masked -> the reference
log-probs, computed once with the starting policy and cached in the run directory -> AdamW ->
BEFORE generations -> loop (a window of pairs per step; chosen and rejected packed into one
forward per micro-batch; the DPO loss averaged over the window, clipped once, one AdamW step)
-> checkpoint -> AFTER generations.

The reference is the starting policy itself, never "the base with the adapter switched off":
that would silently be the untuned base, which the handbook warns about. It
is evaluated once, before any update and without dropout (lm-dpo trains without dropout), so
no second model is kept. The cache `reference_logps.json` is keyed by the data files, the
base's SHA-256, the starting checkpoint's files and the encoding: a resume reuses it (the
trained weights never recompute it); a key that no longer matches is refused.

Per step `metrics.jsonl` carries the shared train row (loss, grad_norm, ...) plus
reward_margin, chosen_reward, rejected_reward, chosen_logp, rejected_logp and
preference_accuracy. A checkpoint holds what an lm-sft checkpoint holds (adapters with the
base's SHA-256, or full weights; optimizer state; trainer_state.json last), so export, eval and
generate work on it as on an lm-sft run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.data.preferences import load_preferences
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, read_json, sha256_file
from engine.jobs import Job, run_config
from engine.llm.sft_data import EncodedSample, SFTExample, data_source, encode_sft
from engine.lora import ADAPTERS_FILE, describe_adapters, read_adapters
from engine.recipes.lm_dpo_config import LMDPOConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.checkpoint import MODEL_FILE
from engine.train.lm_base import (
    Base,
    apply_weights,
    checkpoint_activations,
    generate_answer,
    load_policy,
    pack,
    save_weights,
    size_text,
    with_base_file,
    write_after,
    write_before,
)
from engine.train.lm_loop import LoopState, StepLoop, StepResult, accumulate, optimizer_step
from engine.train.metrics import write_eval_record
from engine.train.optim import adamw_for
from engine.train.precision import autocast, run_precision
from engine.train.preference import PreferenceLoss, collapse, preference_loss, sequence_logps

REFERENCE_FILE = "reference_logps.json"   # the reference's log-probs, computed once per run


# -- the starting policy (and reference) ----------------------------------------------------
def sft_start(config: LMDPOConfig):
    """(the lm-sft run the policy starts from, its config with this run's weights mode)."""
    run = RunDir(config.resolve_path(config.model.sft_run, "field 'model.sft_run'")).require()
    if run.manifest().get("recipe") != "lm-sft":
        raise ForgebenchError("model.sft_run must be an lm-sft run", path=run.path,
                              where="field 'model.sft_run'",
                              hint="point it at the run whose adapters DPO should refine")
    sft = run_config(run)
    return run, sft.model_copy(update={"model": sft.model.model_copy(
        update={"weights": config.model.weights})})


def base_model(config: LMDPOConfig) -> Path:
    """The base file: the lm-sft run's own base."""
    return Path(sft_start(config)[0].manifest()["base_model"]["path"])


def load_start(config: LMDPOConfig, precision: str = "f32", base_path: Path | None = None):
    """(base, adapters or None, trainable parameters) holding the starting policy: the lm-sft
    checkpoint applied to its base (or to `base_path`, the same file found elsewhere), with
    dropout off, its dense cache in `precision`."""
    run, sft = sft_start(config)
    sft = with_base_file(sft, base_path)
    return load_policy(sft, run.checkpoint(config.model.checkpoint),
                       run.manifest()["base_model"]["sha256"],
                       lora=sft.lora.model_copy(update={"dropout": 0.0}), precision=precision)


# -- data -----------------------------------------------------------------------------------
def preference_source(config: LMDPOConfig, split: str = "train") -> Path:
    """The JSONL file of a split, or the preferences dataset folder holding every split."""
    return data_source(config, split, "preference data", "preferences")


def data_manifest(config: LMDPOConfig) -> dict:
    """The data files and the starting checkpoint's weight files, with their SHA-256: what
    resume re-validates, and what the reference cache is keyed by. The pairs and the starting
    adapters are checked here, before a run folder exists, so bad input leaves nothing."""
    from engine.data.dataset import load_dataset

    files = {}
    for split in ("train", "val", "test"):
        if split != "train" and not getattr(config.data, f"{split}_path"):
            continue
        path = preference_source(config, split)
        load_preferences(path, split if path.is_dir() else None)
        if path.is_dir():
            files |= {f"{path.name}/{name}": digest for name, digest in
                      load_dataset(path, check_media=False).files_manifest().items()}
        else:
            files[f"{split}:{path.name}"] = sha256_file(path)
    sft_run = sft_start(config)[0]
    checkpoint = sft_run.checkpoint(config.model.checkpoint)
    require_same_base(checkpoint, sft_run.manifest()["base_model"]["sha256"])
    return {"files": files, "start": {
        "run": str(sft_run.path), "checkpoint": checkpoint.name,
        "files": {p.name: sha256_file(p) for p in sorted(checkpoint.path.iterdir())
                  if p.name in (ADAPTERS_FILE, MODEL_FILE)}}}


def require_same_base(checkpoint: Checkpoint, base_sha: str) -> None:
    """The starting adapters were trained on the base the run loads (their recorded SHA-256)."""
    adapters = checkpoint.path / ADAPTERS_FILE
    if not adapters.is_file():
        return                                  # full weights: the run's base pins them
    recorded = read_adapters(adapters)[1].get("base_sha256")
    if recorded and recorded != base_sha:
        raise ForgebenchError(
            f"adapter base model SHA-256 is {recorded!r} but the lm-sft run's base is "
            f"{base_sha!r}", path=adapters, where="metadata 'base_sha256'",
            hint="the reference must be the SFT policy over its own base: start from an lm-sft "
                 "checkpoint trained on this base")


@dataclass
class EncodedPair:
    chosen: EncodedSample
    rejected: EncodedSample
    where: str


def encode_pairs(config: LMDPOConfig, base: Base, split: str = "train"):
    """(encoded pairs, summary counts) of one split: each side is the prompt and one response
    rendered with the base's template, only the response (and its end of turn) supervised."""
    d = config.data
    path = preference_source(config, split)
    pairs, counts = load_preferences(path, split if path.is_dir() else None)
    render = functools.partial(base.template.render, enable_thinking=d.enable_thinking)
    encoded, too_long = [], 0
    for pair in pairs:
        system = pair.system if pair.system is not None else d.system
        prompt = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": pair.prompt}]
        sides = [encode_sft(SFTExample(prompt + [{"role": "assistant", "content": text}], 0,
                                       pair.source, pair.where),
                            base.tokenizer, render, d.max_len, d.truncation)
                 for text in (pair.chosen, pair.rejected)]
        if None in sides:
            too_long += 1
            continue
        if sides[0].labels == sides[1].labels:
            raise ForgebenchError("chosen and rejected encode to the same tokens, so the pair "
                                  "prefers nothing", path=pair.source, where=pair.where,
                                  hint="they may differ only in surrounding whitespace")
        encoded.append(EncodedPair(*sides, pair.where))
    if not encoded:
        raise ForgebenchError("no pair is left to train on (all were dropped as too long)",
                              path=path, where="field 'data.truncation'", hint="raise data.max_len")
    report = counts.as_dict() | {
        "kept": len(encoded), "dropped_too_long": too_long,
        "truncated": sum(p.chosen.truncated or p.rejected.truncated for p in encoded),
        "input_tokens": sum(len(s.input_ids) for p in encoded for s in (p.chosen, p.rejected)),
        "supervised_tokens": sum(s.n_supervised for p in encoded
                                 for s in (p.chosen, p.rejected))}
    return encoded, report


# -- log-probs and the reference ------------------------------------------------------------
def forward_pairs(model, pairs: list[EncodedPair]):
    """Summed response log-probs of the chosen and the rejected sides [M] each, from one packed
    forward; and their supervised token counts."""
    logps, counts = sequence_logps(model, *pack([p.chosen for p in pairs]
                                                + [p.rejected for p in pairs]))
    m = len(pairs)
    return logps[:m], logps[m:], counts[:m], counts[m:]


@torch.no_grad()
def pair_logps(model, pairs: list[EncodedPair], micro_batch: int, precision: str,
               progress=None) -> dict[str, torch.Tensor]:
    """Log-probs of every pair's two sides under `model` in eval mode (no dropout)."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for start in range(0, len(pairs), micro_batch):
        with autocast(precision):
            c, r, _, _ = forward_pairs(model, pairs[start:start + micro_batch])
        chosen.append(c.float())
        rejected.append(r.float())
        if progress:
            progress.update(len(c))
    model.train(was_training)
    return {"chosen": torch.cat(chosen), "rejected": torch.cat(rejected)}


def reference_key(manifest: dict, config: LMDPOConfig, report: dict) -> str:
    """What the reference log-probs depend on: data and starting weights (their hashes), the
    base's SHA-256, and how the pairs were encoded and computed."""
    ingredients = {"data": manifest["data"], "base_sha256": manifest["base_model"]["sha256"],
                   "encoding": config.data.model_dump(mode="json"),
                   "precision": (manifest.get("precision") or {}).get("precision")
                   or config.train.precision, "pairs": report["kept"]}
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()


def reference_logps(job: Job, config: LMDPOConfig, model, pairs: list[EncodedPair],
                    report: dict) -> dict[str, torch.Tensor]:
    """The reference's log-probs: read from the run's cache, or computed now with the model
    as it is (the starting policy: this runs before a resume loads trained weights)."""
    run = job.run
    key = reference_key(run.manifest(), config, report)
    path = run.path / REFERENCE_FILE
    if path.is_file():
        cached = read_json(path)
        if cached.get("key") != key:
            raise ForgebenchError(
                "the cached reference log-probs belong to other data, another base or another "
                "starting checkpoint", path=path,
                hint="the reference must be this run's own starting policy: start a new run")
        return {side: torch.tensor(cached[side], dtype=torch.float32)
                for side in ("chosen", "rejected")}
    job.announce("reference", f"reference log-probs of {len(pairs)} pairs (once; cached)")
    bar = job.progress(len(pairs), desc="reference")
    values = pair_logps(model, pairs, config.train.micro_batch, run_precision(run, config), bar)
    bar.close()
    atomic_write_json(path, {"key": key, "pairs": len(pairs),
                             **{side: v.tolist() for side, v in values.items()}})
    run.log_event("reference_computed", path=REFERENCE_FILE, pairs=len(pairs), key=key)
    return values


class WindowStats:
    """Sums over one window's pairs of what a step logs; `row()` their means."""

    FIELDS = ("loss", "reward_margin", "chosen_reward", "rejected_reward", "chosen_logp",
              "rejected_logp", "preference_accuracy")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.FIELDS, 0.0)
        self.pairs = 0

    def add(self, terms, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        margins = terms.margins
        for name, values in (("loss", terms.losses.detach()), ("reward_margin", margins),
                             ("chosen_reward", terms.chosen_rewards),
                             ("rejected_reward", terms.rejected_rewards),
                             ("chosen_logp", chosen.detach()),
                             ("rejected_logp", rejected.detach()),
                             ("preference_accuracy", (margins > 0).double())):
            self.sums[name] += float(values.sum())
        self.pairs += len(margins)

    def row(self) -> dict[str, float]:
        return {name: total / self.pairs for name, total in self.sums.items()}


# -- training -------------------------------------------------------------------------------
def load_for_training(job: Job, precision: str):
    """(base, adapters, trainable, encoded pairs, their report, reference log-probs): the
    starting policy, its pairs and their reference log-probs (before any update)."""
    config, run = job.config, job.run
    job.announce("loading", f"loading base {size_text(base_model(config))} and the starting "
                            "policy")
    base, adapters, trainable = load_start(config, precision)
    if not base.dense:
        from engine.models.gguf_model import memory_report

        run.log_event("base_weights", mode=base.model.weights_mode,
                      **memory_report(base.model))
    job.announce("encoding", "encoding the preference pairs")
    pairs, report = encode_pairs(config, base)
    run.log_event("data_encoded", **report)
    reference = reference_logps(job, config, base.model, pairs, report)   # before any update
    return base, adapters, trainable, pairs, report, reference


def train(job: Job) -> None:
    config: LMDPOConfig = job.config
    run, opt = job.run, config.optim
    precision = run_precision(run, config)          # "auto" was resolved when the run started
    torch.manual_seed(config.seed)
    base_sha = run.manifest()["base_model"]["sha256"]
    base, adapters, trainable, pairs, report, reference = load_for_training(job, precision)
    model = base.model
    start = run.manifest()["data"]["start"]
    identity = {"recipe": "lm-dpo", "base": str(base.path), "base_sha256": base_sha,
                "method": "lora" if adapters else "full",
                "reference": f"{Path(start['run']).name}/{start['checkpoint']}",
                **(describe_adapters(adapters) if adapters else {})}
    optimizer = adamw_for(trainable, opt)
    state = LoopState.fresh(len(pairs), config.seed)
    if job.resume_from:
        optimizer_state, trainer_state = apply_weights(job.resume_from, model, adapters,
                                                       base_sha)
        optimizer.load_state_dict(optimizer_state)
        state.resume(trainer_state)
    else:
        warn_few_pairs(job, report["kept"])
        write_before(job, base, identity, "the starting policy")
    if config.train.activation_checkpointing:
        checkpoint_activations(model)

    def save() -> Checkpoint:
        return save_weights(run, state.step, model, adapters, base_sha,
                            trainer_state=state.trainer_state(
                                invocation=job.invocation, base_sha256=base_sha,
                                reference=identity["reference"], data=report),
                            keep_last=config.keep_last, optimizer=optimizer)

    loop = StepLoop(job, state, save, optim=opt, optimizer=optimizer)
    model.train()
    guard = Guard(job)
    loop.run(dpo_step(job, pairs, reference, state, model, optimizer,
                      [p for _, p in trainable], guard))
    # a collapsed run's AFTER answers too, so the A/B pane can set them against BEFORE's
    write_after(job, state.step, loop.last, base, identity, force=guard.stopped)


def warn_few_pairs(job: Job, pairs: int) -> None:
    """A `warning` event (and a line on stderr) when the run trains on fewer pairs than
    `guard.min_pairs`: a few pairs are memorised within a step or two."""
    minimum = job.config.guard.min_pairs
    if pairs < minimum:
        message = (f"only {pairs} preference pair(s) (guard.min_pairs is {minimum}): DPO "
                   "memorises a few pairs within a step or two; rate more pairs, or watch the "
                   "reward margin and chosen log-prob charts")
        job.run.log_event("warning", message=message, check="min_pairs", pairs=pairs,
                          min_pairs=minimum)
        print(f"warning: {message}", file=sys.stderr)


class Guard:
    """The collapse check of every step (engine/train/preference.py: `collapse`): a
    `dpo_collapse` event, and a stop of the run when `guard.collapse` is "stop"."""

    def __init__(self, job: Job) -> None:
        self.job, self.settings = job, job.config.guard
        self.stopped = False

    def check(self, step: int, row: dict) -> None:
        if self.settings.collapse == "off":
            return
        found = collapse(row, self.job.config.dpo.beta, self.settings.max_margin,
                         self.settings.max_chosen_drop)
        if found is None:
            return
        stop = self.settings.collapse == "stop"
        self.job.run.log_event("dpo_collapse", step=step, rule=found.rule, value=found.value,
                               limit=found.limit, message=found.message,
                               action="stop" if stop else "warn")
        if stop and not self.stopped:
            self.stopped = True
            self.job.request_stop(f"DPO collapse at step {step}: {found.message}")


def dpo_step(job: Job, pairs: list[EncodedPair], reference: dict, state: LoopState, model,
             optimizer, params: list, guard: "Guard"):
    """One step of lm-dpo: a window of pairs, chosen and rejected packed into one forward per
    micro-batch, the DPO loss averaged over the window (each micro-batch's summed loss divided
    by the window's pair count)."""
    config = job.config
    tr, precision = config.train, run_precision(job.run, config)
    settings = PreferenceLoss(**config.dpo.model_dump())

    def step(_step: int, lr: float) -> StepResult:
        indices = state.cursor.take(tr.window)
        stats, tokens = WindowStats(), {"input_tokens": 0, "supervised_tokens": 0}

        def micro_step(_micro: int, chunk: list[int]):
            window = [pairs[i] for i in chunk]
            with autocast(precision):
                chosen, rejected, chosen_n, rejected_n = forward_pairs(model, window)
            terms = preference_loss(settings, chosen, rejected, reference["chosen"][chunk],
                                    reference["rejected"][chunk], chosen_n, rejected_n)
            stats.add(terms, chosen, rejected)
            tokens["input_tokens"] += sum(len(s.input_ids) for p in window
                                          for s in (p.chosen, p.rejected))
            tokens["supervised_tokens"] += int(chosen_n.sum() + rejected_n.sum())
            return terms.losses.sum(), len(chunk)

        chunks = [indices[first:first + tr.micro_batch]
                  for first in range(0, len(indices), tr.micro_batch)]
        accumulate(job, chunks, micro_step, len(indices))   # the mean over the whole window
        values = stats.row()
        outcome = optimizer_step(job, params, optimizer, config.optim.grad_clip, values["loss"])
        guard.check(state.step + 1, values)
        return StepResult(values.pop("loss"), outcome, tokens["supervised_tokens"], tokens,
                          {"pairs": len(indices), **values},
                          postfix={"loss": f"{stats.row()['loss']:.4f}",
                                   "margin": f"{values['reward_margin']:.3f}"})

    return step


# -- evaluation and generation from a run ---------------------------------------------------
def load_trained(run: RunDir, checkpoint: Checkpoint, base_path: Path | None = None,
                 precision: str = "f32") -> tuple[Base, LMDPOConfig]:
    """The base with the checkpoint's adapters (or full weights) applied, in eval mode.
    `base_path` and `precision` as in lm_sft.load_trained: the same base file found
    elsewhere (a model library's copy, by its hash), and the dense cache's precision."""
    config = run_config(run)
    base, adapters, _ = load_start(config, precision, base_path)
    apply_weights(checkpoint, base.model, adapters, run.manifest()["base_model"]["sha256"])
    base.model.eval()
    return base, config


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """DPO loss, reward margin and preference accuracy of a checkpoint on a split, against
    the run's reference (its starting policy, evaluated first on the same pairs)."""
    config = run_config(run)
    mb, precision = config.train.micro_batch, run_precision(run, config)
    base, adapters, _ = load_start(config, precision)
    pairs, report = encode_pairs(config, base, split=split)
    reference = pair_logps(base.model, pairs, mb, precision)
    apply_weights(checkpoint, base.model, adapters, run.manifest()["base_model"]["sha256"])
    policy = pair_logps(base.model, pairs, mb, precision)
    stats = WindowStats()
    stats.add(preference_loss(PreferenceLoss(**config.dpo.model_dump()), policy["chosen"],
                              policy["rejected"], reference["chosen"], reference["rejected"],
                              torch.tensor([p.chosen.n_supervised for p in pairs]),
                              torch.tensor([p.rejected.n_supervised for p in pairs])),
              policy["chosen"], policy["rejected"])
    return write_eval_record(run, checkpoint, split, {
        **stats.row(), "pairs": len(pairs), "ties": report["ties"], "skips": report["skips"]})


def generate(run: RunDir, checkpoint: Checkpoint, args) -> dict:
    """`forgebench generate RUN`: answers from the run's cache precision, as its samples were."""
    base, config = load_trained(run, checkpoint,
                                precision=run_precision(run, run_config(run)))
    return generate_answer(base, checkpoint, config.data.enable_thinking, args)
