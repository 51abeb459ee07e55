"""The whole decoder forward in C (ggml_kernels.c fb_forward) for GGUF models under llama.cpp
numerics: no Python per layer or per token, the bits of the torch path.

`native_decoder(model)` describes a loaded Llama / Qwen2 / Qwen3 / Gemma 3 model to the C code
once (weights in the C kernels' layout, shared with the torch path's ExactWeight, norms, RoPE and
window settings) and runs it for a batch of positions against the model's f16 KVCache, one
llama.cpp ubatch (512 positions) per call, on torch's thread count. Python keeps the embedding
lookup, the LM head (engine/kernels/ggml_matmul.py, threaded in C as well), the tokenizer,
sampling and the API. The torch modules stay the reference: `model.native = False` (or
FORGEBENCH_NATIVE=0) runs them instead, and the tests hold the two to identical bits.

It serves only what it reproduces exactly; anything else returns None and the torch path runs:
f32 numerics, LoRA adapters attached, weight types without a bit-exact kernel in the llama.cpp
configuration followed (BF16; Q4_0 where llama.cpp repacks it),
packed sequences, a batch of more than one sequence in `hidden`.

Batched decode (`decode_batch`, for the server's concurrent requests): one step advances B
sequences by one token each, every sequence at its own position in its own KV cache. The weight
matmuls take the B rows together, so each weight is read from memory once per step instead of
once per sequence, and attention runs per sequence. Each row is summed by the kernel llama.cpp
runs for ONE token (vec_dot / gemv), not the batch kernels llama.cpp would pick for B rows
(tiled, gemm, tinyBLAS; numerics.py: they sum in other orders): a sequence's logits are then the
bits it gets alone, the bits llama.cpp gives that request decoded on its own, whatever shares the
step. (llama.cpp's own server batching B slots would run the B-row kernels, and its answers
would change with the number of concurrent requests.)
"""

from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import torch
from gguf import GGMLQuantizationType as T

from engine.kernels import ggml_matmul
from engine.kernels.exact_plan import weight_struct
from engine.kernels.ggml_matmul import TERNARY, UBATCH, ExactWeight, plan_struct, supports_exact
from engine.kernels.native import Layer, Model, kernels, ptr
from engine.kernels.numerics import attention_llamacpp, gelu_table
from engine.models.blocks import KVCache, RMSNorm
from engine.models.packed import FrozenQuantLinear
from engine.ptqtp.weight import PlaneSumLinear

LINEARS = (("q", "attn.q"), ("k", "attn.k"), ("v", "attn.v"), ("o", "attn.o"),
           ("gate", "mlp.gate"), ("up", "mlp.up"), ("down", "mlp.down"))
