"""`forgebench convert`: re-emit, dequantize or quantize a GGUF file.

    forgebench convert FILE.gguf --dtype keep|f32|f16|bf16|q8_0|q4_0|q4_k_s|q4_k_m|q5_k_m|q6_k
                       --out NEW.gguf

`keep` writes the file again unchanged (byte-identical for files laid out as ggml and the `gguf`
package write them). A float dtype turns every matrix weight into that dtype; from a quantized
source this dequantizes and the output records it (`forgebench.dequantized_from` = the source's
SHA-256, `forgebench.dequantized_from_type`), because the rounding of the first quantization
stays in the weights. A quantized dtype follows llama-quantize's per-tensor policy
(quant_policy.py) with ggml's reference quantizers (quantize.py); a source that is already
quantized, or was dequantized from a quantized file, is refused rather than quantized twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, quants
from gguf import LlamaFileType as F

from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.gguf import quant_policy
from engine.gguf.constants import DEQUANTIZED_FROM_KEY, DEQUANTIZED_FROM_TYPE_KEY
from engine.gguf.quantize import quantize
from engine.gguf.writer import GGUFContent, MetaValue, TensorEntry, read_gguf_content, write_gguf

DTYPES = ("keep",) + tuple(quant_policy.FILE_TYPES)
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION, which llama-quantize writes into every output


@dataclass
class ConvertResult:
    path: Path
    dtype: str
    types: Counter            # ggml type name -> tensor count in the output
    dequantized: bool


def _source_type_name(content: GGUFContent) -> str:
    """The source's recipe (general.file_type, e.g. Q4_K_M) when it names a quantized one,
    else the quantized tensor types present (some writers leave file_type at F32)."""
    meta = content.metadata.get("general.file_type")
    try:
        recipe = F(int(meta.value)) if meta is not None else None
    except ValueError:
        recipe = None
    if recipe is not None and recipe not in (F.ALL_F32, F.MOSTLY_F16, F.MOSTLY_BF16):
        return recipe.name.replace("MOSTLY_", "")
    return "+".join(sorted({t.ggml_type.name for t in content.tensors
                            if t.ggml_type not in quant_policy.FLOAT_TYPES}))


def _to_f32(entry: TensorEntry, keep_f16: bool = False) -> np.ndarray:
    """A tensor's values as f32 in torch-order shape (ggml's f16/bf16 -> f32 is exact); with
    `keep_f16`, an f16 tensor's values as they lie in the file (the quantizer widens them row by
    row, where numpy's cast of a whole tensor took longer than quantizing it).

    Float sources are plain numpy casts, so quantizing an f16/bf16 export never loads torch;
    block formats go through the engine's dequantization kernels."""
    data = entry.data() if callable(entry.data) else entry.data
    raw = np.asarray(data, dtype=np.uint8)
    if entry.ggml_type == T.F32:
        values = raw.view(np.float32)
    elif entry.ggml_type == T.F16:
        values = raw.view(np.float16) if keep_f16 else raw.view(np.float16).astype(np.float32)
    elif entry.ggml_type == T.BF16:
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        import torch

        from engine.gguf.dequant import dequantize

        tensor = torch.from_numpy(raw.copy())
        values = dequantize(tensor, entry.ggml_type, entry.shape, name=entry.name).numpy()
    return values.reshape(entry.shape)


def _encode(values: np.ndarray, ggml_type: T) -> np.ndarray:
    if ggml_type == T.F32:
        return values.astype(np.float32)
    if ggml_type == T.F16:
        return values.astype(np.float16)            # round to nearest even, as ggml
    if ggml_type == T.BF16:
        return quants.quantize(values, T.BF16)     # ggml's rounding, NaN kept quiet
    return quantize(values, ggml_type)


def _converted(entry: TensorEntry, target: T) -> TensorEntry:
    if target == entry.ggml_type:
        return entry
    keep_f16 = target not in quant_policy.FLOAT_TYPES      # the quantizers take f16 as it is
    return TensorEntry(entry.name, target, entry.shape,
                       lambda: _encode(_to_f32(entry, keep_f16), target))


def _plane_sum(planes: list[TensorEntry]) -> np.ndarray:
    total = _to_f32(planes[0]).copy()
    for plane in planes[1:]:
        total += _to_f32(plane)
    return total.reshape(-1).view(np.uint8)


