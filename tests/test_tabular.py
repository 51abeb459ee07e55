"""tabular-classify and the tabular dataset kind, checked against independent references:
scikit-learn's metrics and pipelines, brute-force threshold sweeps, an ECE worked by hand, the
handbook's chapter-4 figures, and real `python -m engine` runs (the test split read once)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.data.dataset import load_dataset, validate_dataset, write_manifest
from engine.data.generators.sensors import generate_sensors
from engine.data.tabular import table_split
from engine.errors import ForgebenchError
from engine.eval import binary
from engine.models import tabular as tm
from tests.lm_pretrain_support import forgebench

sklearn = pytest.importorskip("sklearn")
from sklearn import metrics as skm  # noqa: E402
from sklearn.ensemble import HistGradientBoostingClassifier  # noqa: E402
from sklearn.impute import SimpleImputer  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "resources" / "sample-workspace" / "datasets" / "sensors"
HANDBOOK = {"val_ap": {"boosting": 0.703, "logistic": 0.681, "constant": 0.240},
            "test_ap": 0.693, "test_roc_auc": 0.788}


def scored(seed: int, n: int = 300):
    rng = np.random.default_rng(seed)
    target = rng.integers(0, 2, n)
    score = np.round(rng.random(n) * 0.6 + 0.3 * target, 2)  # rounding makes ties
    return target, score


# -- metrics against sklearn and brute force ----------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranking_and_probability_metrics_match_sklearn(seed):
    target, score = scored(seed)
    assert binary.average_precision(target, score) == pytest.approx(
        skm.average_precision_score(target, score), abs=1e-12)
    assert binary.roc_auc(target, score) == pytest.approx(skm.roc_auc_score(target, score),
                                                          abs=1e-12)
    assert binary.brier(target, score) == pytest.approx(skm.brier_score_loss(target, score))
    assert binary.log_loss(target, score) == pytest.approx(skm.log_loss(target, score))
    precision, recall, _ = skm.precision_recall_curve(target, score)
    curve = binary.pr_curve(target, score)
    # sklearn lists thresholds ascending and appends the (recall 0, precision 1) end point
    np.testing.assert_allclose(curve["precision"][::-1], precision[:-1])
    np.testing.assert_allclose(curve["recall"][::-1], recall[:-1])
    # twin: the interpolated (trapezoid) area is a different number on the same data, so the
    # comparison above is sharp enough to catch the common mis-definition of AP
    assert abs(skm.auc(recall, precision) - binary.average_precision(target, score)) > 1e-4


@pytest.mark.parametrize("rule", ["f1", "recall_floor", "cost"])
def test_threshold_choice_equals_a_brute_force_sweep(rule):
    target, score = scored(3)
    chosen = binary.choose_threshold(target, score, rule, min_recall=0.7, cost_fp=1, cost_fn=4)
    best_value, best_threshold = None, None
    for t in sorted(set(score.tolist()), reverse=True):
        alert = score >= t
        tp, fp = int(np.sum(alert & (target == 1))), int(np.sum(alert & (target == 0)))
        fn = int(np.sum(~alert & (target == 1)))
        assert binary.confusion(target, score, t)["tp"] == tp
        recall, precision = tp / (tp + fn), tp / (tp + fp)
        value = {"f1": skm.f1_score(target, alert),
                 "recall_floor": precision if recall >= 0.7 else -1,
                 "cost": -(fp + 4 * fn)}[rule]
        if best_value is None or value > best_value + 1e-12:
            best_value, best_threshold = value, t
    assert chosen["threshold"] == best_threshold
    tn, fp, fn, tp = skm.confusion_matrix(target, score >= best_threshold).ravel()
    assert (chosen["tn"], chosen["fp"], chosen["fn"], chosen["tp"]) == (tn, fp, fn, tp)


def test_ece_and_reliability_bins_by_hand():
    probability = np.array([0.05, 0.15, 0.12, 0.95, 0.85, 1.0])
    target = np.array([0, 1, 0, 1, 0, 1])
    result = binary.reliability(target, probability, bins=10)
    # bin 0: {0.05} all negative -> 0.05; bin 1: {0.15, 0.12} half positive -> |0.135-0.5|*2;
    # bin 8: {0.85} negative -> 0.85; bin 9: {0.95, 1.0} positive -> |0.975-1|*2; over 6 rows
    assert result["ece"] == pytest.approx((0.05 + 0.365 * 2 + 0.85 + 0.025 * 2) / 6)
    counts = [b["count"] for b in result["bins"]]
    assert counts == [1, 2, 0, 0, 0, 0, 0, 0, 1, 2]
    assert result["bins"][1]["mean_probability"] == pytest.approx(0.135)
    assert result["bins"][9]["positive_fraction"] == 1.0
    assert result["bins"][2]["mean_probability"] is None


def test_equal_mass_ece_and_noise_floor_by_hand():
    # two bins of two rows: {0.1, 0.2} half positive -> |0.15-0.5|; {0.3, 0.4} -> |0.35-0.5|
    probability, target = np.array([0.3, 0.1, 0.4, 0.2]), np.array([0, 0, 1, 1])
    assert binary.equal_mass_ece(target, probability, bins=2) == pytest.approx(0.25)
    # p = 0.5 on every row: ECE = |mean(y) - 0.5|, whose mean over binomial draws of 100 rows
    # is E|Binomial(100, 0.5)/100 - 0.5| = 0.0398 (exact sum over the binomial)
    from math import comb
    exact = sum(comb(100, k) * abs(k / 100 - 0.5) for k in range(101)) / 2 ** 100
    assert binary.ece_noise_floor(np.full(100, 0.5), draws=2000) == pytest.approx(exact, abs=4e-3)
    assert binary.ece_noise_floor(np.full(10000, 0.5)) < 0.01   # more rows, lower floor


# -- the portable models against sklearn --------------------------------------------------
def features_with_gaps(seed: int, n: int = 600):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = (x[:, 0] + (x[:, 2] > 0.8) * 2 + rng.normal(size=n) > 0.8).astype(int)
    x[rng.random(x.shape) < 0.05] = np.nan
    return x, y


def test_boosting_copy_reproduces_sklearn_and_refuses_a_wrong_copy(monkeypatch):
    x, y = features_with_gaps(0)
    estimator = HistGradientBoostingClassifier(max_iter=30, max_leaf_nodes=7,
                                               early_stopping=False, random_state=0).fit(x, y)
    model = tm.from_sklearn_boosting(estimator, list("abcd"), x, {})
    fresh, _ = features_with_gaps(1)
    np.testing.assert_allclose(model.uncalibrated(fresh), estimator.predict_proba(fresh)[:, 1],
                               rtol=1e-10, atol=1e-12)
    npz, description = model.save()
    reloaded = tm.TabularModel.load(npz, json.loads(json.dumps(description)))
    np.testing.assert_array_equal(reloaded.raw(fresh), model.raw(fresh))
    # twin: a copy that sends missing values the wrong way is caught at fit time
    original = tm._boosting_raw
    monkeypatch.setattr(tm, "_boosting_raw", lambda f, a: original(
        f, dict(a, missing_go_to_left=~a["missing_go_to_left"])))
    with pytest.raises(ValueError, match="disagrees"):
        tm.from_sklearn_boosting(estimator, list("abcd"), x, {})


def test_logistic_preprocessing_matches_an_sklearn_pipeline():
    x, y = features_with_gaps(2)
    reference = make_pipeline(SimpleImputer(strategy="median", add_indicator=True),
                              StandardScaler(), LogisticRegression(C=1.0, max_iter=1000))
    reference.fit(x, y)
    preprocessing = tm.logistic_preprocessing(x)
    estimator = LogisticRegression(C=1.0, max_iter=1000).fit(
        tm.logistic_design(x, preprocessing), y)
    model = tm.logistic_model(preprocessing, estimator.coef_, estimator.intercept_[0],
                              list("abcd"), {})
    fresh, _ = features_with_gaps(3)
    np.testing.assert_allclose(model.uncalibrated(fresh), reference.predict_proba(fresh)[:, 1],
                               atol=1e-6)


def sample_splits() -> dict:
    dataset = load_dataset(SAMPLE)
    return {s: table_split(dataset, s) for s in ("train", "calibration", "val", "test")}


def boosting_reference(config):
    """sklearn's own estimator with the recipe's boosting settings (the reference side)."""
    return HistGradientBoostingClassifier(**config.boosting.model_dump(), early_stopping=False,
                                          random_state=config.seed)


def test_cross_fit_refuses_fewer_groups_than_folds_and_a_fold_that_leaves_one_class():
    """Each fold is whole groups, so the folds need as many groups, and the rows outside a
    fold must hold both targets for a model to be fitted on them: a clear error (the field
    and what to set), not sklearn's ValueError from inside the fit."""
    from engine.data.tabular import TableSplit
    from engine.recipes.tabular_classify import cross_fitted_raw
    from engine.recipes.tabular_classify_config import TabularClassifyConfig
    config = TabularClassifyConfig(data={"dir": str(SAMPLE)}, calibration_folds=5)
    rng = np.random.default_rng(0)

    def rows(groups: list[str], target: list[int]) -> TableSplit:
        return TableSplit(rng.normal(size=(len(target), 2)), np.array(target),
                          [f"r{i}" for i in range(len(target))], groups, ["a", "b"])

    with pytest.raises(ForgebenchError) as error:
        cross_fitted_raw("logistic", config, rows(list("aabbccdd"), [0, 1] * 4))
    assert error.value.where == "field 'calibration_folds'"
    assert "train holds 4 group(s)" in str(error.value) and "calibration_folds = 4" in str(
        error.value)
    # every positive in group e: the model for e's fold would see only negatives
    with pytest.raises(ForgebenchError, match=r"outside fold \d of 5 hold only target 0"):
        cross_fitted_raw("logistic", config, rows(list("aabbccddee"), [0] * 8 + [1, 1]))
    # the twin: five groups, each with both targets, are scored out of fold
    raw = cross_fitted_raw("logistic", config, rows(list("aabbccddee"), [0, 1] * 5))
    assert raw.shape == (10,) and np.isfinite(raw).all()


