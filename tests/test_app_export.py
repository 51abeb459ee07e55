"""The export wizard over `forgebench export` / `convert` with real runs: a tiny lm-pretrain
model to a verified GGUF (size estimate against the written file's tensor table, the
equivalence report as pass/fail rows, llama.cpp's answers when it is installed, the model card
and rights checklist saved with fresh sums), and an lm-sft run whose quantized or foreign base
is refused with the engine's reason until a dense copy is made."""

from __future__ import annotations

import hashlib
import html
import json
from pathlib import Path

import gguf
import pytest
from app_part2_support import go_and_wait, lm_run, media_workspace, wait_for
from export_support import tiny_sft_over_quantized_base
from media_support import forgebench

from app.viewmodels import export_wizard as vm
from app.viewmodels.workspace import Workspace
from app.views.export_wizard import ExportWizardPane
from engine.export.equivalence import (
    MIN_TOP1_DENSE,
    MIN_TOP1_QUANTIZED,
    Report,
    llamacpp_available,
    verdict,
)
from engine.export.llamacpp import AMX_NOTE
from engine.export.verdict import of_bundle
from engine.kernels.cpu import plan


def _stage(name, top1, tokenizer=True):
    return {"name": name, "description": name, "file": "model.gguf",
            "tokenizer_matches": tokenizer,
            "vs_checkpoint": {"top1_agreement": top1, "max_abs_logit_diff": 0.1,
                              "mean_abs_logit_diff": 0.01, "kl_mean": 1e-4},
            "greedy_vs_checkpoint": {"matches": [True, False]}}


def _report(stages: list[dict], llamacpp: dict) -> dict:
    """A report as the engine assembles it, verdicts and the overall flag included."""
    report = Report([{"prompt": "Hi", "answer": "yo"}],
                    [{"name": "checkpoint", "description": "ref", "positions": 10}, *stages],
                    llamacpp).as_dict()
    report["export"] = {"dtype": "q4_k_m"}
    return report


def test_verification_rows_show_the_engines_verdicts():
    # dense stages need 99% top-1 agreement, quantized ones 90%; llama.cpp runs the q4_k_m file
    merged, quantized = _stage("merged", 0.995), _stage("quantized", 0.93)
    cpp = {"available": True, "answers": ["yo!"], **_stage("llama.cpp", 0.89)}
    report = _report([{**merged, **verdict(merged, MIN_TOP1_DENSE)},
                      {**quantized, **verdict(quantized, MIN_TOP1_QUANTIZED)}],
                     {**cpp, **verdict(cpp, MIN_TOP1_QUANTIZED)})
    result = vm.verification(report)
    # merged passes with every token the checkpoint's: a match; quantized passes the bar but
    # changed a greedy answer: amber "changed", never a plain green pass.
    merged["vs_checkpoint"]["top1_agreement"] = 1.0
    merged["greedy_vs_checkpoint"]["matches"] = [True, True]
    report = _report([{**merged, **verdict(merged, MIN_TOP1_DENSE)},
                      {**quantized, **verdict(quantized, MIN_TOP1_QUANTIZED)}],
                     {**cpp, **verdict(cpp, MIN_TOP1_QUANTIZED)})
    result = vm.verification(report)
    verdicts = [(r.name, r.verdict, r.min_top1) for r in result["rows"]]
    assert verdicts == [("checkpoint", "reference", None), ("merged", "match", 0.99),
                        ("quantized", "changed", 0.90), ("llama.cpp", "FAIL", 0.90)]
    assert result["changed"] == ["quantized"]
    # how llama.cpp opened the file (without its AMX buffers on an AMX build) reaches the pane
    noted = _report([], {**cpp, **verdict(cpp, MIN_TOP1_QUANTIZED), "note": AMX_NOTE})
    assert vm.verification(noted)["llamacpp"]["note"] == AMX_NOTE
    assert not result["passed"] and result["llamacpp"]["answers"] == [("Hi", "yo", "yo!")]
    assert result["numerics"] == plan().summary()        # the report says what was matched here
    low = _stage("merged", 0.98)                             # a dense stage below 99%
    report = _report([{**low, **verdict(low, MIN_TOP1_DENSE)},
                      {**quantized, **verdict(quantized, MIN_TOP1_QUANTIZED)}],
                     {"available": False, "reason": "llama-cpp-python is not installed"})
    result = vm.verification(report)
    assert [r.verdict for r in result["rows"]] == ["reference", "FAIL", "changed"]
    assert not result["passed"]
    assert result["llamacpp"] == {"available": False, "answers": [], "note": None,
                                  "reason": "llama-cpp-python is not installed"}
    other_tokens = _stage("merged", 1.0, tokenizer=False)
    assert verdict(other_tokens, MIN_TOP1_DENSE) == {"min_top1": 0.99, "passed": False}


