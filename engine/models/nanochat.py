"""nanochat's GPT (karpathy/nanochat, nanochat/gpt.py at commit 92d63d4e8bb4): the model of the
best-known from-scratch recipe, computed op for op as the reference does on CPU, so that a
nanochat state_dict loads here unchanged and the parity ladder (tests/test_nanochat_parity.py)
holds at its tolerances.

What the reference has, and so this file has:

- token embedding `transformer.wte` (vocab padded up to a multiple of 64; logits cropped back),
  RMSNorm right after it, and no positional embedding: rotary embeddings (base 100000, the
  half-split layout, rotating by -theta) on q and k;
- RMSNorm without weights through `F.rms_norm` with no eps, i.e. torch's default eps, which is
  `torch.finfo(dtype).eps` (2**-23 in fp32; measured in the tests, not assumed);
- "smear": a gate mixes the previous token's (normed) embedding into each position;
- per-layer scalars: `resid_lambdas[i] * x + x0_lambdas[i] * x0` before every block;
- attention with grouped-query heads, QK-norm after rotary, both scaled by 1.2, causal SDPA with
  an optional sliding window: window W (a "left" count) lets a query see the W keys before it
  AND itself, W + 1 keys in all (the reference's mask is `row - col <= W`, self-inclusive);
  the pattern string (L = sequence_len, S = -(-L // 4 // 128) * 128, a quarter rounded up to
  a multiple of 128 — 512 at L = 2048, not the 768 gpt.py's comment says; the last layer
  always L) is tiled over the layers;
- value embeddings (ResFormer) on alternating layers, the last one included, mixed into v
  through a per-head gate `3 * sigmoid(ve_gate(x[..., :12]))`;
- MLP c_fc -> relu(x)**2 -> c_proj, 4x wide, no biases anywhere;
- "backout": the residual after layer n_layer // 2 is subtracted (times `backout_lambda`) before
  the final norm;
- an untied `lm_head`, logits in fp32 soft-capped at 15 by `15 * tanh(logits / 15)`.

`NanochatConfig.for_depth` reads the reference's depth-style settings (scripts/base_train.py:
`--depth`, `--aspect-ratio`, `--head-dim`, `--max-seq-len`, `--window-pattern`), and
`NanochatConfig.d6` is the CPU demo of runs/runcpu.sh.

Compute dtype (the reference's COMPUTE_DTYPE, which replaces autocast): fp32 by default; in
bf16 (`NanochatGPT(config, compute_dtype=torch.bfloat16)`) the two embedding tables are stored in
bf16 after their fp32 init, the activations are bf16 from the embedding on, every Linear casts
its fp32 master weight to bf16 in forward, the rotary tables and every RMSNorm are bf16, and only
the logits go back to fp32 for the soft-cap and the loss. Under a bf16 autocast (a recipe's
`train.precision = "bf16"`) an fp32-stored model computes the same way, with autocast off
inside. Left to autocast, the embeddings, norms and rotary tables stayed fp32 and only the
matmuls ran in bf16, casting to and fro around each: another sum than the reference's, and
slower (bench/bench_pretrain.py's d6 step, one thread on a Zen 4: 0.90x the reference's
tokens per CPU second that way; 1.32x in its own scheme, where the sliced AdamW of
engine/train/muon.py is the rest of the gain).

Inference keeps a KV cache (`new_cache` / `hidden(start_pos=...)`), including the smear's
previous embedding, and matches the full forward (tested). There is no GGUF export: llama.cpp
has no architecture with value embeddings, smear, backout or the per-layer residual scalars,
so `gguf_refusal` states why and the export path raises it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ForgebenchError

ROPE_BASE = 100000
SOFTCAP = 15.0
QK_SCALE = 1.2          # "sharper attention", applied to both q and k after their norm
VE_GATE_CHANNELS = 12   # value-embedding gate reads the first 12 channels of the block input
SMEAR_CHANNELS = 24     # smear gate reads the first 24 channels of the embedding
PAD_VOCAB_TO = 64
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class NanochatConfig:
    """nanochat's GPTConfig, field for field."""

    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "SSSL"
    padded_vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        pattern = self.window_pattern.upper()
        if not pattern or any(c not in "SL" for c in pattern):
            raise ForgebenchError(f"window pattern {self.window_pattern!r} may hold only S and L",
                                  where="field 'model.window_pattern'",
                                  hint='e.g. "L" (all full context) or "SSSL"')
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ForgebenchError(
                f"n_embd {self.n_embd}, n_head {self.n_head}, n_kv_head {self.n_kv_head}: "
                "n_embd must divide by n_head and n_head by n_kv_head", where="model")
        if (self.n_embd // self.n_head) % 2:
            raise ForgebenchError("head size must be even for rotary embeddings", where="model")
        self.padded_vocab_size = -(-self.vocab_size // PAD_VOCAB_TO) * PAD_VOCAB_TO

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def max_seq_len(self) -> int:
        """The trained context (what generation windows prompts to)."""
        return self.sequence_len

    @classmethod
    def for_depth(cls, depth: int, *, vocab_size: int, aspect_ratio: int = 64,
                  head_dim: int = 128, max_seq_len: int = 2048,
                  window_pattern: str = "SSSL") -> "NanochatConfig":
        """scripts/base_train.py's build_model_meta: width = depth * aspect_ratio rounded up to
        a multiple of head_dim, one head (and one kv head) per head_dim channels."""
        model_dim = -(-(depth * aspect_ratio) // head_dim) * head_dim
        heads = model_dim // head_dim
        return cls(sequence_len=max_seq_len, vocab_size=vocab_size, n_layer=depth,
                   n_head=heads, n_kv_head=heads, n_embd=model_dim,
                   window_pattern=window_pattern)

    @classmethod
    def d6(cls, vocab_size: int = 32768) -> "NanochatConfig":
        """runs/runcpu.sh: --depth=6 --head-dim=64 --window-pattern=L --max-seq-len=512."""
        return cls.for_depth(6, vocab_size=vocab_size, head_dim=64, max_seq_len=512,
                             window_pattern="L")

    def window_sizes(self) -> list[int]:
        """Per-layer left window (keys before the query that it may also see)."""
        long_window = self.sequence_len
        short_window = -(-long_window // 4 // 128) * 128   # the reference's formula: 2048 -> 512
        pattern = self.window_pattern.upper()
        sizes = [long_window if pattern[i % len(pattern)] == "L" else short_window
                 for i in range(self.n_layer)]
        sizes[-1] = long_window
        return sizes


def has_value_embedding(layer: int, n_layer: int) -> bool:
    """Alternating layers, the last one always included."""
    return layer % 2 == (n_layer - 1) % 2


def norm(x: torch.Tensor) -> torch.Tensor:
    # no eps: torch's default, finfo(x.dtype).eps, is what the reference uses
    return F.rms_norm(x, (x.size(-1),))


class Linear(nn.Linear):
    """Bias-free linear whose weight is cast to the activation's dtype (the reference's
    replacement for autocast: fp32 master weights, matmuls in the compute dtype)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(dtype=x.dtype))


def rotary_tables(start: int, length: int, head_dim: int, dtype: torch.dtype,
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, T, 1, head_dim/2] for positions start..start+length-1 (each element is the
    reference's precomputed table entry: the same fp32 product, then cos/sin)."""
    channels = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (ROPE_BASE ** (channels / head_dim))
    t = torch.arange(start, start + length, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)                                      # [T, D/2]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return cos[None, :, None, :], sin[None, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; halves (x1, x2) rotated by -theta, as the reference (checkpoint
    compatible; only the relative rotation of q and k matters)."""
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """q [B, H, Tq, D], k/v [B, Hkv, Tk, D] with the queries the last Tq of the Tk positions;
    causal, each query sees at most `window` keys before it plus itself. [B, H, Tq, D]."""
    tq, tk = q.size(2), k.size(2)
    gqa = q.size(1) != k.size(1)
    if window >= tq and tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if tq == 1:
        if window < tk:
            k, v = k[:, :, tk - (window + 1):], v[:, :, tk - (window + 1):]
        return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=gqa)
    row = (tk - tq) + torch.arange(tq, device=q.device).unsqueeze(1)      # [Tq, 1]
    col = torch.arange(tk, device=q.device).unsqueeze(0)                  # [1, Tk]
    mask = col <= row
    if window < tk:
        mask = mask & ((row - col) <= window)                             # self-inclusive
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: NanochatConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, \
            config.head_dim
        d, kv = config.n_embd, config.n_kv_head * config.head_dim
        self.c_q = Linear(d, d)
        self.c_k = Linear(d, kv)
        self.c_v = Linear(d, kv)
        self.c_proj = Linear(d, d)
        self.ve_gate = (Linear(VE_GATE_CHANNELS, config.n_kv_head)
                        if has_value_embedding(layer, config.n_layer) else None)

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, rotary, window: int,
                cache: "NanochatCache | None") -> torch.Tensor:
        B, T, C = x.size()                                                # x [B, T, C]
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)            # [B, T, H, D]
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)         # [B, T, Hkv, D]
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:                                                # ve [B, T, Hkv*D]
            ve = ve.view(B, T, self.n_kv_head, self.head_dim)
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))  # [B, T, Hkv]
            v = v + gate.unsqueeze(-1) * ve
        cos, sin = rotary
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = norm(q), norm(k)
        q = q * QK_SCALE
        k = k * QK_SCALE
        if cache is not None:
            k, v = cache.append(self.layer, k, v)                         # [B, Tk, Hkv, D]
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)                 # [B, T, C]
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: NanochatConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())                # relu²


class Block(nn.Module):
    def __init__(self, config: NanochatConfig, layer: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(config, layer)
        self.mlp = MLP(config)

    def forward(self, x, ve, rotary, window, cache):
        x = x + self.attn(norm(x), ve, rotary, window, cache)
        return x + self.mlp(norm(x))


@dataclass
class NanochatCache:
    """Keys/values per layer [B, t, Hkv, D] so far, and the last position's normed embedding
    (what the next token's smear mixes in)."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    prev_embedding: torch.Tensor | None = None
    length: int = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], 1)
            self.values[layer] = torch.cat([self.values[layer], v], 1)
        return self.keys[layer], self.values[layer]


class NanochatGPT(nn.Module):
    """nanochat's GPT. Parameter names are the reference's, so its state_dict loads as is."""

    def __init__(self, config: NanochatConfig, compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if compute_dtype not in COMPUTE_DTYPES:
            raise ForgebenchError(f"nanochat computes in float32 or bfloat16, not {compute_dtype}",
                                  where="model", hint='train.precision = "f32" or "bf16"')
        self.config = config
        self.compute_dtype = compute_dtype
        V, C = config.padded_vocab_size, config.n_embd
        kv_dim = config.n_kv_head * config.head_dim
        self.window_sizes = config.window_sizes()
        # built on the meta device and initialised once by init_weights, as the reference does:
        # no default init draws from the RNG first, so a seed gives the reference's weights
        with torch.device("meta"):
            self._build(config, V, C, kv_dim)
        self.to_empty(device="cpu")
        self.init_weights()

    def _build(self, config: NanochatConfig, V: int, C: int, kv_dim: int) -> None:
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(V, C),
            "h": nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
        })
        self.lm_head = Linear(C, V)
        self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
        self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        self.smear_gate = Linear(SMEAR_CHANNELS, 1)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(0.2 * torch.ones(1))
        self.value_embeds = nn.ModuleDict({
            str(i): nn.Embedding(V, kv_dim) for i in range(config.n_layer)
            if has_value_embedding(i, config.n_layer)})

    @torch.no_grad()
    def init_weights(self) -> None:
        """The reference's init_weights, in its order of RNG draws (so a seeded init here gives
        the reference's weights bit for bit)."""
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=0.8)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        n_layer = self.config.n_layer
        s = 3 ** 0.5 * self.config.n_embd ** -0.5   # uniform with the std of N(0, 1/n_embd)
        for block in self.transformer.h:
            nn.init.uniform_(block.attn.c_q.weight, -s, s)
            nn.init.uniform_(block.attn.c_k.weight, -s, s)
            nn.init.uniform_(block.attn.c_v.weight, -s, s)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.uniform_(block.mlp.c_fc.weight, -s * 0.4, s * 0.4)
            nn.init.zeros_(block.mlp.c_proj.weight)
        for i in range(n_layer):
            self.resid_lambdas.data[i] = 1.15 - (0.10 * i / max(n_layer - 1, 1))
        for i in range(n_layer):
            self.x0_lambdas.data[i] = 0.20 - (0.15 * i / max(n_layer - 1, 1))
        nn.init.zeros_(self.smear_lambda)
        nn.init.constant_(self.backout_lambda, 0.2)
        nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        for ve in self.value_embeds.values():
            nn.init.uniform_(ve.weight, -s, s)
        for block in self.transformer.h:
            if block.attn.ve_gate is not None:
                nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)
        # the reference stores the embedding tables in its compute dtype (drawn in fp32 first,
        # so the RNG sequence and the rounded values are its own); the rest stays fp32
        self.transformer.wte.to(dtype=self.compute_dtype)
        for ve in self.value_embeds.values():
            ve.to(dtype=self.compute_dtype)

    def active_dtype(self, device_type: str) -> torch.dtype:
        """What this forward computes in: the compute dtype, or bf16 where a bf16 autocast is
        on for the device (the recipes' switch), which the model then computes its own way."""
        if self.compute_dtype == torch.float32 and torch.is_autocast_enabled(device_type) \
                and torch.get_autocast_dtype(device_type) == torch.bfloat16:
            return torch.bfloat16
        return self.compute_dtype

    @staticmethod
    def _own_casts(device_type: str, dtype: torch.dtype):
        """Autocast off for a bf16 forward: the casts are the model's (the reference has no
        autocast); an fp32 forward is left as it is."""
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type, enabled=False)

    def new_cache(self, batch: int = 1, max_len: int = 0) -> NanochatCache:
        """An empty cache (it grows by concatenation; the arguments are the Llama family's
        signature, which lm-pretrain's generation calls)."""
        return NanochatCache()

    def _smear(self, x: torch.Tensor, cache: NanochatCache | None) -> torch.Tensor:
        """x [B, T, C] normed embeddings; position t gets gate * x[t-1] added."""
        prev = None
        if cache is not None:
            prev, cache.prev_embedding = cache.prev_embedding, x[:, -1:, :]
        if x.size(1) > 1:
            gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(
                self.smear_gate(x[:, 1:, :SMEAR_CHANNELS]))               # [B, T-1, 1]
            return torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
        if prev is not None:
            gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(
                self.smear_gate(x[:, :, :SMEAR_CHANNELS]))
            return x + gate * prev
        return x

    def hidden(self, idx: torch.Tensor, start_pos: int = 0, cache: NanochatCache | None = None,
               trace: list | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, T, C] for token ids [B, T] at positions start_pos…
        (`cache` holds the earlier ones). `trace`, when given, collects each block's input and
        output (what the parity ladder compares per layer)."""
        T = idx.size(1)
        if start_pos + T > 10 * self.config.sequence_len:   # the reference's rotary table size
            raise ForgebenchError(f"position {start_pos + T} is past the rotary table "
                                  f"({10 * self.config.sequence_len})", where="generation")
        dtype = self.active_dtype(idx.device.type)
        with self._own_casts(idx.device.type, dtype):
            return self._hidden(idx, dtype, start_pos, cache, trace)

    def _hidden(self, idx: torch.Tensor, dtype: torch.dtype, start_pos: int,
                cache: NanochatCache | None, trace: list | None) -> torch.Tensor:
        T = idx.size(1)
        x = self.transformer.wte(idx).to(dtype)                           # [B, T, C]
        rotary = rotary_tables(start_pos, T, self.config.head_dim, x.dtype, idx.device)
        x = self._smear(norm(x), cache)
        x0 = x
        backout_layer = self.config.n_layer // 2
        x_backout = None
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx).to(x.dtype) if str(i) in self.value_embeds \
                else None                                                 # [B, T, Hkv*D]
            if trace is not None:
                trace.append(x)
            x = block(x, ve, rotary, self.window_sizes[i], cache)
            if trace is not None:
                trace.append(x)
            if i == backout_layer:
                x_backout = x
        if cache is not None:
            cache.length += T
        x = x - self.backout_lambda.to(x.dtype) * x_backout
        return norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Soft-capped fp32 logits [..., vocab_size] of final hidden states [..., C] (the head
        multiplies in the hidden states' dtype)."""
        with self._own_casts(h.device.type, h.dtype):
            logits = self.lm_head(h)[..., :self.config.vocab_size].float()
        return SOFTCAP * torch.tanh(logits / SOFTCAP)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of ids [B, T]; with targets [B, T] (-1 = ignored) the mean
        cross-entropy, as the reference's training forward."""
        logits = self.logits(self.hidden(idx))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1)

    def matrix_parameters(self) -> list[nn.Parameter]:
        """The transformer blocks' matrices: what nanochat puts on Muon."""
        return list(self.transformer.h.parameters())


def gguf_refusal() -> ForgebenchError:
    """Why a nanochat model has no GGUF: no llama.cpp architecture computes it."""
    return ForgebenchError(
        "llama.cpp has no architecture for nanochat's GPT: value embeddings with per-head "
        "gates, the smear of the previous token, the backout of the middle layer, the "
        "per-layer residual scalars and the weightless RMSNorm after the embedding have no "
        "GGUF counterpart, so an export would compute a different model",
        where="export", hint="use the run's checkpoint (forgebench generate / chat / eval) "
                             "or train the llama family of lm-pretrain for a GGUF")