def test_split_calibration_equals_sklearns_frozen_sigmoid_calibrator():
    """The handbook's calibrator, CalibratedClassifierCV(FrozenEstimator(model),
    method="sigmoid") on the calibration split, gives the probabilities our Platt fit gives;
    the twin, the same sigmoid fitted on the validation rows it would be judged on, does not."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.frozen import FrozenEstimator

    from engine.recipes.tabular_classify import fit_candidate
    from engine.recipes.tabular_classify_config import TabularClassifyConfig

    splits = sample_splits()
    train, calibration, val = splits["train"], splits["calibration"], splits["val"]
    config = TabularClassifyConfig(data={"dir": str(SAMPLE)}, seed=42)
    model = fit_candidate("boosting", config, train)
    model.calibration = tm.fit_platt(model.raw(calibration.features), calibration.target)
    ours = model.probability(val.features)
    estimator = boosting_reference(config).fit(train.features, train.target)
    reference = CalibratedClassifierCV(FrozenEstimator(estimator), method="sigmoid").fit(
        calibration.features, calibration.target).predict_proba(val.features)[:, 1]
    assert np.max(np.abs(ours - reference)) < 1e-6

    model.calibration = tm.fit_platt(model.raw(val.features), val.target)   # the twin
    assert np.max(np.abs(model.probability(val.features) - reference)) > 1e-3


def test_cross_fitted_calibration_equals_sklearn_on_machine_group_folds():
    """calibration = "cross-fit" is CalibratedClassifierCV(model, method="sigmoid",
    cv=GroupKFold by machine, ensemble=False): the same probabilities; the twin, sklearn on
    row-level folds that split machines, differs, so the check sees a group leak."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.model_selection import GroupKFold, KFold

    from engine.recipes.tabular_classify import cross_fitted_raw, fit_candidate
    from engine.recipes.tabular_classify_config import TabularClassifyConfig

    splits = sample_splits()
    train, val = splits["train"], splits["val"]
    config = TabularClassifyConfig(data={"dir": str(SAMPLE)}, seed=42, calibration="cross-fit")
    model = fit_candidate("boosting", config, train)
    model.calibration = tm.fit_platt(cross_fitted_raw("boosting", config, train), train.target)
    ours = model.probability(val.features)

    def reference(folds) -> np.ndarray:
        calibrated = CalibratedClassifierCV(boosting_reference(config), method="sigmoid",
                                            cv=list(folds), ensemble=False)
        return calibrated.fit(train.features, train.target).predict_proba(val.features)[:, 1]

    grouped = GroupKFold(5).split(train.features, train.target, train.groups)
    assert np.max(np.abs(ours - reference(grouped))) < 1e-6
    rows = KFold(5, shuffle=True, random_state=0).split(train.features)
    assert np.max(np.abs(ours - reference(rows))) > 1e-3


