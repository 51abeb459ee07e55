"""lm-sft `mode = "cpt"` (continued pretraining) on a tiny random Gemma-3 GGUF: documents packed
with EOS separators (every token a target once), bad documents refused with line and field, a
real `forgebench run` whose eval report holds the held-out domain and control perplexity
before and after (checked against a plain full-logits cross-entropy), LoRA and full fine-tuning,
and exact resume after SIGTERM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lm_pretrain_support import forgebench

from engine.errors import ForgebenchError
from engine.llm.documents import load_documents, pack_documents
from engine.rundir import RunDir
from engine.train.precision import autocast

torch.set_num_threads(1)

DOMAIN = ["Part P-101 is a brass valve kept in bin A. Stock counts are live data.",
          "Part P-202 is a steel hinge kept in bin B. Stock counts are live data.",
          "Part P-303 is a rubber seal kept in bin C. Stock counts are live data.",
          "Part P-404 is a blue flange kept in bin D. Stock counts are live data."]
HELD_OUT = ["Part P-909 is a brass hinge kept in bin A. Stock counts are live data."]
CONTROL = "The morning was cool and the river ran high after the rain."

CONFIG = """\
recipe = "lm-sft"
mode = "cpt"
seed = 3
steps = {steps}
save_every = {save_every}

[model]
gguf = "{gguf}"
weights = "packed"

[data]
path = "train.jsonl"
val_path = "val.jsonl"
control_path = "control.txt"
max_len = 24

[lora]
method = "{method}"
rank = 4
alpha = 8.0
dropout = 0.1
targets = ["q", "v", "up"]

[optim]
lr = 1e-2

[train]
window = 2
micro_batch = 2
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from fixtures_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("base")
    return {qtype: write_tiny_gguf(root / f"tiny-gemma3-{qtype}.gguf", arch="gemma3",
                                   qtype=qtype, n_layers=1) for qtype in ("Q4_K", "F32")}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from engine.gguf.reader import open_gguf
    from engine.llm.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(open_gguf(tiny["Q4_K"]))


def write_run_folder(folder: Path, gguf: Path, *, steps=4, save_every=0, method="lora") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, docs in (("train.jsonl", DOMAIN), ("val.jsonl", HELD_OUT)):
        (folder / name).write_text("".join(json.dumps({"source_id": f"d{i}", "text": t}) + "\n"
                                           for i, t in enumerate(docs)))
    (folder / "control.txt").write_text(CONTROL + "\n")
    config = folder / "cpt.toml"
    config.write_text(CONFIG.format(steps=steps, save_every=save_every, gguf=gguf,
                                    method=method))
    return config


def test_packing_puts_eos_between_documents_and_targets_every_token_once(tokenizer):
    docs = ["alpha beta", "gamma", "delta epsilon zeta"]
    stream = []
    for text in docs:
        stream += tokenizer.encode(text, add_special=False) + [tokenizer.eos_id]
    blocks = pack_documents(docs, tokenizer, block_len=5)
    assert all(b.sequence[0] == tokenizer.bos_id and len(b.input_ids) <= 5 for b in blocks)
    assert all(b.labels == b.sequence[1:] and b.n_supervised == len(b.input_ids)
               for b in blocks)                                # every position is a target
    assert [t for b in blocks for t in b.sequence[1:]] == stream  # each token once, in order
    assert stream.count(tokenizer.eos_id) == len(docs)
    # without BOS, blocks overlap by one token so that again each token after the first counts
    tokenizer.add_bos = False
    try:
        plain = pack_documents(docs, tokenizer, block_len=5)
    finally:
        tokenizer.add_bos = True
    assert [t for b in plain for t in b.sequence[1:]] == stream[1:]
    assert all(len(b.input_ids) <= 5 for b in plain)


@pytest.mark.parametrize("lines, message", [
    (['{"text": "ok"}', '{"body": "no text"}'], "field 'text' must be a non-empty string "
                                                "(missing)"),
    (['{"text": "ok"}', '{"text": ""}'], "(empty)"),
    (['{"text": "ok"}', '{"text": 7}'], "(a int)"),
    (['{"text": "ok"}', '{"text": "x"'], "malformed JSON"),
    (['{"text": "ok"}', '["text"]'], "expected a JSON object"),
])
def test_bad_documents_are_refused_with_line_and_field(tmp_path, lines, message):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ForgebenchError) as caught:
        load_documents(path)
    assert caught.value.where == "line 2" and message in caught.value.message, caught.value
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ForgebenchError, match="the text file is empty"):
        load_documents(tmp_path / "empty.txt")


def reference_loss(model, blocks) -> float:
    """Mean next-token CE over every block's targets from the full logits, one block at a time
    (no packing, no fused head): the independent check of the report's perplexity."""
    total, count = 0.0, 0
    with torch.no_grad():
        for block in blocks:
            logits = model.logits(model.hidden(torch.tensor([block.input_ids])))[0]
            total += float(torch.nn.functional.cross_entropy(
                logits.float(), torch.tensor(block.labels), reduction="sum"))
            count += len(block.labels)
    return total / count


