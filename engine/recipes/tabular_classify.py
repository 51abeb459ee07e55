"""tabular-classify: a fault alert from one row of readings (handbook chapter 4).

Reads top to bottom: the table's train and val splits, and calibration where it is used (whole
groups, e.g. machines, per split) -> three candidates fitted on train (the training fault rate,
logistic regression on median-imputed standardised features with missingness flags, histogram
gradient boosting with early stopping off so no random row split sneaks in) -> the best by
validation average precision -> Platt scaling (sklearn's sigmoid calibrator) fitted on scores of
rows the scoring model never saw: by default (`calibration = "cross-fit"`) the out-of-fold
scores of train, folds grouped by machine (`CalibratedClassifierCV(model, cv=GroupKFold,
ensemble=False)`: one sigmoid, the model fitted on all of train), or with `calibration =
"split"` the calibration split's scores of the frozen model (the handbook's
`CalibratedClassifierCV(FrozenEstimator(model), method="sigmoid")`) -> an alert threshold chosen
on validation (F1, a recall floor, or a cost) -> reliability bins and ECE before and after
calibration, judged on validation (equal-width ECE, the equal-mass variant, and the ECE a
perfectly calibrated model would show on as many rows, so a change smaller than that noise is
not read as a gain), the confusion matrix in counts, PR curve and reliability PNGs: all of it in
evals/selection-step-000001.json (what was chosen on validation, and why).

The fitted model is stored as arrays (`engine.models.tabular`: model.npz loaded with
allow_pickle=False, meta.json beside it) whose SHA-256 is checked before every use. A fit is
one step: checkpoint step-000001 holds it; resuming a run that died before it refits from the
start, and the same seed gives the same bytes (no pickle, no clock in the model). The test
split is read only by `forgebench eval --split test`, and only once per run: every split read
is an event in events.jsonl, and a second test read is refused.
"""

from __future__ import annotations

import csv
import io

import numpy as np

from engine.data.tabular import TableSplit, table_schema, table_split
from engine.errors import ForgebenchError
from engine.eval import binary
from engine.eval.plot import reliability_plot, unit_plot
from engine.fsutil import atomic_write_bytes, atomic_write_json, read_json
from engine.jobs import Job, run_config
from engine.models.tabular import (
    TabularModel,
    constant_model,
    fit_platt,
    from_sklearn_boosting,
    logistic_design,
    logistic_model,
    logistic_preprocessing,
)
from engine.recipes.tabular_classify_config import TabularClassifyConfig
from engine.rundir import SENTINEL, Checkpoint, RunDir
from engine.train.integrity import checkpoint_problems, file_records
from engine.train.loop import record_eval
from engine.train.media_data import dataset_manifest, open_dataset

KINDS = ("tabular",)
MODEL_FILE, META_FILE = "model.npz", "meta.json"
HEADLINE = ("average_precision", "roc_auc", "brier", "log_loss", "ece", "precision", "recall")


def data_manifest(config: TabularClassifyConfig) -> dict:
    return dataset_manifest(config, KINDS)


def read_split(run: RunDir, dataset, split: str) -> TableSplit:
    """One split's rows; the read is an event, so what a job looked at is on record. Every
    split the recipe reads needs both targets: a model cannot be fitted, calibrated or have
    its average precision measured on rows of one class."""
    data = table_split(dataset, split)
    run.log_event("split_read", split=split, rows=len(data.target))
    present = np.unique(data.target)
    if len(present) < 2:
        target = table_schema(dataset.manifest)["target"]
        raise ForgebenchError(
            f"every {split!r} row has {target} = {int(present[0])}; the alert needs rows of "
            f"both targets in {split!r}", path=dataset.root, where=f"column {target!r}",
            hint="split again so each split holds both (forgebench data split DIR --ratios "
                 "...), or add rows of the missing target as a new dataset version")
    return data


# -- the candidates -----------------------------------------------------------------------
def fit_candidate(name: str, config: TabularClassifyConfig, train: TableSplit) -> TabularModel:
    import sklearn
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression

    versions = {"scikit-learn": sklearn.__version__, "numpy": np.__version__}
    if name == "constant":
        return constant_model(train.target, train.feature_names)
    if name == "logistic":
        settings = config.logistic.model_dump()
        preprocessing = logistic_preprocessing(train.features)
        estimator = LogisticRegression(**settings)
        estimator.fit(logistic_design(train.features, preprocessing), train.target)
        return logistic_model(preprocessing, estimator.coef_, estimator.intercept_[0],
                              train.feature_names, {"settings": settings, **versions})
    settings = config.boosting.model_dump()
    estimator = HistGradientBoostingClassifier(**settings, early_stopping=False,
                                               random_state=config.seed)
    estimator.fit(train.features, train.target)
    return from_sklearn_boosting(estimator, train.feature_names, train.features,
                                 {"settings": settings, **versions})


