"""Which type each tensor gets in a file-level quantization recipe (Q4_K_M, Q6_K, ...).

A mirror of llama.cpp's `llama_tensor_get_type` (`src/llama-quant.cpp`) for the recipes the
engine writes, without an importance matrix or user overrides: which tensors may be quantized at
all (matrix weights only: norms and 1-D tensors keep their type), the per-category bumps (output
and tied embeddings to Q6_K, a "more bits" subset of attn_v / ffn_down layers to Q6_K, ...), and
the fallbacks for rows that are not a multiple of the block size (Gemma-3-270m's 640-wide rows:
Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16 when even 32 does not divide them).

llama.cpp walks the tensors in its loader's order (non-layer tensors by name, then layer by layer,
by name within a layer) and counts attn_v / ffn_down tensors as it goes; the counters decide the
"more bits" layers, so the walk below uses the same order.

Mirrored from the llama.cpp vendored in llama-cpp-python 0.3.36 (commit 0c1e570); the branches
for recipes outside FILE_TYPES (IQ*, Q2_K, Q3_K, MXFP4) and for GLM5-next are left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as F

from engine.gguf import layouts

# forgebench convert / export names -> llama.cpp file types
FILE_TYPES: dict[str, F] = {
    "f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16,
    "q8_0": F.MOSTLY_Q8_0, "q4_0": F.MOSTLY_Q4_0,
    "q4_k_s": F.MOSTLY_Q4_K_S, "q4_k_m": F.MOSTLY_Q4_K_M, "q5_k_m": F.MOSTLY_Q5_K_M,
    "q6_k": F.MOSTLY_Q6_K,
}

# llama_ftype_get_default_type
DEFAULT_TYPE: dict[F, T] = {
    F.ALL_F32: T.F32, F.MOSTLY_F16: T.F16, F.MOSTLY_BF16: T.BF16,
    F.MOSTLY_Q8_0: T.Q8_0, F.MOSTLY_Q4_0: T.Q4_0,
    F.MOSTLY_Q4_K_S: T.Q4_K, F.MOSTLY_Q4_K_M: T.Q4_K, F.MOSTLY_Q5_K_M: T.Q5_K,
    F.MOSTLY_Q6_K: T.Q6_K,
}

FLOAT_TYPES = layouts.FLOAT_TYPES

# tensor_type_fallback: a 256-block type on rows it does not divide
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

# tensor_allows_quantization: names never quantized (substrings), besides norms and 1-D tensors
KEEP_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
    "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
) + tuple(f"time_mix_{n}.weight" for n in (
    "first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2", "decay_w1",
    "decay_w2", "lerp_fused"))
KEEP_NAMES = ("position_embd.weight", "token_types.weight")


@dataclass(frozen=True)
class ModelFacts:
    """The model properties the policy reads from GGUF metadata."""
    arch: str
    n_layers: int
    n_expert: int = 0

    @classmethod
    def from_metadata(cls, metadata: dict) -> "ModelFacts":
        arch = str(metadata.get("general.architecture", ""))
        return cls(arch, int(metadata.get(f"{arch}.block_count", 0) or 0),
                   int(metadata.get(f"{arch}.expert_count", 0) or 0))

    @property
    def is_70b(self) -> bool:
        # llama.cpp's LLM_TYPE_70B for the llama family is the 80-layer model
        return self.arch == "llama" and self.n_layers == 80


def _block(ggml_type: T) -> int:
    return GGML_QUANT_SIZES[ggml_type][0]


def _is_quantized(ggml_type: T) -> bool:
    return ggml_type not in FLOAT_TYPES and ggml_type not in (T.I8, T.I16, T.I32, T.I64, T.F64)


def _ggml_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing (ggml order) size-1 dimensions do not count."""
    dims = list(reversed(shape)) or [1]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return len(dims)


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """Matrix weights only: no norms, biases, 1-D tensors or the small special tables."""
    return (_ggml_dims(shape) >= 2 and name.endswith("weight")
            and not any(s in name for s in KEEP_SUBSTRINGS) and name not in KEEP_NAMES)