# -- the generator and the handbook -------------------------------------------------------
def test_sample_table_has_the_handbook_structure_and_figures():
    from engine.recipes.tabular_classify import fit_candidate
    from engine.recipes.tabular_classify_config import TabularClassifyConfig

    dataset = load_dataset(SAMPLE)
    splits = {s: table_split(dataset, s) for s in ("train", "calibration", "val", "test")}
    assert {s: len(d.target) for s, d in splits.items()} == {
        "train": 1200, "calibration": 300, "val": 200, "test": 300}
    groups = [set(d.groups) for d in splits.values()]
    assert sum(len(g) for g in groups) == len(set().union(*groups)) == 400  # machine-disjoint
    assert 0.02 < np.isnan(splits["train"].features).mean() < 0.05
    config = TabularClassifyConfig(data={"dir": str(SAMPLE)}, seed=42)
    val_ap, models = {}, {}
    for name in ("constant", "logistic", "boosting"):
        models[name] = fit_candidate(name, config, splits["train"])
        val_ap[name] = binary.average_precision(splits["val"].target,
                                                models[name].uncalibrated(splits["val"].features))
    for name, figure in HANDBOOK["val_ap"].items():
        assert val_ap[name] == pytest.approx(figure, abs=0.05), (name, val_ap)
    assert val_ap["boosting"] > val_ap["logistic"] > val_ap["constant"]
    test_probability = models["boosting"].uncalibrated(splits["test"].features)
    # 300 test rows: AP and ROC-AUC move by several hundredths between seeds
    assert binary.average_precision(splits["test"].target, test_probability) == pytest.approx(
        HANDBOOK["test_ap"], abs=0.06)
    assert binary.roc_auc(splits["test"].target, test_probability) == pytest.approx(
        HANDBOOK["test_roc_auc"], abs=0.06)