def cross_fitted_raw(name: str, config: TabularClassifyConfig, rows: TableSplit) -> np.ndarray:
    """Out-of-fold raw scores of `rows`: each fold of whole groups (sklearn's GroupKFold over
    the machines) is scored by a copy of the candidate fitted on the other folds, so no row is
    scored by a model that saw it or any reading of its machine."""
    from sklearn.model_selection import GroupKFold

    folds, groups = config.calibration_folds, len(set(rows.groups))
    other_way = 'or calibration = "split" (a sigmoid on the calibration split)'
    if groups < folds:
        raise ForgebenchError(
            f"cross-fitted calibration needs a group per fold: {folds} folds, but train holds "
            f"{groups} group(s)", where="field 'calibration_folds'",
            hint=(f"set calibration_folds = {groups}, " if groups >= 2 else "") + other_way)
    raw = np.empty(len(rows.target))
    splits = GroupKFold(folds).split(rows.features, rows.target, rows.groups)
    for fold, (fit_index, held_index) in enumerate(splits, 1):
        if len(np.unique(rows.target[fit_index])) < 2:
            raise ForgebenchError(
                f"cross-fitted calibration: the train rows outside fold {fold} of {folds} hold "
                f"only target {int(rows.target[fit_index][0])}, so no model can be fitted on them",
                where="field 'calibration_folds'", hint="use fewer folds, " + other_way)
        raw[held_index] = fit_candidate(name, config, rows.subset(fit_index)).raw(
            rows.features[held_index])
    return raw


# -- reports and plots --------------------------------------------------------------------
def probability_report(target: np.ndarray, probability: np.ndarray, bins: int) -> dict:
    calibration = binary.reliability(target, probability, bins)
    return {"rows": int(len(target)), "positives": int(target.sum()),
            "average_precision": binary.average_precision(target, probability),
            "roc_auc": binary.roc_auc(target, probability),
            "brier": binary.brier(target, probability),
            "log_loss": binary.log_loss(target, probability),
            "ece": calibration["ece"],
            "ece_equal_mass": binary.equal_mass_ece(target, probability, bins),
            "ece_noise_floor": binary.ece_noise_floor(probability, bins),
            "reliability": calibration["bins"]}


def write_plots(run: RunDir, name: str, target: np.ndarray, probability: np.ndarray,
                reliabilities: dict[str, list[dict]]) -> list[str]:
    curve = binary.pr_curve(target, probability)
    pr = unit_plot([("model", np.r_[0.0, curve["recall"]], np.r_[1.0, curve["precision"]],
                     "#1f5fbf", False),
                    ("base rate", [0, 1], [target.mean()] * 2, "#999999", False)],
                   f"{name}: precision-recall", "recall", "precision")
    reliability_png = reliability_plot(reliabilities, f"{name}: reliability",
                                       "mean predicted probability", "observed fault fraction")
    return run.write_eval_pngs(name, {"pr": pr, "reliability": reliability_png})


# -- checkpoint ---------------------------------------------------------------------------
def save_model(run: RunDir, model: TabularModel, extra: dict, job: Job) -> Checkpoint:
    npz, description = model.save()
    with run.staging_checkpoint(1) as staging:
        atomic_write_bytes(staging / MODEL_FILE, npz)
        atomic_write_json(staging / META_FILE, {"recipe": "tabular-classify",
                                                "model": description, **extra})
        files = file_records(staging, [MODEL_FILE, META_FILE])
        atomic_write_json(staging / SENTINEL, {"step": 1, "files": files,
                                               "invocation": job.invocation})
    checkpoint = run.checkpoint(1)
    run.log_event("checkpoint_saved", step=1, checkpoint=checkpoint.name,
                  path=str(checkpoint.path.relative_to(run.path)),
                  bytes=sum(f["size"] for f in files.values()))
    return checkpoint


def load_model(checkpoint: Checkpoint) -> tuple[TabularModel, dict]:
    """The checkpoint's model and meta, after every file's size and SHA-256 match the record
    written at save time."""
    problems = checkpoint_problems(checkpoint)
    if problems:
        raise ForgebenchError("checkpoint is damaged: " + "; ".join(problems),
                              path=checkpoint.path, hint="retrain: forgebench run CONFIG")
    meta = read_json(checkpoint.path / META_FILE)
    model = TabularModel.load((checkpoint.path / MODEL_FILE).read_bytes(), meta["model"])
    return model, meta


