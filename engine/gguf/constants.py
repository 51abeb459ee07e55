"""One table of what the engine reads: quant types it can dequantize, the activation format
llama.cpp pairs with each weight type in its matmuls, and the architectures it runs or refuses."""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

# Weight types with a torch dequantization kernel (engine/gguf/dequant.py).
SUPPORTED_TYPES: tuple[T, ...] = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                                  T.Q4_K, T.Q5_K, T.Q6_K)

# llama.cpp (ggml-cpu type_traits) quantizes a matmul's activations to this type ("vec_dot_type")
# before the integer dot product with weights of the key type. None: activations stay f32.
VEC_DOT_TYPE: dict[T, T | None] = {
    T.F32: None, T.F16: T.F16, T.BF16: T.BF16,
    T.Q8_0: T.Q8_0, T.Q4_0: T.Q8_0, T.Q5_0: T.Q8_0, T.Q4_1: T.Q8_1, T.Q5_1: T.Q8_1,
    T.Q4_K: T.Q8_K, T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K,
}

QK_K = 256


def type_size(ggml_type: T) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[ggml_type][1]


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
