"""The Reports pane and its view-model: a run's evaluation reports read from evals/*.json, the
before/after table with what the split can resolve, the confusion matrix in counts, every
scalar figure, and the pictures the report names; checked on the shipped tabular example (a
real tabular-classify run) and on a report written here by `forgebench eval`."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from layout_support import cells_cut_off, labels_cut_off, shown_at
from media_support import forgebench

from app.viewmodels import reports as vm
from app.viewmodels.workspace import Workspace, install_sample_workspace


def _report(tmp_path, record: dict, name: str = "selection-step-000001") -> vm.Report:
    evals = tmp_path / "run" / "evals"
    evals.mkdir(parents=True, exist_ok=True)
    (evals / f"{name}.json").write_text(json.dumps(record))
    return vm.read_report(vm.report_files(tmp_path / "run")[0])


CALIBRATION = {"split": "val", "checkpoint": "step-000001", "step": 1,
               "uncalibrated": {"rows": 200, "ece": 0.053, "ece_noise_floor": 0.062,
                                "log_loss": 0.4293, "reliability": [{"count": 3}]},
               "calibrated": {"rows": 200, "ece": 0.066, "ece_noise_floor": 0.0619,
                              "log_loss": 0.4282, "reliability": [{"count": 3}]},
               "threshold": {"threshold": 0.363, "tn": 132, "fp": 15, "fn": 19, "tp": 34,
                             "rule": "f1"},
               "plots": ["evals/selection-step-000001-pr.png"]}


def test_a_calibration_pair_reads_as_before_and_after_with_what_the_split_resolves(tmp_path):
    report = _report(tmp_path, CALIBRATION)
    before, after, rows = report.pair()
    assert (before, after) == ("uncalibrated", "calibrated")
    assert rows == [("rows", 200, 200), ("ece", 0.053, 0.066),
                    ("ece_noise_floor", 0.062, 0.0619), ("log_loss", 0.4293, 0.4282)]
    notes = report.noise_notes()
    assert len(notes) == 1 and "about 0.062 on its 200 rows" in notes[0]
    assert "the uncalibrated ECE lies below" in notes[0]
    # twin: two ECEs above the floor are a difference the split can show, and get no note
    resolved = json.loads(json.dumps(CALIBRATION))
    resolved["uncalibrated"]["ece"], resolved["calibrated"]["ece"] = 0.15, 0.09
    assert _report(tmp_path / "b", resolved).noise_notes() == []


def test_the_confusion_matrix_comes_from_the_chosen_threshold_or_the_top_level(tmp_path):
    report = _report(tmp_path, CALIBRATION)
    assert report.confusion() == {"tn": 132, "fp": 15, "fn": 19, "tp": 34, "threshold": 0.363}
    html = vm.summary_html(report)
    assert "34 (TP)" in html and "19 (FN)" in html and "15 (FP)" in html and "132 (TN)" in html
    test_report = {"split": "test", "tn": 177, "fp": 33, "fn": 33, "tp": 57, "threshold": 0.31}
    assert _report(tmp_path / "t", test_report, "test-step-000001").confusion()["tp"] == 57
    # twin: counts that are not all there are no matrix
    assert _report(tmp_path / "n", {"split": "val", "tp": 3, "fp": 1}).confusion() is None


def test_figures_list_every_scalar_by_its_path_headline_first(tmp_path):
    report = _report(tmp_path, {"beam": {"raw": {"wer": 0.5}, "clips": 3}, "wer": 0.25,
                                "flag": True, "plots": ["a.png"], "bins": [1, 2]})
    assert report.figures() == [("wer", "0.25"), ("flag", "true"), ("beam.clips", "3"),
                                ("beam.raw.wer", "0.5")]


def test_pictures_are_the_named_plots_else_the_report_s_pngs(tmp_path):
    report = _report(tmp_path, CALIBRATION)
    assert report.pictures() == []                                # named, but not there
    png = tmp_path / "run" / "evals" / "selection-step-000001-pr.png"
    png.write_bytes(b"not read here")
    assert report.pictures() == [png]
    unnamed = _report(tmp_path / "u", {"split": "val"}, "val-step-000002")
    (tmp_path / "u" / "run" / "evals" / "val-step-000002-curve.png").write_bytes(b"x")
    assert [p.name for p in unnamed.pictures()] == ["val-step-000002-curve.png"]


@pytest.fixture
def sample(tmp_path) -> Workspace:
    return Workspace.open(install_sample_workspace(tmp_path / "sample-workspace"))


def test_the_pane_shows_the_tabular_example_s_report_and_pictures(qtbot, sample):
    from app.views.reports_pane import ReportsPane
    pane = shown_at(qtbot, ReportsPane())
    pane.set_workspace(sample)
    runs = [pane.run_combo.itemText(i) for i in range(pane.run_combo.count())]
    assert runs == ["sensor-alert", "shapes-segmenter", "speech-commands"]
    assert pane.run_combo.currentText() == "sensor-alert"
    record = json.loads((sample.runs_dir / "sensor-alert" / "evals" /
                         "selection-step-000001.json").read_text())
    counts = record["threshold"]
    text = pane.summary.text()
    assert f"{counts['tp']} (TP)" in text and f"{counts['tn']} (TN)" in text
    assert "<th>uncalibrated</th><th>calibrated</th>" in text
    assert [p.source.isNull() for p in pane.pictures] == [False, False]     # PR, reliability
    assert [p.toolTip().rsplit("-", 1)[1] for p in pane.pictures] == ["pr.png",
                                                                      "reliability.png"]
    shown = {pane.figures.item(r, 0).text(): pane.figures.item(r, 1).text()
             for r in range(pane.figures.rowCount())}
    assert shown["chosen"] == record["chosen"]
    assert shown["calibrated.ece"] == vm.format_value(record["calibrated"]["ece"])
    qtbot.waitUntil(lambda: labels_cut_off(pane) == [])        # once the layout has settled
    assert cells_cut_off(pane.figures) == []


def test_a_new_report_appears_and_a_rewritten_one_is_read_again(qtbot, sample):
    from app.views.reports_pane import ReportsPane
    pane = shown_at(qtbot, ReportsPane())
    pane.set_workspace(sample)
    run = sample.runs_dir / "sensor-alert"
    forgebench("eval", str(run), "--split", "val")           # a real report, with its PNGs
    pane.refresh_runs()
    names = [pane.report_combo.itemText(i) for i in range(pane.report_combo.count())]
    assert names == ["selection-step-000001", "val-step-000001"]
    assert pane.report_combo.currentText() == "selection-step-000001"     # still chosen
    pane.report_combo.setCurrentIndex(1)
    assert "split val" in pane.summary.text() and len(pane.pictures) == 2
    # the same report written again (another eval) is read again at the next look
    path = run / "evals" / "val-step-000001.json"
    record = json.loads(path.read_text())
    record["tp"] += 1000
    path.write_text(json.dumps(record))
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    pane.refresh_runs()
    assert f"{record['tp']} (TP)" in pane.summary.text()
    # twin: with nothing written, the next look leaves the pane as it was
    before = pane.summary.text()
    pane.refresh_runs()
    assert pane.summary.text() == before
    shutil.rmtree(run / "evals")                             # a run without reports leaves
    pane.refresh_runs()
    assert pane.run_combo.findText("sensor-alert") < 0


def test_a_damaged_report_is_listed_and_says_what_is_wrong_with_it(qtbot, sample):
    from app.views.reports_pane import ReportsPane
    evals = sample.runs_dir / "sensor-alert" / "evals"
    (evals / "val-step-000001.json").write_text('{"split": "val", "ece": 0.0')   # cut short
    pane = shown_at(qtbot, ReportsPane())
    pane.set_workspace(sample)
    assert pane.report_combo.currentText() == "selection-step-000001"      # twin: read whole
    assert "(TP)" in pane.summary.text()
    pane.report_combo.setCurrentIndex(pane.report_combo.findText("val-step-000001"))
    text = pane.summary.text()
    assert "cannot read the report" in text and "val-step-000001.json" in text
    assert "forgebench eval RUN --split val" in text
    assert pane.pictures == [] and pane.figures.rowCount() == 0
