"""lm-decision: a typed decision service from a language model (handbook chapters 23-24): an
option-pointer head over a frozen GGUF decoder's hidden states.

Reads top to bottom: the base (frozen) -> the decisions dataset and its closed option schema ->
each record laid out as one causal sequence (request, question, one line per option, readout)
-> the decoder's hidden states at each option's end and at the readout, computed once per
record -> the pointer head (engine.models.pointer) trained with cross-entropy over the record's
options (AdamW, warmup then cosine, clipped) -> at the last step: one temperature from 201
log-spaced values fitted on the calibration split, reliability bins and ECE on val before and
after, the risk-coverage curve and an abstain threshold chosen on val, PNGs of both ->
checkpoint. `decide` answers one request with an option, its probability, or "abstain".

Why the decoder stays frozen: with it frozen, the hidden states are a fixed function of the
record, so they are computed once (one packed forward per batch of records) and every step
trains only the head (2 * (D * P + P) parameters): on a CPU a 270M decoder's forward and
backward per step would cost seconds per record, a head step costs milliseconds. It is the
handbook's "useful first comparison" (head-only) and keeps resume exact by construction: the
states are recomputed bit for bit from the same records, and the checkpoint holds the head,
AdamW, the data cursor and the RNG. LoRA on the decoder is the next step, not this recipe.

The input contract (a change to it is a change of model): `Request: ...\\nQuestion: ...\\n
Options:\\n` then `- {id}: {text}\\n` per option (its last token is the option's end) and
`Answer:` (its last token is the readout), each piece tokenized on its own so the positions are
exact. A record longer than data.max_len is refused, never cut: cutting can remove an option or
the evidence. A checkpoint holds `model.safetensors` (the head), `decision.json` (the layout,
width, option schema and base SHA-256) and, from the last step, `calibration.json`
(temperature, abstain threshold): the calibration cannot be reused with another head.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from engine.data import decisions
from engine.data.formats import MANIFEST
from engine.errors import ForgebenchError
from engine.eval import decision as metrics
from engine.eval.plot import RELIABILITY_COLOURS, reliability_plot, unit_plot
from engine.fsutil import read_json
from engine.jobs import Job, run_config
from engine.models.pointer import OptionPointer, gather_hidden
from engine.recipes.lm_decision_config import LMDecisionConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.checkpoint import load_checkpoint, save_checkpoint
from engine.train.lm_base import base_model, load_base, require_same_base, size_text
from engine.train.lm_loop import LoopState, StepLoop, StepResult, optimizer_step
from engine.train.loop import record_eval
from engine.train.media_data import dataset_manifest, open_dataset, split_records
from engine.train.optim import adamw_for

KINDS = ("decisions",)
DECISION_FILE, CALIBRATION_FILE = "decision.json", "calibration.json"
LAYOUT = "request-question-options-readout/1"
PACK_TOKENS = 4096        # tokens per packed feature forward
HEADLINE = ("accuracy", "nll", "brier", "ece", "coverage", "risk")


def data_manifest(config: LMDecisionConfig) -> dict:
    return dataset_manifest(config, KINDS)


# -- the input contract -------------------------------------------------------------------
@dataclass
class Laid:
    """One record as the decoder reads it: token ids, where each option ends and where the
    readout is, the option ids in order and the right option's index (None when serving)."""

    ids: list[int]
    option_ends: list[int]
    readout: int
    option_ids: list[str]
    target: int | None


def lay_out(tokenizer, state: str, question: str, options: list[dict],
            label: str | None = None) -> Laid:
    ids = tokenizer.encode(f"Request: {state}\nQuestion: {question}\nOptions:\n",
                           add_special=True, parse_special=False)
    ends = []
    for option in options:
        ids += tokenizer.encode(f"- {option['id']}: {option['text']}\n", add_special=False,
                                parse_special=False)
        ends.append(len(ids) - 1)
    ids += tokenizer.encode("Answer:", add_special=False, parse_special=False)
    option_ids = [o["id"] for o in options]
    return Laid(ids, ends, len(ids) - 1, option_ids,
                option_ids.index(label) if label is not None else None)


