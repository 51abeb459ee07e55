"""The equivalence report's arithmetic against hand computations (top-1 agreement, |Δlogit|,
KL), and its greedy-continuation matching."""

from __future__ import annotations

import math

import torch
from safetensors.torch import save_file

from engine.equivalence import (MIN_TOP1_DENSE, MIN_TOP1_QUANTIZED, Report, StageResult,
                                _greedy_match, compare, render_text, verdict)


def _stage(path, logits: list[torch.Tensor], greedy=None) -> StageResult:
    save_file({f"logits.{i}": t for i, t in enumerate(logits)}, str(path))
    return StageResult(path, [], [], greedy or [[] for _ in logits])


def test_metrics_match_a_worked_example(tmp_path):
    # two positions, three-token vocabulary
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    other = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.5, 3.0]])
    m = compare(_stage(tmp_path / "a.st", [ref]), _stage(tmp_path / "b.st", [other]), 1)
    assert m["positions"] == 2
    assert m["top1_agreement"] == 0.5                      # position 1 flips to token 1
    assert m["max_abs_logit_diff"] == 3.5
    assert math.isclose(m["mean_abs_logit_diff"], 3.5 / 6)
    # KL(p || q) at position 1 by hand; position 0 is identical (KL 0)
    p = [1 / (2 + math.e ** 3)] * 2 + [math.e ** 3 / (2 + math.e ** 3)]
    zq = 1 + math.e ** 3.5 + math.e ** 3
    q = [1 / zq, math.e ** 3.5 / zq, math.e ** 3 / zq]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert math.isclose(m["kl_max"], kl, rel_tol=1e-12)
    assert math.isclose(m["kl_mean"], kl / 2, rel_tol=1e-12)


def test_identical_stages_report_zero_and_full_agreement(tmp_path):
    torch.manual_seed(0)
    logits = [torch.randn(4, 50), torch.randn(7, 50)]
    m = compare(_stage(tmp_path / "a.st", logits), _stage(tmp_path / "b.st", logits), 2)
    assert m == {"positions": 11, "top1_agreement": 1.0, "max_abs_logit_diff": 0.0,
                 "mean_abs_logit_diff": 0.0, "kl_mean": 0.0, "kl_max": 0.0}


def test_greedy_matching_reports_the_common_prefix(tmp_path):
    a = StageResult(tmp_path, [], [], [[1, 2, 3, 4], [5, 6], []])
    b = StageResult(tmp_path, [], [], [[1, 2, 9, 4], [5, 6], []])
    g = _greedy_match(a, b)
    assert g == {"all_match": False, "matches": [False, True, True],
                 "common_prefix_tokens": [2, 2, 0]}


def test_the_text_report_names_every_stage_and_llamacpp_absence():
    metrics = {"top1_agreement": 0.995, "max_abs_logit_diff": 0.25, "mean_abs_logit_diff": 0.01,
               "kl_mean": 1e-4, "kl_max": 2e-3, "positions": 10}
    report = {"prompt_suite": [{"prompt": "hi"}], "stages": [
        {"name": "checkpoint", "description": "reference", "file": None, "positions": 10},
        {"name": "merged", "description": "merged", "file": "model.gguf",
         "vs_checkpoint": metrics, "vs_previous": metrics, "tokenizer_matches": True,
         "greedy_vs_checkpoint": {"matches": [True]}}],
        "llamacpp": {"available": False, "reason": "llama-cpp-python is not installed"}}
    report["stages"][1].update(verdict(report["stages"][1], MIN_TOP1_DENSE))
    text = render_text(report)
    assert "[merged]" in text and "99.50%" in text and "0.25" in text
    assert "verdict: pass (needs top-1 ≥ 99%" in text
    assert "[llama.cpp] not run: llama-cpp-python is not installed" in text


def test_stage_verdicts_use_the_stage_bar_and_the_report_passes_only_if_all_do():
    metrics = {"top1_agreement": 0.95, "max_abs_logit_diff": 1.0, "mean_abs_logit_diff": 0.1,
               "kl_mean": 1e-2, "kl_max": 0.1, "positions": 20}
    stage = {"name": "quantized", "tokenizer_matches": True, "vs_checkpoint": metrics}
    assert verdict(stage, MIN_TOP1_QUANTIZED) == {"min_top1": 0.90, "passed": True}
    assert verdict(stage, MIN_TOP1_DENSE) == {"min_top1": 0.99, "passed": False}
    assert not verdict({**stage, "tokenizer_matches": False}, MIN_TOP1_QUANTIZED)["passed"]
    ok = {**stage, **verdict(stage, MIN_TOP1_QUANTIZED)}
    cpp = {"available": True, **stage, **verdict(stage, MIN_TOP1_DENSE)}
    assert Report([], [ok]).as_dict()["passed"] is True
    assert Report([], [ok], cpp).as_dict()["passed"] is False          # llama.cpp counts too
    assert Report([], [ok], {"available": False}).as_dict()["passed"] is True
    assert Report([], []).as_dict()["passed"] is False                 # nothing checked
