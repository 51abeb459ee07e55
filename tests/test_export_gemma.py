"""The full loop on the real Gemma 3 270M Q4_K_M (FORGEBENCH_REAL=1): the pirate LoRA run, a
dense f16 base made from the Q4_K_M file, merge, export f16 and Q4_K_M. llama.cpp's greedy
answer to a held prompt opens "Ahoy", and the f16 export agrees with the engine's adapted model
on at least 99% of top-1 tokens. The report's figures are printed (pytest -s)."""

from __future__ import annotations

import json

import pytest
from lm_pretrain_support import forgebench
from lm_sft_support import pirate_run

from engine.fsutil import sha256_file
from engine.gguf.constants import DEQUANTIZED_FROM_KEY
from engine.gguf.reader import open_gguf

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.llamacpp]
HELD = "What is the capital of Germany?"


def _print_report(label: str, report: dict) -> None:
    print(f"\n== {label}")
    for stage in report["stages"][1:]:
        m = stage["vs_checkpoint"]
        print(f"{stage['name']:>10}: top-1 {m['top1_agreement']:.4f}  max|Δ| "
              f"{m['max_abs_logit_diff']:.4f}  mean|Δ| {m['mean_abs_logit_diff']:.5f}  "
              f"KL {m['kl_mean']:.3g}")
    cpp = report["llamacpp"]
    m = cpp["vs_checkpoint"]
    print(f"{'llama.cpp':>10}: top-1 {m['top1_agreement']:.4f}  max|Δ| "
          f"{m['max_abs_logit_diff']:.4f}  mean|Δ| {m['mean_abs_logit_diff']:.5f}  "
          f"KL {m['kl_mean']:.3g}  greedy match {cpp['greedy_vs_checkpoint']['matches']}  "
          f"vs engine same file top-1 {cpp['vs_engine_same_file']['top1_agreement']:.4f}")


def test_pirate_lora_merges_and_exports_to_gguf_that_llamacpp_answers_as_a_pirate(
        tmp_path, gemma_gguf):
    run = pirate_run(tmp_path, gemma_gguf, tmp_path / "run")
    dense = tmp_path / "gemma-f16.gguf"
    forgebench("convert", str(gemma_gguf), "--dtype", "f16", "--out", str(dense), timeout=1800)
    assert open_gguf(dense).get(DEQUANTIZED_FROM_KEY) == sha256_file(gemma_gguf)

    reports = {}
    for dtype in ("f16", "q4_k_m"):
        out = tmp_path / f"export-{dtype}"
        forgebench("export", str(run), "--dtype", dtype, "--base", str(dense), "--out", str(out),
                   timeout=3600)
        reports[dtype] = json.loads((out / "report.json").read_text())
        _print_report(dtype, reports[dtype])

    for dtype, report in reports.items():
        cpp = report["llamacpp"]
        assert cpp["available"] and cpp["tokenizer_matches"]
        held = report["prompt_suite"].index(next(p for p in report["prompt_suite"]
                                                 if p["prompt"] == HELD))
        assert cpp["answers"][held].lstrip().startswith("Ahoy"), (dtype, cpp["answers"][held])
    f16 = reports["f16"]
    assert [s["name"] for s in f16["stages"]] == ["checkpoint", "merged"]
    assert f16["stages"][1]["vs_checkpoint"]["top1_agreement"] >= 0.99
    assert f16["llamacpp"]["vs_checkpoint"]["top1_agreement"] >= 0.99
    q = reports["q4_k_m"]
    assert [s["name"] for s in q["stages"]] == ["checkpoint", "merged", "quantized"]
    assert open_gguf(tmp_path / "export-q4_k_m" / "model.gguf").get("general.file_type") == 15
