"""A LoRA adapter under llama.cpp numerics: the engine computes what llama.cpp computes with the
adapter loaded as a GGUF LoRA (llama-graph.cpp build_lora_mm), bit for bit.

Kernel level: ggml's f32 x f32 MUL_MAT (tinyBLAS for a batch, ggml_vec_dot_f32 for one row or a
shape tinyBLAS refuses, with its f32 leftovers) against libggml-cpu itself. Model level: tiny
random models with a random adapter, every logit of a prompt and of a greedy continuation against
llama-cpp-python with `lora_path`; the plain f32 adapter product (what the engine ran before)
is the twin that shows the check can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from export_support import make_adapter
from fixtures_gguf import write_tiny_gguf
from llamacpp_oracle import assert_kernel_matches, ggml_mul_mat, require_same_plan

from engine.export.lora_export import write_gguf_lora
from engine.kernels.numerics import dot_vec_f32, f32_tail_group, matmul_f32
from engine.lora import LoRALinear, attach_adapter_file, llamacpp_lora_scale
from engine.models.gguf_model import load_gguf_model

torch.set_num_threads(2)
KERNEL = "LoRA adapter products (F32 A and B)"
PROMPT = [1, 40, 7, 200, 12, 99, 5, 261, 33, 18, 2, 77, 150, 64, 3, 250]


def _rand(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.llamacpp
@pytest.mark.parametrize("n,m,k", [
    (5, 8, 256),      # tinyBLAS (2+ rows, rows % 4, cols % lanes): A·x of a prompt
    (16, 64, 16),     # tinyBLAS over a rank-16 B
    (16, 64, 8),      # rank 8: cols % lanes != 0, ggml_vec_dot_f32's leftovers only
    (1, 8, 640),      # one row: ggml_vec_dot_f32, no leftovers
    (1, 6, 70),       # 64 in the 4-accumulator loop, 6 leftovers
    (4, 6, 200),      # rows % 4 != 0: vec_dot, 8 leftovers
])
def test_f32_mul_mat_matches_ggml(n, m, k):
    p = require_same_plan()
    rng = np.random.default_rng(n * 1000 + k)
    x, w = _rand(rng, n, k), _rand(rng, m, k)
    theirs = ggml_mul_mat(w, 0, m, k, x)                              # GGML_TYPE_F32 weight
    ours = matmul_f32(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    assert_kernel_matches(ours, theirs, KERNEL, p)


@pytest.mark.llamacpp
def test_vec_dot_f32_leftovers_match_ggml_for_every_count():
    """The leftovers past the 4·lanes loop, 1..63 of them for one row: whole groups multiplied
    then added, the rest fused, the group as this machine's compiler builds ggml's loop (8 on a
    Zen 4, 4 on a Sapphire Rapids: f32_tail_group); neither all-fused, all-rounded nor the other
    group matches."""
    p = require_same_plan()
    rng = np.random.default_rng(3)
    all_fused = all_rounded = other_group = 0
    other = 12 - f32_tail_group()
    for k in range(1, 64):
        x, w = _rand(rng, 1, k), _rand(rng, 32, k)
        theirs = ggml_mul_mat(w, 0, 32, k, x)
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        assert_kernel_matches(dot_vec_f32(tx, tw, p.f16_lanes).numpy(), theirs, KERNEL, p)
        all_fused += not np.array_equal(dot_vec_f32(tx, tw, p.f16_lanes, group=64).numpy(),
                                        theirs)
        all_rounded += not np.array_equal(dot_vec_f32(tx, tw, p.f16_lanes, group=1).numpy(),
                                          theirs)
        other_group += not np.array_equal(dot_vec_f32(tx, tw, p.f16_lanes, group=other).numpy(),
                                          theirs)
    assert all_fused and all_rounded and other_group


@pytest.mark.llamacpp
def test_plain_f32_product_is_not_ggmls():
    """The twin: torch's own f32 matmul sums in another order, so the check above can fail."""
    require_same_plan()
    rng = np.random.default_rng(5)
    x, w = _rand(rng, 16, 640), _rand(rng, 8, 640)
    theirs = ggml_mul_mat(w, 0, 8, 640, x)
    assert not np.array_equal(F.linear(torch.from_numpy(x), torch.from_numpy(w)).numpy(), theirs)