def lay_out_split(config: LMDecisionConfig, base, dataset, split: str,
                  reverse_options: bool = False) -> list[Laid]:
    """Every record of a split laid out (its options reversed when asked); a record over
    data.max_len is an error naming it."""
    laid = []
    for record in split_records(dataset, split):
        options = record["options"][::-1] if reverse_options else record["options"]
        item = lay_out(base.tokenizer, record["state"], record["question"], options,
                       record["label"])
        if len(item.ids) > config.data.max_len:
            raise ForgebenchError(
                f"record {record['id']!r} is {len(item.ids)} tokens with its options and "
                f"readout, over data.max_len = {config.data.max_len}",
                path=dataset.root / dataset.manifest.get("records", "records.jsonl"),
                where=f"record {record['id']!r}",
                hint="raise data.max_len, or shorten the request; records are never cut")
        laid.append(item)
    return laid


def option_schema(dataset) -> list[dict]:
    schema = decisions.schema_of(dataset.manifest)
    if schema is None:
        raise ForgebenchError("the decisions dataset declares no option schema",
                              path=dataset.root / MANIFEST, where="field 'options'",
                              hint="add \"options\": [{\"id\": ..., \"text\": ...}, ...]")
    return schema


# -- hidden states and logits ---------------------------------------------------------------
@dataclass
class Features:
    """The decoder's states of a list of records: option ends [N, Kmax, D] (padded), their mask
    [N, Kmax], readouts [N, D], targets [N]."""

    options: torch.Tensor
    mask: torch.Tensor
    readout: torch.Tensor
    target: torch.Tensor

    def take(self, index) -> "Features":
        return Features(self.options[index], self.mask[index], self.readout[index],
                        self.target[index])


def features(model, laid: list[Laid], progress=None) -> Features:
    """Hidden states at every option end and readout, packed PACK_TOKENS at a time, always in
    the same chunks (so a resume recomputes the same bits)."""
    states: list[torch.Tensor] = []
    start = 0
    while start < len(laid):
        stop, tokens = start, 0
        while stop < len(laid) and (stop == start or tokens + len(laid[stop].ids) <= PACK_TOKENS):
            tokens += len(laid[stop].ids)
            stop += 1
        chunk = laid[start:stop]
        states += gather_hidden(model, [x.ids for x in chunk],
                                [x.option_ends + [x.readout] for x in chunk])
        if progress is not None:
            progress.update(len(chunk))
        start = stop
    width = max(len(x.option_ends) for x in laid)
    dim = states[0].shape[1]
    options = torch.zeros(len(laid), width, dim)
    mask = torch.zeros(len(laid), width, dtype=torch.bool)
    for i, (x, h) in enumerate(zip(laid, states)):
        options[i, :len(x.option_ends)] = h[:-1].float()
        mask[i, :len(x.option_ends)] = True
    readout = torch.stack([h[-1].float() for h in states])
    target = torch.tensor([x.target if x.target is not None else -1 for x in laid])
    return Features(options, mask, readout, target)


@torch.no_grad()
def logits_of(head: OptionPointer, feats: Features) -> np.ndarray:
    return head(feats.readout, feats.options, feats.mask).double().numpy()


# -- calibration, reports and plots ---------------------------------------------------------
def slices_of(dataset, split: str) -> dict[str, list[str]]:
    """The dataset's slice fields (dataset.json "slices") -> each record's value, in order."""
    records = split_records(dataset, split)
    return {name: [str(r.get(name)) for r in records]
            for name in dataset.manifest.get("slices", [])}


