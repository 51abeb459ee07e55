"""llama.cpp's CPU arithmetic, reproduced so the engine's logits are the ones llama.cpp serves.

What llama.cpp (ggml-cpu) does that plain f32 does not:
- a matmul with quantized weights first quantizes each activation row to the weight type's
  "vec_dot_type" (Q8_K for K-quants, Q8_0 for Q4_0/Q5_0/Q8_0, f16 for f16 weights) and then takes
  integer dot products, summed in the order of the SIMD kernel that serves that weight type and
  batch size (engine/kernels/ggml_matmul.py reproduces those orders bit for bit);
- the KV cache is f16, the query is rounded to f16 for K·Q, and the softmax probabilities are
  rounded to f16 for V·softmax (no flash attention, llama-cpp-python's default); both products
  are summed as tinyBLAS sums a batch and ggml_vec_dot_f16 one query (dot_tinyblas, dot_vec_f16);
- the softmax exponent is ggml_v_expf, a polynomial, not a correctly rounded exp (expf_ggml);
- GELU goes through a 65536-entry f16 table (GGML_GELU_FP16): input and output rounded to f16;
  the table is ggml's own, entry for entry (its f32 formula has an FMA and a correctly rounded
  tanhf);
- RMSNorm's 1/sqrtf is correctly rounded in C; torch's f32 sqrt is not always (rsqrt_f32), nor is
  torch's `scalar / tensor` (divide);
- RoPE takes cos/sin from the C library's cosf/sinf and rotates with fused multiply-adds.

Why every last bit: each matmul's output is requantized to Q8 before the next, so a one-ulp
difference now and then moves an activation across a rounding step, and Gemma's large post-norm
gains carry one step into ~1 logit. llama.cpp itself shows it: its one-token-at-a-time logits
agree with its batched ones on only ~96% of top-1 choices on gemma-3-270m, because its kernels
sum in a different order for one row than for a batch. The engine follows the kernel llama.cpp
picks for each batch size, so it matches llama.cpp either way.

Sources (the ggml vendored by llama-cpp-python 0.3.36, x86 builds with AVX2 + FMA + F16C, with
and without AVX-512; engine/kernels/cpu.py says which orders this machine's llama.cpp runs):
ggml-quants.c (quantize_row_q8_K_ref), ggml-cpu/arch/x86/quants.c (quantize_row_q8_0, vec_dot),
ggml-cpu/arch/x86/repack.cpp, ggml-cpu/tiled, llamafile/sgemm.cpp, ggml-cpu/vec.h (ggml_v_expf,
ggml_gelu_f32), ggml-cpu/vec.cpp (ggml_vec_soft_max_f32, ggml_vec_dot_f16), ggml-cpu/ops.cpp
(rms_norm_f32, soft_max_f32, rope), llama-graph.cpp (build_attn_mha). AVX-512 builds change the
f16 dot products (16 lanes), the softmax (16 lanes, another expf form) and the Q6_K tiled
microtile; the engine follows them, in the configuration llama.cpp was opened in (repacked,
or without extra buffer types as engine/export/llamacpp.py opens an AMX build). Other CPUs (ARM
NEON, SVE) and AMX tile kernels are not reproduced; there it matches to f32 summation order, not
to the bit, and says so.

Checked op by op on gemma-3-270m Q4_K_M against the tensors llama.cpp itself computes (its eval
callback), and kernel by kernel against libggml-cpu's own functions (tests/test_gguf_llamacpp.py,
tests/test_ggml_kernels.py): every hidden-state op is bit-identical.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from engine.gguf.constants import QK_K, VEC_DOT_TYPE
from engine.kernels.cpu import plan
from engine.kernels.native import kernels, ptr, tail_probe

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


def divide(numerator: float, x: torch.Tensor) -> torch.Tensor:
    """numerator / x, correctly rounded. torch's `scalar / tensor` is reciprocal(x)·scalar, two
    roundings, which is an ulp off C's division now and then."""
    return torch.div(torch.full_like(x, numerator), x)


