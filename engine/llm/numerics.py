"""llama.cpp's CPU arithmetic, reproduced in torch so the engine's logits are what llama.cpp serves.

What llama.cpp (ggml-cpu) does that plain f32 does not:
- a matmul with quantized weights first quantizes each activation row to the weight type's
  "vec_dot_type" (Q8_K for K-quants, Q8_0 for Q4_0/Q5_0/Q8_0, f16 for f16 weights) and then takes
  integer dot products. Dequantizing the activation exactly (q·d) and multiplying with the exactly
  dequantized weight in f32 gives the same sums up to f32 summation order;
- the KV cache is f16, the query is rounded to f16 for K·Q, and the softmax probabilities are
  rounded to f16 for V·softmax (no flash attention, llama-cpp-python's default);
- GELU goes through a 65536-entry f16 table (GGML_GELU_FP16): input and output rounded to f16;
  the table is ggml's own, entry for entry (its f32 formula has an FMA and a correctly rounded tanhf);
- RMSNorm's 1/sqrtf is correctly rounded in C; torch's f32 sqrt is not always (rsqrt_f32).

Sources: ggml-quants.c (quantize_row_q8_K_ref), ggml-cpu/arch/x86/quants.c (quantize_row_q8_0),
ggml-cpu/vec.h (ggml_vec_geglu_f32, ggml_gelu_f32), ggml-cpu/ops.cpp (rms_norm_f32),
llama-graph.cpp (build_attn_mha).

Checked op by op on gemma-3-270m Q4_K_M against the tensors llama.cpp itself computes (its eval
callback; tests/test_gguf_llamacpp.py): RMSNorm and GeGLU outputs are bit-identical, every
matmul, RoPE and attention output agrees to f32 summation-order noise (relative ~1e-6).

What is not reproduced: the order of llama.cpp's f32 sums inside its SIMD kernels (tinyBLAS for
Q5_0/Q8_0/f16, the repacked Q4_K 8x8 gemm/gemv, the Q6_K dot product) and its own exp/cos/sin.
llama.cpp's own sums depend on the batch: a token evaluated inside a prompt batch and the same
token evaluated alone differ in the last bits. A requantization to Q8 turns such a last-bit
difference into a whole quantization step now and then, and Gemma's large post-norm gains carry
one step into ~1 logit, so end-to-end logits agree with llama.cpp only as well as llama.cpp's
own batched and one-token-at-a-time paths agree with each other (~96% top-1 on gemma-3-270m).
"""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType as T

from engine.gguf.constants import QK_K, VEC_DOT_TYPE

NUMERICS = ("f32", "llamacpp")


def round_f16(x: torch.Tensor) -> torch.Tensor:
    """f32 -> nearest f16 (round-to-nearest-even, as F16C's vcvtps2ph) -> f32."""
    return x.to(torch.float16).to(torch.float32)


def rsqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """1.0f/sqrtf(x) with both steps correctly rounded, as C does. torch's own f32 sqrt is not
    always correctly rounded (off by an ulp on some inputs), and one ulp in an RMSNorm scale is
    enough to flip later Q8 activation roundings. f64 then f32 rounds exactly like f32 for sqrt and
    division (53 >= 2·24 + 2 bits)."""
    root = torch.sqrt(x.double()).float()
    return (1.0 / root.double()).float()


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"activation length {x.shape[-1]} is not a multiple of block size {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def q8_0_values(x: torch.Tensor) -> torch.Tensor:
    """Activations as llama.cpp's quantize_row_q8_0 (AVX path) leaves them: round(x·127/amax)·f16(amax/127)."""
    b = _blocks(x.float(), 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = round_f16(amax / 127.0)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv)                                  # _MM_ROUND_NEAREST: half to even
    return (q * d).reshape(x.shape)


