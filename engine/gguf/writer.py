"""Write GGUF files — typed metadata, tensor infos, aligned data — and read them back typed.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, kv count u64; each kv
as key string, value type u32, value; each tensor info as name string, n_dims u32, dims u64
(ggml order: row length first), ggml type u32, data offset u64; zero padding to the alignment;
then every tensor's bytes, each padded with zeros to the alignment. This is the layout the
`gguf` package and ggml both write, so reading a file into `GGUFContent` and writing it back
(`reemit`) reproduces it byte for byte.

`read_gguf_content` is the writer's mirror: it keeps every value's exact GGUF type (u32 vs i32,
array element types, raw string bytes), which a re-emit needs and engine.gguf.reader's Python
values do not carry; it parses the header directly (about a second for a 262k-token
vocabulary, where the `gguf` package's GGUFReader builds one object per string).

Files are written to a temp name beside the target and renamed at the end, after a free-space
check: a failure (disk full included) leaves no partial output.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Union

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.errors import ForgebenchError
from engine.fsutil import atomic_writer, require_free_space

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

# scalar value types -> struct format (little-endian)
_SCALAR_FORMAT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?",
}
_NUMPY_DTYPE = {t: np.dtype(f) for t, f in _SCALAR_FORMAT.items()}

TensorData = Union[bytes, np.ndarray, Callable[[], Union[bytes, np.ndarray]]]


@dataclass(frozen=True, eq=False)
class MetaValue:
    """One metadata value with its exact GGUF type (u32 and i32 must not be confused on re-emit).

    STRING values are str or raw bytes; ARRAY values are a list (of str/bytes for string arrays)
    or a numpy array, with `item_type` naming the element type.
    """
    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MetaValue):
            return NotImplemented
        if (self.type, self.item_type) != (other.type, other.item_type):
            return False
        if self.type == GGUFValueType.ARRAY and self.item_type != GGUFValueType.STRING:
            return np.array_equal(np.asarray(self.value), np.asarray(other.value))
        return self.python() == other.python()

    def python(self) -> Any:
        """The value as the reader's metadata dict holds it (strings decoded)."""
        if isinstance(self.value, bytes):
            return self.value.decode("utf-8", errors="replace")
        if self.item_type == GGUFValueType.STRING:
            return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v
                    for v in self.value]
        return self.value.tolist() if isinstance(self.value, np.ndarray) else self.value


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


def tensor_nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if n % block:
        raise ValueError(f"{n} values do not fill whole {GGMLQuantizationType(ggml_type).name} "
                         f"blocks of {block}")
    return n // block * size


def _pad(n: int, alignment: int) -> int:
    return -n % alignment


# ---------------------------------------------------------------- encoding

