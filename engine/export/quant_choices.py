"""The quantizations an export offers, in one list: `forgebench export --dtype`, the picker
(`--compare`) and the export wizard's quantization step all read it.

- llama-quantize's file types (engine/gguf/quant_policy.py FILE_TYPES: f32 ... q8_0), written by
  engine/gguf/convert.py;
- `ptqtp`: PTQTP's two ternary planes (engine/ptqtp, docs/ptqtp.md) for every block projection
  whose rows fill 256-value blocks, the other matrices as Q4_K_M would hold them. The engine runs
  it (generate, chat, the server, the export report); stock llama.cpp does not (it refuses the
  second plane's tensors), so its export has no llama.cpp stage.

`write_export_file` writes one, `estimated_bytes` says how large it will be before it exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType as T

from engine.gguf import quant_policy
from engine.gguf.layouts import PTQTP_2


@dataclass(frozen=True)
class QuantChoice:
    name: str
    quantized: bool         # the weights are quantized (measured against the dense fine-tune)
    llamacpp: bool          # stock llama.cpp loads the file
    description: str


PTQTP = "ptqtp"
PTQTP_OTHERS = "q4_k_m"     # what PTQTP's export does with the matrices it does not decompose

CHOICES: dict[str, QuantChoice] = {
    **{name: QuantChoice(name, quant_policy.DEFAULT_TYPE[ftype] not in quant_policy.FLOAT_TYPES,
                         True, f"llama.cpp {name.upper()}")
       for name, ftype in quant_policy.FILE_TYPES.items()},
    PTQTP: QuantChoice(PTQTP, True, False,
                       "PTQTP: two ternary planes per projection (engine only; llama.cpp "
                       "refuses the file)"),
}
QUANTIZED = tuple(name for name, choice in CHOICES.items() if choice.quantized)


def write_export_file(src: str | Path, dst: str | Path, dtype: str, *, progress=None,
                      threads: int = 1, allow_dequantized: bool = False) -> Path:
    """`src` (a dense GGUF) written as export type `dtype` at `dst`."""
    if dtype == PTQTP:
        from engine.ptqtp.gguf_file import convert_ptqtp

        return convert_ptqtp(src, dst, planes=2, progress=progress, others=PTQTP_OTHERS).path
    from engine.gguf.convert import convert_gguf

    return convert_gguf(src, dst, dtype, progress=progress, threads=threads,
                        allow_dequantized=allow_dequantized).path


def tensor_bytes(shape: tuple[int, ...], kind: T) -> int:
    """Stored bytes of a tensor of `shape` (torch order) and type `kind`."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[kind]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def estimated_bytes(table: list[tuple[str, tuple[int, ...], T]], facts: quant_policy.ModelFacts,
                    dtype: str) -> int:
    """Bytes of tensor data of a model whose tensors are `table` (name, torch-order shape,
    type) exported as `dtype` (metadata not counted)."""
    if dtype != PTQTP:
        plan = quant_policy.plan_types(table, quant_policy.FILE_TYPES[dtype], facts)
        return sum(tensor_bytes(shape, plan[name]) for name, shape, _ in table)
    from engine.gguf.constants import gguf_tensor_name
    from engine.ptqtp.gguf_file import kept_reason

    plan = quant_policy.plan_types(table, quant_policy.FILE_TYPES[PTQTP_OTHERS], facts)
    total = 0
    for name, shape, _ in table:      # a checkpoint's torch names as its GGUF export names them
        if kept_reason(gguf_tensor_name(name) or name, shape, 256) is None:
            total += PTQTP_2.nbytes(shape[0], shape[1])
        else:
            total += tensor_bytes(shape, plan[name])
    return total


def estimated_sizes(table, facts) -> dict[str, int]:
    """estimated_bytes for every choice."""
    return {dtype: estimated_bytes(table, facts, dtype) for dtype in CHOICES}