def calibrate(head: OptionPointer, calibration: Features, val: Features, bins: int,
              max_risk: float, val_slices: dict[str, list[str]]) -> tuple[dict, dict]:
    """(calibration.json: temperature and abstain threshold, the report behind it)."""
    fit_logits, fit_mask = logits_of(head, calibration), calibration.mask.numpy()
    fit = metrics.fit_temperature(fit_logits, fit_mask, calibration.target.numpy())
    z, mask, target = logits_of(head, val), val.mask.numpy(), val.target.numpy()
    before = metrics.softmax(z, mask)
    after = metrics.softmax(z, mask, fit["temperature"])
    abstain = metrics.choose_abstain_threshold(after, target, max_risk)
    curve, curve_before = (metrics.risk_coverage(p, target) for p in (after, before))
    report = {"fit": fit, "val_before": metrics.probability_report(before, mask, target, bins),
              "val_after": metrics.probability_report(after, mask, target, bins),
              "abstain": abstain,
              "risk_coverage_before": {k: v.tolist() for k, v in curve_before.items()},
              "risk_coverage": {k: v.tolist() for k, v in curve.items()},
              "aurc_before": metrics.area_under_risk_coverage(curve_before),
              "aurc_after": metrics.area_under_risk_coverage(curve),
              "slices": {name: metrics.by_slice(values, after, target)
                         for name, values in val_slices.items()}}
    return {"temperature": fit["temperature"], "threshold": abstain["threshold"],
            "max_risk": max_risk, "at_edge": fit["at_edge"]}, report


def write_plots(run: RunDir, name: str, reliabilities: dict[str, list[dict]],
                curves: dict[str, dict], threshold: dict | None) -> list[str]:
    reliability_png = reliability_plot(reliabilities, f"{name}: reliability",
                                       "top-option probability", "fraction right")
    series = [(label, np.r_[0.0, c["coverage"]], np.r_[0.0, c["risk"]], colour, False)
              for colour, (label, c) in zip(RELIABILITY_COLOURS, curves.items())]
    if threshold is not None:
        series.append((f"abstain below {threshold['threshold']:.3f}", [threshold["coverage"]],
                       [threshold["risk"]], "#2f8f2f", True))
    risk_png = unit_plot(series, f"{name}: risk-coverage", "coverage (share answered)",
                         "risk (error rate of answers)")
    return run.write_eval_pngs(name, {"reliability": reliability_png,
                                      "risk-coverage": risk_png})


# -- training -------------------------------------------------------------------------------
class FeatureProgress:
    """The decoder-state pass (minutes for a real model on a CPU): a bar on stderr, and
    status.json's stage line with the count and an ETA, so the app shows more than a stage."""

    def __init__(self, job: Job, total: int):
        self.job, self.total, self.done = job, total, 0
        self.bar = job.progress(total, desc="features")
        self.started = time.monotonic()

    def update(self, count: int) -> None:
        self.done += count
        self.bar.update(count)
        rate = self.done / max(time.monotonic() - self.started, 1e-9)
        eta = (self.total - self.done) / rate
        self.job.run.set_status("stopping" if self.job.stop_requested else "running",
                                step=self.job.step, stage="features",
                                stage_detail=f"decoder states {self.done}/{self.total} "
                                             f"records, ETA {eta:.0f} s")


def decision_data(job: Job):
    """(dataset, option schema, base, laid-out records per split, their decoder features),
    the dataset's checks first (they are cheap), then the frozen base's states, once."""
    config, run = job.config, job.run
    dataset = open_dataset(config, KINDS)
    schema = option_schema(dataset)
    if not dataset.records(config.calibration.split):
        raise ForgebenchError(f"the dataset has no {config.calibration.split!r} records to fit "
                              "the temperature on", path=dataset.root,
                              where="field 'calibration.split'",
                              hint="assign a calibration split (forgebench data split DIR "
                                   "--ratios ...), or set calibration.split = \"val\"")
    job.announce("loading", f"loading base {size_text(base_model(config))} (frozen)")
    base = load_base(config)
    base.model.eval()
    job.announce("encoding", "laying out the train, val and calibration records")
    laid = {split: lay_out_split(config, base, dataset, split)
            for split in dict.fromkeys(("train", "val", config.calibration.split))}
    total = sum(len(v) for v in laid.values())
    job.announce("features", f"decoder states of {total} records (once; the decoder is frozen)")
    progress = FeatureProgress(job, total)
    feats = {split: features(base.model, items, progress) for split, items in laid.items()}
    progress.bar.close()
    run.log_event("data_encoded", **{f"{s}_records": len(v) for s, v in laid.items()},
                  max_tokens=max(len(x.ids) for v in laid.values() for x in v))
    return dataset, schema, base, laid, feats