@functools.lru_cache(maxsize=1)
def _libm():
    """The C math library (None where there is none to load, e.g. Windows)."""
    name = ctypes.util.find_library("m")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    for fn in (lib.cosf, lib.sinf):
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


def cos_sin_f32(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cosf/sinf of f32 angles from the C library, the functions ggml's RoPE calls (glibc's are
    not correctly rounded, so no other implementation matches them bit for bit); f64 rounded
    to f32 where no C math library is found."""
    lib = _libm()
    if lib is None:
        wide = angles.double()
        return wide.cos().float(), wide.sin().float()
    flat = angles.reshape(-1).tolist()
    cos = torch.tensor([lib.cosf(a) for a in flat], dtype=torch.float32).view(angles.shape)
    sin = torch.tensor([lib.sinf(a) for a in flat], dtype=torch.float32).view(angles.shape)
    return cos, sin


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"activation length {x.shape[-1]} is not a multiple of block size {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's quantize_row_q8_0 (AVX path): ints round(x·127/amax) [..., nb, 32] (as f32) and
    the block scale f16(amax/127) [..., nb]."""
    b = _blocks(x.float(), 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, divide(127.0, amax), torch.zeros_like(amax))
    q = torch.round(b * inv)  # _MM_ROUND_NEAREST: half to even
    return q, round_f16(amax / 127.0)[..., 0]


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_row_q8_K_ref: ints min(127, nearest(x·(-127/max))) [..., nb, 256] (as f32) and the
    f32 scale 1/iscale [..., nb], where max is the first element of largest magnitude (signed)."""
    b = _blocks(x.float(), QK_K)
    idx = b.abs().argmax(-1, keepdim=True)  # first occurrence, like `ax > amax`
    peak = torch.gather(b, -1, idx)
    nonzero = peak != 0
    iscale = torch.where(
        nonzero,
        divide(-127.0, torch.where(nonzero, peak, torch.ones_like(peak))),
        torch.zeros_like(peak),
    )
    q = torch.clamp(torch.round(b * iscale), max=127.0)  # nearest_int: half to even
    d = torch.where(
        nonzero,
        divide(1.0, torch.where(nonzero, iscale, torch.ones_like(iscale))),
        torch.zeros_like(iscale),
    )
    return q, d[..., 0]


def q8_0_values(x: torch.Tensor) -> torch.Tensor:
    """The values llama.cpp's Q8_0 activation blocks stand for (q·d)."""
    q, d = quantize_q8_0(x)
    return (q * d[..., None]).reshape(x.shape)


def q8_k_values(x: torch.Tensor) -> torch.Tensor:
    """The values llama.cpp's Q8_K activation blocks stand for (q·d)."""
    q, d = quantize_q8_k(x)
    return (q * d[..., None]).reshape(x.shape)


def activation_values(x: torch.Tensor, weight_type: T) -> torch.Tensor:
    """The activation values llama.cpp's matmul multiplies with weights of `weight_type`.

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
    s, a = (
        torch.tensor(_SQRT_2_OVER_PI, dtype=torch.float32),
        torch.tensor(_GELU_A, dtype=torch.float32),
    )
    inner = ((a * x).double() * x.double() + 1.0).float()
    t = torch.tanh((s * x * inner).double()).float()
    return 0.5 * x * (1.0 + t)


@functools.lru_cache(maxsize=1)
def gelu_table() -> torch.Tensor:
    """ggml_table_gelu_f16 as ggml_cpu_init fills it: f16(gelu(v)) for every f16 bit pattern v."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    return round_f16(torch.nan_to_num(gelu_tanh_f32(values)))


