"""Merging LoRA adapters into a dense GGUF base: the merged file computes what base + adapter
computes in the engine, rounding is one f16 rounding of the exact sum, and every bad input
(another base, a quantized base, an existing output, a full disk) is refused leaving no file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from export_support import engine_logits, fill_disk_after, make_adapter
from gguf import GGMLQuantizationType as T
from gguf_write_fixtures import write_dense_llama
from lm_pretrain_support import forgebench

from engine.errors import ForgebenchError
from engine.export.merge import merge_into_gguf
from engine.fsutil import sha256_file
from engine.gguf.constants import DEQUANTIZED_FROM_KEY, MERGED_ADAPTER_KEY
from engine.gguf.convert import convert_gguf
from engine.gguf.writer import read_gguf_content
from engine.lora import read_adapters
from engine.models.gguf_model import load_gguf_model

torch.set_num_threads(1)
IDS = [1, 5, 9, 12, 3, 7, 30, 2, 11, 4]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {dtype: write_dense_llama(root / f"dense-{dtype}.gguf", dim=256, ffn=512,
                                     n_layers=2, dtype=dtype.upper(), seed=3)
            for dtype in ("f32", "f16")}


def _tensor(path: Path, name: str):
    return next(t for t in read_gguf_content(path).tensors if t.name == name)


def test_merged_f32_file_computes_base_plus_adapter(tmp_path, bases):
    adapted, _ = make_adapter(bases["f32"], tmp_path / "adapters.safetensors")
    result = merge_into_gguf(bases["f32"], tmp_path / "adapters.safetensors", tmp_path / "m.gguf")
    assert result.base_match == "file" and len(result.merged) == 2 * 7

    merged, _ = load_gguf_model(tmp_path / "m.gguf", numerics="f32")
    expected, got = engine_logits(adapted, IDS), engine_logits(merged, IDS)
    base_model, _ = load_gguf_model(bases["f32"], numerics="f32")
    moved = (engine_logits(base_model, IDS) - expected).abs().max()
    assert moved > 0.05                                      # the adapter changes the answer …
    assert (got - expected).abs().max() < 1e-4 * moved.item() + 2e-5   # … and the merge keeps it

    base, out = read_gguf_content(bases["f32"]), read_gguf_content(tmp_path / "m.gguf")
    assert [t.name for t in out.tensors] == [t.name for t in base.tensors]
    for before, after in zip(base.tensors, out.tensors):
        assert before.ggml_type == after.ggml_type
        if before.name not in result.merged:                 # norms, embeddings: untouched bytes
            assert bytes(before.data) == bytes(after.data), before.name
    for key, value in base.metadata.items():                # every key kept, typed
        assert out.metadata[key] == value, key
    adapter_sha = sha256_file(tmp_path / "adapters.safetensors")
    assert out.metadata[MERGED_ADAPTER_KEY].python() == adapter_sha


def test_f16_merge_is_one_rounding_of_the_exact_sum(tmp_path, bases):
    make_adapter(bases["f16"], tmp_path / "a.safetensors", targets=["q", "down"], rank=3,
                 alpha=5.0, b_std=0.2)
    merge_into_gguf(bases["f16"], tmp_path / "a.safetensors", tmp_path / "m.gguf")
    tensors, meta = read_adapters(tmp_path / "a.safetensors")
    scale = float(meta["alpha"]) / int(meta["rank"])
    for layer in range(2):
        for target, gname in (("q", "attn_q"), ("down", "ffn_down")):
            name = f"blk.{layer}.{gname}.weight"
            w = np.asarray(_tensor(bases["f16"], name).data).view(np.float16).astype(np.float64)
            a = tensors[f"layers.{layer}.{target}.lora_a"].double().numpy()
            b = tensors[f"layers.{layer}.{target}.lora_b"].double().numpy()
            exact = w.reshape(b.shape[0], a.shape[1]) + scale * (b @ a)
            entry = _tensor(tmp_path / "m.gguf", name)
            assert entry.ggml_type == T.F16
            got = np.asarray(entry.data).view(np.float16).reshape(exact.shape)
            # within half an f16 step of the exact value (plus the f32 sum's own rounding)
            half_ulp = np.spacing(np.abs(got)).astype(np.float64) / 2
            assert np.all(np.abs(got.astype(np.float64) - exact)
                          <= half_ulp + 1e-6 * np.abs(exact) + 1e-9)
            assert not np.array_equal(got, w.astype(np.float16).reshape(got.shape))


def test_a_dense_copy_of_a_quantized_base_is_accepted_the_quantized_file_refused(tmp_path, bases):
    q8 = convert_gguf(bases["f16"], tmp_path / "base-q8.gguf", "q8_0").path
    dense = convert_gguf(q8, tmp_path / "dense.gguf", "f16").path
    assert read_gguf_content(dense).metadata[DEQUANTIZED_FROM_KEY].python() == sha256_file(q8)
    make_adapter(q8, tmp_path / "a.safetensors")              # trained over the Q8_0 file

    with pytest.raises(ForgebenchError) as refused:
        merge_into_gguf(q8, tmp_path / "a.safetensors", tmp_path / "m.gguf")
    text = refused.value.render()
    assert "quantized" in text and "Q8_0" in text and "--dtype f16" in text
    assert "compounds" in text
    assert not (tmp_path / "m.gguf").exists()

    result = merge_into_gguf(dense, tmp_path / "a.safetensors", tmp_path / "m.gguf")
    assert result.base_match == "dequantized from"


def test_an_adapter_from_another_base_is_refused(tmp_path, bases):
    make_adapter(bases["f16"], tmp_path / "a.safetensors", base_sha256="0" * 64)
    with pytest.raises(ForgebenchError) as refused:
        merge_into_gguf(bases["f16"], tmp_path / "a.safetensors", tmp_path / "m.gguf")
    assert "different base" in refused.value.render()
    assert refused.value.path == str(bases["f16"])
    assert list(tmp_path.iterdir()) == [tmp_path / "a.safetensors"]


def test_an_existing_output_is_never_overwritten(tmp_path, bases):
    make_adapter(bases["f16"], tmp_path / "a.safetensors")
    existing = tmp_path / "m.gguf"
    existing.write_bytes(b"keep me")
    with pytest.raises(ForgebenchError, match="already exists"):
        merge_into_gguf(bases["f16"], tmp_path / "a.safetensors", existing)
    assert existing.read_bytes() == b"keep me"


def test_a_disk_that_fills_up_mid_write_leaves_no_file(tmp_path, bases, monkeypatch):
    make_adapter(bases["f16"], tmp_path / "a.safetensors")
    fill_disk_after(monkeypatch, 1 << 20)
    with pytest.raises(ForgebenchError) as refused:
        merge_into_gguf(bases["f16"], tmp_path / "a.safetensors", tmp_path / "m.gguf")
    assert "disk filled up" in refused.value.render()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]   # no temp file left


def test_the_cli_refuses_a_quantized_base_with_a_nonzero_exit(tmp_path):
    from fixtures_gguf import write_tiny_gguf

    base = write_tiny_gguf(tmp_path / "q4k.gguf", arch="llama", qtype="Q4_K", n_layers=1)
    make_adapter(base, tmp_path / "a.safetensors", targets=["q"])
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    for name in ("a.safetensors",):
        (run / "checkpoints" / "step-000001" / "adapters.safetensors").write_bytes(
            (tmp_path / name).read_bytes())
    from engine.train.integrity import file_records

    # a committed checkpoint whose files verify (readers check them before anything else)
    records = file_records(run / "checkpoints" / "step-000001", ["adapters.safetensors"])
    (run / "checkpoints" / "step-000001" / "trainer_state.json").write_text(
        json.dumps({"step": 1, "files": records}))
    (run / "run.json").write_text(json.dumps({
        "recipe": "lm-sft", "config": {}, "base_model": {"path": str(base),
                                                         "sha256": sha256_file(base)}}))
    (run / "status.json").write_text(json.dumps({"state": "completed"}))
    result = forgebench("export", str(run), "--dtype", "f16", "--out", str(tmp_path / "e"),
                        "--no-report", check=False)
    assert result.returncode != 0
    assert "quantized" in result.stderr and "forgebench convert" in result.stderr
    assert not (tmp_path / "e").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".e.")]


def test_the_training_chat_template_is_written_when_the_base_has_none(tmp_path, bases):
    """A base without `tokenizer.chat_template` gets the layout the adapter was trained with
    (llama.cpp would otherwise fall back to another); a base's own template is never
    replaced."""
    from engine.export.merge import CHAT_TEMPLATE_KEY
    from engine.gguf.writer import write_gguf
    from engine.llm.chat import ChatTemplate

    content = read_gguf_content(bases["f32"])
    own = content.metadata[CHAT_TEMPLATE_KEY].python()
    bare = tmp_path / "bare.gguf"                   # the same base, its template removed
    write_gguf(bare, {k: v for k, v in content.metadata.items() if k != CHAT_TEMPLATE_KEY},
               content.tensors, version=content.version)
    make_adapter(bare, tmp_path / "a.safetensors")
    make_adapter(bases["f32"], tmp_path / "own.safetensors")
    layout = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
    merge_into_gguf(bare, tmp_path / "a.safetensors", tmp_path / "m.gguf", chat_template=layout)
    assert read_gguf_content(tmp_path / "m.gguf").metadata[CHAT_TEMPLATE_KEY].python() == layout
    assert ChatTemplate.from_gguf(tmp_path / "m.gguf").render(
        [{"role": "user", "content": "Hi"}]) == "<|user|>Hi\n<|assistant|>"
    merge_into_gguf(bases["f32"], tmp_path / "own.safetensors", tmp_path / "own.gguf",
                    chat_template=layout)
    assert read_gguf_content(tmp_path / "own.gguf").metadata[CHAT_TEMPLATE_KEY].python() == own
