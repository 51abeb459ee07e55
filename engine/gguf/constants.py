"""One table of GGUF names: the quant types the engine can dequantize and the activation format
llama.cpp pairs with each weight type in its matmuls (both read from the weight-layout table,
engine/gguf/layouts.py), the architectures it runs or refuses, the tensor names of a decoder (and
which engine parameter each holds), and the metadata keys the engine writes (all under
`forgebench.`). Every reader and writer of these names imports them from here."""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

from engine.gguf.layouts import BLOCK_LAYOUTS, BY_TYPE

# Weight types with a torch dequantization kernel (engine/gguf/dequant.py).
SUPPORTED_TYPES: tuple[T, ...] = tuple(layout.ggml_type for layout in BLOCK_LAYOUTS)

# llama.cpp (ggml-cpu type_traits) quantizes a matmul's activations to this type ("vec_dot_type")
# before the integer dot product with weights of the key type. None: activations stay f32.
VEC_DOT_TYPE: dict[T, T | None] = {layout.ggml_type: layout.vec_dot for layout in BLOCK_LAYOUTS}

QK_K = 256


def type_size(ggml_type: T) -> int:
    """Bytes per block (of a type in the layout table)."""
    return BY_TYPE[T(ggml_type)].block_bytes


# Decoder architectures the engine runs (engine/models/gguf_model.py).
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# Refused with a named reason: mixture-of-experts and hybrid/recurrent families.
REFUSED_ARCHS = {
    **{a: "a mixture-of-experts model" for a in (
        "qwen2moe", "qwen3moe", "mixtral", "deepseek", "deepseek2", "dbrx", "olmoe", "arctic",
        "grok", "gpt-oss", "llama4", "granitemoe", "hunyuan-moe", "ernie4_5-moe", "glm4moe",
        "bailingmoe", "dots1", "phimoe")},
    **{a: "a hybrid or recurrent (state-space) model" for a in (
        "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "jamba", "falcon-h1",
        "granitehybrid", "lfm2", "plamo2", "nemotron_h", "qwen3next", "recurrentgemma")},
}

# -- tensor names ---------------------------------------------------------------------------
# module path (per layer, after "layers.{i}.") -> GGUF tensor name (after "blk.{i}.")
LAYER_TENSORS = {
    "attn_norm": "attn_norm", "mlp_norm": "ffn_norm",
    "attn.q": "attn_q", "attn.k": "attn_k", "attn.v": "attn_v", "attn.o": "attn_output",
    "attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate", "mlp.up": "ffn_up", "mlp.down": "ffn_down",
    "post_attn_norm": "post_attention_norm", "post_mlp_norm": "post_ffw_norm",
}
# model-level module path -> GGUF tensor name (before ".weight")
MODEL_TENSORS = {"tok_embeddings": "token_embd", "norm": "output_norm", "output": "output"}


def gguf_tensor_name(param: str) -> str | None:
    """The GGUF tensor a parameter of an engine model is stored as (`layers.3.attn.q.weight`
    -> `blk.3.attn_q.weight`), the inverse of how `_bind` names what it loads; None when the
    file holds no such tensor. The loader and the exports of trained weights use this one
    mapping."""
    module, _, kind = param.rpartition(".")
    if module in MODEL_TENSORS:
        return f"{MODEL_TENSORS[module]}.{kind}"
    parts = module.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() \
            and parts[2] in LAYER_TENSORS:
        return f"blk.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{kind}"
    return None


# tensors a GGUF holds that the engine keeps outside its parameters (Llama 3 rope factors)
NON_PARAMETER_TENSORS = {"rope_freqs.weight"}

# -- layout ---------------------------------------------------------------------------------
ALIGNMENT_KEY = "general.alignment"
DEFAULT_ALIGNMENT = 32

# -- metadata keys the engine writes --------------------------------------------------------
DEQUANTIZED_FROM_KEY = "forgebench.dequantized_from"            # SHA-256 of the quantized source
DEQUANTIZED_FROM_TYPE_KEY = "forgebench.dequantized_from_type"  # its quant type
SOURCE_SHA_KEY = "forgebench.source_sha256"          # an lm-pretrain export: the checkpoint file
MERGED_ADAPTER_KEY = "forgebench.merged_adapter_sha256"         # a merged LoRA: the adapter file
MERGED_ALPHA_KEY = "forgebench.merged_lora_alpha"
MERGED_RANK_KEY = "forgebench.merged_lora_rank"
FULL_WEIGHTS_KEY = "forgebench.finetuned_weights_sha256"        # a full fine-tune: the weights
ADAPTER_BASE_SHA_KEY = "forgebench.base_sha256"      # a GGUF LoRA adapter: its base file