def test_scale_is_formed_in_f32_as_llama_cpp_forms_it():
    """llama_adapter_lora_weight::get_scale: 1.0f * alpha / rank in f32; alpha 0 means 1."""
    assert llamacpp_lora_scale(16.0, 8).item() == 2.0
    assert llamacpp_lora_scale(1.0, 3).item() == np.float32(np.float32(1.0) / np.float32(3.0))
    assert llamacpp_lora_scale(0.0, 4).item() == 1.0


def _engine_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        cache = model.new_cache(1, len(ids))
        return model.logits(model.hidden(torch.tensor([ids]), 0, cache))[0].numpy()


def _engine_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy continuation through the KV cache: the prompt in one batch, then one token a step,
    as llama.cpp evaluates it; the tokens and each step's logits."""
    out, rows = [], []
    with torch.no_grad():
        cache = model.new_cache(1, len(ids) + n)
        logits = model.logits(model.hidden(torch.tensor([ids]), 0, cache))[0, -1]
        for i in range(n):
            rows.append(logits.numpy())
            out.append(int(logits.argmax()))
            h = model.hidden(torch.tensor([[out[-1]]]), len(ids) + i, cache)
            logits = model.logits(h)[0, -1]
    return out, rows


def _llamacpp(path, lora, ids: list[int], n: int):
    """llama.cpp with the GGUF LoRA: the prompt's logits, and its greedy continuation (tokens and
    each step's logits)."""
    from engine.export.llamacpp import open_llama

    llm = open_llama(str(path), lora_path=str(lora), n_ctx=256, logits_all=True, n_threads=2,
                     verbose=False)
    llm.eval(ids)
    prompt = np.array(llm.scores[:len(ids)], dtype=np.float32)
    out, rows = [], []
    for i in range(n):
        row = np.array(llm.scores[len(ids) + i - 1], dtype=np.float32)
        rows.append(row)
        out.append(int(row.argmax()))
        llm.eval([out[-1]])
    llm.close()
    return prompt, out, rows


def _adapted(tmp_path, arch: str, qtype: str, rank: int):
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, qtype,
                           vocab="bpe" if arch.startswith("qwen") else "spm")
    make_adapter(path, tmp_path / "a.safetensors", rank=rank, alpha=2.0 * rank, b_std=0.05)
    lora = write_gguf_lora(tmp_path / "a.safetensors", path, tmp_path / "lora.gguf")
    model, _ = load_gguf_model(path, numerics="llamacpp", tokenizer=False)
    attach_adapter_file(model, tmp_path / "a.safetensors")
    return path, lora, model.eval()


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch,qtype,rank", [
    ("llama", "Q4_K", 4),       # B·t by ggml_vec_dot_f32 (rank % lanes != 0)
    ("llama", "Q8_0", 16),      # B·t by tinyBLAS for the prompt
    ("gemma3", "Q4_K", 8),
    ("qwen3", "Q6_K", 6),       # rank % 4 != 0: A·x by ggml_vec_dot_f32 as well
])
def test_adapter_logits_and_greedy_match_llamacpp_bit_for_bit(tmp_path, arch, qtype, rank):
    p = require_same_plan()
    if not p.exact_weight(qtype, 64):
        pytest.skip(f"{qtype} weights are not reproduced bit for bit here ({p.summary()})")
    path, lora, model = _adapted(tmp_path, arch, qtype, rank)
    prompt, tokens, rows = _llamacpp(path, lora, PROMPT, 8)
    ours = _engine_logits(model, PROMPT)
    assert np.array_equal(ours, prompt), f"max |Δlogit| {np.abs(ours - prompt).max():.3g}"
    assert np.array_equal(_engine_logits(model, PROMPT[:1]), _llamacpp(path, lora, PROMPT[:1],
                                                                       0)[0])
    our_tokens, our_rows = _engine_greedy(model, PROMPT, 8)
    assert our_tokens == tokens
    assert all(np.array_equal(a, b) for a, b in zip(our_rows, rows, strict=True))


