"""Fold LoRA adapters into a dense GGUF base: W += (alpha/r)·B·A, in f32, cast back to W's type.

Only a dense base (every adapted matrix f32, f16 or bf16) is merged. A quantized base is refused:
dequantize, merge and requantize compounds the rounding error, so the way out is explicit —
`forgebench convert BASE.gguf --dtype f16` writes a dense copy marked with the SHA-256 of the
file it came from, and that copy is accepted as the adapter's base.

Adapters are matched to tensors by name (`layers.<i>.<target>` -> `blk.<i>.<gguf name>.weight`)
and alpha and rank come from the adapter file's metadata, so they are never retyped. Tensors
are merged one at a time while the output is written, so memory stays near one matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, Keys, quants

from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.gguf.constants import (
    DEQUANTIZED_FROM_KEY,
    FULL_WEIGHTS_KEY,
    MERGED_ADAPTER_KEY,
    MERGED_ALPHA_KEY,
    MERGED_RANK_KEY,
    NON_PARAMETER_TENSORS,
    SOURCE_SHA_KEY,
    gguf_tensor_name,
)
from engine.gguf.quant_policy import FLOAT_TYPES
from engine.gguf.writer import GGUFContent, MetaValue, TensorEntry, read_gguf_content, write_gguf
from engine.lora import TARGETS, adapter_info, read_adapters, target_module

CHAT_TEMPLATE_KEY = Keys.Tokenizer.CHAT_TEMPLATE


@dataclass
class Adapter:
    """A saved LoRA adapter: factors by `layers.<i>.<target>`, with its metadata."""
    path: Path
    a: dict[str, np.ndarray]          # [r, in] f32
    b: dict[str, np.ndarray]          # [out, r] f32
    rank: int
    alpha: float
    targets: list[str]
    base_sha256: str
    sha256: str

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def gguf_names(self) -> dict[str, str]:
        """`layers.<i>.<target>` -> the GGUF weight it adapts."""
        out = {}
        for name in self.a:
            _, layer, target = name.split(".")
            out[name] = gguf_tensor_name(f"layers.{layer}.{target_module(target)}.weight")
        return out


def load_adapter(path: str | Path) -> Adapter:
    """Read an adapters.safetensors file (engine.lora's format) as f32 numpy factors."""
    path = Path(path)
    tensors, meta = read_adapters(path)
    info = adapter_info(meta, path)
    a, b = {}, {}
    for key, tensor in tensors.items():
        name, _, kind = key.rpartition(".")
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in TARGETS \
                or kind not in ("lora_a", "lora_b"):
            raise ForgebenchError(f"unexpected adapter tensor {key!r}", path=path, where=key,
                                  hint="expected names layers.<i>.<target>.lora_a / lora_b")
        (a if kind == "lora_a" else b)[name] = tensor.float().numpy()
    if set(a) != set(b):
        raise ForgebenchError("adapter has lora_a and lora_b for different layers", path=path,
                              where=", ".join(sorted(set(a) ^ set(b))[:3]))
    return Adapter(path, a, b, info.rank, info.alpha, info.targets, info.base_sha256,
                   sha256_file(path))


def base_identities(content: GGUFContent) -> dict[str, str]:
    """SHA-256 values that identify a GGUF base: its own, and the file it was made from
    (a dequantized copy of a quantized GGUF, or an lm-pretrain checkpoint's weights)."""
    ids = {"file": sha256_file(content.path)}
    for key, what in ((DEQUANTIZED_FROM_KEY, "dequantized from"),
                      (SOURCE_SHA_KEY, "exported from")):
        if key in content.metadata:
            ids[what] = content.metadata[key].python()
    return ids


def recognise_base(content: GGUFContent, base_sha256: str, what: str) -> str:
    """How `content` is the base that `what` was trained on (SHA-256 `base_sha256`): "file",
    "dequantized from" or "exported from"; refuse any other base."""
    ids = base_identities(content)
    for how, digest in ids.items():
        if digest == base_sha256:
            return how
    raise ForgebenchError(
        f"the {what} was trained on a different base (base sha256 "
        f"{base_sha256[:16]}…, this file is {ids['file'][:16]}…)",
        path=content.path, where="--base",
        hint="merge into the GGUF the run was trained on, or a dense copy of it made with "
             "'forgebench convert BASE.gguf --dtype f16 --out DENSE.gguf'")


def check_base(content: GGUFContent, adapter: Adapter) -> str:
    """Refuse an adapter trained on another base; return how the base was recognised."""
    if not adapter.base_sha256:
        raise ForgebenchError("the adapter does not record its base model's SHA-256",
                              path=adapter.path, where="metadata 'base_sha256'",
                              hint="merge only adapters saved by forgebench lm-sft")
    return recognise_base(content, adapter.base_sha256, "adapter")


def check_dense(content: GGUFContent, adapter: Adapter) -> dict[str, TensorEntry]:
    """The base tensors the adapter touches, after refusing quantized ones and shape mismatches."""
    tensors = {t.name: t for t in content.tensors}
    targets = {}
    for name, gguf_name in adapter.gguf_names().items():
        entry = tensors.get(gguf_name)
        if entry is None:
            raise ForgebenchError(f"the base has no tensor {gguf_name!r} for adapter {name}",
                                  path=content.path, where=gguf_name,
                                  hint="the adapter belongs to a model with another layout")
        if entry.ggml_type not in FLOAT_TYPES:
            raise ForgebenchError(
                f"the base is quantized ({gguf_name} is {entry.ggml_type.name}); refusing to "
                "merge into it: dequantizing, merging and quantizing again compounds the "
                "rounding error", path=content.path, where=gguf_name,
                hint="make a dense copy first and merge into that: forgebench convert "
                     f"{content.path.name} --dtype f16 --out DENSE.gguf, then --base DENSE.gguf")
        out_features, in_features = entry.shape
        a, b = adapter.a[name], adapter.b[name]
        if a.shape != (adapter.rank, in_features) or b.shape != (out_features, adapter.rank):
            raise ForgebenchError(
                f"adapter {name} has A {list(a.shape)} and B {list(b.shape)}, but "
                f"{gguf_name} is [{out_features}, {in_features}] (rank {adapter.rank})",
                path=adapter.path, where=name, hint="the adapter belongs to another model")
        targets[gguf_name] = entry
    return targets


def _f32(entry: TensorEntry) -> np.ndarray:
    """A dense tensor's values as f32 (f16 and bf16 widen exactly)."""
    raw = np.asarray(entry.data, dtype=np.uint8)
    if entry.ggml_type == T.F32:
        return raw.view(np.float32).reshape(entry.shape)
    if entry.ggml_type == T.F16:
        return raw.view(np.float16).astype(np.float32).reshape(entry.shape)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(entry.shape)


def merged_values(entry: TensorEntry, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """W + scale·(B·A) in f32, stored back in W's type (f16 round-to-nearest-even, ggml's bf16)."""
    delta = (b.astype(np.float32) @ a.astype(np.float32)) * np.float32(scale)   # [out, in]
    return quants.quantize(_f32(entry) + delta, entry.ggml_type)


@dataclass
class MergeResult:
    path: Path
    merged: list[str]             # GGUF tensor names changed
    base_match: str               # how the base was recognised ("file", "dequantized from", ...)
    source_sha256: str            # the adapter's or the full weights' file


def with_chat_template(metadata: dict, chat_template: str | None) -> dict:
    """The metadata with `tokenizer.chat_template` set to the template a model was fine-tuned
    with, when the base carries none (a base GGUF often has none; llama.cpp would then fall
    back to another layout and the tuned model would answer in the wrong format)."""
    if chat_template and not metadata.get(CHAT_TEMPLATE_KEY):
        metadata = dict(metadata)
        metadata[CHAT_TEMPLATE_KEY] = MetaValue(GGUFValueType.STRING, chat_template)
    return metadata


def _name(metadata: dict, name: str | None) -> None:
    """`general.name` is the fine-tune's (a runtime shows it), not the base's: the base's
    name stays in `general.basename` when it had one to give."""
    if not name:
        return
    old = metadata.get("general.name")
    if old is not None and "general.basename" not in metadata:
        metadata["general.basename"] = old
    metadata["general.name"] = MetaValue(GGUFValueType.STRING, name)


def merge_into_gguf(base: str | Path, adapter_path: str | Path, out: str | Path, *,
                    progress: Callable[[TensorEntry, int, int], None] | None = None,
                    chat_template: str | None = None, name: str | None = None) -> MergeResult:
    """Write base + adapter as a dense GGUF at `out` (must not exist): same metadata, tensor
    order and types, with the adapter's identity recorded, `chat_template` (the layout
    the adapter was trained with) when the base has none, and `name` (the fine-tune's) as
    `general.name` when given."""
    out = Path(out)
    if out.exists():
        raise ForgebenchError("the output file already exists; refusing to overwrite it",
                              path=out, where="--out", hint="choose a new name")
    adapter = load_adapter(adapter_path)
    content = read_gguf_content(base)
    base_match = check_base(content, adapter)
    targets = check_dense(content, adapter)
    by_gguf = {g: n for n, g in adapter.gguf_names().items()}

    def entry_for(t: TensorEntry) -> TensorEntry:
        if t.name not in targets:
            return t
        name = by_gguf[t.name]
        return TensorEntry(t.name, t.ggml_type, t.shape,
                           lambda: merged_values(t, adapter.a[name], adapter.b[name],
                                                 adapter.scale))

    metadata = with_chat_template(dict(content.metadata), chat_template)
    metadata[MERGED_ADAPTER_KEY] = MetaValue(GGUFValueType.STRING, adapter.sha256)
    metadata[MERGED_ALPHA_KEY] = MetaValue(GGUFValueType.FLOAT32, adapter.alpha)
    metadata[MERGED_RANK_KEY] = MetaValue(GGUFValueType.UINT32, adapter.rank)
    _name(metadata, name)
    write_gguf(out, metadata, [entry_for(t) for t in content.tensors], version=content.version,
               progress=progress)
    return MergeResult(out, sorted(targets), base_match, adapter.sha256)


def write_full_weights(base: str | Path, weights: str | Path, out: str | Path, base_sha256: str,
                       *, progress: Callable[[TensorEntry, int, int], None] | None = None,
                       chat_template: str | None = None, name: str | None = None) -> MergeResult:
    """Write a full fine-tune's weights (a checkpoint's torch state dict, `weights`) into the
    dense GGUF it was trained from: the base's metadata, tokenizer, tensor order and types,
    every tensor replaced by the trained one (named by the loader's own mapping). Refuses a
    checkpoint whose tensors do not name and shape-match the base, and a quantized base."""
    from safetensors import safe_open


    out, weights = Path(out), Path(weights)
    if out.exists():
        raise ForgebenchError("the output file already exists; refusing to overwrite it",
                              path=out, where="--out", hint="choose a new name")
    content = read_gguf_content(base)
    base_match = recognise_base(content, base_sha256, "checkpoint")
    tensors = {t.name: t for t in content.tensors}
    with safe_open(str(weights), "pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    by_gguf = {}
    for key, shape in shapes.items():
        name = gguf_tensor_name(key)
        entry = tensors.get(name) if name else None
        if entry is None:
            raise ForgebenchError(f"checkpoint tensor {key!r} has no counterpart in the base",
                                  path=weights, where=key,
                                  hint="the checkpoint belongs to a model with another layout")
        if tuple(entry.shape) != shape:
            raise ForgebenchError(f"checkpoint tensor {key!r} is {list(shape)}, but the base's "
                                  f"{name} is {list(entry.shape)}", path=weights, where=key,
                                  hint="the checkpoint belongs to another model")
        if entry.ggml_type not in FLOAT_TYPES:
            raise ForgebenchError(
                f"the base is quantized ({name} is {entry.ggml_type.name}); full fine-tuned "
                "weights are written into a dense base only", path=content.path, where=name,
                hint="export against the dense f32/f16/bf16 GGUF the run was trained on")
        by_gguf[name] = key
    missing = sorted(set(tensors) - set(by_gguf) - NON_PARAMETER_TENSORS)
    if missing:
        raise ForgebenchError(f"the checkpoint has no weights for {len(missing)} base tensors "
                              f"({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''})",
                              path=weights, where=missing[0],
                              hint="the checkpoint belongs to another model")

    def trained(t: TensorEntry) -> np.ndarray:
        with safe_open(str(weights), "pt") as f:              # one tensor in memory at a time
            values = f.get_tensor(by_gguf[t.name]).float().contiguous().numpy()
        return quants.quantize(values, t.ggml_type)

    def entry_for(t: TensorEntry) -> TensorEntry:
        if t.name not in by_gguf:
            return t
        return TensorEntry(t.name, t.ggml_type, t.shape, lambda: trained(t))

    digest = sha256_file(weights)
    metadata = with_chat_template(dict(content.metadata), chat_template)
    metadata[FULL_WEIGHTS_KEY] = MetaValue(GGUFValueType.STRING, digest)
    _name(metadata, name)
    write_gguf(out, metadata, [entry_for(t) for t in content.tensors], version=content.version,
               progress=progress)
    return MergeResult(out, sorted(by_gguf), base_match, digest)
