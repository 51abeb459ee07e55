"""A PTQTP model as a GGUF file, and `forgebench convert SRC --dtype ptqtp`.

The file (documented in docs/ptqtp.md):

- every decomposed matrix keeps its name (`blk.N.attn_q.weight`) and holds plane 1 as llama.cpp's
  TQ2_0 (256-element blocks: 64 bytes of 2-bit trits, then one f16 scale = that group's α¹) or,
  with `--ternary tq1_0`, TQ1_0 (the same block and scale, 5 trits a byte: 54 bytes);
- a 2-plane file adds `blk.N.attn_q.weight.plane2`, same shape and type, holding α²·T². The
  weight is the sum of the two tensors: W ≈ plane1 + plane2.
- metadata: `ptqtp.planes` (1|2), `ptqtp.group` (256, or 0 for one scale per row),
  `ptqtp.version` (1), `ptqtp.source_sha256`, `ptqtp.method` ("ptqtp"; "absmean" for the
  round-to-nearest baseline), and the convert's `forgebench.dequantized_from*`
  keys when the source was quantized. `general.file_type` is MOSTLY_TQ2_0 (MOSTLY_TQ1_0).
  With an importance (activation-aware fit, engine/ptqtp/imatrix.py) also
  `ptqtp.imatrix.dataset`, `.text_sha256`, `.tokens` and `.chunks_count` (what it was
  calibrated on); `ptqtp.importance` is "imatrix" then, "none" without one, and
  `ptqtp.error_feedback` "gptq" when the importance held the decomposed matrices' input
  covariances (the fit moved each column's error onto the later columns), else "none".

A 1-plane file is a plain llama.cpp model (stock llama.cpp loads and runs it); a 2-plane file is
read by the engine (engine/ptqtp/weight.py) and by the `gguf` package, but llama.cpp refuses it
(it counts the extra `.plane2` tensors as unknown).

Tensor policy (as llama-quantize's for TQ2_0, but never re-quantizing what the source holds):
only the 2-D projection weights of the decoder blocks (attn_q/k/v/output, ffn_gate/up/down) whose
row length is a multiple of 256 are decomposed; the token embedding, the output head, norms,
biases and every other tensor are copied from the source unchanged (their type and bytes), and so
are projections whose rows TQ2_0 cannot hold (gemma-3-270m's 640-wide rows). The report beside
the file (`F.gguf.ptqtp.json`) lists every tensor: decomposed (relative Frobenius error of each
plane count) or kept, and why.

Size budget (`max_bytes`, `forgebench convert --max-size MB`): the projections PTQTP cannot take
are the ones whose type decides the file's size beside the planes (gemma-3-270m: q/k/v/gate/up,
Q5_0/Q8_0 in the shipped Q4_K_M, 45 MB of a 245 MB file). With a budget they step down, one
tensor one step at a time, along `DEMOTIONS` (Q8_0 -> Q5_0 -> Q4_0; llama.cpp's Q3_K_M holds
gemma's 640-wide rows as Q4_0), always taking the step that adds the least error per byte
saved, until the file fits: the error of a tensor is its relative error against the source,
squared, weighted by the importance when there is one (‖(W − Ŵ)·diag(√h)‖² / ‖W·diag(√h)‖²:
the share of the layer's output lost). Every projection PTQTP can take stays PTQTP. The size
is exact (header and padding included), known before anything is written; the report's
`budget` lists each step and every kept tensor's final type.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType
from gguf import LlamaFileType as F

from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.gguf.constants import DEQUANTIZED_FROM_KEY, DEQUANTIZED_FROM_TYPE_KEY, QK_K
from engine.gguf.layouts import PTQTP_2
from engine.gguf.writer import MetaValue, TensorEntry, read_gguf_content, write_gguf
from engine.ptqtp.decompose import (
    Decomposition,
    absmean_ternary,
    decompose,
    output_error,
    relative_error,
)

PLANE2_SUFFIX = PTQTP_2.planes[1]      # ".plane2" (the weight-layout table's PTQTP row)
PLANES_KEY, GROUP_KEY, VERSION_KEY = "ptqtp.planes", "ptqtp.group", "ptqtp.version"
SOURCE_KEY, METHOD_KEY = "ptqtp.source_sha256", "ptqtp.method"
IMPORTANCE_KEY, IMATRIX_PREFIX = "ptqtp.importance", "ptqtp.imatrix."
FEEDBACK_KEY = "ptqtp.error_feedback"       # "gptq" where the fit used the inputs' covariance
FORMAT_VERSION = 1
TQ2_0_BYTES, TQ1_0_BYTES = 66, 54
PROJECTION = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)"
                        r"\.weight$")
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
DEMOTIONS = (T.Q5_0, T.Q4_0)      # what a kept projection may step down to, in this order


def pack_tq2_0(trits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """trits int8 [rows, cols] in {−1,0,1}, scales [rows, cols/256] (one per 256-block) -> the
    TQ2_0 bytes uint8 [rows, cols/256·66], laid out as ggml's block_tq2_0."""
    rows, cols = trits.shape
    if cols % QK_K:
        raise ValueError(f"TQ2_0 needs rows that are a multiple of {QK_K}, not {cols}")
    nb = cols // QK_K
    q = (trits.astype(np.int16) + 1).astype(np.uint8).reshape(rows * nb, 2, 4, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    d = np.asarray(scales, dtype=np.float16).reshape(rows * nb, 1).view(np.uint8)
    return np.concatenate([qs.reshape(rows * nb, 64), d], axis=1).reshape(rows, nb * TQ2_0_BYTES)


_TQ1_0_WEIGHTS = np.array([81, 27, 9, 3, 1], dtype=np.int32)


def pack_tq1_0(trits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """trits int8 [rows, cols] in {−1,0,1}, scales [rows, cols/256] -> the TQ1_0 bytes uint8
    [rows, cols/256·54], laid out as ggml's block_tq1_0: elements 0..159 five to a byte (byte n
    holds n, 32 + n, ..., 128 + n), 160..239 five to a byte (16 bytes), 240..255 four to a byte
    (4 bytes), each byte ceil(256·q/243) for q = Σ (t_k + 1)·3^(4-k); then the f16 scale."""
    rows, cols = trits.shape
    if cols % QK_K:
        raise ValueError(f"TQ1_0 needs rows that are a multiple of {QK_K}, not {cols}")
    nb = cols // QK_K
    q = (trits.astype(np.int32) + 1).reshape(rows * nb, QK_K)
    qs0 = (q[:, :160].reshape(-1, 5, 32) * _TQ1_0_WEIGHTS[None, :, None]).sum(1)
    qs1 = (q[:, 160:240].reshape(-1, 5, 16) * _TQ1_0_WEIGHTS[None, :, None]).sum(1)
    qh = (q[:, 240:].reshape(-1, 4, 4) * _TQ1_0_WEIGHTS[None, :4, None]).sum(1)
    packed = np.concatenate([qs0, qs1, qh], axis=1)
    packed = ((packed * 256 + 242) // 243).astype(np.uint8)
    d = np.asarray(scales, dtype=np.float16).reshape(rows * nb, 1).view(np.uint8)
    return np.concatenate([packed, d], axis=1).reshape(rows, nb * TQ1_0_BYTES)


PACKERS = {T.TQ2_0: pack_tq2_0, T.TQ1_0: pack_tq1_0}
PLANE_TYPES = {"tq2_0": T.TQ2_0, "tq1_0": T.TQ1_0}     # --ternary
FILE_TYPE = {T.TQ2_0: F.MOSTLY_TQ2_0, T.TQ1_0: F.MOSTLY_TQ1_0}


def plane_bytes(dec: Decomposition, p: int, plane_type: T = T.TQ2_0) -> np.ndarray:
    """Plane p of a decomposition as TQ2_0 or TQ1_0 bytes (a per-row scale is repeated in
    every block)."""
    scales = dec.scales[p].numpy()
    if dec.group != QK_K:
        scales = np.repeat(scales, dec.group // QK_K, axis=1) if dec.group % QK_K == 0 \
            else None
    if scales is None:
        raise ValueError(f"a group of {dec.group} does not fill whole 256-element blocks")
    return PACKERS[plane_type](dec.planes[p].numpy(), scales)


@dataclass
class PtqtpResult:
    path: Path
    report_path: Path
    types: Counter
    dequantized: bool
    report: dict


def _others_plan(content, others: str) -> dict[str, T]:
    """Target types of the float tensors PTQTP keeps, under llama-quantize's recipe `others`
    ({} for "keep")."""
    from engine.gguf import quant_policy

    if others == "keep":
        return {}
    if others not in quant_policy.FILE_TYPES:
        raise ValueError(f"others={others!r}: 'keep' or a file type")
    facts = quant_policy.ModelFacts.from_metadata(
        {k: v.python() for k, v in content.metadata.items()
         if v.type != GGUFValueType.ARRAY})
    plan = quant_policy.plan_types([(t.name, t.shape, t.ggml_type) for t in content.tensors],
                                   quant_policy.FILE_TYPES[others], facts)
    return {t.name: plan[t.name] for t in content.tensors if t.ggml_type in FLOAT_TYPES}


def decomposable_names(src: str | Path) -> set[str]:
    """The tensors of `src` a PTQTP convert decomposes (its block projections with rows of a
    multiple of 256)."""
    return {t.name for t in read_gguf_content(src).tensors
            if kept_reason(t.name, tuple(t.shape), QK_K) is None}


def kept_reason(name: str, shape: tuple[int, ...], group: int | None) -> str | None:
    """None if the tensor is decomposed, else why it is kept."""
    if not PROJECTION.match(name):
        return "not a block projection (embeddings, output head, norms stay as the source)"
    if len(shape) != 2 or shape[-1] % QK_K:
        return f"rows of {shape[-1]} values are not a multiple of TQ2_0's {QK_K}-value block"
    return None


def _check_options(dst: Path, planes: int, group: int | None, method: str,
                   plane_type: T) -> None:
    """Refuses a plane type, plane count, method or group the format cannot hold, and an
    existing output file."""
    if plane_type not in PACKERS:
        raise ValueError(f"planes are TQ2_0 or TQ1_0, not {plane_type.name}")
    if planes not in (1, 2):
        raise ForgebenchError(f"--planes must be 1 or 2, not {planes}", where="--planes",
                              hint="2 (the PTQTP model) or 1 (a file stock llama.cpp runs)")
    if method not in ("ptqtp", "absmean") or (method == "absmean" and planes != 1):
        raise ValueError(f"method {method!r} with {planes} planes")
    if group is not None and group != QK_K:
        raise ForgebenchError(f"--group {group} cannot be stored as {T(plane_type).name}",
                              where="--group",
                              hint="256 (one scale per 256-value block) or 'row'")
    if dst.exists():
        raise ForgebenchError("the output file already exists; refusing to overwrite it",
                              path=dst, where="--out", hint="choose a new name or delete it first")


def _check_importance(importance, entry: TensorEntry, src: Path) -> None:
    """Refuses an importance that lacks a decomposed matrix or has the wrong length for it."""
    values = importance.values.get(entry.name)
    if values is None:
        raise ForgebenchError("the importance (imatrix) has no entry for this matrix",
                              path=src, where=entry.name,
                              hint="collect it from this model (engine/ptqtp/imatrix.py)")
    if np.shape(values) != (entry.shape[-1],):
        raise ForgebenchError(f"the importance holds {np.shape(values)} values for rows of "
                              f"{entry.shape[-1]}", path=src, where=entry.name,
                              hint="collect it from this model (engine/ptqtp/imatrix.py)")


def _set_ptqtp_metadata(metadata: dict, plane_type: T, planes: int, group: int | None,
                        method: str, src_sha: str, dequantized_from_type: str | None,
                        importance=None) -> None:
    """The PTQTP keys (and llama.cpp's file type) of the output; a quantized source's type
    is recorded when its matrices were dequantized before the decomposition, and the
    calibration of an activation-aware fit."""
    metadata["general.file_type"] = MetaValue(GGUFValueType.UINT32, int(FILE_TYPE[plane_type]))
    metadata["general.quantization_version"] = MetaValue(GGUFValueType.UINT32, 2)
    metadata[PLANES_KEY] = MetaValue(GGUFValueType.UINT32, planes)
    metadata[GROUP_KEY] = MetaValue(GGUFValueType.UINT32, 0 if group is None else group)
    metadata[VERSION_KEY] = MetaValue(GGUFValueType.UINT32, FORMAT_VERSION)
    metadata[SOURCE_KEY] = MetaValue(GGUFValueType.STRING, src_sha)
    metadata[METHOD_KEY] = MetaValue(GGUFValueType.STRING, method)
    metadata[IMPORTANCE_KEY] = MetaValue(GGUFValueType.STRING,
                                         "none" if importance is None else "imatrix")
    if importance is not None:
        metadata[FEEDBACK_KEY] = MetaValue(GGUFValueType.STRING,
                                           "gptq" if importance.covariances else "none")
        metadata[IMATRIX_PREFIX + "dataset"] = MetaValue(GGUFValueType.STRING, importance.dataset)
        metadata[IMATRIX_PREFIX + "text_sha256"] = MetaValue(GGUFValueType.STRING,
                                                             importance.text_sha256)
        metadata[IMATRIX_PREFIX + "tokens"] = MetaValue(GGUFValueType.UINT32, importance.tokens)
        metadata[IMATRIX_PREFIX + "chunks_count"] = MetaValue(GGUFValueType.UINT32,
                                                              importance.chunks)
    if dequantized_from_type is not None:
        metadata[DEQUANTIZED_FROM_KEY] = MetaValue(GGUFValueType.STRING, src_sha)
        metadata[DEQUANTIZED_FROM_TYPE_KEY] = MetaValue(GGUFValueType.STRING,
                                                        dequantized_from_type)


def _report_row(entry: TensorEntry, w: np.ndarray, dec: Decomposition, planes: int,
                seconds: float, importance: np.ndarray | None = None,
                hessian: np.ndarray | None = None) -> dict:
    """One decomposed tensor's report: its error after plane 1 and after all planes (and,
    with an importance, the error weighted by it: what the fit minimised; with a hessian, the
    relative output error over the calibration inputs, what the error feedback minimised)."""
    one = dec.plane_dense(0)
    row = {"name": entry.name, "shape": list(entry.shape),
           "source_type": entry.ggml_type.name, "planes": planes,
           "rel_error_plane1": relative_error(w, one), "seconds": round(seconds, 3),
           "rounds": max(0, len(dec.history) - 1)}
    if planes == 2:
        row["rel_error"] = relative_error(w, one + dec.plane_dense(1))
    else:
        row["rel_error"] = row["rel_error_plane1"]
    if importance is not None:
        row["rel_error_weighted"] = relative_error(w, dec.dense(), importance)
    if hessian is not None:
        row["rel_error_output"] = output_error(w, dec.dense(), hessian)
        row["error_feedback"] = True
    return row


def file_bytes(metadata: dict, tensors: list[TensorEntry], version: int) -> int:
    """The exact size of the GGUF file these would write (header, tensors, padding)."""
    from engine.gguf.writer import _alignment, _pad, encode_header

    align = _alignment(metadata)
    return len(encode_header(metadata, tensors, version)) + sum(
        t.n_bytes + _pad(t.n_bytes, align) for t in tensors)


def _bits(kind: T) -> float:
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[kind]
    return 8 * size / block


def _demotion_ladder(entry: TensorEntry, importance) -> list[tuple[T, float]]:
    """(type, weighted relative error², against the source) for the source type and every
    `DEMOTIONS` type of fewer bits that can hold the rows, in decreasing bits."""
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES

    from engine.gguf.convert import _encode, _to_f32

    ladder = [(entry.ggml_type, 0.0)]
    steps = [k for k in DEMOTIONS if _bits(k) < _bits(entry.ggml_type)
             and entry.shape[-1] % GGML_QUANT_SIZES[k][0] == 0]
    if not steps:
        return ladder
    w = _to_f32(entry).reshape(entry.shape).astype(np.float64)
    h = None if importance is None else importance.values.get(entry.name)
    root = np.ones(entry.shape[-1]) if h is None else np.sqrt(np.asarray(h, dtype=np.float64))
    norm = float(np.square(w * root).sum())
    for kind in sorted(steps, key=_bits, reverse=True):
        approx = quants.dequantize(_encode(w.astype(np.float32), kind), kind)
        err = float(np.square((w - approx.reshape(w.shape)) * root).sum())
        ladder.append((kind, err / norm if norm > 0 else err))
    return ladder


def fit_budget(kept: list[TensorEntry], size_of, max_bytes: int, importance=None
               ) -> tuple[dict[str, T], list[dict]]:
    """The types of the kept projections that bring `size_of(types)` (the file's size with
    those types) within `max_bytes`: greedy steps of least added error per byte saved (module
    docstring) -> (name -> type for every stepped tensor, the steps in order)."""
    ladders = {e.name: _demotion_ladder(e, importance) for e in kept}
    ladders = {n: lad for n, lad in ladders.items() if len(lad) > 1}
    shapes = {e.name: e.shape for e in kept}
    at = {n: 0 for n in ladders}
    types: dict[str, T] = {}
    steps: list[dict] = []
    size = size_of(types)
    while size > max_bytes:
        best = None
        for name, lad in ladders.items():
            i = at[name]
            if i + 1 >= len(lad):
                continue
            n = int(np.prod(shapes[name]))
            saved = n * (_bits(lad[i][0]) - _bits(lad[i + 1][0])) / 8
            cost = max(lad[i + 1][1] - lad[i][1], 0.0) / saved
            if best is None or cost < best[0]:
                best = (cost, name)
        if best is None:
            raise ForgebenchError(
                f"the file needs {size / 1e6:.1f} MB even with every kept projection at "
                f"{DEMOTIONS[-1].name}, over the {max_bytes / 1e6:.1f} MB budget",
                where="--max-size", hint="allow a larger file, or TQ1_0 planes (--ternary tq1_0)")
        name = best[1]
        at[name] += 1
        kind, err = ladders[name][at[name]]
        types[name] = kind
        size = size_of(types)
        steps.append({"name": name, "type": kind.name, "rel_error_weighted": err ** 0.5,
                      "file_mb": round(size / 1e6, 4)})
    return types, steps


def _write_report(report_path: Path, report: dict) -> None:
    """Written beside and then renamed, so a reader never sees half a report."""
    tmp = report_path.with_name(report_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(report_path)


def _apply_budget(content, tensors: list[TensorEntry], metadata: dict, rows_report: list[dict],
                  max_bytes: int, importance, rest: dict) -> dict:
    """Steps the kept projections down until the file fits `max_bytes` (in place: `tensors`
    and the kept rows of `rows_report`) -> the report's `budget`."""
    from engine.gguf.convert import _converted

    version = content.version
    sources = {e.name: e for e in content.tensors}
    kept = [sources[r["name"]] for r in rows_report
            if "kept" in r and PROJECTION.match(r["name"]) and r["name"] not in rest]
    index = {t.name: i for i, t in enumerate(tensors)}

    def size_of(types: dict[str, T]) -> int:
        trial = list(tensors)
        for name, kind in types.items():
            e = sources[name]
            trial[index[name]] = TensorEntry(name, kind, e.shape, b"")
        return file_bytes(metadata, trial, version)

    before = size_of({})
    types, steps = fit_budget(kept, size_of, max_bytes, importance)
    for name, kind in types.items():
        tensors[index[name]] = _converted(sources[name], kind)
    final = {r["name"]: r for r in rows_report}
    for e in kept:
        row = final[e.name]
        row["type"] = types.get(e.name, e.ggml_type).name
        if e.name in types:
            row["stepped_down"] = f"{e.ggml_type.name} -> {types[e.name].name} (size budget)"
    return {"max_bytes": max_bytes, "bytes_before": before, "bytes": size_of(types),
            "steps": steps}


def convert_ptqtp(src: str | Path, dst: str | Path, *, planes: int = 2, group: int | None = 256,
                  iterations: int | None = None, progress=None,
                  method: str = "ptqtp", plane_type: T = T.TQ2_0,
                  others: str = "keep", importance=None,
                  max_bytes: int | None = None) -> PtqtpResult:
    """Write `src` (any GGUF the engine runs) as a PTQTP model at `dst` (which must not exist),
    one tensor in memory at a time, and its report at `dst` + '.ptqtp.json'.

    method="absmean" writes plain round-to-nearest ternary (BitNet b1.58's absmean, one plane)
    in the same layout instead: the baseline the benchmark measures PTQTP against.
    `plane_type`: each plane as TQ2_0 (2.0625 bits a weight) or TQ1_0 (1.6875), the same values.
    `others`: the matrices PTQTP does not decompose stay as the source holds them ("keep"), or a
    float source's are quantized as llama-quantize's recipe of that name would ("q4_k_m": what an
    export from a dense fine-tune uses, so that the rest of the model is not left in f16).
    `importance`: an engine.ptqtp.imatrix.Importance (each projection's input mean squares from
    calibration text) for the activation-aware fit, or None for the plain Frobenius fit; it
    must name every matrix that is decomposed; where it holds a matrix's input covariance
    (`Importance.covariances`), that matrix is fitted with error feedback (GPTQ).
    `max_bytes`: the most the file may hold; the projections PTQTP cannot take step down to
    fewer bits, least harmed first, until it fits (module docstring)."""
    from engine.gguf.convert import _converted, _source_type_name, _to_f32

    src, dst = Path(src), Path(dst)
    plane_type = T(plane_type)
    _check_options(dst, planes, group, method, plane_type)
    if importance is not None and method != "ptqtp":
        raise ValueError("an importance applies to the PTQTP fit, not to absmean")
    report_path = dst.with_name(dst.name + ".ptqtp.json")
    content = read_gguf_content(src)
    metadata = dict(content.metadata)
    kwargs = {} if iterations is None else {"iterations": iterations}
    rows_report: list[dict] = []
    last: dict[str, Decomposition] = {}          # the current tensor's planes, for plane 2
    dequantized = False
    tensors: list[TensorEntry] = []

    def decomposed(entry: TensorEntry):
        def plane1():
            last.clear()
            w = _to_f32(entry)
            imp = None if importance is None else importance.values[entry.name]
            hessian = None if importance is None else importance.covariances.get(entry.name)
            start = time.perf_counter()
            if method != "ptqtp":
                dec = absmean_ternary(w, group=group)
            elif hessian is not None:
                dec = decompose(w, planes=planes, group=group, hessian=hessian, **kwargs)
            else:
                dec = decompose(w, planes=planes, group=group, importance=imp, **kwargs)
            seconds = time.perf_counter() - start
            rows_report.append(_report_row(entry, w, dec, planes, seconds, imp, hessian))
            last[entry.name] = dec
            return plane_bytes(dec, 0, plane_type)

        def plane2():
            dec = last.pop(entry.name)
            return plane_bytes(dec, 1, plane_type)
        out = [TensorEntry(entry.name, plane_type, entry.shape, plane1)]
        if planes == 2:
            out.append(TensorEntry(entry.name + PLANE2_SUFFIX, plane_type, entry.shape, plane2))
        return out

    rest = _others_plan(content, others)
    for entry in content.tensors:
        if entry.name.endswith(PLANE2_SUFFIX) or entry.ggml_type in PACKERS:
            raise ForgebenchError("the source is already a ternary (PTQTP, TQ1_0 or TQ2_0) model",
                                  path=src, where=entry.name,
                                  hint="convert from the original f16/f32/bf16 or quantized GGUF")
        why = kept_reason(entry.name, tuple(entry.shape), group)
        if why is None and importance is not None:
            _check_importance(importance, entry, src)
        if why is None:
            dequantized |= entry.ggml_type not in FLOAT_TYPES
            tensors.extend(decomposed(entry))
        else:
            rows_report.append({"name": entry.name, "shape": list(entry.shape),
                                "source_type": entry.ggml_type.name, "kept": why})
            tensors.append(_converted(entry, rest.get(entry.name, entry.ggml_type)))
    if not any(t.ggml_type == plane_type for t in tensors):
        raise ForgebenchError(f"no tensor of this model can be stored as {plane_type.name}",
                              path=src,
                              hint="PTQTP decomposes block projections whose rows hold a "
                                   f"multiple of {QK_K} values")
    src_sha = sha256_file(src)
    _set_ptqtp_metadata(metadata, plane_type, planes, group, method, src_sha,
                        _source_type_name(content) if dequantized else None, importance)
    budget = None
    if max_bytes is not None:
        budget = _apply_budget(content, tensors, metadata, rows_report, max_bytes, importance,
                               rest)
    start = time.perf_counter()
    write_gguf(dst, metadata, tensors, version=content.version, progress=progress)
    done = [r for r in rows_report if "rel_error" in r]
    report = {"source": str(src), "source_sha256": src_sha, "planes": planes,
              "group": group or "row", "dequantized_source": dequantized,
              "seconds": round(time.perf_counter() - start, 2),
              "decomposed": len(done), "kept": len(rows_report) - len(done),
              "mean_rel_error": float(np.mean([r["rel_error"] for r in done])),
              "importance": None if importance is None else {
                  "dataset": importance.dataset, "text_sha256": importance.text_sha256,
                  "tokens": importance.tokens, "chunks": importance.chunks},
              "budget": budget, "tensors": rows_report}
    _write_report(report_path, report)
    return PtqtpResult(dst, report_path, Counter(t.ggml_type.name for t in tensors),
                       dequantized, report)