def test_cpt_run_reports_domain_and_control_perplexity_before_and_after(tmp_path, tiny,
                                                                       tokenizer):
    from engine.models.gguf_model import load_gguf_model

    config = write_run_folder(tmp_path, tiny["Q4_K"], steps=4)
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    report = json.loads((tmp_path / "run" / "evals" / "perplexity.json").read_text())
    before, after = report["before"], report["after"]
    assert (before["step"], after["step"]) == (0, 4)
    for part in ("domain", "control"):
        assert after[f"{part}_ppl"] == pytest.approx(math.exp(after[f"{part}_loss"]))
        assert report["change"][f"{part}_ppl"] == pytest.approx(
            after[f"{part}_ppl"] - before[f"{part}_ppl"])
    assert after["domain_ppl"] < before["domain_ppl"]      # the domain is learned
    assert before["control_tokens"] == after["control_tokens"] > 0
    # the BEFORE figures are the base's, against a plain full-logits cross-entropy in the
    # precision the run computed in (bf16 where "auto" found AVX512-BF16 or AMX: its logits
    # round to bf16, 4e-4 of the loss away from f32's on an AMX Xeon)
    model, _ = load_gguf_model(tiny["Q4_K"], numerics="f32", weights="packed")
    model.eval()
    domain = pack_documents(HELD_OUT, tokenizer, 24)
    control = pack_documents([CONTROL + "\n"], tokenizer, 24)
    with autocast(RunDir(tmp_path / "run").manifest()["precision"]["precision"]):
        expected = {"domain": reference_loss(model, domain),
                    "control": reference_loss(model, control)}
    assert before["domain_loss"] == pytest.approx(expected["domain"], rel=1e-4)
    assert before["control_loss"] == pytest.approx(expected["control"], rel=1e-4)
    assert before["domain_tokens"] == sum(len(b.labels) for b in domain)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "control_ppl" in r] == [0, 4]     # charted


@pytest.mark.slow
def test_cpt_full_fine_tuning_resumes_exactly_after_sigterm(tmp_path, tiny):
    """Full fine-tuning of a float base, stopped by SIGTERM after step 2 and resumed: the same
    losses, weights and AFTER report as an uninterrupted run."""
    from safetensors.torch import load_file

    straight = write_run_folder(tmp_path / "a", tiny["F32"], steps=4, method="full")
    forgebench("run", str(straight), "--out", str(tmp_path / "a" / "run"))
    split = write_run_folder(tmp_path / "b", tiny["F32"], steps=4, method="full")
    forgebench("run", str(split), "--out", str(tmp_path / "b" / "run"), "--stop-after-step",
               "2")
    status = json.loads((tmp_path / "b" / "run" / "status.json").read_text())
    assert status["state"] == "stopped" and status["step"] == 2
    forgebench("resume", str(tmp_path / "b" / "run"))

    def losses(run):
        return [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text()
                                       .splitlines()) if m.get("split") == "train"]

    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert losses(a) == losses(b) and len(losses(a)) == 4
    wa = load_file(a / "checkpoints" / "step-000004" / "model.safetensors")
    wb = load_file(b / "checkpoints" / "step-000004" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ra = json.loads((a / "evals" / "perplexity.json").read_text())
    rb = json.loads((b / "evals" / "perplexity.json").read_text())
    assert ra["after"]["domain_loss"] == rb["after"]["domain_loss"]
    assert ra["change"] == rb["change"]
    # `forgebench eval` of the last checkpoint reads the same held-out domain blocks
    forgebench("eval", str(b), "--split", "val")
    record = json.loads((b / "evals" / "val-step-000004.json").read_text())
    assert record["loss"] == pytest.approx(rb["after"]["domain_loss"], rel=1e-12)
    assert record["perplexity"] == pytest.approx(math.exp(record["loss"]))


def test_cpt_config_is_checked():
    from engine.recipes.lm_sft_config import LMSFTConfig

    base = {"model": {"gguf": "m.gguf"}, "data": {"path": "d.jsonl"}}
    assert LMSFTConfig(**base, mode="cpt").mode == "cpt"
    with pytest.raises(ValueError, match="mode \"cpt\" reads raw documents"):
        LMSFTConfig(mode="cpt", model=base["model"], data={"path": "d.jsonl",
                                                           "format": "messages"})
    with pytest.raises(ValueError, match="control_path is for mode"):
        LMSFTConfig(model=base["model"], data={"path": "d.jsonl", "control_path": "c.txt"})


def test_inspect_sft_refuses_a_cpt_config_with_the_reason(tmp_path, tiny, capsys):
    from engine.cli import main

    assert main(["inspect-sft", str(write_run_folder(tmp_path, tiny["Q4_K"]))]) == 2
    assert "a mode \"cpt\" run has none" in capsys.readouterr().err
