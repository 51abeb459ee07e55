"""lm-es: gradient-free fine-tuning of a GGUF language model by evolution strategies (seed 000
§15.8) — over LoRA adapters beside a frozen base that may stay quantized, or over every float
weight of a dense (f32/f16/bf16) base.

Reads top to bottom: base model -> SFT samples (lm-sft's encoding) -> adapters or dense weights
-> BEFORE generations -> loop -> checkpoint -> AFTER generations. Each iteration takes one batch
of samples that every member scores; the members are evaluated in place on the one model
(perturb -> score -> restore, engine.train.es), each forward using every thread; the rewards'
centered ranks weight the regenerated noise into the update. Everything runs under no_grad:
no backward, no activations kept, no optimizer state.

The metrics row (engine.train.metrics.train_row) holds, per iteration t: `loss`, the centre's
teacher-forced cross-entropy on the batch before the update (lm-sft's loss, whatever the
reward), `reward` (the centre's), the population's `reward_mean/max/min/std`, `grad_norm` (the
norm of the ES gradient estimate), `update_norm`, `sigma` and `lr`.

A checkpoint holds the adapters (`adapters.safetensors`, the lm-sft format) or the full weights
and `trainer_state.json` — no optimizer files: (seed, iteration) regenerate all the noise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.errors import ForgebenchError
from engine.jobs import Job, run_config
from engine.llm.chat import ChatTemplate
from engine.llm.sft_data import data_manifest, encode_samples  # noqa: F401 (the hooks)
from engine.lora import (
    attach_lora,
    describe_adapters,
    lora_parameters,
)
from engine.models.gguf_model import densify, load_gguf_model
from engine.recipes.lm_es_config import LMESConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.es import EvolutionStrategy
from engine.train.lm_base import (
    Base,
    apply_weights,
    generate_answer,
    require_same_base,
    save_weights,
    with_base_file,
    write_after,
    write_before,
)
from engine.train.lm_loop import LoopState, StepLoop, StepResult
from engine.train.metrics import write_eval_record
from engine.train.optim import NonFiniteError, StepOutcome
from engine.train.rewards import RewardSpec, score, teacher_forced

FLOAT_TYPES = ("F32", "F16", "BF16")


# -- the base model (engine.train.lm_base.Base: what export's checks read) --------------------
def base_model(config: LMESConfig) -> Path:
    """The GGUF that pins the run; full mode refuses a quantized one before anything starts."""
    path = config.resolve_path(config.model.gguf, "field 'model.gguf'")
    if not path.is_file():
        raise ForgebenchError("base model file not found", path=path, where="field 'model.gguf'")
    if config.params.mode == "full":
        from engine.gguf.reader import open_gguf

        quantized = sorted({t.ggml_type.name for t in open_gguf(path).tensors.values()}
                           - set(FLOAT_TYPES))
        if quantized:
            raise ForgebenchError(
                "full-weight ES adds Gaussian noise to every weight, and this base stores "
                f"quantized blocks ({', '.join(quantized)}) that noise cannot be added to",
                path=path, where="field 'params.mode'",
                hint=f"transcode it first: forgebench convert {path.name} --dtype f16 --out "
                     "DENSE.gguf (then model.gguf = \"DENSE.gguf\"), or use mode = \"lora\"")
    return path


def load_base(config: LMESConfig) -> Base:
    path = base_model(config)
    weights = config.model.weights if config.params.mode == "lora" else "packed"
    model, tokenizer = load_gguf_model(path, numerics="f32", weights=weights)
    return Base(model, tokenizer, ChatTemplate.from_gguf(model.gguf), path, dense=False)


def prepare_params(config: LMESConfig, base: Base) -> tuple[dict | None, list[torch.Tensor]]:
    """(adapters or None, the tensors ES perturbs): LoRA factors A and B beside the frozen
    base, or every float weight of the densified base. None of them needs a gradient."""
    model, params = base.model, config.params
    if params.mode == "lora":
        adapters = attach_lora(model, targets=params.targets, rank=params.rank,
                               alpha=params.alpha, seed=config.seed)
        tensors = lora_parameters(adapters)
    else:
        adapters = None
        densify(model, base.path)
        base.dense = True
        model.float()
        tensors = list(model.parameters())
    for tensor in tensors:
        tensor.requires_grad_(False)
    return adapters, tensors


# -- data (lm-sft's section, read by engine.llm.sft_data) and the reward -------------------
def reward_spec(config: LMESConfig) -> RewardSpec:
    return RewardSpec(**config.reward.model_dump())


# -- training -------------------------------------------------------------------------------
@torch.no_grad()
def train(job: Job) -> None:
    config: LMESConfig = job.config
    run, es = job.run, config.es
    base_sha = run.manifest()["base_model"]["sha256"]
    job.announce("loading", f"loading base {base_model(config).name}")
    base = load_base(config)
    job.announce("encoding", "encoding the samples")
    samples, report = encode_samples(config, base)
    run.log_event("data_encoded", **report)
    adapters, tensors = prepare_params(config, base)
    model = base.model
    model.eval()
    identity = {"recipe": "lm-es", "base": str(base.path), "base_sha256": base_sha,
                "mode": config.params.mode, **(describe_adapters(adapters) if adapters else {})}
    # Built over the starting weights: the anchor is captured here, before a checkpoint loads.
    strategy = EvolutionStrategy(tensors, seed=config.seed, population=es.population,
                                 sigma=es.sigma, lr=es.lr, antithetic=es.antithetic,
                                 shaping=es.shaping, anchor_decay=es.anchor_decay,
                                 decay=es.decay)
    state = LoopState.fresh(len(samples), config.seed)
    if job.resume_from:
        _, trainer_state = apply_weights(job.resume_from, model, adapters, base_sha)
        strategy.load([t.clone() for t in tensors])      # the centre; the anchor stays
        state.resume(trainer_state)
    else:
        write_before(job, base, identity)

    def save() -> Checkpoint:
        return save_weights(run, state.step, model, adapters, base_sha,
                            trainer_state=state.trainer_state(
                                invocation=job.invocation, base_sha256=base_sha, data=report,
                                es_iteration=state.step, es_seed=config.seed,
                                es_noise="gaussian", es_sigma=es.sigma,
                                es_population=es.population, es_antithetic=es.antithetic,
                                es_lr=es.lr),
                            keep_last=config.keep_last)

    loop = StepLoop(job, state, save, fixed_lr=es.lr)
    loop.run(es_step(job, base, samples, state, strategy))
    write_after(job, state.step, loop.last, base, identity)


def es_step(job: Job, base: Base, samples: list, state: LoopState,
            strategy: EvolutionStrategy):
    """One ES iteration: the centre scored on a batch (its reward and teacher-forced CE), every
    member scored in place (perturb -> score -> restore), then the rank-weighted update."""
    config = job.config
    es, spec, model, tokenizer = config.es, reward_spec(config), base.model, base.tokenizer

    def step(step: int, _lr: float) -> StepResult:
        batch = [samples[i] for i in state.cursor.take(es.batch)]
        job.stage = "centre"
        centre = score(model, tokenizer, batch, spec, es.micro_batch)
        mean_ce = centre.mean_ce
        if mean_ce is None:                   # `rule` computes no CE of its own
            ce_sum, _, tokens = teacher_forced(model, batch, es.micro_batch)
            mean_ce = ce_sum / tokens
        rewards = []
        for member in range(es.population):
            job.stage = f"member {member + 1}/{es.population}"
            strategy.perturb(step, member)
            rewards.append(score(model, tokenizer, batch, spec, es.micro_batch).reward)
        strategy.restore()
        job.stage = "update"
        result = strategy.step(step, rewards)
        if not result.finite and config.nonfinite == "stop":
            raise NonFiniteError(f"a member's reward is not finite ({rewards})",
                                 where="ES iteration",
                                 hint="lower es.sigma, or set nonfinite = \"skip\"")
        supervised = sum(s.n_supervised for s in batch)
        return StepResult(
            mean_ce, StepOutcome(result.grad_norm, False, not result.finite),
            supervised * (es.population + 1),                        # every scored token
            {"reward": centre.reward, "reward_mean": result.reward_mean,
             "reward_max": result.reward_max, "reward_min": result.reward_min,
             "reward_std": result.reward_std, "update_norm": result.update_norm,
             "sigma": es.sigma, "population": es.population, "supervised_tokens": supervised},
            postfix={"reward": f"{centre.reward:.4f}"})

    return step


# -- evaluation and generation from a run ---------------------------------------------------
def load_trained(run: RunDir, checkpoint: Checkpoint,
                 base_path: Path | None = None) -> tuple[Base, LMESConfig]:
    """The base with the checkpoint's adapters (or full weights) applied, in eval mode.
    `base_path`: the same base file found elsewhere (a model library's copy, by its hash)."""
    config = with_base_file(run_config(run), base_path)
    base_sha = run.manifest()["base_model"]["sha256"]
    base = load_base(config)
    require_same_base(base.path, base_sha)
    adapters, _ = prepare_params(config, base)
    apply_weights(checkpoint, base.model, adapters, base_sha)
    base.model.eval()
    return base, config


@torch.no_grad()
def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Teacher-forced CE and the run's reward of a checkpoint on a split; writes evals/ and a
    metric row."""
    base, config = load_trained(run, checkpoint)
    samples, _ = encode_samples(config, base, split=split)
    result = score(base.model, base.tokenizer, samples, reward_spec(config),
                   config.es.micro_batch)
    ce_sum, correct, tokens = teacher_forced(base.model, samples, config.es.micro_batch)
    return write_eval_record(run, checkpoint, split, {
        "loss": ce_sum / tokens, "token_accuracy": correct / tokens, "reward": result.reward,
        "reward_kind": config.reward.kind, "supervised_tokens": tokens, "samples": len(samples)})


@torch.no_grad()
def generate(run: RunDir, checkpoint: Checkpoint, args) -> dict:
    base, config = load_trained(run, checkpoint)
    return generate_answer(base, checkpoint, config.data.enable_thinking, args)