def train(job: Job) -> None:
    config: LMDecisionConfig = job.config
    run, opt = job.run, config.optim
    torch.manual_seed(config.seed)
    base_sha = run.manifest()["base_model"]["sha256"]
    dataset, schema, base, laid, feats = decision_data(job)
    train_feats = feats["train"]
    head = OptionPointer(train_feats.readout.shape[1], config.head.width)
    optimizer = adamw_for(list(head.named_parameters()), opt)
    state = LoopState.fresh(len(laid["train"]), config.seed)
    if job.resume_from:
        tensors, optimizer_state, trainer_state = load_checkpoint(job.resume_from)
        head.load_state_dict(tensors)
        optimizer.load_state_dict(optimizer_state)
        state.resume(trainer_state)
    contract = decision_contract(config, dataset, schema, base, base_sha, train_feats)

    def save() -> Checkpoint:
        """A checkpoint of the head; the last step's also holds the calibration (fitted now)
        and writes its report."""
        calibration = report = None
        if state.step == config.steps:
            job.stage = "calibrate"
            calibration, report = calibrate(head, feats[config.calibration.split],
                                            feats["val"], config.calibration.bins,
                                            config.calibration.max_risk,
                                            slices_of(dataset, "val"))
        job.stage = "save"
        extra = {DECISION_FILE: json.dumps(contract, indent=2).encode()}
        if calibration is not None:
            extra[CALIBRATION_FILE] = json.dumps(calibration, indent=2).encode()
        checkpoint = save_checkpoint(run, state.step, model_tensors=head.state_dict(),
                                     optimizer=optimizer,
                                     trainer_state=state.trainer_state(
                                         step=state.step, invocation=job.invocation,
                                         base_sha256=base_sha),
                                     extra_files=extra, keep_last=config.keep_last)
        if calibration is not None:
            write_calibration_report(run, job, checkpoint, config, calibration, report)
        return checkpoint

    def validate() -> None:
        z, mask = logits_of(head, feats["val"]), feats["val"].mask.numpy()
        target = feats["val"].target.numpy()
        report = metrics.probability_report(metrics.softmax(z, mask), mask, target,
                                            config.calibration.bins)
        run.log_metric({"invocation": job.invocation, "step": state.step, "split": "val",
                        "loss": report["nll"], **{k: report[k] for k in
                                                  ("accuracy", "brier", "ece")}})

    if not job.resume_from:
        validate()        # step 0: the random head, the plumbing baseline every step must beat
    # (the last step's val row comes with the calibration; an evaluation forces no checkpoint)
    loop = StepLoop(job, state, save, validate, opt, optimizer,
                    warmup=round(opt.warmup_fraction * config.steps), eval_at_end=False,
                    save_on_eval=False)
    head.train()
    loop.run(head_step(job, head, optimizer, train_feats, state))


def decision_contract(config: LMDecisionConfig, dataset, schema: list[dict], base,
                      base_sha: str, train_feats: Features) -> dict:
    """decision.json: the layout, width, option schema and base a head was trained with."""
    questions = Counter(r["question"] for r in split_records(dataset, "train"))
    return {"recipe": "lm-decision", "layout": LAYOUT, "width": config.head.width,
            "dim": int(train_feats.readout.shape[1]), "options": schema,
            "max_len": config.data.max_len, "base": str(base.path), "base_sha256": base_sha,
            "question": questions.most_common(1)[0][0]}


