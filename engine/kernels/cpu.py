"""Which ggml kernels llama.cpp runs on this CPU, in which configuration, and which the engine
reproduces to the bit.

llama.cpp as pip builds it (llama-cpp-python) is compiled with -march=native, so the instruction
set of the machine it was built on picks its kernels at compile time, and each kernel sums in its
own order. A second choice is made when it loads a model: with its extra buffer types on (its
default) ggml repacks Q4_0 and Q4_K matrices whose rows are a multiple of 8 into interleaved
layouts (repack.cpp: q4_0_8x8, q4_K_8x8) and, on a build with AMX-INT8 + AVX512-VNNI, puts the
quantized weights in its AMX buffer; with them off (`use_extra_bufts = false`, what
`llama-server --no-repack` sets) every weight keeps its GGUF layout and ggml_compute_forward_mul_mat
picks: the tiled K-quant matmul (ggml-cpu/tiled) for Q2_K..Q6_K at 8+ batch rows, llamafile's
tinyBLAS for f16/Q8_0/Q5_0/Q4_0 at 2+ rows, the vec_dot loop otherwise. engine/export/llamacpp.py
opens an AMX build without them (its AMX matmul crashes), so the plan follows that
configuration there (`repacked` False, rows named "no extra buffer types (--no-repack)") and the
repacked one everywhere else (`amx_configuration` is the one rule for both).

On x86 the orders that differ between AVX2 and AVX-512 builds:
- f16 tinyBLAS (llamafile/sgemm.cpp): AVX2 8 lanes and hsum(__m256); AVX-512 16 lanes and
  _mm512_reduce_add_ps.
- ggml_vec_dot_f16 (vec.cpp, simd-mappings.h): AVX2 4×8 lanes, 32 per step; AVX-512 4×16 lanes,
  64 per step; the leftover in f64 on both. (With AVX512-FP16 ggml's F16 vectors become __m512h,
  but its dot product keeps the f32 accumulators, GGML_F16_DOT_*: the same 4×16 order.)
- ggml_vec_soft_max_f32 + ggml_v_expf (vec.cpp, vec.h): AVX2 8 lanes and k·j + k; AVX-512 (with
  DQ) 16 lanes and scalef(j, n).
Everything else the engine claims is the same on both: the Q8_0/Q8_K activation quantizers, the
Q8_0/Q5_0/Q4_0 vec_dot and tinyBLAS_Q0_AVX (VNNI only changes how the exact integers are formed),
the repacked Q4_K 8x8 gemm (its AVX-512 BW/DQ branch keeps one fma per 64) and gemv,
vec_dot_q4_K/q5_K/q6_K_q8_K (AVX2 code, no AVX-512 variant), the tiled microtiles, RMSNorm, GELU's
table and RoPE's libm cosf/sinf. (The AVX512-VNNI microtile of tiled/tiled-kernel.cpp writes its
epilogue as _mm512_add_ps(p, _mm512_mul_ps(r, d_x)), but GCC compiles C++ with -ffp-contract=fast
and fuses it into the same fma(r, d_x, p) that the AVX2 microtile writes out; and ggml's C files
are gnu11, so vec_dot_q5_K's `summs += dmin * sum` is one fma too. Both checked against
libggml-cpu's own functions: tests/test_ggml_kernels.py.)

Not reproduced, said so by `plan()`: CPUs without AVX2/FMA/F16C or not x86 (ARM NEON, SVE, ...);
an AMX build opened with its extra buffer types (AMX tile kernels; open_llama never does); the
repacked q4_0_8x8 kernels; BF16 weights (no kernels for them here).

The features come from cpuid through the C build (ggml_kernels.c: cpu_features, with XCR0 as GCC's
-march=native reads it); without a C compiler, from /proc/cpuinfo. FORGEBENCH_SIMD=avx2 drops the
AVX-512 and AMX features (`as_forced`), for checking the AVX2 orders against a llama.cpp built
with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" on an
AVX-512 machine (docs/numerics.md says how). The same switch makes the rest of a process compute
as an AVX2-only CPU would: the inference kernels (native.kernels) and the training passes
(native.train_kernels) are both built for AVX2 (-march=x86-64-v3),
precision "auto" sees no bf16 units (engine.train.precision), and, set before the process starts,
torch's own libraries are capped at AVX2 (engine/__init__.py), so a benchmark can measure an
AVX2 machine's path on an AVX-512 one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ForgebenchError
from engine.gguf.layouts import BLOCK_LAYOUTS

# bit i of ggml_kernels.c cpu_features() -> the flag's name in /proc/cpuinfo
FEATURE_BITS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512vbmi",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_int8",
)
SIMD_CHOICES = ("native", "avx2")
# weight types the engine follows only to f32 rounding in every configuration (plan().rounding_types
# adds those not reproduced in this machine's configuration)
ROUNDING_WEIGHT_TYPES = ("BF16",)
# quantized weight types whose llama.cpp kernels ggml_matmul reproduces (the layout table's
# "ggml_matmul" rows), where this machine's configuration runs them
EXACT_KERNEL_TYPES = tuple(layout.name for layout in BLOCK_LAYOUTS
                           if layout.llamacpp == "ggml_matmul")
# ggml's AMX buffer (ggml-cpu/amx: qtype_has_amx_kernels) takes no ternary weights: they stay in
# host memory on the vec_dot kernel whatever the configuration
TERNARY_TYPES = ("TQ1_0", "TQ2_0")
EXACT = "bit-exact"
ROUNDING = "f32 rounding"
REPACKED = "repacked (llama.cpp's default extra buffer types)"
NO_REPACK = "no extra buffer types (--no-repack)"


@dataclass(frozen=True)
class Kernel:
    """One row of the plan: a kernel family, whether the engine matches it to the bit, and why."""

    name: str
    status: str  # EXACT or ROUNDING
    detail: str


@dataclass(frozen=True)
class KernelPlan:
    """The summation orders the engine follows to agree with llama.cpp built for `features`, in
    the configuration llama.cpp runs in (`repacked`: its extra buffer types on)."""

    features: frozenset[str]
    source: str  # where the features were read: cpuid, /proc/cpuinfo, none
    forced: str | None  # FORGEBENCH_SIMD, when set
    f16_lanes: int = 8  # tinyBLAS KN and ggml_vec_dot_f16's lanes per register
    softmax_lanes: int = 8  # ggml_vec_soft_max_f32's vector width (and its expf form)
    repacked: bool = True  # False: llama.cpp opened without extra buffer types (AMX builds)
    kernels: tuple[Kernel, ...] = field(default=())

    @property
    def x86_exact(self) -> bool:
        """The engine reproduces llama.cpp's x86 kernels here (AVX2 + FMA + F16C present)."""
        return {"avx2", "fma", "f16c"} <= self.features

    @property
    def quantized_exact(self) -> bool:
        """The quantized matmuls of the configuration llama.cpp runs in are reproduced."""
        return self.x86_exact

    @property
    def configuration(self) -> str:
        """How llama.cpp holds the weights here: REPACKED or NO_REPACK."""
        return REPACKED if self.repacked else NO_REPACK

    @property
    def isa(self) -> str:
        if not self.x86_exact:
            return "not reproduced"
        return "AVX-512" if self.f16_lanes == 16 else "AVX2"

    def exact_weight(self, ggml_type: str, rows: int) -> bool:
        """Whether the engine reproduces llama.cpp's matmul with these weights bit for bit here:
        repacked Q4_0 (rows % 8 == 0, extra buffer types on), BF16 and anything under AMX tiles
        are not; every other type the plan lists is."""
        if not self.x86_exact or ggml_type in ROUNDING_WEIGHT_TYPES:
            return False
        if self.amx_tiles:
            return ggml_type in ("F16", *TERNARY_TYPES)
        if ggml_type == "Q4_0":
            return not (self.repacked and rows % 8 == 0)
        return ggml_type == "F16" or ggml_type in EXACT_KERNEL_TYPES

    @property
    def amx_tiles(self) -> bool:
        """An AMX build with its extra buffer types on: ggml's AMX tile kernels take the
        quantized matmuls (not reproduced; open_llama never opens it so)."""
        return self.repacked and amx_configuration(self.features)

    @property
    def rounding_types(self) -> tuple[str, ...]:
        """Weight types matched only to f32 rounding here (Q4_0: where its rows are a multiple
        of 8 and llama.cpp repacks it)."""
        quantized = EXACT_KERNEL_TYPES
        if not self.x86_exact:
            return ("F16", *quantized, *ROUNDING_WEIGHT_TYPES)
        if self.amx_tiles:
            return (*(t for t in quantized if t not in TERNARY_TYPES), *ROUNDING_WEIGHT_TYPES)
        return (("Q4_0",) if self.repacked else ()) + ROUNDING_WEIGHT_TYPES

    def summary(self) -> str:
        """One line for reports and the export wizard."""
        if not self.x86_exact:
            return (
                f"llama.cpp numerics: this CPU's ggml kernels ({platform.machine() or 'unknown'}) "
                "are not reproduced; the engine agrees with llama.cpp to f32 rounding, "
                "not to the bit"
            )
        exact = sum(k.status == EXACT for k in self.kernels)
        forced = f", forced by FORGEBENCH_SIMD={self.forced}" if self.forced else ""
        return (
            f"llama.cpp numerics: {self.isa} kernel orders, {self.configuration}{forced}; "
            f"{exact} of {len(self.kernels)} kernel families bit-exact, the rest to f32 rounding "
            "(forgebench doctor lists them)"
        )


