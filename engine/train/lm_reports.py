"""The held-out reports lm-sft writes before training and after it, so each run's eval report
shows what training changed:

- continued pretraining (`mode = "cpt"`): perplexity on held-out domain documents
  (`data.val_path`, or split val of the text-corpus folder) and on a general control text
  (`data.control_path`), the same packing as training; a falling domain perplexity with a
  rising control one is forgetting, measured;
- tool conversations: the 6-level tool-call score (engine/eval/tool_calls.py) of greedy
  outputs at every held-out assistant decision (`data.val_path`, or split val of the text-sft
  folder), with the level distribution. No call is executed.

Each report is `evals/<kind>-<checkpoint>.json`; once the AFTER one exists,
`evals/<kind>.json` holds both and the change. Every figure is also a metrics row
(split "val"), so the runs pane charts it.
"""

from __future__ import annotations

import functools
import json
import math

import torch

from engine.eval.tool_calls import score_call, summarize
from engine.llm.sft_data import encode_samples, has_split, split_examples
from engine.llm.tool_data import ToolExample, decisions, render_prompt
from engine.rundir import RunDir
from engine.train.devices import module_device, to_device
from engine.train.lm_base import Base, complete, pack
from engine.train.loss import IGNORE, supervised_loss
from engine.train.metrics import WindowLoss
from engine.train.precision import autocast, run_precision

PERPLEXITY, TOOL_CALLS = "perplexity", "tool-calls"


@torch.no_grad()
def mean_loss(base: Base, samples: list, micro_batch: int, precision) -> WindowLoss:
    """Token-weighted cross-entropy of the model over encoded samples (eval mode)."""
    was_training = base.model.training
    base.model.eval()
    device = module_device(base.model)      # a run's reports are taken where it trains
    total = WindowLoss()
    for start in range(0, len(samples), micro_batch):
        inputs, labels, lengths = pack(samples[start:start + micro_batch])
        inputs, labels = to_device(inputs, device), to_device(labels, device)
        with autocast(precision, device.type):
            total.add(float(supervised_loss(base.model, inputs, labels, lengths)),
                      int((labels != IGNORE).sum()))
    base.model.train(was_training)
    return total


def wanted(config) -> list[str]:
    """The reports this config's data calls for."""
    if not has_split(config, "val"):
        return []
    if config.mode == "cpt":
        return [PERPLEXITY]
    return [TOOL_CALLS] if config.data.format == "tools" or _has_tools(config) else []


def _has_tools(config) -> bool:
    return any(isinstance(e, ToolExample) for e in split_examples(config, "val"))


def write_reports(run: RunDir, name: str, step: int, base: Base, config, announce) -> None:
    """Every wanted report of the model at checkpoint `name`; after step 0 also the
    before-vs-after report of each. `announce(stage, detail)` shows the progress."""
    for kind in wanted(config):
        announce(kind, f"{kind} report of {name}")
        if kind == PERPLEXITY:
            record = perplexity_report(run, base, config)
        else:
            record = tool_call_report(base, config, lambda done, total, kind=kind: announce(
                kind, f"{kind} report of {name}: decision {done + 1} of {total}"))
        record = {"checkpoint": name, "step": step, "split": "val", **record}
        run.write_eval(f"{kind}-{name}", record)
        run.log_metric({k: v for k, v in record.items() if not isinstance(v, (dict, list))})
        before = run.evals_dir / f"{kind}-step-000000.json"
        if step and before.is_file():
            first = json.loads(before.read_text(encoding="utf-8"))
            run.write_eval(kind, {"before": first, "after": record, "change": {
                k: record[k] - first[k] for k in record
                if k in first and k != "step" and not k.endswith("_tokens")
                and isinstance(record[k], (int, float))}})


def perplexity_report(run: RunDir, base: Base, config) -> dict:
    precision = run_precision(run, config)
    record = {}
    for part, split in (("domain", "val"), ("control", "control")):
        if split == "control" and not config.data.control_path:
            continue
        samples, _ = encode_samples(config, base, split)
        loss = mean_loss(base, samples, config.train.micro_batch, precision)
        record |= {f"{part}_loss": loss.value, f"{part}_ppl": math.exp(loss.value),
                   f"{part}_tokens": loss.tokens}
    return {"loss": record["domain_loss"], **record}     # the headline: held-out domain loss


def tool_call_report(base: Base, config, progress) -> dict:
    """Greedy outputs at every held-out decision, scored; `progress(done, total)` before each."""
    examples = split_examples(config, "val")
    render = functools.partial(base.template.render, enable_thinking=config.data.enable_thinking)
    todo = [(example, decision) for example in examples if isinstance(example, ToolExample)
            for decision in decisions(example)]
    levels, abstentions, outputs = [], [], []
    for done, (example, decision) in enumerate(todo):
        progress(done, len(todo))
        text = complete(base, render_prompt(render, decision.context, example.tools),
                        config.sample.max_tokens)
        expected = decision.expected
        if expected is None:
            level = score_call(text, "", {}, example.schemas)
            abstentions.append(level == 0)
        else:
            level = score_call(text, expected["name"], expected["arguments"], example.schemas)
            levels.append(level)
        outputs.append({"line": decision.line, "expected": expected, "output": text,
                        "level": level})
    summary = summarize(levels, abstentions)
    return {"tool_mean_level": summary["mean_level"],
            "tool_exact": summary["at_least"]["exact args"], **summary, "outputs": outputs}
