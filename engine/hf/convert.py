"""Hugging Face checkpoint folder -> GGUF, as llama.cpp writes it, streamed one tensor at a time.

    forgebench convert DIR --dtype f32|f16|bf16|q8_0|q4_0|q4_k_s|q4_k_m|q5_k_m|q6_k --out F.gguf

The file equals what llama.cpp's `convert_hf_to_gguf.py` (the copy vendored in
llama-cpp-python 0.3.36) writes for f32/f16/bf16/q8_0 — metadata keys in its order and types,
tokenizer arrays, tensor names, order, shapes, Llama's Q/K row permutation, Gemma 3's norm
shift and vocabulary trim, and bytes — and, for the other types, what `llama-quantize` writes
from the converter's f16 file: the f16-rounded values quantized with ggml's reference
quantizers — the k-quants in C (engine/hf/kquants.c, a copy of ggml's), the others and any
machine without a C compiler through the engine's numpy port (engine.gguf.quantize), the same
bytes — under llama-quantize's per-tensor policy (quant_policy.py).
The metadata is recorded on the `gguf` package's own GGUFWriter (the class the converter
writes with), with the package's Metadata heuristics (name, size label from the folder and
model card) and gguf-py's SpecialVocab as llama.cpp vendors it (engine/hf/special_vocab.py:
special ids, add_bos/eos, merges, chat template), so key order and value types follow the same
code. Config keys a config.json leaves out get transformers' defaults, as the converter reads
configs through AutoConfig.

Streaming: no tensor is held whole. Each tensor is read from its shard in row blocks of about
`CHUNK_BYTES` (plain positioned reads at the header's offsets: no mapping of the shard, so a
process under an address-space limit converts shards larger than the limit), converted and
written; peak memory is one block plus fixed overhead. The output grows as `<out>.partial`
with a progress record after each tensor; an interrupted conversion run again with the same
input and arguments restarts at the first unfinished tensor (engine.gguf.writer).

Known differences from llama.cpp, by design: none in the file. (The converter also accepts
PyTorch .bin checkpoints and dozens of other architectures; this reads safetensors of the
families the engine trains: Llama (and Mistral, which llama.cpp converts as Llama), Qwen2,
Qwen3, Gemma 3 text.)
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType
from gguf import LlamaFileType as F

from engine.errors import ForgebenchError
from engine.gguf import quant_policy
from engine.gguf.parser import MetaValue, tensor_nbytes
from engine.gguf.writer import TensorEntry, write_gguf_resumable
from engine.hf import tokenizer as hf_tokenizer
from engine.hf.checkpoint import FLOAT_DTYPES, HFCheckpoint, TensorSlot

DTYPES = tuple(quant_policy.FILE_TYPES)
CONVERTER_TYPES = {F.ALL_F32: T.F32, F.MOSTLY_F16: T.F16, F.MOSTLY_BF16: T.BF16,
                   F.MOSTLY_Q8_0: T.Q8_0}
CHUNK_BYTES = 8 << 20           # f32 bytes per row block
MODEL_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
              "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3}
SKIP_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")


@dataclass
class HFConvertResult:
    path: Path
    dtype: str
    n_tensors: int
    resumed_at: int          # index of the first tensor this run wrote (0: a fresh start)
    types: dict[str, int]


# ---------------------------------------------------------------- hyperparameters

# What transformers' config classes (5.x) fill in for keys a config.json leaves out, for the
# keys the conversion reads: llama.cpp's converter reads the config through AutoConfig, so a
# hand-written or older config.json gets these values in its file too.
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "num_key_value_heads": 32},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "num_key_value_heads": 32, "head_dim": 128},
    "gemma3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
               "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096},
}


def _with_defaults(arch: str, h: dict) -> dict:
    for key, value in _DEFAULTS.get(arch, {}).items():
        h.setdefault(key, value)
    if arch == "llama":
        if h.get("num_key_value_heads") is None and "num_attention_heads" in h:
            h["num_key_value_heads"] = h["num_attention_heads"]
        if h.get("head_dim") is None and "num_attention_heads" in h and "hidden_size" in h:
            h["head_dim"] = h["hidden_size"] // h["num_attention_heads"]
    if "rope_parameters" not in h and "rope_scaling" not in h:
        # transformers 5 gathers the rope settings into rope_parameters
        if arch == "gemma3":
            h["rope_parameters"] = {
                "full_attention": {"rope_type": "default",
                                   "rope_theta": h.get("rope_theta", 1_000_000.0)},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": h.get("rope_local_base_freq", 10_000.0)}}
        else:
            h["rope_parameters"] = {"rope_theta": h.get("rope_theta", 10_000.0),
                                    "rope_type": "default"}
    return h


class _Params:
    """The config as the converter reads it (TextModel.__init__: text_config lifted, the rope
    parameters gathered in one dict)."""

    def __init__(self, ckpt: HFCheckpoint):
        self.h = _with_defaults(ckpt.arch, dict(ckpt.text_config))
        self.arch = ckpt.arch
        self.block_count = self.find(["n_layers", "num_hidden_layers", "n_layer", "num_layers"])
        rope = dict(self.h.get("rope_parameters", self.h.get("rope_scaling")) or {})
        theta = self.find(["global_rope_theta", "rope_global_theta", "rope_theta_global",
                           "rope_theta", "rotary_emb_base"], optional=True)
        local = self.find(["local_rope_theta", "rope_local_theta", "rope_theta_local",
                           "swa_rope_theta", "rope_local_base_freq"], optional=True)
        partial = self.find(["partial_rotary_factor", "rope_pct", "rope_percent"], optional=True)
        orig = self.find(["original_max_position_embeddings"], optional=True)
        if "full_attention" not in rope and "sliding_attention" not in rope:
            if local is not None:
                rope["sliding_attention"] = {"rope_theta": local}
            if "rope_theta" not in rope and theta is not None:
                rope["rope_theta"] = theta
            if "rope_type" not in rope and (kind := rope.get("type")) is not None:
                rope["rope_type"] = kind
            if "partial_rotary_factor" not in rope and partial is not None:
                rope["partial_rotary_factor"] = partial
            if "original_max_position_embeddings" not in rope and orig is not None:
                rope["original_max_position_embeddings"] = orig
        self.rope = rope

    def find(self, keys, optional: bool = False):
        for key in keys:
            if key in self.h:
                return self.h[key]
        if optional:
            return None
        raise ForgebenchError(f"config.json has none of {', '.join(keys)}",
                              where="config.json", hint="use the model's original config.json")


# config.json keys TextModel.set_gguf_parameters reads (the first present wins), each with its
# writer call, in the order it writes them: the shape before the rope settings, the norm
# epsilons after
_SHAPE_KEYS = (
    (["max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
      "model_max_length"], gguf.GGUFWriter.add_context_length),
    (["hidden_size", "n_embd", "dim"], gguf.GGUFWriter.add_embedding_length),
    (["prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
      "n_inner", "hidden_dim"], gguf.GGUFWriter.add_feed_forward_length),
    (["num_attention_heads", "n_head", "n_heads"], gguf.GGUFWriter.add_head_count),
    (["num_key_value_heads", "n_kv_heads"], gguf.GGUFWriter.add_head_count_kv),
)
_NORM_KEYS = (
    (["rms_norm_eps", "norm_eps"], gguf.GGUFWriter.add_layer_norm_rms_eps),
    (["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"], gguf.GGUFWriter.add_layer_norm_eps),
)


def _set_parameters(w: gguf.GGUFWriter, p: _Params, ftype: F) -> None:
    """TextModel.set_gguf_parameters and the family overrides (Llama, Qwen2/3, Gemma 3)."""
    w.add_block_count(p.block_count)
    _set_found(w, p, _SHAPE_KEYS)
    if p.h.get("is_causal") is False:
        w.add_causal_attention(False)
    rope = p.rope.get("full_attention", p.rope)
    _set_rope_scaling(w, rope)
    if (theta := rope.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (theta := p.rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(theta)
    _set_found(w, p, _NORM_KEYS)
    if (head_dim := p.h.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(ftype)
    if p.arch == "llama":
        w.add_vocab_size(p.h["vocab_size"])
        rope_dim = p.h.get("head_dim") or p.h["hidden_size"] // p.h["num_attention_heads"]
        w.add_rope_dimension_count(rope_dim)
    elif p.arch == "gemma3":
        _set_gemma3(w, p)


def _set_found(w: gguf.GGUFWriter, p: _Params, table) -> None:
    for keys, add in table:
        if (value := p.find(keys, True)) is not None:
            add(w, value)


def _set_rope_scaling(w: gguf.GGUFWriter, rope: dict) -> None:
    """Linear, YaRN (with its optional factors) or LongRoPE scaling, as the config says."""
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for value, add in ((rope.get("extrapolation_factor"),
                            w.add_rope_scaling_yarn_ext_factor),
                           (rope.get("attention_factor", rope.get("attn_factor")),
                            w.add_rope_scaling_yarn_attn_factor),
                           (rope.get("beta_fast"), w.add_rope_scaling_yarn_beta_fast),
                           (rope.get("beta_slow"), w.add_rope_scaling_yarn_beta_slow)):
            if value is not None:
                add(value)
    elif kind in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)


def _set_gemma3(w: gguf.GGUFWriter, p: _Params) -> None:
    """Gemma3Model.set_gguf_parameters: its defaults, soft-capping and sliding window."""
    h = p.h
    w.add_context_length(h.get("max_position_embeddings", 131072))
    w.add_head_count(h.get("num_attention_heads", 8))
    w.add_layer_norm_rms_eps(h.get("rms_norm_eps", 1e-6))
    w.add_key_length(h.get("head_dim", 256))
    w.add_value_length(h.get("head_dim", 256))
    w.add_rope_freq_base(p.rope.get("full_attention", p.rope).get("rope_theta", 1_000_000.0))
    if h.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(h["final_logit_softcapping"])
    if h.get("sliding_window_pattern") != 1:
        w.add_sliding_window(h["sliding_window"])
    w.add_head_count_kv(h.get("num_key_value_heads", 4))


def _meta_values(w: gguf.GGUFWriter) -> dict[str, MetaValue]:
    """The recorder's keys as typed MetaValues (array element types as GGUFWriter picks them)."""
    out = {}
    for key, v in w.kv_data[0].items():
        if v.type == GGUFValueType.ARRAY:
            item = v.sub_type or (GGUFValueType.UINT8 if isinstance(v.value, bytes)
                                  else GGUFValueType.get_type(v.value[0]))
            out[key] = MetaValue(GGUFValueType.ARRAY, list(v.value), item)
        else:
            value = v.value
            if v.type in (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64,
                          GGUFValueType.INT64, GGUFValueType.UINT8, GGUFValueType.INT8,
                          GGUFValueType.UINT16, GGUFValueType.INT16):
                value = int(value)
            out[key] = MetaValue(v.type, value)
    return out


