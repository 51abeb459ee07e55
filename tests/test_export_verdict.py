"""Export verdicts (engine/export/verdict.py): the one verdict every surface shows, table-tested
from report figures; question 1's weights check (engine/export/quality.py) against gguf-py's
dequantizer on a real quantized file, with its twin whose scales are damaged; and, end to end on
a tiny lm-sft run, a damaged export that fails question 1 on every surface (report, CLI exit
code, card, wizard page, notification, Models library, Runs ledger) beside an undamaged one that
passes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.export import verdict as v
from engine.export.quality import check_weights
from engine.kernels.cpu import EXACT, ROUNDING, Kernel, plan_for


def _q1(top1=1.0, kl=0.0, max_abs=0.01, claimed=False, greedy=(6, 6), weights_failed=()):
    weights = {"checked": 10, "failed": list(weights_failed), "worst": None,
               "reference": "merged.gguf"}
    cpp = {"available": True, "top1": top1, "kl_mean": kl, "max_abs": max_abs,
           "claimed_exact": claimed, "greedy_matched": greedy[0], "greedy_total": greedy[1],
           "weight_types": ["Q8_0"]}
    return v.question1(weights, cpp)


def _report(q1=None, base=3.0, tuned=1.0, export=1.08, dtype="q4_k_m", picker=None):
    q2 = {"available": True, "base_loss": base, "fine_tune_loss": tuned, "export_loss": export,
          "gain_kept": v.gain_kept(base, tuned, export)}
    report = {"question1": q1 or _q1(), "question2": q2, "export": {"dtype": dtype}}
    if picker:
        report["picker"] = picker
    return report


@pytest.mark.parametrize("export_loss, key, words", [
    (1.08, "kept", "keeps 96% of the fine-tune's gain"),
    (1.2, "kept", "keeps 90% of the fine-tune's gain"),       # the boundary is kept
    (1.6, "reduced", "keeps 70% of the fine-tune's gain; q5_k_m keeps more"),
    (2.5, "lost", "loses most of the fine-tune's gain (keeps 25%); q8_0 keeps more"),
    (3.4, "lost", "loses most of the fine-tune's gain (keeps 0%); q8_0 keeps more"),
])
def test_the_share_of_the_gain_decides_kept_reduced_lost(export_loss, key, words):
    verdict = v.of_report(_report(export=export_loss))
    assert (verdict.key, verdict.words) == (key, words)
    assert verdict.usable and verdict.q1 == "passed"
    assert verdict.colour == v.COLOURS[key][1] and verdict.line.startswith(v.TITLES[key])


def test_a_lost_verdict_names_the_pickers_recommendation_when_there_is_one():
    picker = {"rows": [], "recommended": "q6_k"}
    verdict = v.of_report(_report(export=2.5, picker=picker))
    assert verdict.key == "lost" and verdict.suggestion == "q6_k" and "q6_k keeps more" in \
        verdict.words


@pytest.mark.parametrize("q1, passed", [
    (dict(top1=0.995, kl=1e-3), True),            # both bars are inclusive
    (dict(top1=0.9949, kl=1e-4), False),
    (dict(top1=1.0, kl=1.1e-3), False),
    (dict(top1=float("nan"), kl=float("nan")), False),
    (dict(claimed=True, max_abs=0.0), True),      # bit-exact where the doctor claims it
    (dict(claimed=True, max_abs=1e-6), False),
    (dict(claimed=True, max_abs=0.0, greedy=(5, 6)), False),
])
def test_question_1_bars(q1, passed):
    answer = _q1(**q1)
    assert (answer["status"] == "passed") == passed
    verdict = v.of_report(_report(q1=answer))
    assert (verdict.key == "defect") == (not passed)
    if not passed:
        assert not verdict.usable and verdict.words.startswith("the file is not right")


def test_damaged_weights_are_a_defect_even_where_llama_cpp_agrees():
    bad = {"name": "blk.0.attn_q.weight", "type": "Q4_0", "rel_error": 14.2, "bound": 0.3}
    verdict = v.of_report(_report(q1=_q1(weights_failed=[bad])))
    assert verdict.key == "defect" and verdict.title == "DEFECT"
    assert "blk.0.attn_q.weight Q4_0: 14.2 relative error" in verdict.words


def test_an_unanswered_question_1_is_never_verified():
    answer = v.question1(None, {"available": False, "reason": "llama-cpp-python is not "
                                "installed"})
    assert answer["status"] == "not answered"
    verdict = v.of_report(_report(q1=answer))
    assert verdict.key == "kept" and verdict.q1 == "not answered"
    assert "not answered: llama-cpp-python is not installed" in verdict.words
    assert "verified" not in verdict.line.lower()


def test_no_gain_no_report_and_generator_verdicts():
    assert v.of_report(_report(base=1.0, tuned=1.0005, export=1.1)).key == "no-gain"
    assert v.gain_kept(1.0, 1.0005, 1.1) is None
    none = v.of_report(None)
    assert none.key == "unchecked" and "--no-report" in none.words and none.usable
    assert v.of_report({"kind": "generator", "passed": True, "bar": "b"}).key == "checked"
    assert v.of_report({"kind": "generator", "passed": False, "bar": "b"}).key == "defect"


def test_the_picker_recommends_the_smallest_type_keeping_90_percent():
    rows = [{"dtype": "q4_k_m", "bytes": 100, "gain_kept": 0.4},
            {"dtype": "q5_k_m", "bytes": 120, "gain_kept": 0.91},
            {"dtype": "q8_0", "bytes": 200, "gain_kept": 0.99}]
    assert v.recommend(rows) == "q5_k_m"
    assert v.recommend(rows[:1]) is None


def _plan_rows(*features):
    return plan_for(frozenset({"avx2", "fma", "f16c", *features})).kernels


def test_bit_exact_is_claimed_from_the_doctors_rows():
    avx512 = _plan_rows("avx512f", "avx512dq")
    assert v.claimed_exact(["Q8_0", "Q6_K"], avx512)
    assert v.claimed_exact(["F16"], avx512)
    assert not v.claimed_exact(["Q4_0"], avx512)          # a rounding row names it
    assert not v.claimed_exact(["Q8_0", "F32"], avx512)   # nothing claims f32 matrices
    assert not v.claimed_exact([], avx512)
    amx = _plan_rows("avx512f", "avx512dq", "amx_int8", "avx512_vnni")
    # an AMX build runs without extra buffer types (open_llama): its plain kernels are followed
    assert v.claimed_exact(["Q8_0", "Q4_K", "Q6_K"], amx)
    assert not v.claimed_exact(["BF16"], amx)             # tinyBLAS bf16: not reproduced
    assert v.claimed_exact(["F16"], amx)
    assert not v.claimed_exact(["F16"], [Kernel("all kernels", ROUNDING, "")])
    assert v.claimed_exact(["Q8_0"], [Kernel("Q8_0, Q5_0 weights", EXACT, "")])


def test_a_plan_with_exact_weight_decides_per_matrix():
    class Plan:                 # the shape of engine.kernels.cpu.KernelPlan.exact_weight
        kernels = ()

        @staticmethod
        def exact_weight(kind: str, rows: int) -> bool:
            return kind == "Q8_0" or (kind == "Q4_0" and rows % 8 != 0)

    assert v.file_claimed_exact(Plan(), [("Q8_0", 640), ("Q4_0", 7)])
    assert not v.file_claimed_exact(Plan(), [("Q8_0", 640), ("Q4_0", 8)])
    assert not v.file_claimed_exact(Plan(), [])
    rows_only = plan_for(frozenset({"avx2", "fma", "f16c", "avx512f", "avx512dq"}))
    rows_only = type("RowsOnly", (), {"kernels": rows_only.kernels})()
    assert v.file_claimed_exact(rows_only, [("Q8_0", 64), ("F16", 64)])


def damage_scales(path: Path, tensor: str, factor: float = 16.0) -> None:
    """Multiply the f16 scale of every block of one Q4_0 / Q8_0 tensor in place."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    info = next(t for t in reader.tensors if t.name == tensor)
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.tensor_type)][1]
    blocks = np.asarray(info.data).reshape(-1, block)
    scales = blocks[:, :2].copy().view(np.float16)
    blocks[:, :2] = (scales.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    reader.data.flush()
    del reader


@pytest.fixture(scope="module")
def dense_and_q4(tmp_path_factory):
    from gguf_write_fixtures import write_dense_llama

    from engine.gguf.convert import convert_gguf

    folder = tmp_path_factory.mktemp("weights")
    dense = write_dense_llama(folder / "dense.gguf", dim=128, ffn=256, n_layers=1,
                              dtype="F32", seed=3)
    convert_gguf(dense, folder / "q4_0.gguf", "q4_0")
    return dense, folder / "q4_0.gguf"


def test_the_weights_check_passes_a_true_file_and_fails_damaged_scales(dense_and_q4, tmp_path):
    dense, quantized = dense_and_q4
    good = check_weights(quantized, dense)
    assert good["checked"] == good["checked"] and not good["failed"]
    assert 0 < good["worst"]["rel_error"] <= good["worst"]["bound"]
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(quantized.read_bytes())
    damage_scales(damaged, "blk.0.attn_q.weight")
    bad = check_weights(damaged, dense)
    assert [f["name"] for f in bad["failed"]] == ["blk.0.attn_q.weight"]
    assert bad["failed"][0]["rel_error"] > 10
    assert check_weights(quantized, None) is None


def test_notification_and_library_read_the_bundles_verdict(tmp_path):
    from app.viewmodels.models import library_files, list_label, with_export_verdict
    from engine.fsutil import atomic_write_json

    root = tmp_path
    atomic_write_json(root / "workspace.json", {"models": []})
    bundle = root / "exports" / "pirate-q4"
    bundle.mkdir(parents=True)
    report = _report(q1=_q1(top1=0.9))
    report["export"]["sha256"] = "ab" * 32
    atomic_write_json(bundle / "report.json", report)
    (bundle / "SHA256SUMS").write_text("")
    ok, text = v.notification(bundle, True, "done")
    assert not ok and text.startswith("DEFECT: the file is not right") and "done" not in text
    assert v.notification(root / "exports" / "missing", False, "boom") == (False, "boom")

    row = {"name": "pirate", "sha256": "ab" * 32, "source": str(bundle / "model.gguf"),
           "bytes": 10, "facts": {"usable": True, "family": "Gemma 3", "params": 1e6}}
    shown = with_export_verdict(root, row)
    assert not shown["facts"]["usable"] and list_label(shown).startswith("⚠ pirate — DEFECT")
    model = root / "models" / "pirate.gguf"
    model.parent.mkdir()
    model.write_bytes(b"x")
    atomic_write_json(root / "workspace.json", {"models": [
        {"name": "pirate", "path": "models/pirate.gguf", "mode": "copy", "sha256": "ab" * 32,
         "source": str(bundle / "model.gguf")}]})
    assert library_files(root) == []                      # pickers never offer a defect
    atomic_write_json(bundle / "report.json", {**report, "question1": _q1()})
    assert library_files(root) == [("pirate", model)]
    assert list_label(with_export_verdict(root, row)).endswith(
        "— Kept: keeps 96% of the fine-tune's gain")


# ----------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    from export_support import tiny_sft_over_quantized_base
    from lm_pretrain_support import forgebench

    folder = tmp_path_factory.mktemp("verdict")
    quantized, config = tiny_sft_over_quantized_base(folder, steps=30)
    forgebench("run", str(config), "--out", str(folder / "runs" / "pirate"))
    forgebench("convert", str(quantized), "--dtype", "f16", "--out", str(folder / "dense.gguf"))
    return folder


def _export(folder: Path, name: str, capsys) -> tuple[int, str]:
    from engine.cli import main

    code = main(["export", str(folder / "runs" / "pirate"), "--dtype", "q4_0", "--base",
                 str(folder / "dense.gguf"), "--out", str(folder / "exports" / name)])
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_a_damaged_export_fails_question_1_on_every_surface_and_a_true_one_passes(
        sft_run, monkeypatch, capsys, qtbot):
    import engine.gguf.convert as convert
    from app.viewmodels.models import ModelsView, library_files, list_label
    from app.viewmodels.runs import ledger_row
    from app.viewmodels.workspace import WORKSPACE_FORMAT, Workspace
    from app.views.export_wizard import ExportWizardPane
    from app.views.jobs_panel import job_center
    from engine import model_library
    from engine.export.bundle import needs_no_repack
    from engine.fsutil import atomic_write_json
    from engine.gguf.reader import open_gguf

    folder = sft_run
    code, out = _export(folder, "pirate-q4", capsys)
    good = folder / "exports" / "pirate-q4"
    verdict = v.of_bundle(good)
    assert code == 0 and verdict.usable, out
    assert f"verdict: {verdict.line}" in out
    assert (good / "report.txt").read_text().splitlines()[2] == f"Verdict: {verdict.line}"
    report = json.loads((good / "report.json").read_text())
    assert report["question1"]["weights"]["checked"] > 0
    assert report["question2"]["available"] and report["question2"]["answers"]
    assert open_gguf(good / "model.gguf").get("general.name") == "pirate-q4"
    card = (good / "model_card.md").read_text()
    assert f"**Verdict — {verdict.line}**" in card and "llama-cli -m model.gguf" in card
    no_repack, reason = needs_no_repack()         # an AMX build of llama.cpp needs it
    assert ("llama-cli -m model.gguf --no-repack -cnv" in card) == no_repack
    assert (reason in card) if no_repack else "--no-repack" not in card
    assert ledger_row(folder / "runs" / "pirate").export == verdict.line

    real = convert.convert_gguf

    def damaging(src, dst, dtype, *args, **kwargs):
        result = real(src, dst, dtype, *args, **kwargs)
        damage_scales(Path(dst), "blk.0.attn_q.weight")
        return result

    monkeypatch.setattr(convert, "convert_gguf", damaging)
    code, out = _export(folder, "pirate-q4-damaged", capsys)
    bad = folder / "exports" / "pirate-q4-damaged"
    defect = v.of_bundle(bad)
    assert code == 3 and defect.key == "defect", out
    assert f"verdict: {defect.line}" in out and defect.line.startswith("DEFECT")
    assert "blk.0.attn_q.weight" in defect.words
    assert not (bad / "model.gguf").exists() and (bad / "model.gguf.defective").is_file()
    assert (bad / "report.txt").read_text().splitlines()[2] == f"Verdict: {defect.line}"
    card = (bad / "model_card.md").read_text()
    assert f"**Verdict — {defect.line}**" in card and "llama-cli" not in card
    assert ledger_row(folder / "runs" / "pirate").export == defect.line

    # the wizard's final page and the notification, after an export job that exits as the
    # CLI did (3 for the defect, 0 for the true file)
    atomic_write_json(folder / "workspace.json", {"format": WORKSPACE_FORMAT, "name": "w"})
    pane = ExportWizardPane()
    qtbot.addWidget(pane)
    pane.set_workspace(Workspace.open(folder))
    pane.select_run(folder / "runs" / "pirate")
    for out_dir, exit_code, expected in ((bad, 3, defect), (good, 0, verdict)):
        seen: list = []
        job_center().finished.connect(lambda *args, into=seen: into.append(args))
        pane.out = out_dir
        pane.export_job.start([sys.executable, "-c", f"raise SystemExit({exit_code})"],
                              "exporting")
        qtbot.waitUntil(lambda into=seen: bool(into), timeout=30000)
        job_center().finished.disconnect()
        (_, ok, message) = seen[0]
        assert ok == expected.usable and message.startswith(expected.line)
        assert "done" not in message.split(" — ")[0]
        assert expected.words in pane.verdict.text().replace("&#x27;", "'")
        assert expected.title in pane.verdict.text()

    # the Models library lists the defective file as not usable, with the verdict
    model_library.add_model(folder, bad / "model.gguf.defective", name="pirate-bad")
    model_library.add_model(folder, good / "model.gguf", name="pirate-good")
    labels = {row["name"]: list_label(row) for row in ModelsView(folder).load()}
    assert labels["pirate-bad"] == f"⚠ pirate-bad — {defect.line}"
    assert labels["pirate-good"].endswith(f"— {verdict.line}")
    assert [name for name, _ in library_files(folder)] == ["pirate-good"]


@pytest.mark.slow
def test_a_failed_conversion_stops_question_2s_early_worker_and_leaves_no_bundle(
        sft_run, monkeypatch):
    """Question 2's worker starts right after the merge, before the conversion writes the file it
    waits for: when the conversion fails, the worker is stopped (not left waiting, nor measuring)
    and the export fails as it did without it."""
    from engine.errors import ForgebenchError
    from engine.export import bundle
    from engine.export.equivalence import Gate

    workers = []
    real_attach = Gate.attach
    monkeypatch.setattr(Gate, "attach",
                        lambda gate, process: workers.append(process) or real_attach(gate, process))

    def failing(*args, **kwargs):
        raise ForgebenchError("the conversion failed", where="test")

    monkeypatch.setattr(bundle, "write_export_file", failing)
    out = sft_run / "exports" / "failed"
    with pytest.raises(ForgebenchError, match="the conversion failed"):
        bundle.export_run(sft_run / "runs" / "pirate", out, dtype="q4_0",
                          base=str(sft_run / "dense.gguf"))
    assert not out.exists()
    assert len(workers) == 1                          # it had started, after the merge
    assert workers[0].poll() is not None and workers[0].returncode != 0      # and was stopped


@pytest.mark.slow
def test_q4_0_loses_a_sharp_fine_tunes_gain_and_the_picker_names_a_larger_type(
        tmp_path, capsys, qtbot):
    from app_part2_support import go_and_wait
    from export_support import sharp_fine_tune

    from app.viewmodels.runs import ledger_row
    from app.viewmodels.workspace import WORKSPACE_FORMAT, Workspace
    from app.views.export_wizard import ExportWizardPane
    from engine.cli import main
    from engine.fsutil import atomic_write_json

    run = sharp_fine_tune(tmp_path)
    out = tmp_path / "exports" / "sharp-q4_0"
    code = main(["export", str(run), "--dtype", "q4_0", "--out", str(out),
                 "--compare", "q4_0,q5_k_m,q8_0"])
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    verdict = v.of_report(report)
    assert code == 0 and verdict.key == "lost", printed       # the file is right: exit 0
    q2 = report["question2"]
    assert q2["fine_tune_loss"] < q2["base_loss"] and q2["gain_kept"] < v.LOST_BELOW
    rows = {r["dtype"]: r for r in report["picker"]["rows"]}
    assert set(rows) == {"q4_0", "q5_k_m", "q8_0"}
    assert rows["q4_0"]["gain_kept"] == pytest.approx(q2["gain_kept"])
    recommended = report["picker"]["recommended"]
    assert recommended in ("q5_k_m", "q8_0") and rows[recommended]["gain_kept"] >= v.KEPT_MIN
    assert rows[recommended]["bytes"] > rows["q4_0"]["bytes"]
    assert verdict.suggestion == recommended and f"{recommended} keeps more" in verdict.words
    # the same words everywhere
    assert f"verdict: {verdict.line}" in printed
    assert f"**Verdict — {verdict.line}**" in (out / "model_card.md").read_text()
    assert (out / "report.txt").read_text().splitlines()[2] == f"Verdict: {verdict.line}"
    assert ledger_row(run).export == verdict.line
    assert v.notification(out, True, "done") == (True, f"{verdict.line} — {out.name}")

    # the wizard's quantization step: the picker job fills "keeps" and selects its choice
    atomic_write_json(tmp_path / "workspace.json", {"format": WORKSPACE_FORMAT, "name": "w"})
    pane = ExportWizardPane()
    qtbot.addWidget(pane)
    pane.set_workspace(Workspace.open(tmp_path))
    pane.select_run(run)
    go_and_wait(qtbot, pane, 2)
    assert pane.pick_button.isVisibleTo(pane)
    pane.measure_types()
    qtbot.waitUntil(lambda: not pane.pick_job.running, timeout=600_000)
    keeps = {pane.sizes.item(r, 0).text(): pane.sizes.item(r, 2).text()
             for r in range(pane.sizes.rowCount()) if pane.sizes.item(r, 2)}
    assert keeps["q8_0"].startswith("keeps ") and keeps["f16"] == ""
    picked = pane.dtype()
    assert picked in ("q5_k_m", "q6_k", "q8_0") and "Recommended: " + picked in \
        pane.pick_text.text(), pane.pick_job.output[-2000:]
    assert not list((tmp_path / "exports").glob(".picker-*"))      # its scratch is removed
