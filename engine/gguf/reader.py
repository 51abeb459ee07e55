"""Open a GGUF file: metadata as Python values and a tensor table whose bytes stay memory-mapped.

The header is parsed here directly (the `gguf` package's GGUFReader builds a numpy view per
string, which takes a minute on a 262k-token vocabulary); value and quant types, block sizes and
the layout are the `gguf` package's. Problems (not GGUF, truncated, unsupported type, bad shape)
are ForgebenchErrors naming the file and the key or tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType as V

from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.gguf.constants import SUPPORTED_TYPES

_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I",
           V.INT32: "<i", V.FLOAT32: "<f", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
           V.BOOL: "<?"}
_NUMPY = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4",
          V.INT32: "<i4", V.FLOAT32: "<f4", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8",
          V.BOOL: "?"}
DEFAULT_ALIGNMENT = 32


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]            # torch order: (rows, …, row length)
    ggml_type: GGMLQuantizationType
    raw: np.ndarray                   # 1-D uint8 view into the memory map (stored block format)

    @property
    def n_bytes(self) -> int:
        return self.raw.nbytes

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _sha256: str | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value; `{arch}` in the key is replaced by the architecture."""
        return self.metadata.get(key.replace("{arch}", self.architecture), default)

    def require(self, key: str) -> Any:
        key = key.replace("{arch}", self.architecture)
        if key not in self.metadata:
            raise ForgebenchError(f"metadata key {key!r} is missing", path=self.path, where=key,
                                  hint="the file is incomplete or was written by an unsupported converter")
        return self.metadata[key]

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ForgebenchError(f"tensor {name!r} is missing", path=self.path, where=name,
                                  hint="the file does not match its declared architecture")
        return self.tensors[name]

    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = sha256_file(self.path)
        return self._sha256

    def check_type(self, info: TensorInfo) -> None:
        """Refuse a tensor whose block format has no dequantization kernel."""
        if info.ggml_type not in SUPPORTED_TYPES:
            raise ForgebenchError(
                f"tensor {info.name!r} has quant type {info.ggml_type.name}, which the engine cannot read",
                path=self.path, where=info.name,
                hint="supported: " + ", ".join(t.name for t in SUPPORTED_TYPES)
                     + "; re-quantize the model with llama-quantize to one of these")


class _Truncated(Exception):
    pass


class _Cursor:
    """Little-endian reads from the mapped header with bounds checks."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.mem, self.off = buf, memoryview(buf), 0

    def take(self, n: int) -> memoryview:
        if self.off + n > len(self.buf):
            raise _Truncated()
        view = self.mem[self.off:self.off + n]
        self.off += n
        return view

    def scalar(self, vtype: V):
        fmt = _SCALAR[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(V.UINT64)
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings in one tight loop (vocabularies hold 100k+ of them)."""
        unpack, mem, off, out = struct.Struct("<Q").unpack_from, self.mem, self.off, []
        try:
            for _ in range(count):
                (n,) = unpack(mem, off)
                out.append(str(mem[off + 8:off + 8 + n], "utf-8", "replace"))
                off += 8 + n
        except struct.error:
            raise _Truncated() from None
        if off > len(self.buf):
            raise _Truncated()
        self.off = off
        return out

    def value(self, vtype: V):
        if vtype == V.STRING:
            return self.string()
        if vtype == V.ARRAY:
            item, count = V(self.scalar(V.UINT32)), self.scalar(V.UINT64)
            if item == V.STRING:
                return self.strings(count)
            if item == V.ARRAY:
                return [self.value(V.ARRAY) for _ in range(count)]
            dt = np.dtype(_NUMPY[item])
            return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).tolist()
        return self.scalar(vtype)


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise ForgebenchError("no such file", path=path, hint="give the path to a .gguf model file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ForgebenchError(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')", path=path,
                              hint="pass a .gguf model file (safetensors/PyTorch files need converting)")
    # copy-on-write map: tensors are writable views for torch.from_numpy, the file never changes
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    cur = _Cursor(mm)
    where = "header"
    try:
        cur.take(4)                                              # magic
        version = cur.scalar(V.UINT32)
        if version not in (2, 3):
            raise ForgebenchError(f"GGUF version {version} is not supported (2 and 3 are)", path=path,
                                  where="header", hint="convert the model with a current llama.cpp")
        n_tensors, n_kv = cur.scalar(V.UINT64), cur.scalar(V.UINT64)
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            where = f"metadata key {key!r}"
            try:
                vtype = V(cur.scalar(V.UINT32))
            except ValueError:
                raise ForgebenchError("unknown metadata value type", path=path, where=key) from None
            metadata[key] = cur.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            where = f"tensor {name!r}"
            dims = [cur.scalar(V.UINT64) for _ in range(cur.scalar(V.UINT32))]
            try:
                ggml_type = GGMLQuantizationType(cur.scalar(V.UINT32))
            except ValueError:
                raise ForgebenchError("unknown tensor type", path=path, where=name) from None
            infos.append((name, tuple(reversed(dims)), ggml_type, cur.scalar(V.UINT64)))
    except _Truncated:
        raise ForgebenchError(f"file is truncated inside the header ({where})", path=path,
                              where=where, hint="the file is truncated or corrupt; download or convert it again") from None
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cur.off // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in infos:
        bs, ts = GGML_QUANT_SIZES[ggml_type]
        if shape and shape[-1] % bs:
            raise ForgebenchError(
                f"tensor {name!r}: row length {shape[-1]} is not a multiple of the "
                f"{ggml_type.name} block size {bs}", path=path, where=name, hint="the file is corrupt")
        start = data_start + offset
        end = start + int(np.prod(shape, dtype=np.int64)) // bs * ts
        if end > len(mm):
            raise ForgebenchError(
                f"file is truncated: tensor {name!r} needs bytes up to {end}, file has {len(mm)}",
                path=path, where=name, hint="download or convert the file again")
        if name in tensors:
            raise ForgebenchError(f"tensor {name!r} appears twice", path=path, where=name)
        tensors[name] = TensorInfo(name, shape, ggml_type, mm[start:end])
    return GGUFFile(path, metadata, tensors)


__all__ = ["GGUFFile", "TensorInfo", "open_gguf"]
