"""GGUF-loaded models (packed weights, dequantized on the fly) against an independent f64 reference
built straight from the gguf package's reader and numpy dequantize, for every family and quant type;
the frozen linear's gradients; dense-cache equivalence; and bad-input refusals."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from fixtures_gguf import ARCHS, QTYPES, write_tiny_gguf

from engine.errors import ForgebenchError
from engine.models.gguf_model import load_gguf_model, memory_report, set_numerics
from engine.models.packed import FrozenQuantLinear

torch.set_num_threads(1)


def _rope(x: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """Rotary positions 0..T-1 on x [T, h, hd] (NeoX halves, or adjacent pairs)."""
    T_, hd = x.shape[0], x.shape[-1]
    inv = base ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(T_)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if neox:
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None) -> np.ndarray:
    """Causal (optionally windowed) grouped-query attention, q [T, H, hd], k/v [T, Hkv, hd]."""
    T_, H, hd = q.shape
    Hkv = k.shape[1]
    out = np.zeros((T_, H, hd))
    for head in range(H):
        kh = head // (H // Hkv)
        s = q[:, head] @ k[:, kh].T / math.sqrt(hd)
        qi, kj = np.arange(T_)[:, None], np.arange(T_)[None, :]
        allowed = (kj <= qi) & ((qi - kj < window) if window else True)
        s = np.where(allowed, s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        out[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kh]
    return out


def reference_logits(path, tokens: list[int]) -> np.ndarray:
    """f64 forward pass written from the llama.cpp graphs, reading tensors with the gguf package."""
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    meta = lambda k, d=None: r.fields[f"{arch}.{k}"].contents() if f"{arch}.{k}" in r.fields else d
    W = {t.name: gguf.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
        tuple(reversed(t.shape.tolist()))) for t in r.tensors}
    dim, H = meta("embedding_length"), meta("attention.head_count")
    Hkv, L = meta("attention.head_count_kv"), meta("block_count")
    hd, eps = meta("attention.key_length", dim // H), meta("attention.layer_norm_rms_epsilon")
    T_ = len(tokens)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    h = W["token_embd.weight"][tokens]
    if arch == "gemma3":
        h = h * math.sqrt(dim)
    for i in range(L):
        p = f"blk.{i}."
        lin = lambda x, n: x @ W[p + n + ".weight"].T + W.get(p + n + ".bias", 0)
        x = rms(h, W[p + "attn_norm.weight"])
        q = lin(x, "attn_q").reshape(T_, H, hd)
        k = lin(x, "attn_k").reshape(T_, Hkv, hd)
        v = lin(x, "attn_v").reshape(T_, Hkv, hd)
        if p + "attn_q_norm.weight" in W:
            q, k = rms(q, W[p + "attn_q_norm.weight"]), rms(k, W[p + "attn_k_norm.weight"])
        window = None
        base = meta("rope.freq_base", 10000.0)
        if arch == "gemma3" and i % 6 < 5:
            window, base = meta("attention.sliding_window"), 10000.0
        q, k = _rope(q, base, arch != "llama"), _rope(k, base, arch != "llama")
        out = _attention(q, k, v, window)
        a = lin(out.reshape(T_, H * hd), "attn_output")
        if arch == "gemma3":
            a = rms(a, W[p + "post_attention_norm.weight"])
        h = h + a
        x = rms(h, W[p + "ffn_norm.weight"])
        g = lin(x, "ffn_gate")
        act = gelu(g) if arch == "gemma3" else g / (1 + np.exp(-g))
        m = lin(act * lin(x, "ffn_up"), "ffn_down")
        if arch == "gemma3":
            m = rms(m, W[p + "post_ffw_norm.weight"])
        h = h + m
    h = rms(h, W["output_norm.weight"])
    return h @ W.get("output.weight", W["token_embd.weight"]).T


TOKENS = [1, 40, 7, 300, 12, 99, 5, 261, 33, 18, 2, 77]


# every quant type once, the families rotated across them (each family gets 2-3 types)
COMBOS = [(ARCHS[i % len(ARCHS)], q) for i, q in enumerate(QTYPES)]


@pytest.mark.parametrize("arch,qtype", COMBOS)
def test_forward_matches_f64_reference(tmp_path, arch, qtype):
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, qtype, seed=hash((arch, qtype)) % 1000)
    model, _ = load_gguf_model(path, numerics="f32", tokenizer=False)
    got = model(torch.tensor([TOKENS])).double()[0].numpy()
    want = reference_logits(path, TOKENS)
    assert np.abs(want).max() > 0.5
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2e-4 * scale + 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_decoding_matches_full_forward(tmp_path, arch):
    model, _ = load_gguf_model(write_tiny_gguf(tmp_path / "m.gguf", arch, "Q6_K"), tokenizer=False)
    x = torch.tensor([TOKENS])
    full = model(x)
    cache = model.new_cache(1, 32)
    parts = [model.logits(model.hidden(x[:, :5], 0, cache))]
    for t in range(5, len(TOKENS)):
        parts.append(model.logits(model.hidden(x[:, t:t + 1], t, cache)))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_sequences_match_each_run_alone(tmp_path, arch):
    """Sequences packed into one row (positions restarting, attention kept within each, gemma3's
    window of 4 inside the longer ones) give each sequence's own hidden states; `rows` keeps
    just the positions asked for."""
    model, _ = load_gguf_model(write_tiny_gguf(tmp_path / "m.gguf", arch, "Q6_K"), tokenizer=False)
    pieces = [TOKENS[:7], TOKENS[3:5], TOKENS[2:]]
    packed = model.hidden(torch.tensor([sum(pieces, [])]), lengths=[len(p) for p in pieces])
    alone = torch.cat([model.hidden(torch.tensor([p])) for p in pieces], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    rows = torch.rand(packed.shape[:2], generator=torch.Generator().manual_seed(0)) < 0.5
    kept = model.hidden(torch.tensor([sum(pieces, [])]), lengths=[len(p) for p in pieces],
                        rows=rows)
    torch.testing.assert_close(kept, packed[rows], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="add up"):
        model.hidden(torch.tensor([TOKENS]), lengths=[len(TOKENS) - 1])


def test_frozen_linear_gradients(tmp_path):
    """dx through the packed weight equals the dense computation; the weight gets no gradient."""
    model, _ = load_gguf_model(write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q4_K"),
                               tokenizer=False)
    lin = model.layers[0].mlp.down
    assert isinstance(lin, FrozenQuantLinear)
    x = torch.randn(3, lin.in_features, requires_grad=True)
    dy = torch.randn(3, lin.out_features)
    (lin(x) * dy).sum().backward()
    dense = lin.dense_weight()
    torch.testing.assert_close(x.grad, dy @ dense, rtol=1e-5, atol=1e-5)
    assert not any(p.requires_grad for p in model.parameters())


def test_dense_cache_matches_packed_and_reports_memory(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "qwen3", "Q5_K")
    packed, _ = load_gguf_model(path, tokenizer=False)
    cached, _ = load_gguf_model(path, weights="dense-cache", tokenizer=False)
    x = torch.tensor([TOKENS])
    torch.testing.assert_close(cached(x), packed(x), rtol=0, atol=1e-5)
    rp, rc = memory_report(packed), memory_report(cached)
    assert rp["dense_cache_bytes"] == 0
    assert (
        rc["dense_cache_bytes"] == rc["f32_dense_bytes"] > rc["packed_bytes"] == rp["packed_bytes"]
    )


def test_llamacpp_numerics_stay_close_to_f32(tmp_path):
    model, _ = load_gguf_model(
        write_tiny_gguf(tmp_path / "m.gguf", "gemma3", "Q4_K"), tokenizer=False
    )
    x = torch.tensor([TOKENS])
    f32 = model(x)
    set_numerics(model, "llamacpp")
    lc = model(x)
    assert model.kv_dtype == torch.float16
    rel = (lc - f32).abs().max() / f32.abs().max()
    assert 0 < rel < 0.05  # different arithmetic, same model


# --- bad input -------------------------------------------------------------------------------


def test_moe_is_refused(tmp_path):
    path = write_tiny_gguf(
        tmp_path / "m.gguf", "qwen2", "Q8_0", metadata={"{arch}.expert_count": 8}
    )
    with pytest.raises(ForgebenchError, match="mixture-of-experts") as e:
        load_gguf_model(path)
    assert "qwen2.expert_count" in str(e.value)


def test_unsupported_architecture_is_refused(tmp_path):
    p = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ForgebenchError, match="recurrent") as e:
        load_gguf_model(p)
    assert "general.architecture" in str(e.value)


def test_vocabulary_mismatch_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    r = gguf.GGUFReader(path)
    n = len(r.fields["tokenizer.ggml.tokens"].data)
    # a second file whose token_embd has one row fewer than the vocabulary
    p2 = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(p2), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(f.name, f.contents())
        else:
            w.add_key_value(f.name, f.contents(), vt)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name == "token_embd.weight":
            data = data[: n - 1]
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ForgebenchError, match="token_embd.weight") as e:
        load_gguf_model(p2)
    assert "vocabulary" in str(e.value) and str(p2) in str(e.value)


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = write_tiny_gguf(
        tmp_path / "m.gguf", "llama", "Q8_0", metadata={"{arch}.feed_forward_length": 768}
    )
    with pytest.raises(ForgebenchError, match="blk.0.ffn_gate.weight"):
        load_gguf_model(path)