def test_generator_is_deterministic_and_matches_the_sample(tmp_path):
    generate_sensors(tmp_path / "again", machines=400, seed=42)
    assert (tmp_path / "again" / "rows.csv").read_bytes() == (SAMPLE / "rows.csv").read_bytes()


# -- bad input ----------------------------------------------------------------------------
def edited_table(tmp_path: Path, edit) -> Path:
    """A copy of a small generated table with `edit(lines)` applied and the manifest rehashed."""
    root = tmp_path / "table"
    generate_sensors(root, machines=20, seed=0)
    lines = (root / "rows.csv").read_text().splitlines()
    (root / "rows.csv").write_text("\n".join(edit(lines)) + "\n")
    manifest = json.loads((root / "dataset.json").read_text())
    (root / "dataset.json").unlink()
    keep = {k: v for k, v in manifest.items()
            if k not in ("kind", "name", "version", "parent", "files", "created",
                         "schema_version")}
    write_manifest(root, "tabular", "table", **keep)
    return root


def replace_cell(lines, line_number, column, value):
    header = lines[0].split(",")
    cells = lines[line_number - 1].split(",")
    cells[header.index(column)] = value
    return lines[:line_number - 1] + [",".join(cells)] + lines[line_number:]


@pytest.mark.parametrize("edit,where,field,reason", [
    (lambda lines: replace_cell(lines, 4, "load", "high"), "line 4", "load", "not a number"),
    (lambda lines: replace_cell(lines, 7, "fault", ""), "line 7", "fault", "missing (NaN)"),
    (lambda lines: replace_cell(lines, 9, "fault", "nan"), "line 9", "fault", "missing (NaN)"),
    (lambda lines: replace_cell(lines, 5, "age", "inf"), "line 5", "age", "not a finite"),
    (lambda lines: [",".join(c for c in line.split(",")[:-2] + line.split(",")[-1:])
                    for line in lines], "line 1 (header)", "age", "missing from the header"),
])
def test_bad_cells_name_line_and_column(tmp_path, edit, where, field, reason):
    root = edited_table(tmp_path, edit)
    report = validate_dataset(root)
    first = report.errors[0]
    assert first.where.startswith(where) and first.field == field and reason in first.reason
    with pytest.raises(ForgebenchError) as caught:
        load_dataset(root)
    assert caught.value.path.endswith("rows.csv") and field in caught.value.where
    assert "forgebench data validate" in caught.value.hint


