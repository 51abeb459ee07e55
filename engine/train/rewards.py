"""Scalar rewards of a language model on a batch of SFT samples, from forward passes only
(what evolution strategies learn from; seed 000 §15.8). A reward is a config choice with
parameters (`RewardSpec`), never arbitrary code:

    nll    −(summed cross-entropy / supervised tokens), teacher-forced: lm-sft's loss, negated
    acc    token accuracy + ce_weight·exp(−mean CE), teacher-forced: bounded in
           [0, 1 + ce_weight] and dense (every supervised token counts)
    rule   mean over the samples of unigram F1 between the greedy answer and the reference,
           plus envelope_bonus when the answer starts with `prefix` and ends with `suffix`
           (engine.eval.text_reward); the answers come from the KV-cached decode loop

Teacher-forced rewards run the last MLP and the head only at supervised positions and keep no
activations (the callers hold torch.no_grad / inference mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.eval.text_reward import rule_reward
from engine.llm.sft_data import IGNORE_INDEX as IGNORE
from engine.sampling import SamplingSettings

Reward = Literal["rule", "acc", "nll"]
REWARDS = ("rule", "acc", "nll")


@dataclass(frozen=True)
class RewardSpec:
    kind: Reward = "acc"
    ce_weight: float = 0.1          # acc: weight of exp(−mean CE)
    prefix: str = "Ahoy!"           # rule: the envelope
    suffix: str = "matey."
    envelope_bonus: float = 0.1
    max_tokens: int = 32            # rule: greedy tokens per answer


@dataclass(frozen=True)
class Score:
    reward: float
    mean_ce: float | None = None    # teacher-forced rewards only
    accuracy: float | None = None


def pack_samples(samples: Sequence) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Samples one after another as inputs/labels [T] and their lengths (attention stays
    within each sample, no padding)."""
    inputs = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)
    labels = torch.tensor([t for s in samples for t in s.labels], dtype=torch.long)
    return inputs, labels, [len(s.input_ids) for s in samples]


def teacher_forced(model: nn.Module, samples: Sequence, micro_batch: int) -> tuple[float, int, int]:
    """(summed CE, correctly predicted tokens, supervised tokens) over the samples."""
    ce_sum, correct, tokens = 0.0, 0, 0
    for start in range(0, len(samples), micro_batch):
        inputs, labels, lengths = pack_samples(samples[start:start + micro_batch])
        supervised = labels != IGNORE
        hidden = model.hidden(inputs[None], lengths=lengths, rows=supervised[None])   # [N, D]
        logits = model.logits(hidden).float()                                         # [N, V]
        targets = labels[supervised]
        ce_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
        correct += int((logits.argmax(dim=-1) == targets).sum())
        tokens += int(targets.numel())
    return ce_sum, correct, tokens


def prompt_and_reference(sample, tokenizer) -> tuple[list[int], str]:
    """The prompt tokens before a sample's first supervised token, and the text of its first
    supervised span (end-of-turn tokens dropped): what `rule` answers and compares."""
    first = next(i for i, label in enumerate(sample.labels) if label != IGNORE)
    span = []
    for label in sample.labels[first:]:
        if label == IGNORE:
            break
        span.append(label)
    stops = {tokenizer.eos_id, *getattr(tokenizer, "eot_ids", ())}
    return sample.sequence[:first + 1], tokenizer.decode([t for t in span if t not in stops])


def greedy_answers(model: nn.Module, tokenizer, samples: Sequence, max_tokens: int) -> list[str]:
    from engine.llm.generate import generate

    answers = []
    for sample in samples:
        prompt, _ = prompt_and_reference(sample, tokenizer)
        answers.append(generate(model, tokenizer, prompt, max_new_tokens=max_tokens,
                                settings=SamplingSettings()).text)
    return answers


def score(model: nn.Module, tokenizer, samples: Sequence, spec: RewardSpec,
          micro_batch: int = 8) -> Score:
    """The reward of the model as it stands on `samples` (the same batch for every member)."""
    if spec.kind == "rule":
        answers = greedy_answers(model, tokenizer, samples, spec.max_tokens)
        rewards = [rule_reward(answer, prompt_and_reference(s, tokenizer)[1], prefix=spec.prefix,
                               suffix=spec.suffix, envelope_bonus=spec.envelope_bonus)
                   for answer, s in zip(answers, samples)]
        return Score(sum(rewards) / len(rewards))
    ce_sum, correct, tokens = teacher_forced(model, samples, micro_batch)
    mean_ce, accuracy = ce_sum / tokens, correct / tokens
    if spec.kind == "nll":
        return Score(-mean_ce, mean_ce, accuracy)
    return Score(accuracy + spec.ce_weight * math.exp(-mean_ce), mean_ce, accuracy)
