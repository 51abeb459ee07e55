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
    assert runs == ["cartridge-guide", "sensor-alert", "shapes-segmenter", "speech-commands"]
    assert pane.run_combo.currentText() == "cartridge-guide"         # the first listed
    pane.show_run(sample.runs_dir / "sensor-alert")
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
    pane.show_run(run)
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
    pane.show_run(sample.runs_dir / "sensor-alert")
    assert pane.report_combo.currentText() == "selection-step-000001"      # twin: read whole
    assert "(TP)" in pane.summary.text()
    pane.report_combo.setCurrentIndex(pane.report_combo.findText("val-step-000001"))
    text = pane.summary.text()
    assert "cannot read the report" in text and "val-step-000001.json" in text
    assert "forgebench eval RUN --split val" in text
    assert pane.pictures == [] and pane.figures.rowCount() == 0


# -- an lm-cartridge run's held-out comparison ----------------------------------------------
def _condition(logprob: float, f1: float | None, tokens: int, ttft: float) -> dict:
    figures = {"logprob_per_token": logprob, "logprob_sum": logprob * 172,
               "kv_prefix_tokens": tokens, "kv_prefix_bytes_f16": tokens * 18432,
               "mean_ttft_s": ttft}
    if f1 is not None:
        figures["answer_f1"] = f1
    return figures


def _question(text: str, logprobs: tuple, f1s: tuple) -> dict:
    row = {"question": text, "reference": "The queue is kept in runs/.launch/queue.json.",
           "source": "hand-written"}
    for condition, logprob, f1 in zip(vm.CONDITIONS, logprobs, f1s):
        row[condition] = {"logprob": logprob * 10, "logprob_per_token": logprob,
                          "answer": f"{condition} says", "answer_f1": f1, "ttft_s": 0.5}
    return row


def cartridge_record(f1: tuple = (0.05, 0.10, 0.30)) -> dict:
    """The figures of an earlier run of the sample workspace's example (gemma-3-270m, p = 256
    rows, 18,432 f16 bytes of KV per token, before answer F1 was scored), F1s added."""
    return {"split": "heldout", "checkpoint": "step-000006", "step": 6,
            "systems": {"no document": _condition(-3.8492, f1[0], 0, 0.561),
                        "whole document": _condition(-1.8499, f1[1], 2561, 50.918),
                        "cartridge": _condition(-3.1443, f1[2], 256, 0.867)},
            "questions": [_question("Where is the queue kept?", (-4.0, -1.5, -2.5),
                                    (0.0, 0.5, 0.25)),
                          _question("What does Stop do?", (-3.0, -2.0, -3.5), (0.1, 0.2, 0.3))],
            "reference_tokens": 172, "kv_bytes_per_token_f16": 18432}


def test_a_cartridge_comparison_reads_as_three_conditions_with_the_best_of_each(tmp_path):
    comparison = vm.cartridge_comparison(_report(tmp_path, cartridge_record(),
                                                 "cartridge-step-000006"))
    assert [comparison.text(c, "logprob_per_token") for c in vm.CONDITIONS] == \
        ["-3.849", "-1.850", "-3.144"]
    # 2561 and 256 positions of 18,432 bytes: 47.2 MB and 4.7 MB
    assert [comparison.text(c, "kv_prefix_bytes_f16") for c in vm.CONDITIONS] == \
        ["0.0", "47.2", "4.7"]
    assert {m.key: comparison.winner(m.key) for m in vm.MEASURES} == {
        "logprob_per_token": "whole document", "answer_f1": "cartridge",
        "kv_prefix_bytes_f16": "no document", "mean_ttft_s": "no document"}
    # bars: shares of the column's largest, a log-likelihood as its per-token probability:
    # e^-3.1443 / e^-1.8499 = e^-1.2944 = 0.27406
    assert comparison.bar("whole document", "logprob_per_token") == 1.0
    assert comparison.bar("cartridge", "logprob_per_token") == pytest.approx(0.27406, 1e-4)
    assert comparison.bar("cartridge", "answer_f1") == 1.0
    assert comparison.bar("cartridge", "kv_prefix_bytes_f16") == pytest.approx(256 / 2561)
    assert comparison.bar("whole document", "mean_ttft_s") == 1.0
    # (-3.1443 + 3.8492) / (-1.8499 + 3.8492) = 0.3526; 2561/256 = 10.0; 50.918/0.867 = 58.7
    headline = comparison.headline()
    assert "(35% of the way)" in headline and "10.0x smaller" in headline
    assert "58.7x sooner" in headline and "2 held-out questions" in headline
    first = comparison.questions[0]
    assert vm.question_cell(first, "whole document") == "-1.500 · F1 0.50"
    assert vm.question_bar(first, "cartridge") == pytest.approx(0.367879, 1e-5)   # e^-1
    # twin: a cartridge that reads the answers worse than no document is short of the way
    worse = cartridge_record()
    worse["systems"]["cartridge"]["logprob_per_token"] = -4.2492
    comparison = vm.cartridge_comparison(_report(tmp_path / "w", worse, "cartridge-x"))
    assert "(-20% of the way)" in comparison.headline()
    # twin: another kind of report is no comparison
    assert vm.cartridge_comparison(_report(tmp_path / "c", CALIBRATION)) is None