def head_step(job: Job, head: OptionPointer, optimizer, train_feats: Features,
              state: LoopState):
    """One step of the pointer head: a batch of records' cached decoder states, cross-entropy
    over each record's options, one clipped AdamW step."""
    config = job.config

    def step(_step: int, lr: float) -> StepResult:
        job.stage = "forward"
        cursor = state.cursor
        batch = train_feats.take(torch.tensor(cursor.take(config.batch)))
        loss = F.cross_entropy(head(batch.readout, batch.options, batch.mask), batch.target)
        loss_value = float(loss.detach())
        job.stage = "backward"
        loss.backward()
        outcome = optimizer_step(job, list(head.parameters()), optimizer,
                                 config.optim.grad_clip, loss_value)
        return StepResult(loss_value, outcome, config.batch, {"examples": config.batch},
                          {"epoch": cursor.epoch + cursor.position / cursor.n},
                          rate_key="examples_per_s",
                          postfix={"loss": f"{loss_value:.4f}", "lr": f"{lr:.2e}"})

    return step


def write_calibration_report(run: RunDir, job: Job, checkpoint: Checkpoint,
                             config: LMDecisionConfig, calibration: dict, report: dict) -> None:
    """evals/calibration-<checkpoint>.json + its PNGs, and one val metrics row with ECE before
    and after (what the runs pane charts)."""
    name = f"calibration-{checkpoint.name}"
    before, after = report["val_before"], report["val_after"]
    curves = {label: {k: np.asarray(v) for k, v in report[key].items()}
              for label, key in (("before", "risk_coverage_before"),
                                 ("after", "risk_coverage"))}
    plots = write_plots(run, name, {"before": before["reliability"],
                                    "after": after["reliability"]},
                        curves, report["abstain"])
    run.write_eval(name, {"split": "val", "checkpoint": checkpoint.name, "step": checkpoint.step,
                          "fitted_on": config.calibration.split, **calibration, **report,
                          "plots": plots})
    if calibration["at_edge"]:
        run.log_event("warning", message=f"the fitted temperature {calibration['temperature']:.3g}"
                      " is at the end of the grid: the best value may lie outside it")
    run.log_metric({"invocation": job.invocation, "step": checkpoint.step, "split": "val",
                    "loss": after["nll"], "accuracy": after["accuracy"], "ece": after["ece"],
                    "ece_before": before["ece"], "nll_before": before["nll"],
                    "brier": after["brier"], "temperature": calibration["temperature"],
                    "threshold": calibration["threshold"],
                    "coverage": report["abstain"]["coverage"], "risk": report["abstain"]["risk"]})


# -- a trained decision model ---------------------------------------------------------------
@dataclass
class Decider:
    base: object
    head: OptionPointer
    contract: dict
    calibration: dict | None