def category(name: str) -> str:
    """tensor_get_category (first match wins, substrings as llama.cpp matches them)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"),
                     ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def loader_order(names: list[str]) -> list[str]:
    """llama_model_loader's weights_map order: by layer number (-1 for non-layer), then name."""
    def key(name: str):
        match = re.match(r"blk\.(\d+)\.", name)
        return (int(match.group(1)) if match else -1, name)
    return sorted(names, key=key)


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def _fallback(ncols: int, target: T) -> T:
    if ncols % _block(target) == 0:
        return target
    chosen = FALLBACK.get(target, target)
    return chosen if ncols % _block(chosen) == 0 else T.F16


class _Counters:
    def __init__(self, names: list[str], facts: ModelFacts):
        self.tied = "output.weight" not in names
        self.n_attention_wv = sum(category(n) in ("attn_v", "attn_qkv", "attn_kv_b")
                                  for n in names)
        self.n_ffn = facts.n_layers
        self.i_attention_wv = 0
        self.i_ffn_down = 0


def _layer(name: str, counter: int, facts: ModelFacts) -> int:
    if facts.n_expert > 1:  # expert tensors are not consecutive: llama.cpp parses the name
        return int(re.match(r"blk\.(\d+)\.", name).group(1))
    return counter


def _choose(name: str, shape: tuple[int, ...], ftype: F, new_type: T, facts: ModelFacts,
            state: _Counters) -> T:
    """llama_tensor_get_type_impl, restricted to the file types in DEFAULT_TYPE."""
    cat = category(name)
    falcon = facts.arch == "falcon"
    if cat == "output" or (state.tied and cat == "token_embd"):
        if falcon or shape[-1] % _block(new_type):
            return T.Q8_0
        return new_type if new_type == T.Q8_0 else T.Q6_K
    if cat == "token_embd":
        return new_type
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):  # llama.cpp's category_is_attn_v
        if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and \
                _use_more_bits(state.i_attention_wv, state.n_attention_wv):
            new_type = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and state.i_attention_wv < 4:
            new_type = T.Q5_K
        if facts.is_70b and new_type in (T.Q3_K, T.Q4_K):
            new_type = T.Q5_K
        if facts.n_expert == 8:
            new_type = T.Q8_0
        state.i_attention_wv += 1
        return new_type
    if cat == "attn_k":
        return T.Q8_0 if facts.n_expert == 8 else new_type
    if cat == "ffn_down":
        i_layer = _layer(name, state.i_ffn_down, facts)
        n_layer = state.n_ffn
        if ftype == F.MOSTLY_Q4_K_M:
            if falcon:
                new_type = (T.Q6_K if i_layer < n_layer // 16 else
                            T.Q5_K if _use_more_bits(i_layer, n_layer) else T.Q4_K)
            elif _use_more_bits(i_layer, n_layer):
                new_type = T.Q6_K
        elif ftype == F.MOSTLY_Q5_K_M and _use_more_bits(i_layer, n_layer):
            new_type = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and not falcon and i_layer < n_layer // 8:
            new_type = T.Q5_K
        state.i_ffn_down += 1
        return new_type
    if cat == "attn_output":
        if not falcon and facts.n_expert == 8 and ftype in (F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M):
            return T.Q5_K
        return new_type
    return new_type


def plan_types(tensors: list[tuple[str, tuple[int, ...], T]], ftype: F,
               facts: ModelFacts) -> dict[str, T]:
    """Target type per tensor name for file type `ftype`. `tensors`: (name, torch-order shape,
    current type). Tensors that may not be quantized keep their current type."""
    ftype = F(ftype)
    if ftype not in DEFAULT_TYPE:
        raise ValueError(f"file type {ftype.name} is not supported")
    default = DEFAULT_TYPE[ftype]
    shapes = {name: (shape, T(kind)) for name, shape, kind in tensors}
    order = loader_order(list(shapes))
    state = _Counters(order, facts)
    plan = {}
    for name in order:
        shape, current = shapes[name]
        if not allows_quantization(name, shape):
            plan[name] = current
        elif not _is_quantized(default):
            plan[name] = default
        else:
            chosen = _choose(name, shape, ftype, default, facts, state)
            plan[name] = _fallback(shape[-1], chosen)
    return plan
