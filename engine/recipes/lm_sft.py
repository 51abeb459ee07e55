"""lm-sft: supervised fine-tuning of a language model — LoRA over a frozen (packed) GGUF base,
or full fine-tuning of a dense base (an f32/f16/bf16 GGUF or an lm-pretrain run's model).

An lm-pretrain run of nanochat's GPT fine-tunes as nanochat's chat_sft does (engine/train/
lm_base.py): conversations in nanochat's format with its training mask, calculator calls
written in the assistant's text, and nanochat's MuonAdamW when the pretraining used it; its
checkpoints chat in nanochat's format with the calculator run inside the reply.

Reads top to bottom: base model -> SFT samples (prompt masked) -> adapters or full weights ->
AdamW -> BEFORE generations -> loop (one token-weighted window per step: summed CE over the
window / its supervised tokens, clipped once, one AdamW step) -> checkpoint -> AFTER
generations. The LM head and cross-entropy run only at supervised positions, fused into one pass
over the frozen head (`linear_cross_entropy`): no [N, vocab] logits, and dh comes out of the
same pass. GGUF weights default to an f32 dense cache when it is small next to the RAM.

`mode = "cpt"` is continued pretraining: the samples are raw documents packed into blocks with
EOS separators, every token a target (engine/llm/documents.py); tool conversations are a data
shape of the SFT mode (engine/llm/tool_data.py). Before training and after it the run writes
its held-out reports (engine/train/lm_reports.py): domain and control perplexity for cpt, the
6-level tool-call score for tool conversations, each with the change in `evals/`.

A LoRA checkpoint holds `adapters.safetensors` (rank, alpha, targets and the base's SHA-256 in
its metadata), the optimizer state and `trainer_state.json` (data cursor, RNG, step) last.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.errors import ForgebenchError
from engine.jobs import Job, run_config
from engine.llm.sft_data import data_manifest  # noqa: F401 (the hook)
from engine.lora import describe_adapters
from engine.recipes.lm_sft_config import LMSFTConfig
from engine.rundir import Checkpoint, RunDir
from engine.train import distributed
from engine.train.devices import require_bf16, to_device
from engine.train.lm_base import (
    Base,
    apply_weights,
    base_model,
    checkpoint_activations,
    encode_for,
    generate_answer,
    load_base,
    load_policy,
    pack,
    prepare_trainable,
    save_weights,
    schedule_sft,
    sft_optimizer,
    size_text,
    with_base_file,
    write_after,
    write_before,
)
from engine.train.lm_loop import LoopState, StepLoop, StepResult, accumulate, optimizer_step
from engine.train.lm_reports import mean_loss, write_reports
from engine.train.loss import IGNORE, SupervisedLoss, one_thread_glue_serves
from engine.train.metrics import write_eval_record
from engine.train.precision import autocast, run_precision

# the samples of a split in the base's own format (nanochat's for its GPT); verify_grads and
# the tests read a run's samples through this name
encode_samples = encode_for


# -- training -------------------------------------------------------------------------------
def load_for_training(job: Job, precision: str):
    """(base, encoded samples, their report), the base's weight modes logged."""
    config, run = job.config, job.run
    job.announce("loading", f"loading base {size_text(base_model(config))}")
    base = load_base(config, precision)
    if not base.dense:        # what each weight mode costs, and the one this run uses
        from engine.models.gguf_model import memory_report

        run.log_event("base_weights", mode=base.model.weights_mode, **memory_report(base.model))
    job.announce("encoding", "encoding the training samples")
    samples, report = encode_for(config, base)
    run.log_event("data_encoded", **report)
    return base, samples, report