NORMS = ("attn_norm", "attn.q_norm", "attn.k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


def _plane_sum_weight(linear: PlaneSumLinear) -> SimpleNamespace | None:
    """A PTQTP layer's two TQ planes as one fb_weight (`struct`; `planes` keeps their memory):
    the C kernel adds the second plane's product to the first's, as PlaneSumLinear does."""
    planes = [_exact_weight(plane) for plane in linear.planes]
    if (len(planes) != 2 or None in planes or planes[0].ggml_type not in TERNARY
            or planes[1].ggml_type != planes[0].ggml_type or planes[0].native is None):
        return None
    first, second = planes
    return SimpleNamespace(planes=planes, struct=weight_struct(
        first.parts, first.ggml_type, first.rows, first.cols, plane2=second.parts))


def _exact_weight(linear) -> ExactWeight | None:
    """The linear's weight in the C kernels' layout; None where no bit-exact C kernel serves it."""
    if type(linear) is PlaneSumLinear:
        return _plane_sum_weight(linear)
    if type(linear) is not FrozenQuantLinear or not linear.bitexact:
        return None
    w = linear.weight
    if w.ggml_type != T.F16 and not supports_exact(w.ggml_type, w.rows):
        return None
    if w._exact is None:                 # shared with the torch path's llamacpp_matmul
        w._exact = ExactWeight(w.raw, w.ggml_type, w.rows, w.cols)
    return w._exact


class NativeDecoder:
    """One model's description for fb_forward; the tensors it points into are kept here."""

    def __init__(self, model, lib: ctypes.CDLL, layers: list[dict]):
        self.model, self.lib = model, lib
        # the llama.cpp configuration it was described for: which weights the C forward serves
        # depends on it (repacked Q4_0 goes to the torch path)
        self.repacked = ggml_matmul.plan().repacked
        cfg = model.config
        # the modules described: a LoRA wrapper or a new weight put in their place later
        # makes native_decoder describe the model afresh (or hand it to the torch path)
        self.modules = [(block.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2],
                         block.get_submodule(path))
                        for block in model.layers for _, path in LINEARS]
        gemma = hasattr(cfg, "sliding")
        self.keep: list = []
        structs = (Layer * cfg.n_layers)()
        for i, spec in enumerate(layers):
            s = structs[i]
            for name, exact in spec["weights"].items():
                struct = exact.struct
                bias = spec["biases"][name]
                if bias is not None:
                    struct = type(struct).from_buffer_copy(struct)
                    struct.bias = ptr(bias)
                    self.keep.append(bias)
                setattr(s, name, struct)
            for attr, norm in zip(("attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm",
                                   "post_mlp_norm"), spec["norms"]):
                setattr(s, attr, None if norm is None else ptr(norm))
            if gemma:
                local = cfg.sliding[i]
                base = cfg.rope_local_theta if local else cfg.rope_theta
                s.window = cfg.sliding_window if local else 0
                s.rope_freq_scale = 1.0 if local else 1.0 / cfg.rope_scale
            else:
                base, s.window, s.rope_freq_scale = cfg.rope_theta, 0, 1.0
                factors = model.rope_freq_factors
                if factors is not None:
                    factors = factors.float().contiguous()
                    self.keep.append(factors)
                    s.rope_freq_factors = ptr(factors)
            s.rope_step = base ** (-2.0 / cfg.head_dim)
            self.keep.append(spec["norms"])
        table = gelu_table().contiguous()
        self.keep += [structs, table, model.norm.weight]
        self.struct = Model(cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                            cfg.ffn_dim, cfg.norm_eps,
                            cfg.query_scale if gemma else 1.0,
                            1.0 if gemma else 1.0 / math.sqrt(cfg.head_dim),
                            int((model.rope_type if gemma else cfg.rope_type) == "neox"),
                            int(gemma), ptr(table), ptr(model.norm.weight.data),
                            ctypes.addressof(structs))
        self.gemma = gemma

    def hidden(self, tokens: torch.Tensor, start_pos: int, cache: KVCache | None,
               rows: torch.Tensor | None) -> torch.Tensor:
        """What model.hidden returns, for tokens [1, T]."""
        model, cfg = self.model, self.model.config
        T_ = tokens.shape[1]
        if cache is None:                # teacher-forced scoring: a cache just for this call
            cache = model.new_cache(1, start_pos + T_)
        if start_pos + T_ > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; asked for "
                             f"{start_pos + T_}")
        h = model.tok_embeddings(tokens)
        if self.gemma:
            h = h * math.sqrt(cfg.dim)
        h = h[0].float().contiguous()
        keys = (ctypes.c_void_p * cfg.n_layers)(*(ptr(k) for k in cache.k))
        values = (ctypes.c_void_p * cfg.n_layers)(*(ptr(v) for v in cache.v))
        wanted = None if rows is None else rows[0].nonzero().flatten()
        plan = plan_struct()
        outs = []
        for u0 in range(0, T_, UBATCH):   # llama.cpp evaluates a long prompt ubatch by ubatch
            u1 = min(T_, u0 + UBATCH)
            chunk = h[u0:u1].clone()
            index = None
            if wanted is not None:
                index = (wanted[(wanted >= u0) & (wanted < u1)] - u0).to(torch.int64).contiguous()
            n_out = u1 - u0 if index is None else index.numel()
            out = torch.empty(n_out, cfg.dim)
            status = self.lib.fb_forward(
                ctypes.byref(self.struct), ctypes.byref(plan), u1 - u0, start_pos + u0,
                ptr(chunk), keys, values, cache.max_len, n_out,
                None if index is None else ptr(index), ptr(out), torch.get_num_threads())
            if status != 0:
                raise MemoryError(f"fb_forward failed for {u1 - u0} positions at {start_pos + u0}")
            outs.append(out)
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out if rows is not None else out[None]

    def hidden_batch(self, tokens: list[int], positions: list[int],
                     caches: list[KVCache]) -> torch.Tensor:
        """Final-normed hidden states [B, dim] of one new token per sequence: tokens[b] at
        positions[b] of caches[b] (fb_decode_batch), each row what `hidden` gives that sequence
        for its token alone."""
        model, cfg = self.model, self.model.config
        B, NL = len(tokens), cfg.n_layers
        for position, cache in zip(positions, caches):
            if not 0 <= position < cache.max_len:
                raise ValueError(f"KV cache holds {cache.max_len} positions; asked for "
                                 f"{position + 1}")
        h = model.tok_embeddings(torch.tensor([tokens]))
        if self.gemma:
            h = h * math.sqrt(cfg.dim)
        h = h[0].float().contiguous()
        keys = (ctypes.c_void_p * (B * NL))(*(ptr(k) for c in caches for k in c.k))
        values = (ctypes.c_void_p * (B * NL))(*(ptr(v) for c in caches for v in c.v))
        at = torch.tensor(positions, dtype=torch.int64)
        lengths = torch.tensor([c.max_len for c in caches], dtype=torch.int64)
        out = torch.empty(B, cfg.dim)
        status = self.lib.fb_decode_batch(
            ctypes.byref(self.struct), ctypes.byref(plan_struct()), B, ptr(at), ptr(h), keys,
            values, ptr(lengths), ptr(out), torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"fb_decode_batch failed for {B} sequences")
        return out