def test_data_split_keeps_each_machine_in_one_split(tmp_path):
    """A table without a split column gets whole machines per split from `assign_splits`
    (the table's group column is the split unit), and the recipe can read all four."""
    from engine.data.splits import assign_splits, parse_ratios

    def drop_split(lines):
        index = lines[0].split(",").index("split")
        return [",".join(c for i, c in enumerate(line.split(",")) if i != index)
                for line in lines]

    root = edited_table(tmp_path, drop_split)
    result = assign_splits(root, parse_ratios("0.6,0.1,0.15,0.15"), seed=3)
    dataset = load_dataset(result["path"])
    machine_split = {}
    for record in dataset.records():
        assert machine_split.setdefault(record["machine"], record["split"]) == record["split"]
    assert len(machine_split) == 20 and sum(result["counts"].values()) == 100
    for split in ("train", "val", "calibration", "test"):
        if result["counts"][split]:
            assert len(table_split(dataset, split).target) == result["counts"][split]


def test_empty_feature_cell_is_missing_not_zero(tmp_path):
    root = edited_table(tmp_path, lambda lines: replace_cell(lines, 2, "load", ""))
    split = load_dataset(root).records()[0]["split"]
    data = table_split(load_dataset(root), split)
    assert np.isnan(data.features[data.ids.index("m00000-r0"), data.feature_names.index("load")])


def test_a_table_without_a_schema_is_refused(tmp_path):
    root = tmp_path / "t"
    generate_sensors(root, machines=20, seed=0)
    manifest = json.loads((root / "dataset.json").read_text())
    del manifest["table"]
    (root / "dataset.json").write_text(json.dumps(manifest))
    assert any("needs a 'table' section" in f.reason for f in validate_dataset(root).errors)


# -- real runs ----------------------------------------------------------------------------
def write_run_config(tmp_path: Path, data: Path, top: str = "") -> Path:
    text = (REPO / "resources" / "configs" / "tabular-classify.toml").read_text()
    path = tmp_path / "tabular.toml"
    path.write_text(top + text.replace('dir = "datasets/sensors"', f'dir = "{data}"'))
    return path