def test_the_comparison_shows_the_figures_of_the_markdown_report(tmp_path):
    """One record, two readers: the view-model's figures are those of the engine's .md table."""
    from engine.cartridge.self_study import report_markdown

    record = cartridge_record()
    table = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
             for line in report_markdown(record, "step-000006").splitlines()
             if line.startswith("| ") and line.split("|")[1].strip() in vm.CONDITIONS}
    comparison = vm.cartridge_comparison(_report(tmp_path, record, "cartridge-step-000006"))
    for condition in vm.CONDITIONS:
        logprob, f1, _tokens, kv_bytes, ttft = table[condition]
        values = comparison.values[condition]
        assert float(logprob) == round(values["logprob_per_token"], 4)
        assert float(f1) == round(values["answer_f1"], 3)
        assert int(kv_bytes.replace(",", "")) == values["kv_prefix_bytes_f16"]
        assert float(ttft) == round(values["mean_ttft_s"], 3)
    # twin: a figure changed in the record moves the view-model's, not the .md written before
    record["systems"]["cartridge"]["mean_ttft_s"] = 9.0
    again = vm.cartridge_comparison(_report(tmp_path / "b", record, "cartridge-step-000006"))
    assert float(table["cartridge"][4]) != round(again.values["cartridge"]["mean_ttft_s"], 3)


def test_a_damaged_comparison_is_refused_with_its_path_and_an_older_one_lacks_only_f1(tmp_path):
    damaged = cartridge_record()
    del damaged["systems"]["cartridge"]
    report = _report(tmp_path, damaged, "cartridge-step-000006")
    with pytest.raises(vm.ForgebenchError) as refused:
        vm.cartridge_comparison(report)
    assert "the three conditions" in refused.value.message
    assert refused.value.path == str(report.path) or refused.value.path == report.path
    text = cartridge_record()
    text["questions"][1]["cartridge"]["logprob_per_token"] = "high"
    with pytest.raises(vm.ForgebenchError, match="question 2"):
        vm.cartridge_comparison(_report(tmp_path / "t", text, "cartridge-step-000006"))
    # a comparison written before answer F1 was scored: every other figure, F1 "not scored"
    older = cartridge_record(f1=(None, None, None))
    for row in older["questions"]:
        for condition in vm.CONDITIONS:
            del row[condition]["answer_f1"]
    comparison = vm.cartridge_comparison(_report(tmp_path / "o", older, "cartridge-x"))
    assert comparison.text("cartridge", "answer_f1") == "not scored"
    assert comparison.winner("answer_f1") is None
    assert comparison.winner("logprob_per_token") == "whole document"


def _cartridge_run(workspace: Workspace, record: dict | None = None):
    run = workspace.runs_dir / "guide-cartridge"
    (run / "evals").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": run.name, "recipe": "lm-cartridge"}))
    path = run / "evals" / "cartridge-step-000006.json"
    path.write_text(json.dumps(record or cartridge_record()))
    return run, path


def test_the_pane_shows_a_cartridge_comparison_side_by_side_and_whole(qtbot, sample):
    from app.views.reports_pane import ReportsPane
    run, _ = _cartridge_run(sample)
    pane = shown_at(qtbot, ReportsPane())
    pane.set_workspace(sample)
    pane.show_run(run)
    assert pane.report_combo.currentText() == "cartridge-step-000006"
    view = pane.cartridge
    assert view.isVisible() and not pane.figures.isVisible()
    table = view.table
    shown = [[table.item(r, c).text() for c in range(table.columnCount())]
             for r in range(table.rowCount())]
    assert shown[2] == ["cartridge", "-3.144", "0.30", "4.7", "0.867"]
    from app.views.reports_pane import BAR_ROLE
    assert table.item(2, 3).data(BAR_ROLE) == pytest.approx(256 / 2561)   # KV: 4.7 of 47.2 MB
    assert table.item(1, 3).data(BAR_ROLE) == 1.0
    bold = {table.item(r, 0).text() for r in range(3) for c in range(1, 5)
            if table.item(r, c).font().bold()}
    assert bold == {"whole document", "cartridge", "no document"}
    assert not table.item(2, 1).font().bold() and table.item(1, 1).font().bold()   # twin
    assert "35% of the way" in view.headline.text()
    qtbot.waitUntil(lambda: labels_cut_off(pane) == [])
    qtbot.waitUntil(lambda: cells_cut_off(table) == [])         # the splitter, widened
    per_question = view.per_question
    assert per_question.rowCount() == 2
    assert per_question.item(0, 2).text() == "-1.500 · F1 0.50"
    assert per_question.item(0, 3).toolTip() == "cartridge says"
    qtbot.waitUntil(lambda: cells_cut_off(per_question) == [])


