"""Open a GGUF file: metadata as Python values and a tensor table whose bytes stay memory-mapped.

The header is parsed and checked by engine.gguf.parser (the one parser; the `gguf` package's
GGUFReader builds a numpy view per string, which takes a minute on a 262k-token vocabulary).
Problems (not GGUF, truncated, corrupt, unsupported type, bad shape) are ForgebenchErrors naming
the file and the key or tensor. `GGUFFile.require_int`/`require_float` validate hyper-parameters
before any arithmetic uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.gguf.constants import REFUSED_ARCHS, SUPPORTED_ARCHS, SUPPORTED_TYPES
from engine.gguf.parser import MetaValue, parse_gguf


def _excerpt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    fields: dict[str, MetaValue] = field(default_factory=dict, repr=False)   # typed values
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
                                  hint="the file is incomplete or was written by an "
                                       "unsupported converter")
        return self.metadata[key]

    def require_int(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        """An integer hyper-parameter (`default` when absent, else required), at least
        `minimum`. A per-layer array must hold one value throughout. Anything else (a string,
        a float, a bool, zero heads) is refused here, before arithmetic divides by it."""
        key = key.replace("{arch}", self.architecture)
        value = self.metadata.get(key, default) if default is not None else self.require(key)
        if isinstance(value, list) and value and all(type(v) is int for v in value):
            if len(set(value)) != 1:
                raise ForgebenchError(f"per-layer values {sorted(set(value))} are not supported",
                                      path=self.path, where=key)
            value = value[0]
        if type(value) is not int:
            raise ForgebenchError(f"must be an integer, not {_excerpt(value)}", path=self.path,
                                  where=key, hint="the file's metadata is corrupt")
        if value < minimum:
            raise ForgebenchError(f"must be at least {minimum}, not {value}", path=self.path,
                                  where=key, hint="the file's metadata is corrupt")
        return value

    def require_float(self, key: str, default: float | None = None) -> float:
        """A finite real hyper-parameter (`default` when absent, else required)."""
        key = key.replace("{arch}", self.architecture)
        value = self.metadata.get(key, default) if default is not None else self.require(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ForgebenchError(f"must be a finite number, not {_excerpt(value)}",
                                  path=self.path, where=key,
                                  hint="the file's metadata is corrupt")
        return float(value)

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
                f"tensor {info.name!r} has quant type {info.ggml_type.name}, which the engine "
                "cannot read",
                path=self.path, where=info.name,
                hint="supported: " + ", ".join(t.name for t in SUPPORTED_TYPES)
                     + "; re-quantize the model with llama-quantize to one of these")


def check_architecture(gf: GGUFFile) -> str:
    """The file's architecture if the engine runs it; a refused family (mixture-of-experts,
    recurrent) or an unknown one is a ForgebenchError with the reason."""
    arch = gf.architecture
    if not arch:
        raise ForgebenchError("metadata has no general.architecture", path=gf.path,
                              where="general.architecture", hint="the file is not a model GGUF")
    if arch in REFUSED_ARCHS:
        raise ForgebenchError(f"architecture {arch!r} is {REFUSED_ARCHS[arch]}, which the engine "
                              "does not run", path=gf.path, where="general.architecture",
                              hint="supported: " + ", ".join(SUPPORTED_ARCHS))
    if gf.require_int("{arch}.expert_count", 0, minimum=0) > 0:
        raise ForgebenchError(f"{arch} file has {gf.get('{arch}.expert_count')} experts: "
                              "mixture-of-experts models are not supported", path=gf.path,
                              where=f"{arch}.expert_count", hint="use a dense model")
    if arch not in SUPPORTED_ARCHS:
        raise ForgebenchError(f"architecture {arch!r} is not supported", path=gf.path,
                              where="general.architecture",
                              hint="supported: " + ", ".join(SUPPORTED_ARCHS))
    return arch


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse and check `path` (engine.gguf.parser) and view it as Python values and tensor
    views into a copy-on-write map of the file."""
    parsed = parse_gguf(path, writable=True)
    tensors = {slot.name: TensorInfo(slot.name, slot.shape, slot.ggml_type,
                                     parsed.tensor_bytes(slot)) for slot in parsed.tensors}
    metadata = {key: value.python() for key, value in parsed.metadata.items()}
    return GGUFFile(parsed.path, metadata, tensors, fields=parsed.metadata)


__all__ = ["GGUFFile", "TensorInfo", "check_architecture", "open_gguf"]