def split_reads(run: Path) -> list[str]:
    return [json.loads(line)["split"] for line in (run / "events.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "split_read"]


def test_run_then_eval_reads_the_test_split_once(tmp_path):
    data = tmp_path / "sensors"
    shutil.copytree(SAMPLE, data)
    config = write_run_config(tmp_path, data)
    run = tmp_path / "run"
    forgebench("run", str(config), "--out", str(run))
    assert sorted(split_reads(run)) == ["train", "val"]   # never test (nor calibration: cross-fit)
    checkpoint = run / "checkpoints" / "step-000001"
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["chosen"] == "boosting"
    assert meta["model"]["calibration"]["method"] == "cross-fit"
    assert meta["model"]["calibration"]["rows"] == 1200   # every train row, scored out of fold
    val = json.loads((run / "evals" / "selection-step-000001.json").read_text())
    assert val["threshold"]["rule"] == "f1" and 0 < val["threshold"]["threshold"] < 1
    assert {"ece", "ece_equal_mass", "ece_noise_floor"} <= set(val["uncalibrated"]) & set(
        val["calibrated"])
    for name in ("pr", "reliability"):
        assert Image.open(run / "evals" / f"selection-step-000001-{name}.png").size == (520, 420)

    again = json.loads(forgebench("eval", str(run), "--split", "val").stdout)  # val: any time
    assert again["average_precision"] == pytest.approx(val["calibrated"]["average_precision"])
    assert again["tp"] == val["threshold"]["tp"] and again["fp"] == val["threshold"]["fp"]
    assert (run / "evals" / "selection-step-000001.json").is_file()
    result = json.loads(forgebench("eval", str(run), "--split", "test").stdout)
    assert split_reads(run).count("test") == 1
    assert result["tn"] + result["fp"] + result["fn"] + result["tp"] == result["rows"] == 300
    predictions = (run / "evals" / "test-step-000001-predictions.csv").read_text().splitlines()
    assert len(predictions) == 301
    second = forgebench("eval", str(run), "--split", "test", check=False)
    assert second.returncode == 2 and second.stderr.startswith("error:")
    assert "already read" in second.stderr and split_reads(run).count("test") == 1

    # a tampered model file is refused by its SHA-256 before anything is predicted
    with open(checkpoint / "model.npz", "r+b") as handle:
        handle.seek(200)
        handle.write(b"\x00\x01\x02")
    damaged = forgebench("eval", str(run), "--split", "val", check=False)
    assert damaged.returncode == 2 and "different SHA-256" in damaged.stderr


def test_split_calibration_reads_the_calibration_split_once_and_fits_on_its_rows(tmp_path):
    data = tmp_path / "sensors"
    shutil.copytree(SAMPLE, data)
    config = write_run_config(tmp_path, data)
    config.write_text(config.read_text().replace('calibration = "cross-fit"',
                                                 'calibration = "split"'))
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    assert sorted(split_reads(tmp_path / "run")) == ["calibration", "train", "val"]
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step-000001" / "meta.json")
                      .read_text())
    assert meta["model"]["calibration"]["method"] == "split"
    assert meta["model"]["calibration"]["rows"] == 300


OVERCONFIDENT_BOOSTING = {"learning_rate = 0.06": "learning_rate = 0.5",
                          "max_iter = 120": "max_iter = 300",
                          "max_leaf_nodes = 7": "max_leaf_nodes = 31",
                          "min_samples_leaf = 25": "min_samples_leaf = 2",
                          "l2_regularization = 1.0": "l2_regularization = 0.0"}


@pytest.mark.parametrize("method", ["cross-fit", "split"])
def test_calibration_cuts_an_overconfident_models_validation_ece_past_the_noise(tmp_path,
                                                                              method):
    """The shipped boosting is nearly calibrated already (its true ECE is about 0.03, under the
    0.06 that 200 validation rows show by chance), so validation cannot see its calibration
    help. Boosting that overfits (big steps, deep trees, no penalty) is overconfident: its
    validation ECE is about 0.18, and the sigmoid must bring it down by more than the noise
    floor. The twin: with calibrate = false the report's two columns are the same model."""
    data = tmp_path / "sensors"
    shutil.copytree(SAMPLE, data)
    text = write_run_config(tmp_path, data).read_text()
    for old, new in OVERCONFIDENT_BOOSTING.items():
        assert old in text
        text = text.replace(old, new)
    text = text.replace('calibration = "cross-fit"', f'calibration = "{method}"')
    reports = {}
    for calibrate in ("true", "false"):
        config = tmp_path / f"{calibrate}.toml"
        config.write_text(text.replace("calibrate = true", f"calibrate = {calibrate}")
                          .replace('candidates = ["constant", "logistic", "boosting"]',
                                   'candidates = ["boosting"]'))
        forgebench("run", str(config), "--out", str(tmp_path / calibrate))
        reports[calibrate] = json.loads(
            (tmp_path / calibrate / "evals" / "selection-step-000001.json").read_text())
    before, after = reports["true"]["uncalibrated"], reports["true"]["calibrated"]
    assert before["ece"] > 2 * before["ece_noise_floor"]            # overconfident indeed
    assert before["ece"] - after["ece"] > after["ece_noise_floor"], (before["ece"], after["ece"])
    assert after["log_loss"] < before["log_loss"]
    twin = reports["false"]
    assert twin["calibrated"]["ece"] == twin["uncalibrated"]["ece"] == before["ece"]


def test_same_seed_gives_the_same_model_bytes(tmp_path):
    """A fit is one step: resume means refitting, and it only works because the fit is
    deterministic; two runs of one config must write identical model files."""
    data = tmp_path / "sensors"
    shutil.copytree(SAMPLE, data)
    config = write_run_config(tmp_path, data)
    digests = []
    for name in ("a", "b"):
        forgebench("run", str(config), "--out", str(tmp_path / name))
        digests.append((tmp_path / name / "checkpoints" / "step-000001" / "model.npz")
                       .read_bytes())
    assert digests[0] == digests[1]


def test_bad_table_fails_the_run_with_exit_2(tmp_path):
    data = edited_table(tmp_path, lambda lines: replace_cell(lines, 3, "vibration", "n/a"))
    config = write_run_config(tmp_path, data)
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), check=False)
    assert result.returncode == 2
    assert "rows.csv: line 3" in result.stderr and "'vibration'" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_split_of_one_target_fails_the_run_with_the_column_and_split(tmp_path):
    """No fault among the val rows: the average precision the candidates are chosen by is
    undefined, so the run stops with exit 2 and says which split and column (sklearn would
    warn and choose by NaN, or raise from inside a fit for a one-class train)."""
    def no_val_faults(lines):
        header = lines[0].split(",")
        split, fault = header.index("split"), header.index("fault")
        rows = [line.split(",") for line in lines[1:]]
        for row in rows:
            if row[split] == "val":
                row[fault] = "0"
        return lines[:1] + [",".join(row) for row in rows]

    config = write_run_config(tmp_path, edited_table(tmp_path, no_val_faults))
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), check=False)
    assert result.returncode == 2 and result.stderr.startswith("error:")
    assert "column 'fault': every 'val' row has fault = 0" in result.stderr
    assert "Traceback" not in result.stderr
    twin = write_run_config(tmp_path, edited_table(tmp_path / "twin", lambda lines: lines))
    assert forgebench("run", str(twin), "--out", str(tmp_path / "twin-run"),
                      check=False).returncode == 0