@pytest.mark.llamacpp
def test_plain_f32_adapter_product_misses_llamacpp(tmp_path, monkeypatch):
    """The twin: the adapter product off by its f16 rounding does not give llama.cpp's logits,
    so the test above can fail. (Sums in another order are no twin on every CPU: plain f32 in
    torch's order equals ggml's sums for these small products on an AVX-512 EPYC, and f64 sums
    equal them on a Sapphire Rapids.)"""
    p = require_same_plan()
    if not p.exact_weight("Q4_K", 64):
        pytest.skip(f"Q4_K weights are not reproduced bit for bit here ({p.summary()})")
    path, lora, model = _adapted(tmp_path, "llama", "Q4_K", 4)
    prompt, _, _ = _llamacpp(path, lora, PROMPT, 0)
    monkeypatch.setattr(LoRALinear, "llamacpp_forward",
                        lambda self, x: self.base(x) + self.delta(x).half().float())
    assert not np.array_equal(_engine_logits(model, PROMPT), prompt)


def test_adapter_exports_are_claimed_exact_from_the_doctors_row():
    """The export verdict holds an adapter export (base GGUF + GGUF LoRA) to bit-equality where
    the doctor's plan lists the adapter products bit-exact: on x86 (AVX2, AVX-512), not where
    ggml's kernels are not reproduced."""
    from engine.export.verdict import adapter_claimed_exact
    from engine.kernels.cpu import plan_for

    for features in ({"avx2", "fma", "f16c"}, {"avx2", "fma", "f16c", "avx512f", "avx512dq"}):
        assert adapter_claimed_exact(plan_for(frozenset(features)).kernels)
    assert not adapter_claimed_exact(plan_for(frozenset({"neon"})).kernels)


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_with_an_adapter_matches_llamacpp_bit_for_bit(tmp_path, gemma_gguf, monkeypatch):
    """gemma-3-270m Q4_K_M with a rank-8 adapter on q, v and down (random B of a trained
    adapter's size): every teacher-forced logit and a greedy continuation as llama.cpp with the
    GGUF LoRA; the plain f32 adapter product does not give them."""
    p = require_same_plan()
    if not p.exact_weight("Q4_K", 1024):
        pytest.skip(f"Q4_K weights are not reproduced bit for bit here ({p.summary()})")
    make_adapter(gemma_gguf, tmp_path / "a.safetensors", targets=["q", "v", "down"], rank=8,
                 alpha=16.0, b_std=0.02)
    lora = write_gguf_lora(tmp_path / "a.safetensors", gemma_gguf, tmp_path / "lora.gguf")
    model, tok = load_gguf_model(gemma_gguf, numerics="llamacpp")
    attach_adapter_file(model, tmp_path / "a.safetensors")
    ids = [tok.bos_id, *tok.encode("Arr, the capital of Germany be Berlin, matey! The sea be")]
    prompt, tokens, rows = _llamacpp(gemma_gguf, lora, ids, 6)
    ours = _engine_logits(model.eval(), ids)
    assert np.array_equal(ours, prompt), f"max |Δlogit| {np.abs(ours - prompt).max():.3g}"
    our_tokens, our_rows = _engine_greedy(model, ids, 6)
    assert our_tokens == tokens
    assert all(np.array_equal(a, b) for a, b in zip(our_rows, rows, strict=True))
    monkeypatch.setattr(LoRALinear, "llamacpp_forward",
                        lambda self, x: self.base(x) + self.delta(x).half().float())
    assert not np.array_equal(_engine_logits(model, ids), prompt)
