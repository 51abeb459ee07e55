"""Which weights the C llama.cpp kernels (ggml_kernels.c) serve bit for bit in this machine's
configuration, and their parts unpacked for them; importable without torch.

engine/kernels/ggml_matmul.py (the torch reference and the torch path's ExactWeight) and
engine/llm/native_lm.py (generation without torch) both read these, so the two paths agree on
which weights run in C and on their layout. `unpack_parts` takes and returns numpy arrays; the
torch path wraps the same memory (torch.from_numpy).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.gguf.constants import type_size
from engine.kernels.cpu import EXACT_KERNEL_TYPES, plan
from engine.kernels.native import WEIGHT_TYPES, Plan, Weight, kernels, ptr

UBATCH = 512  # llama.cpp's default n_ubatch: a longer prompt is evaluated in such pieces
# the quantized types whose llama.cpp kernels are reproduced in C (the weight-layout table's
# "ggml_matmul" rows, engine/gguf/layouts.py)
EXACT_TYPES = tuple(T[name] for name in EXACT_KERNEL_TYPES)


def repacked(ggml_type: T, rows: int, p=None) -> bool:
    """Whether llama.cpp holds this weight repacked (its extra buffer types on, x86: Q4_0 and
    Q4_K matrices whose rows are a multiple of 8; repack.cpp ggml_repack_get_optimal_repack_type)
    in the configuration of the kernel plan (this machine's unless given)."""
    p = p or plan()
    return p.repacked and T(ggml_type) in (T.Q4_0, T.Q4_K) and rows % 8 == 0


def supports_exact(ggml_type: T, rows: int, p=None) -> bool:
    """ggml_matmul has llama.cpp's kernel for these weights in the configuration of the kernel
    plan (this machine's unless given; the repacked Q4_0 gemm is the one it lacks)."""
    ggml_type = T(ggml_type)
    return ggml_type in EXACT_TYPES and not (ggml_type == T.Q4_0 and repacked(ggml_type, rows, p))


def plan_struct(p=None) -> Plan:
    """The C kernels' view of a kernel plan (this machine's unless given)."""
    p = p or plan()
    return Plan(p.f16_lanes, p.softmax_lanes, int(p.repacked))


# per weight type: what the C kernels take unpacked (name, dtype, values per block); the rest
# they read from the GGUF blocks themselves ("blocks")
_K_PARTS = (("scales", np.uint8, 8), ("mins", np.uint8, 8), ("d", np.float32, 1),
            ("dmin", np.float32, 1))
PARTS = {
    T.Q8_0: (("d", np.float32, 1),),
    T.Q5_0: (("d", np.float32, 1),),
    T.Q4_0: (("d", np.float32, 1),),
    T.Q4_1: (("d", np.float32, 1), ("dmin", np.float32, 1)),
    T.Q5_1: (("d", np.float32, 1), ("dmin", np.float32, 1)),
    T.Q4_K: _K_PARTS,
    T.Q5_K: _K_PARTS,
    T.Q6_K: (("q", np.uint8, 256), ("scales", np.int8, 16), ("d", np.float32, 1)),
    T.TQ1_0: (),   # the kernels read the trits and the f16 scale from the blocks
    T.TQ2_0: (),
}


def unpack_parts(raw: np.ndarray, ggml_type: T, rows: int, nthreads: int) -> dict[str, np.ndarray]:
    """The parts the C kernels read (needs the C build): the GGUF blocks (F16 halves as int16;
    Q8_0, Q5_0 and Q4_K blocks, whose bits the kernels unpack in registers) and the parts they
    take unpacked (scales, Q6_K's integers), unpacked in C on `nthreads` threads."""
    ggml_type = T(ggml_type)
    raw = np.ascontiguousarray(raw.reshape(rows, -1))
    if ggml_type == T.F16:
        return {"blocks": raw.view(np.int16)}
    if not PARTS[ggml_type]:
        return {"blocks": raw}
    nblocks = raw.size // type_size(ggml_type)
    parts = {name: np.empty((rows, nblocks // rows * per), dtype=dtype)
             for name, dtype, per in PARTS[ggml_type]}
    kernels().fb_unpack(WEIGHT_TYPES[ggml_type.name], nblocks, ptr(raw),
                        *(ptr(parts[n]) if n in parts else None
                          for n in ("q", "scales", "mins", "d", "dmin")), nthreads)
    if "q" not in parts:
        parts["blocks"] = raw
    return parts


def weight_struct(parts: dict, ggml_type: T, rows: int, cols: int, bias=None,
                  plane2=None) -> Weight:
    """fb_weight over unpack_parts' parts (numpy arrays or torch tensors); they must outlive it.
    `plane2`: a PTQTP weight's second plane (unpack_parts' parts of the same TQ type), whose
    product the kernel adds to the first's."""
    def address(name):
        return ptr(parts[name]) if name in parts else None

    return Weight(WEIGHT_TYPES[T(ggml_type).name], 0, rows, cols,
                  address("blocks") or address("q"), address("scales"),
                  address("mins"), address("d"), address("dmin"),
                  None if bias is None else ptr(bias),
                  None if plane2 is None else ptr(plane2["blocks"]))


__all__ = ["EXACT_TYPES", "PARTS", "UBATCH", "plan_struct", "repacked", "supports_exact",
           "unpack_parts", "weight_struct"]