def _from_cpuid() -> frozenset[str] | None:
    from engine.kernels.native import kernels  # here: this module stays importable without torch

    lib = kernels()
    if lib is None:
        return None
    bits = int(lib.cpu_features())
    return frozenset(name for i, name in enumerate(FEATURE_BITS) if bits >> i & 1)


def _from_proc_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split()) & frozenset(FEATURE_BITS)
    return None


@functools.lru_cache(maxsize=1)
def detected() -> tuple[frozenset[str], str]:
    """This machine's features and where they were read."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return frozenset(), "none (not x86)"
    found = _from_cpuid()
    if found is not None:
        return found, "cpuid"
    found = _from_proc_cpuinfo()
    if found is not None:
        return found, "/proc/cpuinfo"
    return frozenset(), "none (no C compiler and no /proc/cpuinfo)"


def forced_simd() -> str | None:
    value = os.environ.get("FORGEBENCH_SIMD", "").strip().lower()
    if not value or value == "native":
        return None
    if value not in SIMD_CHOICES:
        raise ForgebenchError(
            f"FORGEBENCH_SIMD={value!r} is not one of {', '.join(SIMD_CHOICES)}",
            where="environment",
            hint="unset it, or set it to avx2",
        )
    return value


def as_forced(features: frozenset[str], forced: str | None) -> frozenset[str]:
    """The features an x86 CPU of the `forced` kind has (FORGEBENCH_SIMD): under "avx2" the
    AVX-512 and AMX ones dropped, else `features` as they are."""
    if forced == "avx2":
        return frozenset(f for f in features if not f.startswith(("avx512", "amx")))
    return features


def amx_configuration(features: frozenset[str]) -> bool:
    """Whether llama.cpp as pip builds it for these features has ggml's AMX kernels (AMX-INT8 with
    AVX512-VNNI: ggml-cpu compiles them in only then), so that engine/export/llamacpp.py opens it
    without extra buffer types (its AMX matmul crashes; llama.cpp issue #20824)."""
    return {"amx_int8", "avx512_vnni"} <= features


def plan_for(
    features: frozenset[str],
    source: str = "given",
    forced: str | None = None,
    repacked: bool | None = None,
) -> KernelPlan:
    """The kernel plan for llama.cpp compiled for these features (cpuinfo flag names), with its
    extra buffer types on (`repacked`) or off; by default as engine/export/llamacpp.py opens it:
    off on an AMX build, on everywhere else."""
    features = as_forced(features, forced)
    avx512 = "avx512f" in features
    f16_lanes = 16 if avx512 else 8
    softmax_lanes = 16 if avx512 and "avx512dq" in features else 8
    amx = amx_configuration(features)
    if repacked is None:
        repacked = not amx
    base = KernelPlan(features, source, forced, f16_lanes, softmax_lanes, repacked)
    if not base.x86_exact:
        rows = (
            Kernel(
                "all kernels",
                ROUNDING,
                "ggml's kernels for this CPU are not reproduced "
                "(the engine follows x86 AVX2 / AVX-512 builds only)",
            ),
        )
        return KernelPlan(**{**base.__dict__, "kernels": rows})
    if repacked:
        where = ("AMX build opened with its defaults: ggml's AMX tile kernels, not reproduced"
                 if amx else "")
        q4_k = ("repacked q4_K_8x8 where rows % 8 == 0 (gemm one fma per 64, gemv one per 256); "
                "other row counts as without repacking: tiled for 8+ rows, vec_dot_q4_K_q8_K")
        q4_0 = "repacked q4_0_8x8 (rows % 8 == 0) not reproduced; other row counts as Q8_0"
    else:
        where = ""
        q4_k = ("not repacked: tiled K-quant matmul for 8+ rows (per 256 fnmadd(dmin, mins, "
                "d·dot), then fma with d_x), vec_dot_q4_K_q8_K for fewer (8 lanes + 4 min lanes)")
        q4_0 = "not repacked: vec_dot_q4_0_q8_0 and tinyBLAS_Q0_AVX, the Q8_0 order"
    quantized = ROUNDING if where else EXACT

    def note(detail: str) -> str:
        return f"{detail} ({where})" if where else detail

    rows = (
        Kernel(
            "Q8_0 / Q8_K activation quantizers",
            EXACT,
            "quantize_row_q8_0 / q8_K (AVX2 path on every x86)",
        ),
        Kernel(
            "Q8_0, Q5_0 weights",
            quantized,
            note("vec_dot and tinyBLAS_Q0_AVX: 8 lanes of 4 products, one fma per block"),
        ),
        Kernel("Q4_K weights", quantized, note(q4_k)),
        Kernel(
            "Q5_K, Q6_K weights",
            quantized,
            note("never repacked on x86: tiled K-quant microtile for 8+ rows (Q6_K "
                 "fma(d_w·dot, d_x, acc), Q5_K as Q4_K), vec_dot_q5_K / q6_K_q8_K for fewer"),
        ),
        Kernel(
            "f16 weights and attention (K·Q, V·softmax)",
            EXACT,
            f"tinyBLAS {f16_lanes} lanes for 2+ rows, ggml_vec_dot_f16 4×{f16_lanes} lanes for one",
        ),
        Kernel(
            "LoRA adapter products (F32 A and B)",
            EXACT,
            f"a GGUF LoRA's A and B (F32): tinyBLAS {f16_lanes} lanes for 2+ rows (rows % 4, "
            f"cols % {f16_lanes}), else ggml_vec_dot_f32 4×{f16_lanes} lanes and its leftovers "
            "in f32 (whole groups multiplied then added, the rest fma, the group as this "
            "machine's compiler builds ggml's loop: numerics.f32_tail_group)",
        ),
        Kernel("softmax", EXACT, f"ggml_v_expf, {softmax_lanes}-lane sums in f32, groups in f64"),
        Kernel(
            "RMSNorm, GELU table, RoPE",
            EXACT,
            "f64 sum of squares; ggml_table_gelu_f16; libm cosf/sinf",
        ),
        Kernel(
            "Q4_0 weights",
            ROUNDING if repacked else quantized,
            note(q4_0),
        ),
        Kernel(
            "Q4_1, Q5_1 weights",
            quantized,
            note("vec_dot_q4_1 / q5_1_q8_1 at every batch size (no tinyBLAS, repacked or tiled "
                 "kernel for them): Q8_1 activations, 8 lanes fma(d_w·d_x), min part "
                 "fma(m_w, s_x) in one scalar"),
        ),
        Kernel(
            "TQ1_0, TQ2_0 (ternary) weights",
            EXACT,
            "vec_dot_tq1_0 / tq2_0_q8_K at every batch size (never repacked, tiled or under "
            "AMX): 8 lanes of the stored trits (+1) times Q8_K minus the 32-sums, one fma per "
            "256, hsum_float_8; PTQTP's 2-plane weights: plane 1 + plane 2 per output, each so "
            "(llama.cpp does not load the second plane)",
        ),
        Kernel(
            "BF16 weights",
            ROUNDING,
            "not implemented: tinyBLAS and ggml_vec_dot_bf16 (vdpbf16ps on AVX512-BF16 builds, "
            "8- or 16-lane f32 sums elsewhere) have no counterpart in the engine",
        ),
    )
    return KernelPlan(**{**base.__dict__, "kernels": rows})


@functools.lru_cache(maxsize=1)
def plan() -> KernelPlan:
    """The plan for this machine (FORGEBENCH_SIMD applied)."""
    features, source = detected()
    return plan_for(features, source, forced_simd())


def describe(p: KernelPlan | None = None) -> list[str]:
    """The lines `forgebench doctor` prints under its numerics heading."""
    p = p or plan()
    shown = " ".join(f for f in FEATURE_BITS if f in p.features) or "none"
    lines = [
        f"cpu: {platform.machine()} ({p.source}): {shown}",
        f"kernel orders followed: {p.isa}" + (f" (FORGEBENCH_SIMD={p.forced})" if p.forced else ""),
        f"llama.cpp configuration matched: {p.configuration}"
        + ("" if p.repacked else
           " — how engine/export/llamacpp.py opens an AMX build (llama-server --no-repack)"),
    ]
    width = max(len(k.name) for k in p.kernels)
    lines += [f"  {k.name:<{width}}  {k.status:<12}  {k.detail}" for k in p.kernels]
    if p.x86_exact:
        lines.append(
            "bit-exact assumes llama.cpp was built on this machine for it (pip's default, "
            "-march=native) and opened in the configuration above (engine/export/llamacpp.py "
            "open_llama); a build for another instruction set sums in its own order"
        )
    return lines


__all__ = [
    "EXACT",
    "NO_REPACK",
    "REPACKED",
    "amx_configuration",
    "FEATURE_BITS",
    "Kernel",
    "KernelPlan",
    "ROUNDING",
    "ROUNDING_WEIGHT_TYPES",
    "as_forced",
    "describe",
    "detected",
    "forced_simd",
    "plan",
    "plan_for",
]


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch at `count` CPU threads for the block, the count it found restored after (also when
    the block raises). torch is imported here, not with the module: the plan is read by
    processes that never load torch."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
