"""The exported PEFT adapter, loaded by PEFT itself: transformers' LlamaForCausalLM gets the tiny
GGUF base's weights (q/k rows un-permuted, as llama.cpp's converter permuted them), then
`PeftModel.from_pretrained` loads `write_peft`'s folder; its logits must equal the engine's
base + adapter logits within 1e-4 in f32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from export_support import engine_logits, make_adapter
from gguf_write_fixtures import write_dense_llama
from test_peft_parity import HF_NAME

from engine.export.lora_export import write_peft
from engine.gguf.reader import open_gguf
from engine.models.gguf_model import load_gguf_model

pytestmark = pytest.mark.peft
torch.set_num_threads(1)
IDS = [1, 5, 9, 12, 3, 7, 30, 2, 11, 4, 17, 8]
GGUF_NAME = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
             "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


def _hf_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF q/k rows back to HF's: the inverse of convert_hf_to_gguf.py LlamaModel.permute."""
    return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def hf_model_from_gguf(path: Path):
    """A transformers Llama holding exactly the GGUF's (f32) weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    gf = open_gguf(path)
    tensor = {name: torch.from_numpy(info.raw.view(np.float32).reshape(info.shape).copy())
              for name, info in gf.tensors.items()}
    heads, kv_heads = int(gf.get("llama.attention.head_count")), \
        int(gf.get("llama.attention.head_count_kv"))
    n_vocab, dim = tensor["token_embd.weight"].shape
    config = LlamaConfig(vocab_size=n_vocab, hidden_size=dim,
                         intermediate_size=tensor["blk.0.ffn_up.weight"].shape[0],
                         num_hidden_layers=int(gf.get("llama.block_count")),
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         rms_norm_eps=float(gf.get("llama.attention.layer_norm_rms_epsilon")),
                         rope_theta=float(gf.get("llama.rope.freq_base")),
                         max_position_embeddings=int(gf.get("llama.context_length")),
                         tie_word_embeddings="output.weight" not in tensor,
                         attn_implementation="eager")
    hf = LlamaForCausalLM(config).float().eval()
    state = {"model.embed_tokens.weight": tensor["token_embd.weight"],
             "model.norm.weight": tensor["output_norm.weight"],
             "lm_head.weight": tensor.get("output.weight", tensor["token_embd.weight"])}
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        state[p + "input_layernorm.weight"] = tensor[b + "attn_norm.weight"]
        state[p + "post_attention_layernorm.weight"] = tensor[b + "ffn_norm.weight"]
        for target, module in HF_NAME.items():
            w = tensor[b + GGUF_NAME[target] + ".weight"]
            if target in ("q", "k"):
                w = torch.from_numpy(_hf_rows(w.numpy(), heads if target == "q" else kv_heads))
            state[p + module + ".weight"] = w
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


@pytest.mark.parametrize("targets", [["q", "k", "v", "o", "gate", "up", "down"], ["q", "v"]])
def test_peft_loads_the_exported_adapter_and_matches_the_engine(tmp_path, targets):
    from peft import PeftModel

    base = write_dense_llama(tmp_path / "base.gguf", dim=128, ffn=256, head_dim=32,
                             n_kv_heads=2, n_layers=2, dtype="F32", seed=8)
    adapted, _ = make_adapter(base, tmp_path / "a.safetensors", targets=targets, rank=4,
                              alpha=8.0, b_std=0.1)
    write_peft(tmp_path / "a.safetensors", base, tmp_path / "peft")

    hf = hf_model_from_gguf(base)
    with torch.no_grad():
        plain = hf(torch.tensor([IDS])).logits[0].double()
        engine_base = engine_logits(load_gguf_model(base, numerics="f32")[0], IDS)
        torch.testing.assert_close(plain, engine_base, rtol=0, atol=1e-4)   # same base first
        peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
        theirs = peft_model(input_ids=torch.tensor([IDS])).logits[0].double()
        exact = peft_model.double()(input_ids=torch.tensor([IDS])).logits[0]   # PEFT in f64
    ours = engine_logits(adapted, IDS)
    assert (ours - plain).abs().max() > 0.05                       # the adapter changes things
    # both f32 computations against PEFT's f64 one: each rounds its own way (about 2e-4 here on
    # logits up to 55), so neither is held to the other's bits
    assert (theirs - exact).abs().max().item() < 5e-4
    assert (ours - exact).abs().max().item() < 5e-4
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))