def _string(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return struct.pack("<Q", len(raw)) + raw


def _encode_value(key: str, meta: MetaValue) -> bytes:
    kind = GGUFValueType(meta.type)
    if kind == GGUFValueType.STRING:
        return _string(meta.value)
    if kind in _SCALAR_FORMAT:
        return struct.pack(_SCALAR_FORMAT[kind], meta.value)
    if kind != GGUFValueType.ARRAY or meta.item_type is None:
        raise ValueError(f"metadata {key!r}: cannot write value type {kind!r}")
    item = GGUFValueType(meta.item_type)
    head = struct.pack("<IQ", item, len(meta.value))
    if item == GGUFValueType.STRING:
        return head + b"".join(_string(v) for v in meta.value)
    if item in _NUMPY_DTYPE:
        return head + np.asarray(meta.value, dtype=_NUMPY_DTYPE[item]).tobytes()
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


def write_gguf(path: str | os.PathLike, metadata: dict[str, MetaValue] | Iterable,
               tensors: Iterable[TensorEntry | tuple], *, alignment: int | None = None,
               version: int = 3,
               progress: Callable[[TensorEntry, int, int], None] | None = None) -> Path:
    """Write a GGUF file atomically. `metadata`: ordered key -> MetaValue (or (key, MetaValue)
    pairs); `tensors`: TensorEntry or (name, ggml_type, shape, data) tuples, in file order;
    `alignment` sets `general.alignment` (the file's default of 32 is not written out).
    `progress(tensor, done, total)` is called after each tensor is written."""
    path = Path(path)
    metadata = dict(metadata)
    tensors = [t if isinstance(t, TensorEntry) else TensorEntry(*t) for t in tensors]
    if alignment is not None and (alignment != DEFAULT_ALIGNMENT or ALIGNMENT_KEY in metadata):
        metadata[ALIGNMENT_KEY] = MetaValue(GGUFValueType.UINT32, alignment)
    align = _alignment(metadata)
    if align <= 0 or align & (align - 1):
        raise ForgebenchError(f"alignment {align} is not a power of two", path=path,
                              where=ALIGNMENT_KEY)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ForgebenchError("duplicate tensor names", path=path,
                              where=", ".join(sorted({n for n in names if names.count(n) > 1})))
    header = encode_header(metadata, tensors, version)
    total = len(header) + sum(t.n_bytes + _pad(t.n_bytes, align) for t in tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    require_free_space(path.parent, total, margin=1.05)
    try:
        with atomic_writer(path, "wb") as out:
            out.write(header)
            for done, tensor in enumerate(tensors, start=1):
                data = _tensor_bytes(tensor)
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

class _Cursor:
    """Sequential little-endian reads over the mapped file; running off the end means the file
    is truncated."""

    def __init__(self, buf: np.ndarray):
        self.mem = memoryview(buf)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.mem):
            raise EOFError(f"needs {self.pos + n} bytes, file has {len(self.mem)}")
        view = self.mem[self.pos:self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.take(size))

    def string(self) -> bytes:
        (n,) = self.unpack("<Q")
        return bytes(self.take(n))

    def value(self, kind: GGUFValueType) -> MetaValue:
        if kind == GGUFValueType.STRING:
            return MetaValue(kind, self.string())
        if kind in _SCALAR_FORMAT:
            return MetaValue(kind, self.unpack(_SCALAR_FORMAT[kind])[0])
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown value type {int(kind)}")
        item, count = self.unpack("<IQ")
        item = GGUFValueType(item)
        if item == GGUFValueType.STRING:
            return MetaValue(kind, [self.string() for _ in range(count)], item)
        if item not in _NUMPY_DTYPE:
            raise ValueError(f"arrays of {item.name} are not supported")
        dtype = _NUMPY_DTYPE[item]
        raw = self.take(count * dtype.itemsize)
        return MetaValue(kind, np.frombuffer(raw, dtype=dtype).copy(), item)


def read_gguf_content(path: str | os.PathLike) -> GGUFContent:
    """Read a GGUF file's typed metadata and tensors (bytes memory-mapped) for writing back.

    Bad input — missing, not GGUF, truncated, corrupt — is a ForgebenchError naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ForgebenchError("no such file", path=path, hint="give the path to a .gguf file")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ForgebenchError(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')",
                              path=path, hint="pass a .gguf model file")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buf)
    where = "header"
    try:
        cursor.take(4)
        version, n_tensors, n_kv = cursor.unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        metadata: dict[str, MetaValue] = {}
        for index in range(n_kv):
            where = f"metadata entry {index}"
            key = cursor.string().decode("utf-8")
            where = f"metadata {key!r}"
            (kind,) = cursor.unpack("<I")
            metadata[key] = cursor.value(GGUFValueType(kind))
        infos = []
        for index in range(n_tensors):
            where = f"tensor info {index}"
            name = cursor.string().decode("utf-8")
            where = f"tensor {name!r}"
            (n_dims,) = cursor.unpack("<I")
            if n_dims > 4:  # GGML_MAX_DIMS
                raise ValueError(f"{n_dims} dimensions (ggml tensors have at most 4)")
            dims = cursor.unpack(f"<{n_dims}Q")
            kind, offset = cursor.unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(kind), offset))
    except (EOFError, ValueError, UnicodeDecodeError, struct.error) as exc:
        truncated = isinstance(exc, EOFError)
        raise ForgebenchError(
            ("file is truncated" if truncated else "cannot parse the GGUF header")
            + f" ({exc})", path=path, where=where,
            hint="download or convert the file again") from exc
    content = GGUFContent(path, version, metadata)
    if content.alignment <= 0 or content.alignment & (content.alignment - 1):
        raise ForgebenchError(f"alignment {content.alignment} is not a power of two", path=path,
                              where=ALIGNMENT_KEY, hint="the file is corrupt")
    data_start = cursor.pos + _pad(cursor.pos, content.alignment)
    for name, shape, kind, offset in infos:
        start = data_start + offset
        try:
            end = start + tensor_nbytes(kind, shape)
        except (ValueError, KeyError) as exc:
            raise ForgebenchError(f"tensor {name!r}: {exc}", path=path, where=name,
                                  hint="the file is corrupt") from exc
        if end > size:
            raise ForgebenchError(
                f"file is truncated: tensor {name!r} needs bytes up to {end}, file has {size}",
                path=path, where=name, hint="download or convert the file again")
        content.tensors.append(TensorEntry(name, kind, shape, buf[start:end]))
    return content


def reemit(src: str | os.PathLike, dst: str | os.PathLike,
           progress: Callable[[TensorEntry, int, int], None] | None = None) -> Path:
    """Write `src` again, unchanged: same metadata (types and order), tensor order, alignment."""
    content = read_gguf_content(src)
    return write_gguf(dst, content.metadata, content.tensors, version=content.version,
                      progress=progress)