def gelu_llamacpp(x: torch.Tensor) -> torch.Tensor:
    """ggml's table GELU (GGML_GELU_FP16): table[f16(x)] inside (-10, 10), 0 below, identity
    above."""
    table = gelu_table()[x.to(torch.float16).view(torch.int16).long() & 0xFFFF]
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a·b + c rounded once to f32, as an FMA instruction does (a, b f32-valued; c any float dtype):
    the product of two f32 is exact in f64, so one f64 add and one rounding to f32 reproduce it."""
    return torch.addcmul(c.double(), a.double(), b.double()).float()


def hsum8(lanes: torch.Tensor) -> torch.Tensor:
    """ggml's hsum_float_8 over the last dim (8 lanes):
    ((x0+x4) + (x2+x6)) + ((x1+x5) + (x3+x7))."""
    r = lanes[..., 4:] + lanes[..., :4]
    r = r[..., :2] + r[..., 2:]
    return r[..., 0] + r[..., 1]


def hsum16(lanes: torch.Tensor) -> torch.Tensor:
    """GCC's _mm512_reduce_add_ps over the last dim (16 lanes): the upper eight onto the lower
    eight, then hsum_float_8."""
    return hsum8(lanes[..., 8:] + lanes[..., :8])


def hsum(lanes: torch.Tensor) -> torch.Tensor:
    """hsum8 or hsum16 by the width of the last dim."""
    return hsum16(lanes) if lanes.shape[-1] == 16 else hsum8(lanes)


def dot_tinyblas(a: torch.Tensor, b: torch.Tensor, lanes: int = 8) -> torch.Tensor:
    """a [..., P, K] · b [..., Q, K]ᵀ -> [..., P, Q] as llamafile's tinyBLAS sums (f16/f32 inputs):
    `lanes` lanes (k mod lanes; 8 on AVX2, 16 on AVX-512), each an fma chain over k in order, then
    the register's horizontal sum. K must be a multiple of `lanes` (else ggml uses vec_dot)."""
    steps = a.shape[-1] // lanes
    a8 = a.reshape(*a.shape[:-1], steps, lanes).unsqueeze(-3)  # [..., P, 1, steps, L]
    b8 = b.reshape(*b.shape[:-1], steps, lanes).unsqueeze(-4)  # [..., 1, Q, steps, L]
    acc = torch.zeros(torch.broadcast_shapes(a8.shape, b8.shape)[:-2] + (lanes,))
    for s in range(steps):
        acc = fma_f32(a8[..., s, :], b8[..., s, :], acc)
    return hsum(acc)


def dot_vec_f16(a: torch.Tensor, b: torch.Tensor, lanes: int = 8) -> torch.Tensor:
    """The same product as ggml_vec_dot_f16 sums it (one query row): four `lanes`-lane
    accumulators over consecutive 4·lanes-element steps, reduced as (acc0+acc2) + (acc1+acc3),
    then across lanes (AVX2: GGML_F32Cx8_REDUCE, ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7));
    AVX-512: _mm512_reduce_add_ps); the K mod 4·lanes leftover products are added in f64."""
    K, step = a.shape[-1], 4 * lanes
    np_ = K - K % step
    steps = np_ // step
    a4 = a[..., :np_].reshape(*a.shape[:-1], steps, 4, lanes).unsqueeze(-4)
    b4 = b[..., :np_].reshape(*b.shape[:-1], steps, 4, lanes).unsqueeze(-5)
    acc = torch.zeros(torch.broadcast_shapes(a4.shape, b4.shape)[:-3] + (4, lanes))
    for s in range(steps):
        acc = fma_f32(a4[..., s, :, :], b4[..., s, :, :], acc)
    x = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])
    if lanes == 16:
        total = hsum16(x).double()
    else:
        t = x[..., :4] + x[..., 4:]
        total = ((t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])).double()
    for k in range(np_, K):
        total = total + (a[..., :, None, k] * b[..., None, :, k]).double()
    return total.float()