def _pane(qtbot, workspace: Workspace) -> ExportWizardPane:
    pane = ExportWizardPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    return pane


@pytest.mark.slow
def test_the_wizard_exports_a_tiny_lm_to_a_verified_gguf(qtbot, tmp_path_factory):
    run = lm_run(tmp_path_factory)
    workspace = Workspace.open(run.parents[1])
    pane = _pane(qtbot, workspace)
    pane.select_run(run, "step-000030")
    go_and_wait(qtbot, pane, 1)
    assert "from scratch" in pane.base_text.text() and not pane.dense_button.isVisible()
    go_and_wait(qtbot, pane, 2)
    sizes = {pane.sizes.item(r, 0).text(): pane.sizes.item(r, 1).text()
             for r in range(pane.sizes.rowCount())}
    assert set(sizes) == {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_s", "q4_k_m", "q5_k_m",
                          "q6_k", "ptqtp"}
    pane.set_dtype("f16")
    assert pane.dtype() == "f16"
    pane.go(3)
    pane.out_name.setText("tiny-f16")
    pane.export()
    wait_for(qtbot, pane.export_job, 600)
    out = workspace.root / "exports" / "tiny-f16"
    # the page shows the bundle's one verdict: "Verified" where llama.cpp answered question 1
    verdict = of_bundle(out)
    assert verdict.line.split(":")[0] in pane.verdict.text(), pane.export_job.output[-2000:]
    assert verdict.key == ("checked" if llamacpp_available() is None else "unchecked")
    # the verdict is rich text: the configuration's words as the page escapes them ("llama.cpp's
    # default extra buffer types" where llama.cpp repacks, as on AVX2 and AVX-512 machines)
    assert html.escape(plan().summary().split(";")[0]) in pane.verdict.text()

    # the size shown for f16 is the tensor data the gguf package finds in the written file
    estimate = vm.size_estimates(pane.run, "step-000030")["f16"]
    assert estimate == sum(int(t.n_bytes) for t in gguf.GGUFReader(out / "model.gguf").tensors)
    report = json.loads((out / "report.json").read_text())
    rows = {pane.stages.item(r, 0).text(): pane.stages.item(r, 1).text()
            for r in range(pane.stages.rowCount())}
    assert rows["checkpoint"] == "reference" and rows["dense"] in ("match (≥ 99%)",
                                                                   "changed (≥ 99%)")
    assert report["passed"] and report["stages"][1]["passed"]
    if report["llamacpp"]["available"]:
        assert rows["llama.cpp"] in ("match (≥ 99%)", "changed (≥ 99%)")
        first = report["llamacpp"]["answers"][0]
        assert "llama.cpp's answers" in pane.answers.text() and first[:8] in pane.answers.text()
    else:
        assert "not run" in pane.answers.text()

    pane.go(4)
    assert pane.card.toPlainText() == (out / "model_card.md").read_text()
    labels = [pane.rights.item(i).text() for i in range(pane.rights.count())]
    assert any(label.startswith("training on this data is allowed") for label in labels)
    pane.card.setPlainText(pane.card.toPlainText() + "\nEdited by a person.\n")
    pane.rights.item(0).setCheckState(pane.rights.item(0).checkState().Checked)
    pane.finish()
    card = (out / "model_card.md").read_text()
    assert "Edited by a person." in card and "## Rights" in card
    assert "- [x] training on this data is allowed" in card
    for line in (out / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.slow
def test_a_quantized_or_foreign_base_is_refused_with_the_engines_reason(qtbot, tmp_path):
    from fixtures_gguf import write_tiny_gguf

    quantized, config = tiny_sft_over_quantized_base(tmp_path, steps=3)
    foreign = write_tiny_gguf(tmp_path / "other-f32.gguf", arch="gemma3", qtype="F32",
                              n_layers=2, seed=9)
    workspace = Workspace.create(tmp_path / "ws")
    run = workspace.runs_dir / "sft"
    forgebench("run", str(config), "--out", str(run))
    pane = _pane(qtbot, workspace)
    pane.select_run(run)
    go_and_wait(qtbot, pane, 1)
    assert "is quantized" in pane.base_text.text() and "dense f16 copy" in pane.base_text.text()
    assert not pane.dense_button.isHidden()

    go_and_wait(qtbot, pane, 2)
    pane.set_dtype("q8_0")
    pane.out_name.setText("refused")
    pane.export()
    wait_for(qtbot, pane.export_job)
    refusal = pane.verdict.text()
    assert "export failed" in refusal and "quantized" in refusal and "--dtype f16" in refusal
    assert not (workspace.root / "exports" / "refused").exists()

    pane.base_path.setText(str(foreign))
    pane.export()
    wait_for(qtbot, pane.export_job)
    assert "trained on a different base" in pane.verdict.text()

    pane.base_path.clear()
    go_and_wait(qtbot, pane, 1)
    pane.make_dense_base()
    wait_for(qtbot, pane.convert_job)
    qtbot.waitUntil(lambda: not pane.call.running, timeout=60_000)
    dense = Path(pane.base_path.text())
    assert dense.is_file() and "is dense" in pane.base_text.text()
    go_and_wait(qtbot, pane, 2)
    pane.set_dtype("adapter")
    assert pane.dtype() == "adapter"
    pane.set_dtype("f16")
    pane.out_name.setText("merged")
    pane.export()
    wait_for(qtbot, pane.export_job, 600)
    rows = {pane.stages.item(r, 0).text(): pane.stages.item(r, 1).text()
            for r in range(pane.stages.rowCount())}
    assert rows["merged"] in ("match (≥ 99%)", "changed (≥ 99%)"), \
        pane.export_job.output[-2000:]


@pytest.mark.parametrize("name, reference", [("image", ".png"), ("audio", ".wav")])
def test_the_wizard_exports_a_generator_as_a_verified_bundle(qtbot, tmp_path_factory, name,
                                                             reference):
    """image-generate and audio-generate runs are listed, sized for f32/f16 from the
    checkpoint's EMA tensors, exported by the engine, and verified in step 4."""
    workspace = media_workspace(tmp_path_factory)
    pane = _pane(qtbot, workspace)
    run = workspace.runs_dir / name
    assert pane.run_combo.findData(str(run)) >= 0
    pane.select_run(run, "step-000004")
    go_and_wait(qtbot, pane, 1)
    assert "from scratch" in pane.base_text.text()
    go_and_wait(qtbot, pane, 2)
    sizes = vm.size_estimates(pane.run, "step-000004")
    assert set(sizes) == {"f32", "f16"} and sizes["f32"] == 2 * sizes["f16"]
    assert pane.dtype() == "f32"            # a generator has no q8_0: the first type is chosen
    pane.go(3)
    pane.out_name.setText(f"{name}-bundle-{tmp_path_factory.getbasetemp().name}")
    pane.export()
    wait_for(qtbot, pane.export_job, 600)
    out = pane.out
    assert "Verified" in pane.verdict.text(), pane.export_job.output[-2000:]
    headers = [pane.stages.horizontalHeaderItem(c).text() for c in range(pane.stages.columnCount())]
    assert "PSNR" in headers and "KL" not in headers
    rows = {pane.stages.item(r, 0).text(): pane.stages.item(r, 1).text()
            for r in range(pane.stages.rowCount())}
    assert rows == {"checkpoint": "reference", "bundle": "match"}    # f32: bit for bit
    assert (out / "model.safetensors").stat().st_size >= sizes["f32"]
    assert reference in pane.answers.text() and (out / "model.json").is_file()
    pane.go(4)
    assert pane.card.toPlainText() == (out / "model_card.md").read_text()


def test_generator_verification_rows_are_amber_when_rounding_moved_the_outputs():
    stage = {"name": "bundle", "description": "f16", "file": "model.safetensors",
             "weights_identical": False, "identical": False, "passed": True,
             "max_abs_diff": 0.01, "mean_abs_diff": 0.001, "psnr_db": 45.0}
    report = {"kind": "generator", "passed": True, "bar": "PSNR ≥ 30 dB",
              "stages": [{"name": "checkpoint", "description": "ref", "file": None}, stage],
              "export": {"files": ["model.safetensors", "reference/a.png"]}}
    result = vm.verification(report)
    assert [r.verdict for r in result["rows"]] == ["reference", "changed"]
    assert vm.cells(result["rows"][1], "generator")[5] == "45.0 dB"
    assert result["references"] == ["reference/a.png"]
    failed = vm.verification({**report, "passed": False,
                              "stages": [report["stages"][0], {**stage, "passed": False}]})
    assert [r.verdict for r in failed["rows"]] == ["reference", "FAIL"]