# -- evaluation ---------------------------------------------------------------------------
def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """AP, ROC-AUC, Brier, log loss, reliability and the confusion matrix at the saved
    threshold; writes evals/<split>-<checkpoint>.json and its PNGs. The test split is read at
    most once per run."""
    if split == "test":
        earlier = [e for e in run.events() if e.get("kind") == "split_read"
                   and e.get("split") == "test"]
        if earlier:
            raise ForgebenchError(
                "the test split of this run was already read; reading it again would let "
                "its labels steer decisions", path=run.path / "events.jsonl",
                where="split_read event", hint="the earlier result is in evals/test-*.json; "
                "choose on --split val, then start a new run for a fresh test read")
    config = run_config(run)
    model, meta = load_model(checkpoint)
    dataset = open_dataset(config, KINDS)
    data = read_split(run, dataset, split)
    if data.feature_names != model.feature_names:
        raise ForgebenchError(f"the table's features {data.feature_names} differ from the "
                              f"model's {model.feature_names}", path=dataset.root,
                              where="field 'table.features'",
                              hint="use the dataset the run was trained on")
    probability = model.probability(data.features)
    alert = binary.confusion(data.target, probability, meta["threshold"]["threshold"])
    report = probability_report(data.target, probability, config.bins)
    report.update(alert, split=split, checkpoint=checkpoint.name, step=checkpoint.step,
                  family=model.family, calibrated=bool(model.calibration))
    name = f"{split}-{checkpoint.name}"
    report["plots"] = write_plots(run, name, data.target, probability,
                                  {"calibrated" if model.calibration else "model":
                                   report["reliability"]})
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["id", "group", "target", "probability", "alert"])
    for row in zip(data.ids, data.groups, data.target, probability, probability >= alert[
            "threshold"]):
        writer.writerow([row[0], row[1], int(row[2]), f"{row[3]:.6f}", int(row[4])])
    atomic_write_bytes(run.evals_dir / f"{name}-predictions.csv", buffer.getvalue().encode())
    return record_eval(run, checkpoint, split, report, HEADLINE)


# -- training -----------------------------------------------------------------------------
def fit_candidates(job: Job, train_rows, val) -> dict[str, dict]:
    """Every configured candidate fitted on train, with its val average precision (a val row
    each): name -> {"model", "val_average_precision"}."""
    config, candidates = job.config, {}
    for name in config.candidates:
        job.announce("fit", f"fitting {name} on {len(train_rows.target)} rows")
        model = fit_candidate(name, config, train_rows)
        ap = binary.average_precision(val.target, model.uncalibrated(val.features))
        candidates[name] = {"model": model, "val_average_precision": ap}
        job.run.log_metric({"invocation": job.invocation, "step": 1, "split": "val",
                            "candidate": name, "average_precision": ap})
    return candidates


def calibrate_chosen(job: Job, model, chosen: str, train_rows, calibration_rows) -> None:
    """Platt scaling of the chosen model, on the calibration split when there is one, else on
    out-of-fold train scores."""
    config = job.config
    if calibration_rows is not None:
        job.announce("calibrate", f"Platt scaling of {chosen} on the calibration split")
        scores, target = model.raw(calibration_rows.features), calibration_rows.target
    else:
        job.announce("calibrate", f"Platt scaling of {chosen} on out-of-fold train scores "
                                  f"({config.calibration_folds} machine-group folds)")
        scores, target = cross_fitted_raw(chosen, config, train_rows), train_rows.target
    model.calibration = {**fit_platt(scores, target), "method": config.calibration}


def train(job: Job) -> None:
    config: TabularClassifyConfig = job.config
    run = job.run
    if job.resume_from is not None:  # the one step is done: its checkpoint is the model
        return
    on_split = config.calibrate and config.calibration == "split"
    job.announce("load", "reading the train, calibration and val splits" if on_split
                 else "reading the train and val splits")
    dataset = open_dataset(config, KINDS)
    train_rows = read_split(run, dataset, "train")
    calibration_rows = read_split(run, dataset, "calibration") if on_split else None
    val = read_split(run, dataset, "val")

    candidates = fit_candidates(job, train_rows, val)
    chosen = max(candidates, key=lambda n: candidates[n]["val_average_precision"])
    model = candidates[chosen]["model"]

    before = probability_report(val.target, model.uncalibrated(val.features), config.bins)
    if config.calibrate:
        calibrate_chosen(job, model, chosen, train_rows, calibration_rows)
    probability = model.probability(val.features)
    after = probability_report(val.target, probability, config.bins)

    rule = config.threshold
    threshold = binary.choose_threshold(val.target, probability, rule.rule,
                                        min_recall=rule.min_recall, cost_fp=rule.cost_fp,
                                        cost_fn=rule.cost_fn)
    job.stage = "save"
    checkpoint = save_model(run, model, {
        "threshold": threshold, "chosen": chosen, "selection": "validation average precision",
        "candidates": {n: {"val_average_precision": c["val_average_precision"]}
                       for n, c in candidates.items()}}, job)

    # "selection-", not "val-": `forgebench eval --split val` writes val-<checkpoint>.json
    name = f"selection-{checkpoint.name}"
    report = {"split": "val", "checkpoint": checkpoint.name, "step": 1, "chosen": chosen,
              "candidates": {n: c["val_average_precision"] for n, c in candidates.items()},
              "uncalibrated": before, "calibrated": after,
              "calibration": model.calibration, "threshold": threshold,
              "plots": write_plots(run, name, val.target, probability,
                                   {"before": before["reliability"],
                                    "after": after["reliability"]})}
    run.write_eval(name, report)
    run.log_metric({"invocation": job.invocation, "step": 1, "split": "val",
                    "loss": after["log_loss"], "chosen": chosen,
                    **{k: after[k] for k in ("average_precision", "roc_auc", "brier", "ece")},
                    "ece_before": before["ece"], "threshold": threshold["threshold"],
                    "f1": threshold["f1"]})
    run.set_status("running", best_checkpoint=checkpoint.name)
    job.step_done(1)