def q8_k_values(x: torch.Tensor) -> torch.Tensor:
    """Activations as quantize_row_q8_K_ref leaves them: min(127, nearest(x·(-127/max)))·(1/iscale),
    where max is the first element of largest magnitude (signed) and the scale stays f32."""
    b = _blocks(x.float(), QK_K)
    idx = b.abs().argmax(-1, keepdim=True)                    # first occurrence, like `ax > amax`
    peak = torch.gather(b, -1, idx)
    nonzero = peak != 0
    iscale = torch.where(nonzero, -127.0 / torch.where(nonzero, peak, torch.ones_like(peak)),
                         torch.zeros_like(peak))
    q = torch.clamp(torch.round(b * iscale), max=127.0)       # nearest_int: half to even
    d = torch.where(nonzero, 1.0 / torch.where(nonzero, iscale, torch.ones_like(iscale)),
                    torch.zeros_like(iscale))
    return (q * d).reshape(x.shape)


def activation_values(x: torch.Tensor, weight_type: T) -> torch.Tensor:
    """The activation values llama.cpp's matmul effectively multiplies with weights of `weight_type`.

    Q8_1 (paired with Q4_1/Q5_1) is taken as Q8_0's values; llama.cpp additionally rounds the
    block sum used for the weight minimum to f16, a difference below f16 resolution of the sum.
    """
    vec = VEC_DOT_TYPE[T(weight_type)]
    if vec is None:
        return x
    if vec == T.F16:
        return round_f16(x)
    if vec == T.BF16:
        return x.to(torch.bfloat16).to(torch.float32)
    if vec in (T.Q8_0, T.Q8_1):
        return q8_0_values(x)
    if vec == T.Q8_K:
        return q8_k_values(x)
    raise ValueError(f"no activation format for {vec}")


_SQRT_2_OVER_PI = 0.79788456080286535587989211986876
_GELU_A = 0.044715


def gelu_tanh_f32(x: torch.Tensor) -> torch.Tensor:
    """ggml_gelu_f32 as GCC compiles it: 0.5f·x·(1 + tanhf(√(2/π)·x·fma(0.044715·x, x, 1))).

    Every step is an f32 operation; GCC contracts 1 + a·x·x into one fused multiply-add, and tanhf
    is correctly rounded. fma and tanh are evaluated in f64 and rounded once to f32 (exact for the
    f16 inputs the table uses: the product has at most 35 significant bits)."""
    x = x.float()
    s, a = torch.tensor(_SQRT_2_OVER_PI, dtype=torch.float32), torch.tensor(_GELU_A, dtype=torch.float32)
    inner = ((a * x).double() * x.double() + 1.0).float()
    t = torch.tanh((s * x * inner).double()).float()
    return 0.5 * x * (1.0 + t)


@functools.lru_cache(maxsize=1)
def _gelu_table() -> torch.Tensor:
    """ggml_table_gelu_f16 as ggml_cpu_init fills it: f16(gelu(v)) for every f16 bit pattern v."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    return round_f16(torch.nan_to_num(gelu_tanh_f32(values)))


def gelu_llamacpp(x: torch.Tensor) -> torch.Tensor:
    """ggml's table GELU (GGML_GELU_FP16): table[f16(x)] inside (-10, 10), 0 below, identity above."""
    table = _gelu_table()[x.to(torch.float16).view(torch.int16).long() & 0xFFFF]
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))


def attention_llamacpp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """llama.cpp's non-flash attention with an f16 KV cache.

    q [B,H,T,hd] f32, k/v [B,Hkv,S,hd]: kq = f16(q)·f16(k) (f32 sums), softmax(kq·scale + mask) in f32,
    then f16(probabilities)·f16(v).
    """
    groups = q.shape[1] // k.shape[1]
    k16, v16 = round_f16(k), round_f16(v)
    if groups > 1:
        k16 = k16.repeat_interleave(groups, dim=1)
        v16 = v16.repeat_interleave(groups, dim=1)
    kq = torch.matmul(round_f16(q), k16.transpose(-1, -2))   # [B,H,T,S]
    kq = (kq * scale).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(kq, dim=-1)
    return torch.matmul(round_f16(probs), v16)



__all__ = ["NUMERICS", "round_f16", "rsqrt_f32", "q8_0_values", "q8_k_values", "activation_values",
           "gelu_tanh_f32", "gelu_llamacpp", "attention_llamacpp"]