def _describe(model) -> list[dict] | None:
    """Per layer the exact weights, biases and norms fb_forward needs; None where it cannot serve
    the model bit for bit."""
    cfg = model.config
    if cfg.head_dim % 16 or cfg.n_heads % cfg.n_kv_heads:
        return None
    gemma = hasattr(cfg, "sliding")
    layers = []
    for block in model.layers:
        if block.mlp.activation != ("gelu_llamacpp" if gemma else "silu_llamacpp"):
            return None
        weights, biases = {}, {}
        for name, path in LINEARS:
            linear = block.get_submodule(path)
            exact = _exact_weight(linear)
            if exact is None:
                return None
            weights[name] = exact
            biases[name] = None if linear.bias is None else linear.bias.data.float().contiguous()
        norms = []
        for path in NORMS:
            norm = getattr(block, path, None) if "." not in path else getattr(
                block.attn, path.split(".")[1], None)
            if norm is not None and (type(norm) is not RMSNorm or not norm.ggml_exact):
                return None
            norms.append(None if norm is None else norm.weight.data.float().contiguous())
        layers.append({"weights": weights, "biases": biases, "norms": norms})
    return layers


def native_decoder(model) -> NativeDecoder | None:
    """The C forward for `model`, built on first use, or None where the torch path must run."""
    lib = kernels()
    if (lib is None or getattr(model, "numerics", "f32") != "llamacpp"
            or not getattr(model, "native", True) or model.attn_core is not attention_llamacpp
            or model.kv_dtype != torch.float16):
        return None
    built = getattr(model, "_native_decoder", None)
    same_configuration = built is not None and built.repacked == ggml_matmul.plan().repacked
    if same_configuration and built.model is model and all(
            getattr(parent, attr) is module for parent, attr, module in built.modules):
        return built
    layers = _describe(model)
    if layers is None:
        return None
    model._native_decoder = NativeDecoder(model, lib, layers)
    return model._native_decoder


def serves(model, tokens: torch.Tensor, cache: KVCache | None, lengths, start_pos: int) -> bool:
    """Whether this call of model.hidden can go to the C forward."""
    if lengths is not None or tokens.shape[0] != 1:
        return False
    if cache is None:
        return start_pos == 0
    k = cache.k[0]
    return (k.dtype == torch.float16 and k.shape[0] == 1 and all(
        t.is_contiguous() for t in (*cache.k, *cache.v)))


def rowwise_logits(model, h: torch.Tensor) -> torch.Tensor | None:
    """model.logits of each row of h [B, dim] as that row alone gets them (fb_matmul_rowwise:
    the one-row kernels, the LM head's weights read once for all rows); None where the LM head
    is not a bit-exact C matmul (then each row goes through model.logits)."""
    head = getattr(model, "output", None)
    if (type(head) is not FrozenQuantLinear or head.numerics != "llamacpp" or head.bias is not None
            or getattr(model.config, "final_softcap", None)):
        return None
    exact = _exact_weight(head)
    lib = kernels()
    if exact is None or lib is None:
        return None
    x = h.float().contiguous()
    out = torch.empty(x.shape[0], exact.rows)
    status = lib.fb_matmul_rowwise(ctypes.byref(exact.struct), x.shape[0], ptr(x),
                                   ctypes.byref(plan_struct()), torch.get_num_threads(), ptr(out))
    if status != 0:
        raise MemoryError(f"fb_matmul_rowwise: no memory for {x.shape[0]} x {exact.cols}")
    return out


def decode_batch(model, tokens: list[int], positions: list[int],
                 caches: list[KVCache]) -> torch.Tensor:
    """Logits [B, vocab] of one decode step for B sequences: tokens[b] at positions[b] of its
    own cache caches[b] (written there). Row b is bit for bit
    `model.logits(model.hidden([[tokens[b]]], positions[b], caches[b]))`, whatever else shares
    the step: under llama.cpp numerics the C step (fb_decode_batch) runs every row through the
    kernels llama.cpp runs for one token, the weights streamed once for all rows; elsewhere
    (LoRA attached, f32 numerics, no C compiler) the sequences run one after another."""
    with torch.no_grad():
        fast = native_decoder(model) if len(tokens) > 1 else None
        if fast is not None and all(serves(model, torch.zeros(1, 1), c, None, p)
                                    for c, p in zip(caches, positions)):
            h = fast.hidden_batch(tokens, positions, caches)
            logits = rowwise_logits(model, h)
            return logits if logits is not None else torch.cat(
                [model.logits(h[b:b + 1]).float() for b in range(len(tokens))])
        return torch.cat([model.logits(model.hidden(torch.tensor([[t]]), p, c)[:, -1]).float()
                          for t, p, c in zip(tokens, positions, caches)])


__all__ = ["NativeDecoder", "decode_batch", "native_decoder", "rowwise_logits", "serves"]
