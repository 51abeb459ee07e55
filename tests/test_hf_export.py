"""Merged Hugging Face folders out (engine/export/hf_export.py).

The default tests round-trip a checkpoint HF -> GGUF -> HF -> GGUF and check the layout
(shards + index, the training chat template, nothing at --out on failure); the oracle tests
(transformers, PEFT) load the exported folder and compare logits with the engine's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_fixtures import CHAT_TEMPLATE, FAMILIES, make_checkpoint, make_raw_llama

from engine.errors import ForgebenchError
from engine.export.hf_export import write_hf_folder
from engine.gguf.writer import read_gguf_content
from engine.hf.convert import convert_hf

TRAINED_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _with_template(src: Path, dst: Path, template: str) -> Path:
    from engine.export.merge import with_chat_template

    content = read_gguf_content(src)
    metadata = dict(content.metadata)
    metadata.pop("tokenizer.chat_template", None)
    metadata = with_chat_template(metadata, template)
    from engine.gguf.writer import write_gguf

    return write_gguf(dst, metadata, content.tensors)


def test_round_trip_through_the_hf_folder_keeps_every_tensor(tmp_path):
    folder = make_raw_llama(tmp_path / "src")
    base = convert_hf(folder, tmp_path / "base.gguf", "f32").path
    trained = _with_template(base, tmp_path / "trained.gguf", TRAINED_TEMPLATE)
    files = write_hf_folder(trained, folder, tmp_path / "hf", shard_bytes=300_000)
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert set(shards) <= set(files)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] \
        == TRAINED_TEMPLATE
    assert (out / "tokenizer.model").read_bytes() == (folder / "tokenizer.model").read_bytes()
    again = convert_hf(out, tmp_path / "again.gguf", "f32").path
    a, b = read_gguf_content(base), read_gguf_content(again)
    assert {t.name: bytes(t.data) for t in a.tensors} == {t.name: bytes(t.data) for t in b.tensors}
    # the twin: the folder's own template is not what the export carries
    assert CHAT_TEMPLATE != TRAINED_TEMPLATE


def test_an_export_over_an_existing_folder_or_a_foreign_source_writes_nothing(tmp_path):
    folder = make_raw_llama(tmp_path / "src")
    base = convert_hf(folder, tmp_path / "base.gguf", "f32").path
    (tmp_path / "taken").mkdir()
    with pytest.raises(ForgebenchError, match="already exists"):
        write_hf_folder(base, folder, tmp_path / "taken")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(ForgebenchError):
        write_hf_folder(base, broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.peft
@pytest.mark.parametrize("family", FAMILIES)
def test_the_merged_folder_loads_in_transformers_with_the_engines_logits(tmp_path, family):
    """A LoRA merged into the base, exported: transformers' logits on the folder equal the
    engine's on the adapted model; the PEFT adapter of the same LoRA on the HF base, too."""
    import transformers
    from export_support import make_adapter

    from engine.export.lora_export import write_peft
    from engine.export.merge import merge_into_gguf

    folder = make_checkpoint(family, tmp_path / f"tiny-{family}", dtype="float32", seed=5)
    base = convert_hf(folder, tmp_path / "base.gguf", "f32").path
    adapted, _ = make_adapter(base, tmp_path / "adapters.safetensors")
    merge_into_gguf(base, tmp_path / "adapters.safetensors", tmp_path / "merged.gguf",
                    chat_template=TRAINED_TEMPLATE)
    write_hf_folder(tmp_path / "merged.gguf", folder, tmp_path / "hf")
    ids = torch.tensor([[1, 17, 42, 99, 5, 250, 7, 3]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ours, theirs = adapted(ids), hf(ids).logits
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-5 * scale
    # the twin: the base alone gives other logits (the merge is in the folder)
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(ids).logits - theirs).abs().max().item() > 1e-3 * scale
    peft = pytest.importorskip("peft")
    write_peft(tmp_path / "adapters.safetensors", base, tmp_path / "peft")
    with torch.no_grad():
        lora = peft.PeftModel.from_pretrained(plain, tmp_path / "peft").eval()
        assert (lora(ids).logits - theirs).abs().max().item() <= 1e-4 * scale


@pytest.mark.slow
@pytest.mark.peft
def test_a_run_from_a_library_hf_folder_exports_as_a_merged_hf_folder(tmp_path):
    """models add DIR -> lm-sft LoRA over the library's copy -> export --format hf: the folder
    loads in transformers with the logits of the run's merged GGUF export, and carries the
    tokenizer of the HF folder the base came from."""
    import transformers
    from export_support import SFT_CONFIG
    from media_support import forgebench

    from engine.models.gguf_model import load_gguf_model

    folder = make_checkpoint("qwen3", tmp_path / "tiny-qwen3", dtype="float32", hidden=128)
    root = tmp_path / "ws"
    root.mkdir()
    (root / "workspace.json").write_text(json.dumps({"name": "ws", "models": []}))
    entry = json.loads(forgebench("models", "--workspace", str(root), "add", str(folder),
                                  "--json").stdout)
    assert entry["mode"] == "hf" and entry["facts"]["usable"]
    (tmp_path / "pairs.jsonl").write_text("".join(
        json.dumps({"instruction": q, "response": a}) + "\n"
        for q, a in [("say hello", "hello world"), ("name a fox", "quick brown fox"),
                     ("what runs", "the dog runs")]))
    config = tmp_path / "sft.toml"
    config.write_text(SFT_CONFIG.format(steps=3, gguf=root / entry["path"],
                                        data=tmp_path / "pairs.jsonl"))
    run = root / "runs" / "sft"
    forgebench("run", str(config), "--out", str(run))
    forgebench("export", str(run), "--dtype", "f32", "--no-report", "--out",
               str(tmp_path / "gguf-export"))
    forgebench("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf-export"))
    out = tmp_path / "hf-export"
    assert (out / "tokenizer.model").read_bytes() == (folder / "tokenizer.model").read_bytes()
    merged = next((tmp_path / "gguf-export").glob("*.gguf"))
    engine_model, _ = load_gguf_model(merged, tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 17, 42, 99, 5, 250, 7, 3]])
    with torch.no_grad():
        ours, theirs = engine_model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()
    template = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    assert template == read_gguf_content(merged).metadata["tokenizer.chat_template"].python()