# -- the app's per-column statistics ------------------------------------------------------


def test_column_stats_agree_with_the_arrays_the_recipe_reads():
    from app.viewmodels.datasets import DatasetTable, column_stats

    stats = {s.column: s for s in column_stats(DatasetTable(SAMPLE))}
    dataset = load_dataset(SAMPLE)
    splits = [table_split(dataset, s) for s in ("train", "calibration", "val", "test")]
    features = np.vstack([s.features for s in splits])
    target = np.concatenate([s.target for s in splits])
    for j, name in enumerate(splits[0].feature_names):
        column = features[:, j]
        assert stats[name].role == "feature"
        assert stats[name].missing == int(np.isnan(column).sum())
        assert stats[name].mean == pytest.approx(np.nanmean(column))
        assert stats[name].std == pytest.approx(np.nanstd(column))
        assert (stats[name].minimum, stats[name].maximum) == (np.nanmin(column),
                                                              np.nanmax(column))
    assert stats["fault"].role == "target" and stats["fault"].mean == pytest.approx(target.mean())
    assert stats["machine"].distinct == 400 and stats["machine"].filled == 2000
    groups = DatasetTable(SAMPLE).groups()                  # the Splits tab counts machines
    assert len(groups) == 400 and all(count == 5 and "/" not in split
                                      for _, split, count in groups)
    assert column_stats(DatasetTable(REPO / "resources" / "sample-workspace" / "datasets"
                                     / "records")) == []


def test_stats_tab_shows_the_column_table(qtbot):
    from app.viewmodels.datasets import DatasetTable
    from app.views.dataset_tabs.stats import COLUMN_HEADERS, StatsTab

    tab = StatsTab()
    qtbot.addWidget(tab)
    tab.set_table(DatasetTable(SAMPLE))
    tab.fill()
    assert tab.columns.rowCount() == 6 and not tab.columns.isHidden()
    cells = {tab.columns.item(i, 0).text(): [tab.columns.item(i, j).text()
                                             for j in range(len(COLUMN_HEADERS))]
             for i in range(tab.columns.rowCount())}
    assert cells["machine"][1:4] == ["group", "2000", "0"] and cells["machine"][8] == "400"
    assert cells["load"][1] == "feature" and float(cells["load"][6]) >= 0
    tab.set_table(DatasetTable(REPO / "resources" / "sample-workspace" / "datasets" / "records"))
    tab.fill()
    assert tab.columns.rowCount() == 0 and tab.columns.isHidden()


def test_config_refuses_unknown_keys_and_a_second_step():
    from engine.config import validate_config

    base = {"recipe": "tabular-classify", "data": {"dir": "x"}}
    assert validate_config(base).boosting.max_leaf_nodes == 7          # the handbook default
    for bad, field in (({"boostng": {}}, "boostng"), ({"steps": 2}, "steps"),
                       ({"threshold": {"rule": "accuracy"}}, "threshold.rule"),
                       ({"candidates": []}, "candidates")):
        with pytest.raises(ForgebenchError, match=f"field '{field}'"):
            validate_config({**base, **bad})
