"""Llama decoder against an independent f64 reference (Meta-style complex RoPE, explicit softmax),
KV-cache equivalence, and gradients against finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.llama import Llama, LlamaConfig

torch.set_num_threads(1)


def reference_forward(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """Straightforward f64 Llama: complex rotation for adjacent pairs ("norm"), rotate-half for
    neox."""
    c = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    hd, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
    B, T = tokens.shape

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.norm_eps) * w

    freqs = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), freqs)          # [T, hd/2]

    def rope(x):                                                             # x [B,T,h,hd]
        if c.rope_type == "norm":
            xc = torch.view_as_complex(x.reshape(*x.shape[:-1], hd // 2, 2).contiguous())
            xc = xc * torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
            return torch.view_as_real(xc).flatten(-2)
        cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
        rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    h = sd["tok_embeddings.weight"][tokens]
    for i in range(c.n_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "attn_norm.weight"])
        lin = lambda name: x @ sd[p + name + ".weight"].T + sd.get(p + name + ".bias", 0)
        q = lin("attn.q").view(B, T, H, hd)
        k = lin("attn.k").view(B, T, Hkv, hd)
        v = lin("attn.v").view(B, T, Hkv, hd)
        if c.qk_norm:
            q, k = rms(q, sd[p + "attn.q_norm.weight"]), rms(k, sd[p + "attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        out = torch.zeros(B, T, H, hd, dtype=torch.float64)
        for head in range(H):
            kvh = head // (H // Hkv)
            s = torch.einsum("btd,bsd->bts", q[:, :, head], k[:, :, kvh]) / math.sqrt(hd)
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            out[:, :, head] = torch.softmax(s, -1) @ v[:, :, kvh]
        h = h + out.reshape(B, T, H * hd) @ sd[p + "attn.o.weight"].T
        x = rms(h, sd[p + "mlp_norm.weight"])
        g = x @ sd[p + "mlp.gate.weight"].T
        up = x @ sd[p + "mlp.up.weight"].T
        h = h + ((g * torch.sigmoid(g)) * up) @ sd[p + "mlp.down.weight"].T
    h = rms(h, sd["norm.weight"])
    head_w = sd["tok_embeddings.weight"] if c.tie_embeddings else sd["output.weight"]
    return h @ head_w.T


def _randomize(model: Llama, seed: int):
    """Norm weights away from 1 and biases non-zero so the reference really checks them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.mul_(10.0)   # larger activations: attention is far from uniform


CONFIGS = {
    "llama-tied-norm": LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   ffn_dim=48, rope_type="norm", tie_embeddings=True),
    "llama-untied-mha": LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=4,
                                    ffn_dim=48, rope_type="norm", tie_embeddings=False,
                                    rope_theta=500.0),
    "qwen2-bias-neox": LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=1,
                                   ffn_dim=48, rope_type="neox", attn_bias=True,
                                   tie_embeddings=False),
    "qwen3-qknorm-hd": LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   ffn_dim=48, rope_type="neox", qk_norm=True, head_dim=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_f64_reference(name):
    torch.manual_seed(0)
    model = Llama(CONFIGS[name])
    _randomize(model, 1)
    tokens = torch.randint(0, 61, (2, 11))
    got = model(tokens).double()
    want = reference_forward(model, tokens)
    assert want.abs().max() > 1.0          # non-trivial logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_cache_matches_full_forward(name):
    torch.manual_seed(0)
    model = Llama(CONFIGS[name])
    _randomize(model, 2)
    tokens = torch.randint(0, 61, (2, 9))
    full = model(tokens)
    cache = model.new_cache(2, 16)
    parts = [model.logits(model.hidden(tokens[:, :5], 0, cache))]
    for t in range(5, 9):                  # one token at a time, like decoding
        parts.append(model.logits(model.hidden(tokens[:, t:t + 1], t, cache)))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_gradients_match_finite_differences():
    torch.manual_seed(0)
    model = Llama(CONFIGS["qwen3-qknorm-hd"]).double()
    _randomize(model, 3)
    tokens = torch.randint(0, 61, (1, 6))
    targets = torch.randint(0, 61, (1, 6))

    def loss():
        return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())

    loss().backward()
    g = torch.Generator().manual_seed(4)
    checked = 0
    for name, p in model.named_parameters():
        idx = torch.randint(0, p.numel(), (2,), generator=g)
        for i in idx.tolist():
            flat = p.data.view(-1)
            orig = flat[i].item()
            eps = 1e-6
            flat[i] = orig + eps
            up = loss().item()
            flat[i] = orig - eps
            down = loss().item()
            flat[i] = orig
            fd = (up - down) / (2 * eps)
            assert p.grad.view(-1)[i].item() == pytest.approx(fd, rel=1e-4, abs=1e-7), name
            checked += 1
    assert checked >= 2 * 20


def test_hidden_logits_split_and_tied_head():
    model = Llama(CONFIGS["llama-tied-norm"])
    assert model.output is None
    tokens = torch.randint(0, 61, (1, 5))
    h = model.hidden(tokens)
    assert h.shape == (1, 5, 32)
    # the LM head at selected positions equals the full forward at those positions
    torch.testing.assert_close(model.logits(h[:, [1, 3]]), model(tokens)[:, [1, 3]])


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig(rope_type="yarn")
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
