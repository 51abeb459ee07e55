"""lm-sft on tool conversations, end to end on a tiny random Gemma-3 GGUF: a real `forgebench
run` (stopped by SIGTERM and resumed) whose eval report holds the 6-level tool-call score of
every held-out decision before and after training, and bad tool data refused before any work
with its line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_pretrain_support import forgebench
from lm_sft_support import shipped_config

from engine.data.generators.catalog import generate_tool_conversations
from engine.eval.tool_calls import LEVELS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from fixtures_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("base") / "tiny-gemma3-q4k.gguf",
                           arch="gemma3", qtype="Q4_K", n_layers=1)


def tools_config(folder: Path, gguf: Path, **changes) -> Path:
    """resources/configs/lm-sft-tools.toml on the tiny base, with a few values changed."""
    return shipped_config("lm-sft-tools.toml", folder / "tools.toml", gguf, **changes)


@pytest.mark.slow
def test_tool_run_scores_held_out_decisions_before_and_after_and_resumes(tmp_path, tiny):
    generate_tool_conversations(tmp_path / "datasets" / "catalog-tools", n=8)
    config = tools_config(tmp_path, tiny, **{
        "steps = 16": "steps = 2", "save_every = 8": "save_every = 0",
        "max_len = 512": "max_len = 1600", "max_tokens = 36": "max_tokens = 4",
        'weights = "dense-cache"': 'weights = "packed"'})
    run = tmp_path / "run"
    forgebench("run", str(config), "--out", str(run), "--stop-after-step", "1")
    assert json.loads((run / "status.json").read_text())["state"] == "stopped"
    assert not (run / "evals" / "tool-calls.json").exists()      # no AFTER yet
    forgebench("resume", str(run))
    report = json.loads((run / "evals" / "tool-calls.json").read_text())
    val = [r for r in map(json.loads, (tmp_path / "datasets" / "catalog-tools" / "records.jsonl")
                          .read_text().splitlines()) if r["split"] == "val"]
    calls = sum(1 for r in val for m in r["messages"] if m.get("tool_calls"))
    answers = sum(1 for r in val for m in r["messages"]
                  if m["role"] == "assistant" and not m.get("tool_calls"))
    for side, step in (("before", 0), ("after", 2)):
        part = report[side]
        assert part["step"] == step and set(part["levels"]) == set(LEVELS)
        assert sum(part["levels"].values()) == part["call_decisions"] == calls
        assert part["no_call_decisions"] == answers
        assert len(part["outputs"]) == calls + answers
        assert all(o["level"] in range(6) for o in part["outputs"])
    assert report["change"]["tool_mean_level"] == pytest.approx(
        report["after"]["tool_mean_level"] - report["before"]["tool_mean_level"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "tool_mean_level" in r] == [0, 2]


def break_first_call(folder: Path) -> None:
    """Give the first record's lookup_part call an argument its schema refuses, and re-hash
    the folder (a real edit, not a corrupted file)."""
    from engine.data.dataset import write_manifest

    records = folder / "records.jsonl"
    lines = records.read_text().splitlines()
    record = json.loads(lines[0])
    record["messages"][2]["tool_calls"][0]["function"]["arguments"] = {"part_id": "101"}
    lines[0] = json.dumps(record)
    records.write_text("\n".join(lines) + "\n")
    manifest = json.loads((folder / "dataset.json").read_text())
    write_manifest(folder, manifest.pop("kind"), manifest.pop("name"),
                   **{k: v for k, v in manifest.items()
                      if k not in ("schema_version", "version", "parent", "files", "created")})


def test_bad_tool_data_is_refused_with_line_and_field(tmp_path, tiny):
    generate_tool_conversations(tmp_path / "datasets" / "catalog-tools", n=8)
    break_first_call(tmp_path / "datasets" / "catalog-tools")
    config = tools_config(tmp_path, tiny)
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), check=False)
    assert result.returncode == 2
    assert "records.jsonl: line 1 (id 'train-000'), field " \
           "'messages[2].tool_calls[0].function.arguments': does not match the schema of " \
           "'lookup_part'" in result.stderr, result.stderr


def test_the_sample_sets_hold_out_whole_id_ranges(tmp_path):
    """Validation uses only P-9xx IDs, training never does, so a right held-out call copies an
    unseen argument; every record loads as a valid tool conversation."""
    import re

    from engine.data.generators.catalog import generate_cpt_corpus
    from engine.llm.documents import load_documents
    from engine.llm.sft_data import load_sft_examples
    from engine.llm.tool_data import ToolExample

    root = generate_tool_conversations(tmp_path / "tools", n=16)
    records = [json.loads(x) for x in (root / "records.jsonl").read_text().splitlines()]
    ids = {}
    for split in ("train", "val"):
        examples = load_sft_examples(root, split=split)
        assert all(isinstance(e, ToolExample) for e in examples)
        ids[split] = {c["arguments"]["part_id"] for e in examples for m in e.messages
                      for c in m.get("tool_calls") or () if c["name"] == "lookup_part"}
        kinds = {r["source_id"].split("-")[1] for r in records if r["split"] == split}
        # training shows every decision; the small validation file a call of each tool and
        # at least one decision not to call
        assert kinds == {"stock", "math", "missing", "terms"} if split == "train" else \
            {"stock", "math"} < kinds <= {"stock", "math", "missing", "terms"}
    assert ids["val"] and all(i.startswith("P-9") for i in ids["val"])
    assert ids["train"] and not any(i.startswith("P-9") for i in ids["train"])
    corpus = generate_cpt_corpus(tmp_path / "cpt", n=10)
    for split, held_out in (("train", False), ("val", True)):
        parts = {p for doc in load_documents(corpus, split=split)
                 for p in re.findall(r"P-\d{3}", doc)}
        assert parts and all(p.startswith("P-9") == held_out for p in parts)
    assert load_documents(corpus / "control.txt")[0].count("Part") == 0
