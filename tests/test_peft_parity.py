"""Parity with an independent implementation: transformers' LlamaForCausalLM + PEFT LoRA.

The same random weights go into both; both get the same adapter factors (A as the engine
initialised it, B made non-zero so dL/dA is live). The loss (HF shifts labels itself; the engine
gets pre-shifted labels) and every adapter gradient must agree within 1e-5 relative in f32.
"""

from __future__ import annotations

import pytest
import torch

from engine.lora import attach_lora
from engine.train.loss import IGNORE, supervised_loss

pytestmark = pytest.mark.peft
torch.set_num_threads(2)

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
HF_NAME = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}


def _models(tie: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    from engine.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    hf_config = HFConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-5, max_position_embeddings=64,
                         tie_word_embeddings=tie, attn_implementation="eager")
    hf = LlamaForCausalLM(hf_config).float()
    with torch.no_grad():  # non-trivial norm gains, so the norms are exercised too
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    engine = Llama(LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               ffn_dim=48, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64,
                               tie_embeddings=tie, rope_type="neox"))
    state = hf.state_dict()
    with torch.no_grad():
        engine.tok_embeddings.weight.copy_(state["model.embed_tokens.weight"])
        engine.norm.weight.copy_(state["model.norm.weight"])
        if not tie:
            engine.output.weight.copy_(state["lm_head.weight"])
        for i, layer in enumerate(engine.layers):
            prefix = f"model.layers.{i}."
            layer.attn_norm.weight.copy_(state[prefix + "input_layernorm.weight"])
            layer.mlp_norm.weight.copy_(state[prefix + "post_attention_layernorm.weight"])
            for target in TARGETS:
                parent = layer.attn if target in ("q", "k", "v", "o") else layer.mlp
                getattr(parent, target).weight.copy_(state[prefix + HF_NAME[target] + ".weight"])

    adapters = attach_lora(engine, targets=TARGETS, rank=4, alpha=8.0, seed=3)
    peft_model = get_peft_model(hf, LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
        target_modules=[HF_NAME[t].split(".")[1] for t in TARGETS]))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for i in range(2):
            for target in TARGETS:
                ours = adapters[f"layers.{i}.{target}"]
                ours.lora_b.copy_(torch.randn(ours.lora_b.shape, generator=generator) * 0.05)
                theirs = peft_model.get_submodule(
                    f"base_model.model.model.layers.{i}.{HF_NAME[target]}")
                theirs.lora_A["default"].weight.copy_(ours.lora_a)
                theirs.lora_B["default"].weight.copy_(ours.lora_b)
    return engine, adapters, peft_model


def worst_adapter_grad_difference(adapters, peft_model, bound: float = 1e-5) -> float:
    """The largest relative difference between the engine's and PEFT's gradient of any adapter
    factor; every one must be live (non-zero) and within `bound`."""
    worst = 0.0
    for i in range(2):
        for target in TARGETS:
            module = peft_model.get_submodule(
                f"base_model.model.model.layers.{i}.{HF_NAME[target]}")
            for ours_p, theirs_p in ((adapters[f"layers.{i}.{target}"].lora_a,
                                      module.lora_A["default"].weight),
                                     (adapters[f"layers.{i}.{target}"].lora_b,
                                      module.lora_B["default"].weight)):
                assert ours_p.grad.abs().max() > 0
                relative = float((ours_p.grad - theirs_p.grad).norm() / theirs_p.grad.norm())
                worst = max(worst, relative)
                assert relative < bound, (i, target, relative)
    return worst


def _batch():
    """Two sequences of different lengths, prompts masked, right-padded for HF."""
    generator = torch.Generator().manual_seed(11)
    sequences = [(torch.randint(96, (21,), generator=generator), 8),
                 (torch.randint(96, (14,), generator=generator), 5)]
    width = max(len(t) for t, _ in sequences)
    hf_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    hf_labels = torch.full((len(sequences), width), IGNORE)
    hf_mask = torch.zeros(len(sequences), width, dtype=torch.long)
    ours = []
    for row, (tokens, prompt) in enumerate(sequences):
        hf_ids[row, :len(tokens)] = tokens
        hf_mask[row, :len(tokens)] = 1
        hf_labels[row, prompt:len(tokens)] = tokens[prompt:]      # HF shifts internally
        labels = tokens[1:].clone()
        labels[:prompt - 1] = IGNORE                              # the engine: shifted labels
        ours.append((tokens[:-1], labels))
    return ours, hf_ids, hf_labels, hf_mask


@pytest.mark.parametrize("tie", [False, True])
def test_loss_and_adapter_grads_match_peft(tie):
    engine, adapters, peft_model = _models(tie)
    ours, hf_ids, hf_labels, hf_mask = _batch()

    supervised = sum(int((labels != IGNORE).sum()) for _, labels in ours)
    loss = sum(supervised_loss(engine, inputs, labels) for inputs, labels in ours) / supervised
    loss.backward()
    reference = peft_model(input_ids=hf_ids, attention_mask=hf_mask, labels=hf_labels).loss
    reference.backward()

    assert supervised == int((hf_labels != IGNORE).sum()) == 13 + 9
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    worst = worst_adapter_grad_difference(adapters, peft_model)
    print(f"worst relative adapter-gradient difference vs PEFT: {worst:.2e}; "
          f"loss {loss.item():.7f} vs {reference.item():.7f}")