def distribute(model, adapters, trainable, world, device):
    """(the module that trains, whether it is sharded, the trainable parameters): several
    ranks shard a full fine-tune (FSDP2) and replicate adapters (DDP, summed gradients)."""
    sharded = world.distributed and adapters is None
    if not sharded:
        return distributed.data_parallel(SupervisedLoss(model), world, device), False, trainable
    if not hasattr(model, "layers"):
        raise ForgebenchError("several processes shard a full fine-tune of the Llama family's "
                              "layers; nanochat's GPT fine-tunes in one process",
                              where="--nproc", hint="run it without --nproc")
    # (FSDP2 gathers a module's shards in its forward hook; a layer's norms, attention and MLP
    # are what the models call, so those are the units)
    blocks = [block for layer in model.layers for block in layer.children()]
    trained = distributed.fully_sharded(SupervisedLoss(model), blocks, world, device)
    # the optimizer steps the shards (DTensors) that replaced them
    return trained, True, [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def train(job: Job) -> None:
    config: LMSFTConfig = job.config
    run, opt, tr = job.run, config.optim, config.train
    device, world = job.device, job.world
    precision = run_precision(run, config)          # "auto" was resolved when the run started
    require_bf16(precision, device, "field 'train.precision'")
    torch.manual_seed(config.seed)
    base_sha = run.manifest()["base_model"]["sha256"]
    base, samples, report = load_for_training(job, precision)
    adapters, trainable = prepare_trainable(config, base)
    model = base.model
    identity = {"recipe": "lm-sft", "base": str(base.path), "base_sha256": base_sha,
                "method": config.lora.method,
                **(describe_adapters(adapters) if adapters else {})}
    state = LoopState.fresh(len(samples), config.seed)
    if job.resume_from:            # weights before sharding: FSDP2 shards what is loaded
        optimizer_state, trainer_state = apply_weights(job.resume_from, model, adapters,
                                                       base_sha)
    model.to(device)
    if not job.resume_from and world.is_main:   # answers, perplexity / tool-call score BEFORE
        write_before(job, base, identity)
        write_reports(run, "step-000000", 0, base, config, job.announce)
    if tr.activation_checkpointing:
        checkpoint_activations(model)
    trained, sharded, trainable = distribute(model, adapters, trainable, world, device)
    optimizer = sft_optimizer(config, base, trainable, precision)  # MuonAdamW on nanochat
    if job.resume_from:
        optimizer.load_state_dict(distributed.shard_optimizer_state(optimizer_state, optimizer)
                                  if sharded else optimizer_state)
        state.resume(trainer_state)

    def save() -> Checkpoint:
        return save_weights(run, state.step, model, adapters, base_sha,
                            trainer_state=state.trainer_state(
                                invocation=job.invocation, base_sha256=base_sha,
                                lora=config.lora.model_dump(mode="json"), data=report),
                            keep_last=config.keep_last, optimizer=optimizer)

    loop = StepLoop(job, state, save, optim=opt, optimizer=optimizer, precision=precision)
    model.train()
    loop.run(sft_step(job, samples, state, trained, model, adapters, optimizer,
                      [p for _, p in trainable]))
    if loop.finished() and world.is_main:
        if sharded:   # FSDP2 holds shards: answer and report with the checkpoint's full weights
            base = load_trained(run, loop.last, precision=precision)[0]
        write_after(job, state.step, loop.last, base, identity)
        write_reports(run, loop.last.name, state.step, base, config, job.announce)


def sft_step(job: Job, samples: list, state: LoopState, trained, model, adapters, optimizer,
             params: list):
    """One step of lm-sft: a window of samples, this rank's share packed per micro-batch,
    each micro-batch's summed CE divided by the window's supervised tokens over all ranks."""
    config, device, world = job.config, job.device, job.world
    tr, precision = config.train, run_precision(job.run, config)
    glue = one_thread_glue_serves(model)

    def micro_step(micro: int, chunk: list):
        if adapters:
            model.lora_clock.set(state.step, micro)
        inputs, labels, lengths = pack(chunk)                             # [T]
        tokens = int((labels != IGNORE).sum())
        inputs, labels = to_device(inputs, device), to_device(labels, device)
        with autocast(precision, device.type):
            return trained(inputs, labels, lengths), tokens

    def step(_step: int, lr: float) -> StepResult:
        window = [samples[i] for i in state.cursor.take(tr.window)]
        mine = distributed.shard(window, world, "window", "field 'train.window'")
        # every rank divides by the window's supervised tokens over all ranks (all-reduced)
        supervised = int(distributed.all_reduce_sum([sum(s.n_supervised for s in mine)],
                                                    world, device)[0])
        input_tokens = sum(len(s.input_ids) for s in window)
        chunks = [mine[start:start + tr.micro_batch]
                  for start in range(0, len(mine), tr.micro_batch)]
        loss = accumulate(job, chunks, micro_step, supervised, trained, glue)
        schedule_sft(optimizer, _step)              # chat_sft's Muon momentum (AdamW: none)
        outcome = optimizer_step(job, params, optimizer, config.optim.grad_clip, loss.value)
        return StepResult(loss.value, outcome, loss.tokens,
                          {"input_tokens": input_tokens, "supervised_tokens": loss.tokens},
                          flops_work=input_tokens,
                          postfix={"loss": f"{loss.value:.4f}", "lr": f"{lr:.2e}"})

    return step


# -- evaluation and generation from a run ---------------------------------------------------
def load_trained(run: RunDir, checkpoint: Checkpoint, base_path: Path | None = None,
                 precision: str = "f32") -> tuple[Base, LMSFTConfig]:
    """The base with the checkpoint's adapters (or full weights) applied, in eval mode.
    `base_path`: the same base file found elsewhere (a model library's copy, by its hash).
    `precision` is the dense cache's (load_base): the run's own for its evaluation (under its
    autocast a bf16 cache gives the f32 cache's numbers at half the memory) and its answers
    (a bf16 run's AFTER samples were taken from its bf16 cache); "f32" for the exact weights."""
    config = with_base_file(run_config(run), base_path)
    base, _, _ = load_policy(config, checkpoint, run.manifest()["base_model"]["sha256"],
                             precision=precision)
    base.model.eval()
    return base, config


@torch.no_grad()
def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Token-weighted CE of a checkpoint on a split of the dataset; writes evals/ + a metric."""
    precision = run_precision(run, run_config(run))
    base, config = load_trained(run, checkpoint, precision=precision)
    samples, report = encode_for(config, base, split=split)
    total = mean_loss(base, samples, config.train.micro_batch, precision)
    values = {"loss": total.value, "supervised_tokens": total.tokens, "samples": len(samples)}
    if config.mode == "cpt":
        values["perplexity"] = math.exp(total.value)
    return write_eval_record(run, checkpoint, split, values)


def generate(run: RunDir, checkpoint: Checkpoint, args) -> dict:
    """`forgebench generate RUN`: answers from the run's cache precision, as its samples were."""
    base, config = load_trained(run, checkpoint,
                                precision=run_precision(run, run_config(run)))
    return generate_answer(base, checkpoint, config.data.enable_thinking, args)
