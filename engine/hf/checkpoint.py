"""A Hugging Face checkpoint folder, checked and indexed without loading any weights.

A folder holds `config.json`, a tokenizer (`tokenizer.json` and/or SentencePiece
`tokenizer.model`, with `tokenizer_config.json` carrying the chat template) and weights as
`model.safetensors`, or shards `model-0000N-of-0000M.safetensors` named by
`model.safetensors.index.json`. `HFCheckpoint.open` checks all of it up front — every shard's
header against its file size (a truncated download is caught here, not half-way through a
conversion) — and every problem is one ForgebenchError naming the file and the fix.

Tensors are listed in the order llama.cpp's converter walks them (shards sorted by name, names
sorted within a shard) and read one at a time from the memory-mapped shard (`safetensors`'
safe_open), so a reader holds one tensor at a time whatever the model's size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from engine.errors import ForgebenchError

# HF architecture -> (llama.cpp architecture name, family label)
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",    # llama.cpp converts it as Llama (its LlamaModel)
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}

# safetensors dtype -> bytes per element; the float ones are the weights the engine converts
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = ("F32", "F16", "BF16")

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of the checkpoint: where it lives and what it is (read from the header)."""
    name: str
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0          # where its bytes start in the shard file

    @property
    def n_bytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for dim in self.shape:
            n *= dim
        return n