def _folded_planes(content: GGUFContent) -> list[TensorEntry]:
    """The tensors with every multi-plane weight (a PTQTP file's `name` + `name.plane2`, the
    weight-layout table's multi-plane rows) as one f32 tensor under `name`, the sum of its
    planes' dequantized values; other tensors as they are. A dense convert writes the weight the
    engine runs, never a plane alone."""
    from engine.gguf.layouts import stored_layout

    names = {t.name: t for t in content.tensors}
    parts: set[str] = set()
    folded = {}
    for t in content.tensors:
        layout = stored_layout(names, t.name, t.ggml_type)
        if layout is None or len(layout.planes) == 1:
            continue
        planes = [names[t.name + suffix] for suffix in layout.planes]
        parts.update(p.name for p in planes[1:])
        folded[t.name] = TensorEntry(t.name, T.F32, t.shape,
                                     lambda planes=planes: _plane_sum(planes))
    return [folded.get(t.name, t) for t in content.tensors if t.name not in parts]


def _refuse_requantization(content: GGUFContent, dtype: str,
                           allow_dequantized: bool = False) -> None:
    quantized = [t for t in content.tensors
                 if t.ggml_type not in quant_policy.FLOAT_TYPES
                 and quant_policy.allows_quantization(t.name, t.shape)]
    hint = ("quantize from the original f16/f32/bf16 GGUF (or the training run's export); "
            "quantizing twice compounds the rounding error")
    if quantized:
        raise ForgebenchError(
            f"the file is already quantized (tensor {quantized[0].name!r} is "
            f"{quantized[0].ggml_type.name}); refusing to quantize it again to {dtype}",
            path=content.path, where=quantized[0].name, hint=hint)
    if DEQUANTIZED_FROM_KEY in content.metadata and not allow_dequantized:
        source = content.metadata[DEQUANTIZED_FROM_KEY].python()
        raise ForgebenchError(
            f"the file was dequantized from a quantized file (sha256 {source[:16]}…); "
            f"refusing to quantize it again to {dtype}",
            path=content.path, where=DEQUANTIZED_FROM_KEY, hint=hint)


def convert_gguf(src: str | Path, dst: str | Path, dtype: str, progress=None, *,
                 allow_dequantized: bool = False, threads: int = 1) -> ConvertResult:
    """Write `src` converted to `dtype` at `dst` (which must not exist), quantizing `threads`
    tensors at a time.

    `allow_dequantized` lets a file marked as dequantized be quantized: `forgebench export` uses
    it for a model merged into an explicitly dequantized base, a new model the user chose to
    build that way (the marker stays in the output's metadata)."""
    src, dst = Path(src), Path(dst)
    dtype = dtype.lower()
    if dtype not in DTYPES:
        raise ForgebenchError(f"unknown --dtype {dtype!r}", where="--dtype",
                              hint="one of " + ", ".join(DTYPES))
    if dst.exists():
        raise ForgebenchError("the output file already exists; refusing to overwrite it",
                              path=dst, where="--out", hint="choose a new name or delete it first")
    content = read_gguf_content(src)
    metadata = dict(content.metadata)
    dequantized = False
    if dtype == "keep":
        tensors = content.tensors
    else:
        ftype = quant_policy.FILE_TYPES[dtype]
        target_is_quantized = quant_policy.DEFAULT_TYPE[ftype] not in quant_policy.FLOAT_TYPES
        if target_is_quantized:
            _refuse_requantization(content, dtype, allow_dequantized)
        stored = {t.name: t.ggml_type for t in content.tensors}
        content = GGUFContent(content.path, content.version, content.metadata,
                              _folded_planes(content))
        facts = quant_policy.ModelFacts.from_metadata(
            {k: v.python() for k, v in metadata.items() if v.type != GGUFValueType.ARRAY})
        plan = quant_policy.plan_types([(t.name, t.shape, t.ggml_type) for t in content.tensors],
                                       ftype, facts)
        tensors = [_converted(t, plan[t.name]) for t in content.tensors]
        dequantized = any(stored[t.name] not in quant_policy.FLOAT_TYPES
                          and plan[t.name] in quant_policy.FLOAT_TYPES for t in content.tensors)
        # a replaced key keeps its position in the file (dict order); new keys go last
        metadata["general.file_type"] = MetaValue(GGUFValueType.UINT32, int(ftype))
        metadata["general.quantization_version"] = MetaValue(GGUFValueType.UINT32,
                                                             QUANTIZATION_VERSION)
        if dequantized:
            metadata[DEQUANTIZED_FROM_KEY] = MetaValue(GGUFValueType.STRING, sha256_file(src))
            metadata[DEQUANTIZED_FROM_TYPE_KEY] = MetaValue(GGUFValueType.STRING,
                                                            _source_type_name(content))
    write_gguf(dst, metadata, tensors, version=content.version, progress=progress,
               threads=threads)
    return ConvertResult(dst, dtype, Counter(t.ggml_type.name for t in tensors), dequantized)