def test_the_pane_shows_the_shipped_cartridge_example_s_comparison(qtbot, sample):
    """The sample workspace's cartridge example (a real lm-cartridge run, made by
    packaging/make_examples.py) in the pane: its three conditions with the figures of its
    record, every held-out question underneath, nothing cut off at the pane's size."""
    from app.views.reports_pane import ReportsPane
    run = sample.runs_dir / "cartridge-guide"
    pane = shown_at(qtbot, ReportsPane())
    pane.set_workspace(sample)
    pane.show_run(run)
    (path,) = (run / "evals").glob("cartridge-*.json")
    record = json.loads(path.read_text())
    assert pane.report_combo.currentText() == path.stem
    view = pane.cartridge
    assert view.isVisible() and not pane.figures.isVisible()
    table = view.table
    shown = {table.item(r, 0).text(): [table.item(r, c).text() for c in range(1, 5)]
             for r in range(table.rowCount())}
    assert list(shown) == list(vm.CONDITIONS)
    for condition, f in record["systems"].items():
        assert shown[condition] == [f"{f['logprob_per_token']:.3f}", f"{f['answer_f1']:.2f}",
                                    f"{f['kv_prefix_bytes_f16'] / 1e6:.1f}",
                                    f"{f['mean_ttft_s']:.3f}"]
    assert shown["cartridge"][2] != shown["whole document"][2]          # KV: rows vs tokens
    assert view.per_question.rowCount() == len(record["questions"])
    for row, question in enumerate(record["questions"]):
        cell = view.per_question.item(row, 0)
        assert cell.text() == vm.short_question(question["question"])
        assert question["question"] in cell.toolTip()
    assert "of the way" in view.headline.text()
    qtbot.waitUntil(lambda: labels_cut_off(pane) == [])
    qtbot.waitUntil(lambda: cells_cut_off(table) == [])
    qtbot.waitUntil(lambda: cells_cut_off(view.per_question) == [])


def test_a_question_cell_is_one_line_of_words_cut_at_a_word():
    generated = "Write a message to a model asking it to use its\n`model_config` file " * 3
    short = vm.short_question(generated)
    assert "\n" not in short and short.endswith("…") and len(short) <= vm.QUESTION_CHARS + 1
    assert generated.split()[:5] == short.split()[:5]
    assert not short[:-1].endswith(" ")
    assert vm.short_question("Where is the Start button?") == "Where is the Start button?"


def test_a_damaged_or_vanished_comparison_says_what_is_wrong_in_the_pane(qtbot, sample):
    from app.views.reports_pane import ReportsPane
    damaged = cartridge_record()
    del damaged["systems"]["whole document"]
    run, path = _cartridge_run(sample, damaged)
    pane = shown_at(qtbot, ReportsPane())
    pane.set_workspace(sample)
    pane.show_run(run)
    text = pane.summary.text()
    assert "cartridge comparison is damaged" in text and "cartridge-step-000006.json" in text
    assert "forgebench eval RUN" in text and not pane.cartridge.isVisible()
    path.write_text(json.dumps(cartridge_record()))                    # twin: whole again
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    pane.refresh_runs()
    assert pane.cartridge.isVisible() and "damaged" not in pane.summary.text()
    path.unlink()                     # gone between the listing and the reading
    pane._report_chosen(str(path), False)
    assert "cannot read the report" in pane.summary.text() and not pane.cartridge.isVisible()


def test_the_runs_pane_details_say_the_comparison_in_one_sentence(qtbot, sample):
    from app.views.run_details import RunDetails
    run, path = _cartridge_run(sample)
    details = shown_at(qtbot, RunDetails())
    details.show_runs([run, sample.runs_dir / "sensor-alert"])
    text = details.toPlainText()
    assert text.startswith("guide-cartridge\n2 held-out questions")
    assert "(35% of the way)" in text and "the Reports pane" in text
    assert "sensor-alert" not in text               # twin: a run without one says nothing
    path.write_text("[]")
    details.show_runs([run])
    assert "a report is a JSON object" in details.toPlainText()