def _json(path: Path, what: str, hint: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ForgebenchError(f"the checkpoint has no {path.name} ({what})", path=path,
                              hint=hint) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ForgebenchError(f"{path.name} cannot be read as JSON ({exc})", path=path,
                              hint="download the file again") from None


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The shard's JSON header and where its data starts, checked against the file's size."""
    hint = "the shard is damaged or was not downloaded completely; download it again"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ForgebenchError("the shard is truncated (no safetensors header)",
                                      path=path, hint=hint)
            n = int.from_bytes(head, "little")
            if n <= 0 or 8 + n > size:
                raise ForgebenchError(
                    f"the shard is truncated or not safetensors (header of {n} bytes, file "
                    f"of {size})", path=path, hint=hint)
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ForgebenchError("the shard is missing", path=path,
                              hint="download every file the index names") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        if isinstance(exc, ForgebenchError):
            raise
        raise ForgebenchError(f"the shard's header cannot be read ({exc})", path=path,
                              hint=hint) from None
    start = 8 + n
    end = max((meta["data_offsets"][1] for key, meta in header.items()
               if key != "__metadata__"), default=0)
    if start + end > size:
        raise ForgebenchError(
            f"the shard is truncated: its header describes {start + end} bytes, the file has "
            f"{size}", path=path, hint=hint)
    return header, start


@dataclass
class HFCheckpoint:
    """A checked Hugging Face checkpoint folder (see the module docstring)."""
    folder: Path
    config: dict[str, Any]
    hf_arch: str
    arch: str
    tensors: dict[str, TensorSlot] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: str | os.PathLike, *, supported_only: bool = True) -> "HFCheckpoint":
        folder = Path(folder)
        if not folder.is_dir():
            raise ForgebenchError("not a folder", path=folder,
                                  hint="give the Hugging Face checkpoint's folder "
                                       "(the one holding config.json)")
        config = _json(folder / "config.json", "the model's configuration",
                       "copy config.json from the model's Hugging Face repository into the "
                       "folder")
        arches = config.get("architectures") or []
        hf_arch = arches[0] if arches else ""
        arch = ARCHITECTURES.get(hf_arch, "")
        if supported_only and not arch:
            raise ForgebenchError(
                f"architecture {hf_arch or '(none)'!r} is not one the engine converts or runs",
                path=folder / "config.json", where="architectures",
                hint="supported: " + ", ".join(ARCHITECTURES))
        if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
            raise ForgebenchError(
                "the checkpoint has no tokenizer (tokenizer.json or tokenizer.model)",
                path=folder / "tokenizer.json",
                hint="copy tokenizer.json (or tokenizer.model), tokenizer_config.json and "
                     "special_tokens_map.json from the model's repository into the folder")
        ckpt = cls(folder, config, hf_arch, arch)
        ckpt.tensors = ckpt._index()
        return ckpt

    def _shards(self) -> list[Path]:
        index = self.folder / INDEX_NAME
        if index.is_file():
            data = _json(index, "the shard index", "download the index again")
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ForgebenchError("the index has no weight_map", path=index,
                                      where="weight_map", hint="download the index again")
            names = sorted(dict.fromkeys(weight_map.values()))
            for name in names:
                if not (self.folder / name).is_file():
                    raise ForgebenchError(
                        f"the index names shard {name!r}, which is not in the folder",
                        path=self.folder / name, where=f"{INDEX_NAME}: weight_map",
                        hint="download every model-*.safetensors file the index names")
            self._weight_map = weight_map
            return [self.folder / n for n in names]
        self._weight_map = None
        names = sorted(n for n in os.listdir(self.folder)
                       if n.startswith("model") and n.endswith(".safetensors"))
        if not names:
            raise ForgebenchError(
                "the checkpoint has no weights (model.safetensors or its shards)",
                path=self.folder / "model.safetensors",
                hint="download the model's *.safetensors files (PyTorch .bin checkpoints "
                     "are not read: convert them to safetensors first)")
        return [self.folder / n for n in names]

    def _index(self) -> dict[str, TensorSlot]:
        tensors: dict[str, TensorSlot] = {}
        for shard in self._shards():
            header, start = read_safetensors_header(shard)
            for name in sorted(k for k in header if k != "__metadata__"):
                meta = header[name]
                if meta["dtype"] not in DTYPE_SIZES:
                    raise ForgebenchError(f"tensor {name!r} has dtype {meta['dtype']}, which "
                                          "the engine cannot read", path=shard, where=name,
                                          hint="convert the checkpoint to bf16/f16/f32")
                slot = TensorSlot(name, shard, meta["dtype"], tuple(meta["shape"]),
                                  start + meta["data_offsets"][0])
                if meta["data_offsets"][1] - meta["data_offsets"][0] != slot.n_bytes:
                    raise ForgebenchError(f"tensor {name!r}: its header's byte range does not "
                                          "match its shape", path=shard, where=name,
                                          hint="the shard is damaged; download it again")
                tensors[name] = slot
        if self._weight_map is not None:
            missing = sorted(set(self._weight_map) - set(tensors))
            if missing:
                shard = self._weight_map[missing[0]]
                raise ForgebenchError(
                    f"{len(missing)} tensor(s) the index lists are not in their shard "
                    f"(first: {missing[0]!r})", path=self.folder / shard,
                    hint="download the shard again; it does not match the index")
        return tensors

    # ------------------------------------------------------------ facts

    @cached_property
    def tokenizer_config(self) -> dict[str, Any]:
        path = self.folder / "tokenizer_config.json"
        return _json(path, "", "") if path.is_file() else {}

    @property
    def text_config(self) -> dict[str, Any]:
        """The config with a nested text_config lifted to the top (as llama.cpp does)."""
        if "text_config" in self.config:
            return {**self.config, **self.config["text_config"]}
        return self.config

    @property
    def total_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    @property
    def largest_tensor(self) -> TensorSlot:
        return max(self.tensors.values(), key=lambda t: t.n_bytes)

    def fingerprint(self) -> list[list]:
        """Shard names, sizes and mtimes: a resumed conversion checks the input is unchanged."""
        shards = sorted({t.shard for t in self.tensors.values()})
        return [[s.name, s.stat().st_size, s.stat().st_mtime_ns] for s in shards]

    def read(self, name: str):
        """One tensor as a torch tensor (a copy out of the memory-mapped shard)."""
        from safetensors import SafetensorError, safe_open

        slot = self.tensors[name]
        try:
            with safe_open(slot.shard, framework="pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ForgebenchError(f"cannot read tensor {name!r} ({exc})", path=slot.shard,
                                  where=name, hint="download the shard again") from None
