"""Write GGUF files — typed metadata, tensor infos, aligned data — and read them back typed.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, kv count u64; each kv
as key string, value type u32, value; each tensor info as name string, n_dims u32, dims u64
(ggml order: row length first), ggml type u32, data offset u64; zero padding to the alignment;
then every tensor's bytes, each padded with zeros to the alignment. This is the layout the
`gguf` package and ggml both write, so reading a file into `GGUFContent` and writing it back
(`reemit`) reproduces it byte for byte.

`read_gguf_content` is the writer's mirror over the one parser (engine.gguf.parser): every
value keeps its exact GGUF type (u32 vs i32, array element types, raw string bytes), which a
re-emit needs and the reader's Python values do not carry.

Files are written to a temp name beside the target and renamed at the end, after a free-space
check: a failure (disk full included) leaves no partial output.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Union

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from engine.errors import ForgebenchError
from engine.fsutil import atomic_writer, require_free_space
from engine.gguf.constants import ALIGNMENT_KEY, DEFAULT_ALIGNMENT
from engine.gguf.parser import (
    GGUF_MAGIC,
    NUMPY_DTYPE,
    SCALAR_FORMAT,
    MetaValue,
    check_alignment,
    encode,
    parse_gguf,
    tensor_nbytes,
)

TensorData = Union[bytes, np.ndarray, Callable[[], Union[bytes, np.ndarray]]]


@dataclass
class TensorEntry:
    """A tensor to write. `shape` is in torch order (row length last); `data` holds the stored
    bytes (block format for quantized types) or a callable producing them when written, so a
    converter can stream one tensor at a time."""
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: TensorData

    @property
    def n_bytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.shape)


@dataclass
class GGUFContent:
    """Everything a GGUF file holds, in file order, ready to write back."""
    path: Path
    version: int
    metadata: dict[str, MetaValue] = field(default_factory=dict)
    tensors: list[TensorEntry] = field(default_factory=list)

    @property
    def alignment(self) -> int:
        return _alignment(self.metadata)


def _alignment(metadata: dict[str, MetaValue]) -> int:
    meta = metadata.get(ALIGNMENT_KEY)
    return int(meta.value) if meta is not None else DEFAULT_ALIGNMENT


def _pad(n: int, alignment: int) -> int:
    return -n % alignment


# ---------------------------------------------------------------- encoding

def _string(value: str | bytes) -> bytes:
    raw = encode(value)
    return struct.pack("<Q", len(raw)) + raw


def _encode_value(key: str, meta: MetaValue) -> bytes:
    kind = GGUFValueType(meta.type)
    if kind == GGUFValueType.STRING:
        return _string(meta.value)
    if kind in SCALAR_FORMAT:
        return struct.pack(SCALAR_FORMAT[kind], meta.value)
    if kind != GGUFValueType.ARRAY or meta.item_type is None:
        raise ValueError(f"metadata {key!r}: cannot write value type {kind!r}")
    item = GGUFValueType(meta.item_type)
    head = struct.pack("<IQ", item, len(meta.value))
    if item == GGUFValueType.STRING:
        return head + b"".join(_string(v) for v in meta.value)
    if item == GGUFValueType.ARRAY:
        return head + b"".join(_encode_value(key, v) for v in meta.value)
    if item in NUMPY_DTYPE:
        return head + np.asarray(meta.value, dtype=NUMPY_DTYPE[item]).tobytes()
    raise ValueError(f"metadata {key!r}: arrays of {item!r} are not supported")


def encode_header(metadata: dict[str, MetaValue], tensors: list[TensorEntry],
                  version: int = 3) -> bytes:
    """Header, kv pairs and tensor infos, padded to the alignment (the data section follows)."""
    alignment = _alignment(metadata)
    parts = [GGUF_MAGIC, struct.pack("<IQQ", version, len(tensors), len(metadata))]
    for key, meta in metadata.items():
        parts += [_string(key), struct.pack("<I", GGUFValueType(meta.type)),
                  _encode_value(key, meta)]
    offset = 0
    for tensor in tensors:
        dims = tuple(reversed(tensor.shape))
        parts += [_string(tensor.name), struct.pack(f"<I{len(dims)}Q", len(dims), *dims),
                  struct.pack("<IQ", GGMLQuantizationType(tensor.ggml_type), offset)]
        offset += tensor.n_bytes + _pad(tensor.n_bytes, alignment)
    header = b"".join(parts)
    return header + bytes(_pad(len(header), alignment))


def _tensor_bytes(tensor: TensorEntry) -> memoryview:
    data = tensor.data() if callable(tensor.data) else tensor.data
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = memoryview(data).cast("B")
    if view.nbytes != tensor.n_bytes:
        raise ValueError(f"tensor {tensor.name!r}: {view.nbytes} bytes given, "
                         f"{GGMLQuantizationType(tensor.ggml_type).name} {tensor.shape} "
                         f"needs {tensor.n_bytes}")
    return view


def _tensors_bytes(tensors: list[TensorEntry], threads: int) -> Iterator[memoryview]:
    """Each tensor's bytes in file order; with threads > 1, that many tensors are computed at
    once (quantization is numpy work that releases the GIL), at most `threads` ahead of the
    writer so memory stays bounded."""
    if threads <= 1:
        yield from map(_tensor_bytes, tensors)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for tensor in tensors:
            pending.append(pool.submit(_tensor_bytes, tensor))
            if len(pending) >= threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_gguf(path: str | os.PathLike, metadata: dict[str, MetaValue] | Iterable,
               tensors: Iterable[TensorEntry | tuple], *, alignment: int | None = None,
               version: int = 3,
               progress: Callable[[TensorEntry, int, int], None] | None = None,
               threads: int = 1) -> Path:
    """Write a GGUF file atomically. `metadata`: ordered key -> MetaValue (or (key, MetaValue)
    pairs); `tensors`: TensorEntry or (name, ggml_type, shape, data) tuples, in file order;
    `alignment` sets `general.alignment` (the file's default of 32 is not written out).
    `progress(tensor, done, total)` is called after each tensor is written; `threads` tensors
    are computed at a time (the bytes do not depend on it)."""
    path = Path(path)
    metadata = dict(metadata)
    tensors = [t if isinstance(t, TensorEntry) else TensorEntry(*t) for t in tensors]
    if alignment is not None and (alignment != DEFAULT_ALIGNMENT or ALIGNMENT_KEY in metadata):
        metadata[ALIGNMENT_KEY] = MetaValue(GGUFValueType.UINT32, alignment)
    align = check_alignment(_alignment(metadata), path)
    for tensor in tensors:
        try:
            tensor_nbytes(tensor.ggml_type, tensor.shape)
        except ValueError as exc:
            raise ForgebenchError(f"tensor {tensor.name!r}: {exc}", path=path,
                                  where=tensor.name) from None
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ForgebenchError("duplicate tensor names", path=path,
                              where=", ".join(sorted({n for n in names if names.count(n) > 1})))
    header = encode_header(metadata, tensors, version)
    total = len(header) + sum(t.n_bytes + _pad(t.n_bytes, align) for t in tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    require_free_space(path.parent, total, margin=1.05,
                       hint="free some space, or write to a disk with room (--out)")
    try:
        with atomic_writer(path, "wb") as out:
            out.write(header)
            for done, (tensor, data) in enumerate(zip(tensors, _tensors_bytes(tensors, threads)),
                                                  start=1):
                out.write(data)
                out.write(bytes(_pad(data.nbytes, align)))
                if progress is not None:
                    progress(tensor, done, len(tensors))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ForgebenchError("the disk filled up while writing; nothing was written",
                                  path=path, hint="free some space and run the command again") \
                from exc
        raise ForgebenchError(f"cannot write the file ({exc.strerror or exc})", path=path,
                              hint="check the folder exists and is writable") from exc
    return path


# ---------------------------------------------------------------- reading for a rewrite

def read_gguf_content(path: str | os.PathLike) -> GGUFContent:
    """Read a GGUF file's typed metadata and tensors (bytes memory-mapped) for writing back.

    Bad input — missing, not GGUF, truncated, corrupt — is a ForgebenchError naming the file
    (engine.gguf.parser makes every check).
    """
    parsed = parse_gguf(path)
    content = GGUFContent(parsed.path, parsed.version, parsed.metadata)
    content.tensors = [TensorEntry(slot.name, slot.ggml_type, slot.shape,
                                   parsed.tensor_bytes(slot)) for slot in parsed.tensors]
    return content


def reemit(src: str | os.PathLike, dst: str | os.PathLike,
           progress: Callable[[TensorEntry, int, int], None] | None = None) -> Path:
    """Write `src` again, unchanged: same metadata (types and order), tensor order, alignment."""
    content = read_gguf_content(src)
    return write_gguf(dst, content.metadata, content.tensors, version=content.version,
                      progress=progress)


# ---------------------------------------------------------------- resumable streaming write

def partial_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """Where `write_gguf_resumable` keeps an unfinished file and its progress record."""
    path = Path(path)
    return (path.with_name(path.name + ".partial"),
            path.with_name(path.name + ".partial.json"))


def _resume_point(partial: Path, record: Path, key: dict, total: int) -> int:
    """The index of the first unfinished tensor of a leftover `partial` file, or 0 when there is
    no leftover or it was written for another header or input (`key`) or is shorter than its
    record says (the record is written only after the data it counts was fsynced)."""
    import json

    if not (partial.exists() and record.exists()):
        return 0
    try:
        state = json.loads(record.read_text())
    except (OSError, ValueError):
        state = {}
    if state.get("key") == json.loads(json.dumps(key)) \
            and partial.stat().st_size >= state.get("offset", total + 1):
        return int(state["done"])
    return 0


def _stream_tensor_data(out, tensor: TensorEntry) -> int:
    """Write one tensor's bytes (whole, or chunk by chunk when `data` is a callable giving an
    iterator of chunks) to `out` without its padding; a wrong byte count is an error."""
    data = tensor.data() if callable(tensor.data) else tensor.data
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)) else data
    written = 0
    for chunk in chunks:
        if isinstance(chunk, np.ndarray):
            chunk = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
        view = memoryview(chunk).cast("B")
        out.write(view)
        written += view.nbytes
        del chunk, view
    if written != tensor.n_bytes:
        raise ValueError(f"tensor {tensor.name!r}: {written} bytes given, "
                         f"{GGMLQuantizationType(tensor.ggml_type).name} "
                         f"{tensor.shape} needs {tensor.n_bytes}")
    return written


def write_gguf_resumable(path: str | os.PathLike, metadata: dict[str, MetaValue],
                         tensors: list[TensorEntry], *, fingerprint: object = None,
                         progress: Callable[[TensorEntry, int, int, int, int], None] | None = None,
                         ) -> tuple[Path, int]:
    """Write a GGUF file tensor by tensor into `<path>.partial`, recording after each finished
    tensor how far it got (`<path>.partial.json`, written after an fsync of the data), and rename
    it to `path` at the end. A later call with the same header and `fingerprint` (what the
    input was) truncates the partial file to the first unfinished tensor and goes on from there;
    any other leftover is started afresh. A tensor's `data` may be a callable returning an
    iterator of byte chunks, so no tensor need be held whole.

    `progress(tensor, index, n_tensors, bytes_done, bytes_total)` follows every tensor.
    Returns (path, index of the tensor the write started at: 0 unless it resumed)."""
    import hashlib
    import json

    path = Path(path)
    partial, record = partial_paths(path)
    header = encode_header(metadata, tensors)
    align = check_alignment(_alignment(metadata), path)
    sizes = [t.n_bytes + _pad(t.n_bytes, align) for t in tensors]
    total = len(header) + sum(sizes)
    key = {"header_sha256": hashlib.sha256(header).hexdigest(), "input": fingerprint}
    start = _resume_point(partial, record, key, total)
    path.parent.mkdir(parents=True, exist_ok=True)
    offset = len(header) + sum(sizes[:start])
    require_free_space(path.parent, total - (offset if start else 0), margin=1.05,
                       hint="free some space, or write to a disk with room (--out)")

    def save_state(done: int, offset: int) -> None:
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(json.dumps({"key": key, "done": done, "offset": offset}))
        os.replace(tmp, record)

    try:
        with open(partial, "r+b" if start else "wb") as out:
            if start:
                out.truncate(offset)
                out.seek(offset)
            else:
                out.write(header)
                save_state(0, len(header))
            for index in range(start, len(tensors)):
                tensor = tensors[index]
                written = _stream_tensor_data(out, tensor)
                out.write(bytes(_pad(written, align)))
                offset += sizes[index]
                out.flush()
                os.fsync(out.fileno())
                save_state(index + 1, offset)
                if progress is not None:
                    progress(tensor, index + 1, len(tensors), offset, total)
        os.replace(partial, path)
        record.unlink(missing_ok=True)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ForgebenchError("the disk filled up while writing; the finished tensors are "
                                  f"kept in {partial.name} and the same command resumes",
                                  path=path, hint="free some space and run the command again") \
                from exc
        raise ForgebenchError(f"cannot write the file ({exc.strerror or exc})", path=path,
                              hint="check the folder exists and is writable") from exc
    return path, start
