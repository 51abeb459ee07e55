"""The one GGUF header parser: typed metadata fields, the tensor table, and every check on them.

Layout (GGUF v2/v3, little-endian): magic b"GGUF", version u32, tensor count u64, kv count u64;
each kv as key string, value type u32, value; each tensor info as name string, n_dims u32, dims
u64 (ggml order: row length first), ggml type u32, data offset u64; zero padding to the
alignment; then the tensor data. A string is a u64 byte length and the bytes; an array is an
element type u32, a count u64 and the elements.

`parse_gguf` keeps each value's exact GGUF type (`MetaValue`, as gguf-py's ReaderField does:
u32 vs i32, element types, the raw bytes of strings), which a byte-exact re-emit needs
(engine.gguf.writer.read_gguf_content), and `MetaValue.python()` is the Python-value view the
models and the tokenizer read (engine.gguf.reader.open_gguf). Strings that are not valid UTF-8
decode with surrogate escapes, so the tokenizer gets every token's bytes back unchanged.

Every structural check lives here, and each failure is a ForgebenchError naming the file and the
key or tensor: magic and version; counts, string lengths and array sizes bounded by the bytes
the file has left (a corrupt count cannot make the parser allocate or loop without end); array
nesting at most MAX_ARRAY_DEPTH deep; no duplicate keys or tensor names; `general.alignment` an
unsigned integer and a power of two; at most 4 dimensions whose element count fits an int64
(what llama.cpp's gguf.cpp refuses, we refuse); a known tensor type whose block size divides
the row length; each tensor's data aligned and inside the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.errors import ForgebenchError
from engine.gguf.constants import ALIGNMENT_KEY, DEFAULT_ALIGNMENT

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4                     # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8              # llama.cpp reads no nested arrays; gguf-py reads any depth
INT64_MAX = 2**63 - 1            # llama.cpp holds dims and element counts in int64_t

V = GGUFValueType
# scalar value types -> struct format and numpy dtype (little-endian): the one type table
SCALAR_FORMAT = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I",
                 V.INT32: "<i", V.FLOAT32: "<f", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
                 V.BOOL: "<?"}
NUMPY_DTYPE = {t: np.dtype(f) for t, f in SCALAR_FORMAT.items()}
_UNSIGNED = (V.UINT8, V.UINT16, V.UINT32, V.UINT64)
_MIN_KV_BYTES = 8 + 4 + 1        # empty key, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_MIN_ITEM_BYTES = {V.STRING: 8, V.ARRAY: 4 + 8, **{t: d.itemsize for t, d in NUMPY_DTYPE.items()}}


def decode(raw: bytes) -> str:
    """GGUF string bytes as str; bytes that are not UTF-8 survive as surrogate escapes."""
    return raw.decode("utf-8", "surrogateescape")


def encode(text: str | bytes) -> bytes:
    """The inverse of `decode`: str (surrogate escapes included) or bytes as the stored bytes."""
    return text.encode("utf-8", "surrogateescape") if isinstance(text, str) else bytes(text)


class _Strings(list):
    """A string array as the parser reads it: every item a str already."""


@dataclass(frozen=True, eq=False)
class MetaValue:
    """One metadata value with its exact GGUF type (u32 and i32 must not be confused on re-emit).

    STRING values are str or raw bytes; ARRAY values are a list (of str/bytes for string arrays,
    of MetaValue arrays for nested arrays) or a numpy array, with `item_type` naming the element
    type. `python()` is the plain Python view.
    """
    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MetaValue):
            return NotImplemented
        if (self.type, self.item_type) != (other.type, other.item_type):
            return False
        if self.type == V.ARRAY and self.item_type not in (V.STRING, V.ARRAY):
            return np.array_equal(np.asarray(self.value), np.asarray(other.value))
        return self.python() == other.python()

    def python(self) -> Any:
        """The value as Python: str for strings, lists for arrays, int/float/bool scalars."""
        if isinstance(self.value, bytes):
            return decode(self.value)
        if self.item_type == V.STRING:
            if type(self.value) is _Strings:      # the parser's: decoded already
                return list(self.value)
            return [decode(v) if isinstance(v, bytes) else v for v in self.value]
        if self.item_type == V.ARRAY:
            return [v.python() for v in self.value]
        return self.value.tolist() if isinstance(self.value, np.ndarray) else self.value


@dataclass(frozen=True)
class TensorSlot:
    """A tensor's entry in the table: torch-order shape (row length last), type, and the
    absolute byte range [start, end) of its data in the file."""
    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    start: int
    end: int


@dataclass
class ParsedGGUF:
    path: Path
    version: int
    alignment: int
    metadata: dict[str, MetaValue]
    tensors: list[TensorSlot]
    buffer: np.memmap                 # the whole file; tensor bytes are slices of it

    def tensor_bytes(self, slot: TensorSlot) -> np.ndarray:
        return self.buffer[slot.start:slot.end]


def tensor_nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Stored bytes of a tensor; ValueError when the shape does not fill whole blocks or its
    element count overflows llama.cpp's int64."""
    ggml_type = GGMLQuantizationType(ggml_type)
    block, size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for dim in shape:
        if dim < 0 or dim > INT64_MAX:
            raise ValueError(f"dimension {dim} is outside llama.cpp's int64 range")
        n *= dim
    if n > INT64_MAX:
        raise ValueError(f"shape {tuple(shape)} holds {n} elements, more than llama.cpp's int64 "
                         "element count can hold")
    if shape and shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {ggml_type.name} "
                         f"block size {block}")
    return n // block * size