def load_decider(run: RunDir, checkpoint: Checkpoint) -> Decider:
    """The frozen base (its SHA-256 checked against the run's), the checkpoint's head, its input
    contract and, from a last-step checkpoint, its calibration."""
    config = run_config(run)
    contract = read_json(checkpoint.path / DECISION_FILE)
    base = load_base(config)
    require_same_base(base.path, contract["base_sha256"])
    base.model.eval()
    head = OptionPointer(contract["dim"], contract["width"])
    head.load_state_dict(load_checkpoint(checkpoint)[0])
    head.eval()
    calibration_path = checkpoint.path / CALIBRATION_FILE
    calibration = read_json(calibration_path) if calibration_path.is_file() else None
    return Decider(base, head, contract, calibration)


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Accuracy, NLL, Brier, ECE with reliability bins, and coverage/risk at the saved abstain
    threshold, uncalibrated and with the checkpoint's temperature, accuracy per slice, and the
    sensitivity to option order (every record scored again with its options reversed);
    evals/<split>-<ckpt>.json and its PNGs."""
    config = run_config(run)
    decider = load_decider(run, checkpoint)
    dataset = open_dataset(config, KINDS)
    feats, reversed_feats = (
        features(decider.base.model, lay_out_split(config, decider.base, dataset, split, flip))
        for flip in (False, True))
    run.log_event("split_read", split=split, records=len(feats.target))
    z, mask, target = logits_of(decider.head, feats), feats.mask.numpy(), feats.target.numpy()
    calibration = decider.calibration or {"temperature": 1.0, "threshold": 0.0}
    before = metrics.probability_report(metrics.softmax(z, mask), mask, target,
                                        config.calibration.bins)
    probability = metrics.softmax(z, mask, calibration["temperature"])
    report = metrics.probability_report(probability, mask, target, config.calibration.bins)
    at_threshold = metrics.selective(probability, target, calibration["threshold"])
    name = f"{split}-{checkpoint.name}"
    curve = metrics.risk_coverage(probability, target)
    report.update(at_threshold, split=split, checkpoint=checkpoint.name, step=checkpoint.step,
                  calibrated=decider.calibration is not None,
                  temperature=calibration["temperature"], uncalibrated=before,
                  aurc=metrics.area_under_risk_coverage(curve),
                  slices={name: metrics.by_slice(values, probability, target)
                          for name, values in slices_of(dataset, split).items()},
                  order=metrics.order_sensitivity(probability, metrics.softmax(
                      logits_of(decider.head, reversed_feats), mask,
                      calibration["temperature"]), mask),
                  plots=write_plots(run, name, {"before": before["reliability"],
                                                "after": report["reliability"]},
                                    {"calibrated": curve}, None))
    return record_eval(run, checkpoint, split, report, HEADLINE)


def decide(run: RunDir, checkpoint: Checkpoint, request: str, question: str | None = None,
           option_ids: list[str] | None = None) -> dict:
    """One request: the options' calibrated probabilities, the top option, and the decision
    (the option, or "abstain" below the threshold). Options outside the schema are refused."""
    if not request.strip():
        raise ForgebenchError("the request is empty", where="REQUEST",
                              hint="give the text to decide about")
    decider = load_decider(run, checkpoint)
    schema = decider.contract["options"]
    wanted = option_ids if option_ids else [o["id"] for o in schema]
    outside = decisions.outside_schema(wanted, schema)
    if outside:
        raise ForgebenchError(
            f"option {outside[0]!r} is not in this model's option schema", where="--options",
            hint="choose from " + ", ".join(o["id"] for o in schema))
    by_id = {o["id"]: o for o in schema}
    options = [by_id[i] for i in dict.fromkeys(wanted)]
    problem = decisions.options_problem(options, schema)
    if problem:
        raise ForgebenchError(f"the options {problem}", where="--options")
    laid = lay_out(decider.base.tokenizer, request, question or decider.contract["question"],
                   options)
    if len(laid.ids) > decider.contract["max_len"]:
        raise ForgebenchError(f"the request is {len(laid.ids)} tokens with its options, over "
                              f"the model's max_len {decider.contract['max_len']}",
                              where="REQUEST", hint="shorten the request")
    started = time.perf_counter()
    z = logits_of(decider.head, features(decider.base.model, [laid]))
    calibration = decider.calibration or {"temperature": 1.0, "threshold": 0.0}
    probability = metrics.softmax(z, np.ones_like(z, dtype=bool), calibration["temperature"])[0]
    top = int(probability.argmax())
    answered = probability[top] >= calibration["threshold"]
    return {"decision": laid.option_ids[top] if answered else "abstain",
            "option": laid.option_ids[top], "probability": float(probability[top]),
            "probabilities": {i: float(p) for i, p in zip(laid.option_ids, probability)},
            "temperature": calibration["temperature"], "threshold": calibration["threshold"],
            "calibrated": decider.calibration is not None, "checkpoint": checkpoint.name,
            "question": question or decider.contract["question"],
            "seconds": time.perf_counter() - started}