# ---------------------------------------------------------------- tensors

@dataclass
class _Plan:
    slot: TensorSlot | None      # None: a generated tensor (rope_freqs)
    name: str
    shape: tuple[int, ...]
    base: T                      # what the converter writes
    final: T                     # what the file holds (llama-quantize's choice for k-quants)
    permute_heads: int | None = None
    shift: float = 0.0
    values: np.ndarray | None = None


def _read_rows(slot: TensorSlot, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a tensor as f32/f16 (the converter's working dtypes)."""
    row_elems = math.prod(slot.shape[1:]) if len(slot.shape) > 1 else 1
    item = {"F32": 4, "F16": 2, "BF16": 2}[slot.dtype]
    begin = slot.offset + start * row_elems * item
    count = (stop - start) * row_elems * item
    with open(slot.shard, "rb") as f:
        f.seek(begin)
        raw = f.read(count)
    if len(raw) != count:
        raise ForgebenchError(f"tensor {slot.name!r} is cut short", path=slot.shard,
                              where=slot.name, hint="download the shard again")
    shape = (stop - start,) + tuple(slot.shape[1:]) if slot.shape else ()
    if slot.dtype == "F32":
        return np.frombuffer(raw, np.float32).reshape(shape)
    if slot.dtype == "F16":
        return np.frombuffer(raw, np.float16).reshape(shape)
    return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _permute_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """LlamaModel.permute on whole heads: rows (half, pair) -> (pair, half) within each head."""
    return (x.reshape(n_heads, 2, x.shape[0] // n_heads // 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def _encode(x: np.ndarray, plan: _Plan) -> np.ndarray:
    if plan.final == plan.base:          # what the converter writes (f32/f16/bf16/q8_0)
        return gguf.quants.quantize(x, plan.final)
    from engine.gguf.quantize import quantize
    from engine.hf.kquants import quantize_rows

    values = gguf.quants.quantize(x, plan.base).astype(np.float32)   # the converter's f16 file
    native = quantize_rows(values, plan.final)
    return native if native is not None else quantize(values, plan.final)


@dataclass
class _RowPool:
    """A thread pool and how many rows parts to cut a block into for it."""
    executor: object
    threads: int


def _encode_rows(x: np.ndarray, plan: _Plan, pool: _RowPool | None) -> np.ndarray:
    """`_encode` with the rows split over the pool's threads (the C quantizer and numpy release
    the GIL); rows quantize independently, so the bytes are the same."""
    n = pool.threads if pool is not None else 1
    if n <= 1 or x.ndim < 2 or x.shape[0] < 2 * n:
        return _encode(x, plan)
    parts = np.array_split(x, n, axis=0)
    return np.concatenate(list(pool.executor.map(lambda part: _encode(part, plan), parts)),
                          axis=0)


def _chunks(plan: _Plan, pool: _RowPool | None = None) -> Iterator[np.ndarray]:
    if plan.values is not None:
        yield _encode(plan.values, plan)
        return
    slot = plan.slot
    rows = plan.shape[0] if plan.shape else 1
    row_bytes = 4 * (math.prod(plan.shape[1:]) if len(plan.shape) > 1 else 1)
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    if plan.permute_heads:           # whole heads, so the permutation stays within a block
        head_rows = rows // plan.permute_heads
        step = max(head_rows, step // head_rows * head_rows)
    if len(plan.shape) <= 1:
        step = rows
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        x = _read_rows(slot, start, stop) if plan.shape else _read_rows(slot, 0, 1).reshape(())
        if plan.permute_heads:
            x = _permute_rows(x, (stop - start) // (rows // plan.permute_heads))
        if plan.shift:
            x = x + plan.shift
        yield _encode_rows(x, plan, pool)


def _require_float(slot: TensorSlot) -> None:
    if slot.dtype not in FLOAT_DTYPES:
        raise ForgebenchError(
            f"tensor {slot.name!r} is {slot.dtype}; the converter reads f32, f16 and bf16 "
            "weights", path=slot.shard, where=slot.name,
            hint="dequantize the checkpoint to bf16/f16 first (quantized HF checkpoints are "
                 "not read)")


def _llama3_rope_factors(p: _Params) -> np.ndarray | None:
    rope = p.rope.get("full_attention", p.rope)
    if not rope or rope.get("rope_type", "").lower() != "llama3":
        return None
    import torch  # the converter computes these in torch f32; follow it to the last bit

    base = rope.get("rope_theta", 10000.0)
    dim = p.h.get("head_dim") or p.h["hidden_size"] // p.h["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def plan_conversion(ckpt: HFCheckpoint, dtype: str, pool: _RowPool | None = None):
    """The metadata and the tensor entries (data computed when written) for `dtype`; `pool`
    quantizes each row block's parts in parallel."""
    dtype = dtype.lower()
    if dtype not in DTYPES:
        raise ForgebenchError(f"unknown --dtype {dtype!r}", where="--dtype",
                              hint="one of " + ", ".join(DTYPES))
    ftype = quant_policy.FILE_TYPES[dtype]
    converter_ftype = ftype if ftype in CONVERTER_TYPES else F.MOSTLY_F16
    p = _Params(ckpt)
    plans = _tensor_plans(ckpt, p, converter_ftype)
    if ftype not in CONVERTER_TYPES:
        facts = quant_policy.ModelFacts(ckpt.arch, p.block_count)
        chosen = quant_policy.plan_types([(pl.name, pl.shape, pl.base) for pl in plans],
                                         ftype, facts)
        for pl in plans:
            pl.final = chosen[pl.name]
    metadata = _metadata(ckpt, p, plans, converter_ftype)
    if ftype not in CONVERTER_TYPES:
        # llama-quantize sets these two on the converter's file: both move to the end
        version = metadata.pop("general.quantization_version")
        metadata.pop("general.file_type")
        metadata["general.quantization_version"] = version
        metadata["general.file_type"] = MetaValue(GGUFValueType.UINT32, int(ftype))

    entries = [TensorEntry(pl.name, pl.final, pl.shape, (lambda pl=pl: _chunks(pl, pool)))
               for pl in plans]
    if ftype not in CONVERTER_TYPES:   # llama-quantize writes in its loader's order
        order = {n: i for i, n in enumerate(quant_policy.loader_order([e.name for e in entries]))}
        entries.sort(key=lambda e: order[e.name])
    return metadata, entries


def _tensor_plans(ckpt: HFCheckpoint, p: _Params, converter_ftype: F) -> list[_Plan]:
    """Every tensor the converter writes, named and typed as it names and types them (Llama
    3's rope factors first); a tensor with no GGUF name or an embedding that does not fit the
    config's vocabulary is refused."""
    tmap = gguf.get_tensor_name_map(MODEL_ARCH[ckpt.arch], p.block_count)
    heads = {"q_proj": p.find(["n_heads", "num_attention_heads"]),
             "k_proj": p.find(["n_kv_heads", "num_key_value_heads"])}
    vocab_rows = None
    if ckpt.arch == "gemma3":
        vocab_rows = hf_tokenizer.real_vocab_size(ckpt.folder, p.h, ckpt.tokenizer_config)
    plans: list[_Plan] = []
    if ckpt.arch == "llama" and (factors := _llama3_rope_factors(p)) is not None:
        plans.append(_Plan(None, "rope_freqs.weight", factors.shape, T.F32, T.F32,
                           values=factors))
    for name, slot in ckpt.tensors.items():
        if not name.endswith(SKIP_SUFFIXES):
            plans.append(_tensor_plan(ckpt, name, slot, tmap, heads, vocab_rows,
                                      converter_ftype))
    vocab_size = p.h.get("vocab_size")
    embd = next((pl for pl in plans if pl.name == "token_embd.weight"), None)
    if embd is not None and vocab_size is not None and ckpt.arch != "gemma3" \
            and embd.shape[0] != vocab_size:
        raise ForgebenchError(
            f"config.json's vocab_size is {vocab_size} but the embedding has "
            f"{embd.shape[0]} rows", path=ckpt.folder / "config.json", where="vocab_size",
            hint="use the config that belongs to these weights")
    return plans


def _tensor_plan(ckpt: HFCheckpoint, name: str, slot, tmap, heads: dict,
                 vocab_rows: int | None, converter_ftype: F) -> _Plan:
    hf_name = name.replace("language_model.", "")
    new_name = tmap.get_name(key=hf_name, try_suffixes=(".weight", ".bias"))
    if new_name is None:
        raise ForgebenchError(f"tensor {name!r} has no GGUF name for {ckpt.arch}",
                              path=slot.shard, where=name,
                              hint="the checkpoint is not a plain "
                                   f"{ckpt.hf_arch}; convert the base model")
    _require_float(slot)
    shape = tuple(slot.shape)
    plan = _Plan(slot, new_name, shape, T.F32, T.F32)
    if ckpt.arch == "llama":
        for proj, n in heads.items():       # Q and K rows permuted as llama.cpp's rope reads
            if hf_name.endswith((f"{proj}.weight", f"{proj}.bias")):
                plan.permute_heads = n
    if ckpt.arch == "gemma3":
        _gemma3_tensor(plan, name, hf_name, vocab_rows)
        shape = plan.shape
    if len(shape) <= 1 or new_name.endswith("_norm.weight") or \
            new_name[-7:] not in (".weight", ".lora_a", ".lora_b"):
        plan.base = T.F32
    else:
        plan.base = CONVERTER_TYPES[converter_ftype]
        if plan.base == T.Q8_0 and shape[-1] % 32:
            plan.base = T.F16    # gguf.quants refuses; the converter falls back to f16
    plan.final = plan.base
    return plan


def _gemma3_tensor(plan: _Plan, name: str, hf_name: str, vocab_rows: int | None) -> None:
    """Gemma 3's embedding cut to the tokenizer's real vocabulary, and its norms stored as
    1 + weight (Gemma3Model.modify_tensors)."""
    if "embed_tokens.weight" in hf_name and vocab_rows is not None:
        if vocab_rows > plan.shape[0]:
            raise ForgebenchError(
                f"the tokenizer has {vocab_rows} tokens but the embedding has "
                f"{plan.shape[0]} rows", path=plan.slot.shard, where=name,
                hint="use the tokenizer that belongs to these weights")
        plan.shape = (vocab_rows,) + tuple(plan.shape[1:])
    if hf_name.endswith("norm.weight"):
        plan.shift = 1.0


def _metadata(ckpt: HFCheckpoint, p: _Params, plans: list[_Plan],
              converter_ftype: F) -> dict[str, MetaValue]:
    """The metadata, recorded as the converter records it (general.*, the parameters, the
    vocabulary); a tokenizer larger than the embedding is refused."""
    w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[MODEL_ARCH[ckpt.arch]])
    # Gemma 3's parameters set some keys twice, as the converter does (the later value wins,
    # in the first one's place); the writer's warning about it is noise here
    logging.getLogger("gguf.gguf_writer").setLevel(logging.ERROR)
    for pl in plans:
        w.add_tensor_info(pl.name, pl.shape, np.dtype(np.float32), 0, raw_dtype=None)
    total_params = w.get_total_parameter_count()[0]
    meta = gguf.Metadata.load(None, ckpt.folder, None, total_params)
    if meta.name is None:
        meta.name = ckpt.folder.name
    if meta.size_label is None and total_params > 0:
        shared, expert, count = w.get_total_parameter_count()[1:]
        meta.size_label = gguf.size_label(total_params, shared, expert, count)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    _set_parameters(w, p, converter_ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_tokens = hf_tokenizer.write_vocab(w, ckpt.folder, ckpt.arch, p.h, ckpt.tokenizer_config)
    embd = next((pl for pl in plans if pl.name == "token_embd.weight"), None)
    if embd is not None and n_tokens > embd.shape[0]:
        raise ForgebenchError(
            f"the tokenizer has {n_tokens} tokens but the embedding only {embd.shape[0]} rows",
            path=ckpt.folder / "tokenizer_config.json",
            hint="use the tokenizer that belongs to these weights")
    return _meta_values(w)


def convert_hf(folder: str | os.PathLike, out: str | os.PathLike, dtype: str, *,
               progress: Callable[[TensorEntry, int, int, int, int], None] | None = None,
               threads: int | None = None) -> HFConvertResult:
    """Convert the checkpoint in `folder` to `out` (which must not exist); resumes an
    interrupted run of the same conversion (see the module docstring). `threads` (default: the
    CPU count, at most 8; one under an address-space limit) quantize parts of each row block
    at once; the bytes do not depend on it."""
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or (1 if _address_space_limited() else min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(threads) as executor:
        return _convert_hf(folder, out, dtype, progress, _RowPool(executor, threads))


def _address_space_limited() -> bool:
    """Under an RLIMIT_AS the conversion runs on one thread: each pool thread's malloc arena
    reserves 64 MiB of address space (untouched, so no memory) that the limit would count."""
    try:
        import resource
    except ImportError:    # not on Windows
        return False
    return resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY


def _convert_hf(folder, out, dtype, progress, pool) -> HFConvertResult:
    out = Path(out)
    if out.exists():
        raise ForgebenchError("the output file already exists; refusing to overwrite it",
                              path=out, where="--out", hint="choose a new name or delete it first")
    ckpt = HFCheckpoint.open(folder)
    metadata, entries = plan_conversion(ckpt, dtype, pool)
    for e in entries:
        tensor_nbytes(e.ggml_type, e.shape)
    fingerprint = {"input": ckpt.fingerprint(), "dtype": dtype.lower()}
    path, start = write_gguf_resumable(out, metadata, entries, fingerprint=fingerprint,
                                       progress=progress)
    types: dict[str, int] = {}
    for e in entries:
        types[T(e.ggml_type).name] = types.get(T(e.ggml_type).name, 0) + 1
    return HFConvertResult(path, dtype.lower(), len(entries), start, types)