def dot_f16(
    a: torch.Tensor, b: torch.Tensor, tinyblas: bool, lanes: int | None = None
) -> torch.Tensor:
    """dot_tinyblas / dot_vec_f16 for a [..., P, K], b [..., Q, K] with equal leading dims, with
    this machine's lane count unless given: in C when ggml_kernels.c is built, else the torch
    reference above."""
    lanes = lanes or plan().f16_lanes
    lib = kernels()
    if lib is None:
        return dot_tinyblas(a, b, lanes) if tinyblas else dot_vec_f16(a, b, lanes)
    a, b = a.float().contiguous(), b.float().contiguous()
    lead, (P, K), Q = a.shape[:-2], a.shape[-2:], b.shape[-2]
    out = torch.empty(*lead, P, Q)
    lib.f16_dot(math.prod(lead), P, Q, K, ptr(a), ptr(b), int(tinyblas), lanes, ptr(out))
    return out


def tinyblas_serves(rows: int, cols: int, batch: int, lanes: int | None = None) -> bool:
    """Whether llamafile_sgemm takes an f16 product of `rows` weight rows, `cols` long, for a
    batch of `batch` rows: two or more batch rows, rows % 4 == 0, cols % lanes == 0; else ggml
    runs ggml_vec_dot_f16."""
    return batch >= 2 and rows % 4 == 0 and cols % (lanes or plan().f16_lanes) == 0



@functools.lru_cache(maxsize=1)
def f32_tail_group() -> int:
    """How many of ggml_vec_dot_f32's leftover products the compiler multiplies at once (then
    adds in order; the rest it fuses): 8 or 4, read off ggml_tail_probe.c, the same loop built
    by this machine's compiler as pip builds llama.cpp. 8 (GCC's AVX2/AVX-512 loop with no
    vector epilogue) where the probe cannot be built or shows neither."""
    lib = tail_probe()
    if lib is None:
        return 8
    generator = torch.Generator().manual_seed(0)
    seen = {8: True, 4: True}
    for n in range(1, 16):
        for _ in range(4):
            x, y = torch.randn(2, n, generator=generator).unbind(0)
            x, y = x.contiguous(), y.contiguous()
            got = lib.fb_vec_dot_f32_tail(0, n, ptr(x), ptr(y))
            for group in seen:
                ours = _tail_sum(x, y, group).item()
                seen[group] = seen[group] and ours == got
    return next((group for group in (8, 4) if seen[group]), 8)


def _tail_sum(x: torch.Tensor, y: torch.Tensor, group: int) -> torch.Tensor:
    """`sumf += x[i]*y[i]` in f32 from 0 as the compiler builds it: whole groups of `group`
    products rounded and added in order, the last n mod `group` fused."""
    total = torch.zeros(())
    fused_from = x.shape[0] - x.shape[0] % group
    for k in range(x.shape[0]):
        total = total + x[k] * y[k] if k < fused_from else fma_f32(x[k], y[k], total)
    return total


def dot_vec_f32(a: torch.Tensor, b: torch.Tensor, lanes: int | None = None,
                group: int | None = None) -> torch.Tensor:
    """a [..., P, K] · b [..., Q, K]ᵀ -> [..., P, Q] as ggml_vec_dot_f32 sums each output (f32
    operands, one row, or a product tinyBLAS refuses): the first K - K mod 4·lanes products in
    four `lanes`-lane fma accumulators (GGML_F32_STEP = 4·GGML_F32_EPR), reduced as
    (acc0+acc2) + (acc1+acc3) and across lanes (GGML_F32x8_REDUCE / GGML_F32x16_REDUCE, the
    order ggml_vec_dot_f16 reduces in), held in an f32 `sumf`; then the leftovers in order,
    `sumf += x[i]*y[i]` in f32. How GCC -O3 compiles that loop decides the bits: it multiplies
    whole groups of `group` leftovers at once, each product rounded, and adds them in order; the
    last (leftovers mod `group`) it contracts to one fma each. The group follows the compiler's
    tuning for the CPU (f32_tail_group: 8 on an AMD Zen 4, 4 on a Sapphire Rapids). Measured
    against libggml-cpu for every leftover count 1..63 (tests/test_lora_llamacpp.py)."""
    lanes = lanes or plan().f16_lanes
    group = group or f32_tail_group()
    K, step = a.shape[-1], 4 * lanes
    np_ = K - K % step
    if np_:
        total = dot_f16(a[..., :np_], b[..., :np_], False, lanes)
    else:
        total = torch.zeros(*a.shape[:-1], b.shape[-2])
    fused_from = K - (K - np_) % group
    for k in range(np_, K):
        ak, bk = a[..., :, None, k].float(), b[..., None, :, k].float()
        total = total + ak * bk if k < fused_from else fma_f32(ak, bk, total)
    return total


