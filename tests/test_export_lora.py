"""LoRA adapters exported for other runtimes: the GGUF LoRA adapter, loaded by llama.cpp with
`lora_path`, gives the logits llama.cpp gives for the merged model; the PEFT files follow PEFT's
names and undo the llama converter's q/k row permutation; and an lm-sft run exports end to end
(merge into a dense copy of its quantized base, quantize, report)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from export_support import (
    engine_logits,
    llamacpp_logits,
    make_adapter,
    tiny_sft_over_quantized_base,
)
from gguf_write_fixtures import write_dense_llama
from lm_pretrain_support import forgebench
from safetensors import safe_open

from engine.export.lora_export import _unpermute_rows, write_gguf_lora, write_peft
from engine.export.merge import merge_into_gguf
from engine.gguf.reader import open_gguf
from engine.lora import read_adapters

torch.set_num_threads(1)
IDS = [1, 5, 9, 12, 3, 7, 30, 2, 11, 4]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_dense_llama(tmp_path_factory.mktemp("base") / "dense-f32.gguf", dim=256,
                             ffn=512, n_layers=2, dtype="F32", seed=5)


def test_gguf_lora_layout_matches_what_llama_cpp_reads(tmp_path, base):
    make_adapter(base, tmp_path / "a.safetensors", targets=["q", "v", "down"], rank=4,
                 alpha=8.0)
    path = write_gguf_lora(tmp_path / "a.safetensors", base, tmp_path / "lora.gguf")
    gf = open_gguf(path)
    assert gf.metadata["general.type"] == "adapter" and gf.metadata["adapter.type"] == "lora"
    assert gf.metadata["adapter.lora.alpha"] == 8.0
    assert gf.architecture == "llama"
    tensors, _ = read_adapters(tmp_path / "a.safetensors")
    assert len(gf.tensors) == len(tensors) == 2 * 3 * 2
    q = gf.tensors["blk.1.attn_q.weight.lora_a"]
    assert q.shape == (4, 256)                               # ggml ne = [in, r]
    np.testing.assert_array_equal(q.raw.view(np.float32).reshape(4, 256),
                                  tensors["layers.1.q.lora_a"].numpy())
    assert gf.tensors["blk.0.ffn_down.weight.lora_b"].shape == (256, 4)   # ne = [r, out]


@pytest.mark.llamacpp
def test_llamacpp_with_the_gguf_lora_answers_as_the_merged_model(tmp_path, base):
    adapted, _ = make_adapter(base, tmp_path / "a.safetensors", rank=4, alpha=8.0)
    lora = write_gguf_lora(tmp_path / "a.safetensors", base, tmp_path / "lora.gguf")
    merged = merge_into_gguf(base, tmp_path / "a.safetensors", tmp_path / "merged.gguf").path

    plain = llamacpp_logits(base, IDS)
    with_lora = llamacpp_logits(base, IDS, lora=lora)
    from_merged = llamacpp_logits(merged, IDS)
    engine = engine_logits(adapted, IDS)
    effect = (with_lora - plain).abs().max().item()
    assert effect > 0.05                                     # llama.cpp applied the adapter
    assert (with_lora - from_merged).abs().max().item() < 0.02 * effect
    assert (with_lora - engine).abs().max().item() < 0.02 * effect
    assert torch.equal(with_lora.argmax(-1), engine.argmax(-1))


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF q/k rows -> GGUF rows)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_peft_files_use_hf_names_and_undo_the_llama_row_permutation(tmp_path, base):
    make_adapter(base, tmp_path / "a.safetensors", targets=["q", "k", "v", "gate"], rank=2,
                 alpha=4.0)
    written = write_peft(tmp_path / "a.safetensors", base, tmp_path / "peft")
    assert [p.name for p in written] == ["adapter_model.safetensors", "adapter_config.json"]
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 4.0
    assert sorted(config["target_modules"]) == ["gate_proj", "k_proj", "q_proj", "v_proj"]
    tensors, _ = read_adapters(tmp_path / "a.safetensors")
    gf = open_gguf(base)
    heads = {"q": gf.get("llama.attention.head_count"),
             "k": gf.get("llama.attention.head_count_kv")}
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as peft:
        keys = set(peft.keys())
        assert len(keys) == 2 * 2 * 4
        for target, module in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
                               ("v", "self_attn.v_proj"), ("gate", "mlp.gate_proj")):
            prefix = f"base_model.model.model.layers.1.{module}"
            a = peft.get_tensor(f"{prefix}.lora_A.weight").numpy()
            b_hf = peft.get_tensor(f"{prefix}.lora_B.weight").numpy()
            np.testing.assert_array_equal(a, tensors[f"layers.1.{target}.lora_a"].numpy())
            ours = tensors[f"layers.1.{target}.lora_b"].numpy()
            if target in heads:       # converting PEFT's B as llama.cpp converts HF weights
                np.testing.assert_array_equal(_llama_cpp_permute(b_hf, heads[target]), ours)
                assert not np.array_equal(b_hf, ours)
            else:
                np.testing.assert_array_equal(b_hf, ours)
    rows = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    np.testing.assert_array_equal(_unpermute_rows(_llama_cpp_permute(rows, 4), 4), rows)


@pytest.mark.llamacpp
@pytest.mark.slow
def test_an_lm_sft_run_exports_through_a_dense_copy_of_its_quantized_base(tmp_path):
    quantized, config = tiny_sft_over_quantized_base(tmp_path, steps=4)
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    refused = forgebench("export", str(tmp_path / "run"), "--dtype", "q4_k_m", "--out",
                         str(tmp_path / "e"), "--no-report", check=False)
    assert refused.returncode != 0 and "--dtype f16" in refused.stderr
    forgebench("convert", str(quantized), "--dtype", "f16", "--out", str(tmp_path / "dense.gguf"))
    forgebench("export", str(tmp_path / "run"), "--dtype", "q4_k_m", "--base",
               str(tmp_path / "dense.gguf"), "--out", str(tmp_path / "e"))
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["checkpoint", "merged", "quantized"]
    merged, quant = report["stages"][1]["vs_checkpoint"], report["stages"][2]["vs_checkpoint"]
    assert merged["top1_agreement"] >= 0.99 and merged["max_abs_logit_diff"] < 0.05
    assert quant["max_abs_logit_diff"] > merged["max_abs_logit_diff"]
    assert report["llamacpp"]["available"]
    assert report["llamacpp"]["vs_engine_same_file"]["top1_agreement"] >= 0.95
    card = (tmp_path / "e" / "model_card.md").read_text()
    assert "dequantized from a quantized file" in card
    exported = open_gguf(tmp_path / "e" / "model.gguf")
    assert exported.get("general.file_type") == 15  # Q4_K_M
    # The layout the run trained with (the base's family template) travels with the model.
    from engine.llm.chat import ChatTemplate

    trained_with = ChatTemplate.from_gguf(quantized)
    assert exported.get("tokenizer.chat_template") == trained_with.source
    assert "## Prompt format" in card and trained_with.render(
        [{"role": "user", "content": "Hello!"}]) in card