def check_alignment(alignment: object, path: Path, kind: GGUFValueType | None = None) -> int:
    """`general.alignment` as an int: an unsigned integer that is a power of two."""
    if (kind is not None and kind not in _UNSIGNED) or isinstance(alignment, bool) \
            or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ForgebenchError(f"alignment {alignment!r} is not a power of two", path=path,
                              where=ALIGNMENT_KEY,
                              hint="the file is corrupt; download or convert it again")
    return alignment


class _Bad(Exception):
    """A structural problem at the cursor: becomes a ForgebenchError naming file and place."""


class _Truncated(_Bad):
    pass


class _Cursor:
    """Sequential little-endian reads over the mapped file with bounds checks."""

    def __init__(self, buf: np.ndarray):
        self.mem, self.size, self.pos = memoryview(buf), len(buf), 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int) -> memoryview:
        if n > self.left:
            raise _Truncated(f"needs {n} more bytes at offset {self.pos}, the file has "
                             f"{self.left} left")
        view = self.mem[self.pos:self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def count(self, what: str, min_bytes: int) -> int:
        """A u64 count of items each at least `min_bytes` long, refused when the rest of the
        file could not hold them (so a corrupt count fails here, not after a long loop)."""
        (n,) = self.unpack("<Q")
        if n * min_bytes > self.left:
            raise _Bad(f"{what} count {n} cannot fit in the {self.left} bytes left in the file")
        return n

    def string(self) -> bytes:
        (n,) = self.unpack("<Q")
        if n > self.left:
            raise _Truncated(f"a string of {n} bytes runs past the end of the file")
        return bytes(self.take(n))

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings, decoded (vocabularies hold 100k+): the lengths are
        walked in one tight loop, then the bodies are decoded in one call, joined by a NUL
        (ASCII ends any partial UTF-8 sequence, so decoding the joined bytes and splitting gives
        each string's own decoding) and split again; where a string holds a NUL itself, one by
        one."""
        unpack, mem, first = struct.Struct("<Q").unpack_from, self.mem, self.pos
        starts: list[int] = []
        append, pos = starts.append, first
        try:
            for _ in range(count):
                append(pos)
                pos += 8 + unpack(mem, pos)[0]
        except (struct.error, OverflowError):     # a length past the end of the file
            pos = self.size + 1
        if pos > self.size:
            raise _Truncated("a string array runs past the end of the file")
        self.pos = pos
        if not count:
            return _Strings()
        at = np.asarray(starts, np.int64) - first
        region = np.frombuffer(mem, np.uint8, pos - first, first).copy()
        keep = np.ones(region.size, bool)
        keep[(at[:, None] + np.arange(7)).ravel()] = False   # each length but its last byte,
        region[at + 7] = 0                                    # which becomes the NUL
        text = region[keep].tobytes().decode("utf-8", "surrogateescape").split("\0")
        if len(text) == count + 1:
            return _Strings(text[1:])
        ends = [*starts[1:], pos]
        return _Strings(decode(mem[s + 8:e].tobytes()) for s, e in zip(starts, ends))

    def value_type(self) -> GGUFValueType:
        (kind,) = self.unpack("<I")
        try:
            return V(kind)
        except ValueError:
            raise _Bad(f"unknown value type {kind}") from None

    def value(self, kind: GGUFValueType, depth: int = 0) -> MetaValue:
        if kind == V.STRING:
            return MetaValue(kind, self.string())
        if kind in SCALAR_FORMAT:
            return MetaValue(kind, self.unpack(SCALAR_FORMAT[kind])[0])
        item = self.value_type()
        count = self.count("array", _MIN_ITEM_BYTES[item])
        if item == V.STRING:
            return MetaValue(kind, self.strings(count), item)
        if item == V.ARRAY:
            if depth + 1 >= MAX_ARRAY_DEPTH:
                raise _Bad(f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
            return MetaValue(kind, [self.value(V.ARRAY, depth + 1) for _ in range(count)], item)
        dtype = NUMPY_DTYPE[item]
        return MetaValue(kind, np.frombuffer(self.take(count * dtype.itemsize), dtype).copy(),
                         item)


def _fail(path: Path, where: str, exc: _Bad) -> ForgebenchError:
    what = "file is truncated inside the header" if isinstance(exc, _Truncated) \
        else "cannot parse the GGUF header"
    return ForgebenchError(f"{what} ({exc})", path=path, where=where,
                           hint="the file is truncated or corrupt; download or convert it again")


def parse_gguf(path: str | Path, *, writable: bool = False) -> ParsedGGUF:
    """Parse and check a GGUF file's header; the data stays memory-mapped.

    `writable=True` maps copy-on-write, so tensor views can back torch tensors
    (torch.from_numpy wants writable memory); the file itself never changes.
    """
    path = Path(path)
    if not path.is_file():
        raise ForgebenchError("no such file", path=path, hint="give the path to a .gguf file")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ForgebenchError(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')",
                              path=path, hint="pass a .gguf model file (safetensors/PyTorch "
                                              "files need converting)")
    buf = np.memmap(path, dtype=np.uint8, mode="c" if writable else "r")
    cursor = _Cursor(buf)
    version, metadata, infos = _read_header(cursor, path)
    alignment = DEFAULT_ALIGNMENT
    if ALIGNMENT_KEY in metadata:
        meta = metadata[ALIGNMENT_KEY]
        alignment = check_alignment(meta.value, path, meta.type)
    data_start = cursor.pos + -cursor.pos % alignment
    tensors = _tensor_slots(infos, alignment, data_start, len(buf), path)
    return ParsedGGUF(path, version, alignment, metadata, tensors, buf)


def _read_header(cursor: _Cursor, path: Path) -> tuple[int, dict[str, MetaValue], list[tuple]]:
    """(version, metadata, tensor infos (name, shape, type, offset)) from the header; a
    malformed or truncated header is refused naming the entry it broke in."""
    where = "header"
    try:
        cursor.take(4)
        (version,) = cursor.unpack("<I")
        if version not in VERSIONS:
            raise ForgebenchError(f"GGUF version {version} is not supported (2 and 3 are)",
                                  path=path, where="header",
                                  hint="convert the model with a current llama.cpp")
        (n_tensors,) = cursor.unpack("<Q")
        if n_tensors * _MIN_TENSOR_INFO_BYTES > cursor.left:
            raise _Bad(f"tensor count {n_tensors} cannot fit in the file")
        n_kv = cursor.count("metadata", _MIN_KV_BYTES)
        metadata: dict[str, MetaValue] = {}
        for index in range(n_kv):
            where = f"metadata entry {index}"
            key = decode(cursor.string())
            where = key
            if key in metadata:
                raise _Bad("the key appears twice")
            metadata[key] = cursor.value(cursor.value_type())
        infos = []
        for index in range(n_tensors):
            where = f"tensor info {index}"
            name = decode(cursor.string())
            where = f"tensor {name!r}"
            infos.append((name, *_tensor_info(cursor)))
    except _Bad as exc:
        raise _fail(path, where, exc) from None
    return version, metadata, infos


def _tensor_info(cursor: _Cursor) -> tuple[tuple[int, ...], GGMLQuantizationType, int]:
    """(shape, ggml type, data offset) of one tensor info, after its name."""
    (n_dims,) = cursor.unpack("<I")
    if n_dims > MAX_DIMS:
        raise _Bad(f"{n_dims} dimensions (ggml tensors have at most {MAX_DIMS})")
    dims = cursor.unpack(f"<{n_dims}Q")
    kind, offset = cursor.unpack("<IQ")
    try:
        ggml_type = GGMLQuantizationType(kind)
    except ValueError:
        raise _Bad(f"unknown tensor type {kind}") from None
    return tuple(reversed(dims)), ggml_type, offset


def _tensor_slots(infos: list[tuple], alignment: int, data_start: int, file_size: int,
                  path: Path) -> list[TensorSlot]:
    """Each tensor's byte range in the file, checked: unique names, a valid size, an aligned
    offset, data inside the file."""
    tensors: list[TensorSlot] = []
    names: set[str] = set()
    for name, shape, ggml_type, offset in infos:
        if name in names:
            raise ForgebenchError(f"tensor {name!r} appears twice", path=path, where=name,
                                  hint="the file is corrupt")
        names.add(name)
        try:
            n_bytes = tensor_nbytes(ggml_type, shape)
        except ValueError as exc:
            raise ForgebenchError(f"tensor {name!r}: {exc}", path=path, where=name,
                                  hint="the file is corrupt; llama.cpp refuses it too") from None
        if offset % alignment:
            raise ForgebenchError(f"tensor {name!r}: data offset {offset} is not a multiple of "
                                  f"the alignment {alignment}", path=path, where=name,
                                  hint="the file is corrupt")
        start = data_start + offset
        if start + n_bytes > file_size:
            raise ForgebenchError(f"file is truncated: tensor {name!r} needs bytes up to "
                                  f"{start + n_bytes}, file has {file_size}", path=path,
                                  where=name, hint="download or convert the file again")
        tensors.append(TensorSlot(name, shape, ggml_type, start, start + n_bytes))
    return tensors