def matmul_f32(x: torch.Tensor, w: torch.Tensor, lanes: int | None = None) -> torch.Tensor:
    """x [N, K] · w [M, K]ᵀ -> [N, M] as ggml_compute_forward_mul_mat computes an f32 weight
    times f32 activations (vec_dot_type F32: no conversion of x): llamafile's tinyBLAS
    (tinyBLAS<L, __m512/__m256, float>) where llamafile_sgemm takes it (tinyblas_serves: two or
    more rows, M % 4 == 0, K % L == 0), else ggml_vec_dot_f32 per output."""
    lanes = lanes or plan().f16_lanes
    x, w = x.float(), w.float()
    if tinyblas_serves(w.shape[0], w.shape[1], x.shape[0], lanes):
        return dot_f16(x, w, True, lanes)
    return dot_vec_f32(x, w, lanes)

_EXP_CONSTANTS = [
    float.fromhex(h)
    for h in (
        "0x1.715476p+0",
        "0x1.62e4p-1",
        "0x1.7f7d1cp-20",
        "0x1.0e4020p-7",
        "0x1.573e2ep-5",
        "0x1.555e66p-3",
        "0x1.fffdb6p-2",
        "0x1.ffffecp-1",
    )
]


def expf_ggml(x: torch.Tensor, lanes: int = 8) -> torch.Tensor:
    """ggml_v_expf for x <= 0: a range reduction to 2^n·e^b and a degree-5 polynomial, every step
    an f32 or fused operation. The AVX2 + FMA form (lanes=8) ends k·j + k with k = 2^n; the
    AVX-512 form (lanes=16) folds the 1 into the last fma and scales by 2^n (_mm512_scalef_ps,
    exact). Below e^-126 it returns 0 (ggml returns a value under 1e-37, which no f16
    probability or f64 sum can see)."""
    log2e, ln2_hi, ln2_lo, c5, c4, c3, c2, c1 = (
        torch.tensor(c, dtype=torch.float32) for c in _EXP_CONSTANTS
    )
    shifter = torch.tensor(1.5 * 2**23, dtype=torch.float32)
    x = x.float()
    z = fma_f32(x, log2e, shifter)
    n = z - shifter
    b = fma_f32(-n, ln2_lo, fma_f32(-n, ln2_hi, x))
    u = b * b
    if lanes == 16:
        j = fma_f32(
            fma_f32(fma_f32(c5, b, c4), u, fma_f32(c3, b, c2)),
            u,
            fma_f32(c1, b, torch.ones_like(b)),
        )
        value = torch.ldexp(j, n)  # exact: 2^n scaling
    else:
        bits = (z.view(torch.int32).long() << 23) + 0x3F800000  # 2^n as f32 bits
        k = (((bits + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)).int().view(torch.float32)
        j = fma_f32(fma_f32(fma_f32(c5, b, c4), u, fma_f32(c3, b, c2)), u, c1 * b)
        value = fma_f32(j, k, k)
    return torch.where(n.abs() > 126, torch.zeros_like(x), value)


def silu_llamacpp(x: torch.Tensor) -> torch.Tensor:
    """ggml_v_silu as ggml_vec_swiglu_f32 runs it: x / (1 + ggml_v_expf(0 - x)), each step an f32
    operation, with this machine's expf form (AVX2 or AVX-512). Where |n| > 126 (|x| > ~87) ggml
    takes its overflow branch; the engine uses exp in f64 there, which gives the same 0 or x
    after the division up to values no Q8 or f16 activation can hold."""
    x = x.float()
    lanes = plan().softmax_lanes  # ggml_v_silu and ggml_v_expf share the width
    neg = torch.zeros_like(x) - x
    e = torch.where(
        neg.abs() > 87.0, torch.exp(neg.double()).float(), expf_ggml(neg.clamp(-87.0, 87.0), lanes)
    )
    return x / (1.0 + e)


def softmax_ggml(
    scores: torch.Tensor, visible: torch.Tensor, lanes: int | None = None
) -> torch.Tensor:
    """ggml_compute_forward_soft_max_f32 over the last dim (a multiple of `lanes`): exp(x - max)
    by ggml_v_expf, each group of `lanes` summed in f32 (hsum_float_8, or _mm512_reduce_add_ps on
    AVX-512 with DQ) and the groups in f64, then the values times f32(1/sum). Hidden positions
    get exactly 0."""
    lanes = lanes or plan().softmax_lanes
    x = scores.masked_fill(~visible, float("-inf"))
    top = x.amax(-1, keepdim=True)
    exps = expf_ggml(torch.where(visible, x - top, torch.zeros_like(x)), lanes)
    values = torch.where(visible, exps, torch.zeros_like(x))
    groups = hsum(values.reshape(*values.shape[:-1], -1, lanes)).double()  # [..., S/lanes]
    total = torch.zeros(groups.shape[:-1], dtype=torch.float64)
    for g in range(groups.shape[-1]):
        total = total + groups[..., g]
    return values * divide(1.0, total).float()[..., None]


def attention_llamacpp(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """llama.cpp's non-flash attention with an f16 KV cache, summed as ggml sums it.

    q [B,H,T,hd] f32, k/v [B,Hkv,S,hd]: kq = f16(q)·f16(k) (tinyBLAS for a batch of queries,
    ggml_vec_dot_f16 for one), softmax(kq·scale + mask) as ggml_soft_max, then
    f16(probabilities)·f16(v) the same way. Keys are padded with zeros to a multiple of
    ggml_vec_dot_f16's step (llama.cpp pads its cache view to 256; padded keys are masked, so they
    add exact zeros and the dot products have no leftover).
    """
    lanes = plan().f16_lanes
    groups = q.shape[1] // k.shape[1]
    S = k.shape[2]
    pad = -S % (4 * lanes)
    k16, v16 = round_f16(F.pad(k, (0, 0, 0, pad))), round_f16(F.pad(v, (0, 0, 0, pad)))
    visible = F.pad(mask, (0, pad), value=False)
    B, H, T, hd = q.shape
    qg = round_f16(q).reshape(B, k.shape[1], groups * T, hd)  # GQA: heads share k/v
    kq = dot_f16(qg, k16, tinyblas_serves(S + pad, hd, T, lanes), lanes).view(B, H, T, S + pad)
    probs = softmax_ggml(kq * scale, visible)
    out = dot_f16(
        round_f16(probs).reshape(B, k.shape[1], groups * T, S + pad),
        v16.transpose(-1, -2),
        tinyblas_serves(hd, S + pad, T, lanes),
        lanes,
    )
    return out.view(B, H, T, hd)


__all__ = [
    "NUMERICS",
    "cos_sin_f32",
    "divide",
    "round_f16",
    "rsqrt_f32",
    "quantize_q8_0",
    "quantize_q8_k",
    "q8_0_values",
    "q8_k_values",
    "activation_values",
    "gelu_tanh_f32",
    "gelu_table",
    "gelu_llamacpp",
    "silu_llamacpp",
    "fma_f32",
    "hsum8",
    "hsum16",
    "hsum",
    "dot_tinyblas",
    "dot_vec_f16",
    "dot_f16",
    "tinyblas_serves",
    "dot_vec_f32",
    "f32_tail_group",
    "matmul_f32",
    "expf_ggml",
    "softmax_ggml",
    "attention_llamacpp",
]
