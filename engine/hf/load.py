"""A Hugging Face checkpoint folder opened as the engine opens a GGUF, without writing a file.

`open_hf(folder)` runs the conversion of engine.hf.convert in memory at the checkpoint's own
float precision (bf16 stays bf16, f16 f16, f32 f32: no rounding) and returns a
`engine.gguf.reader.GGUFFile` holding the same metadata and tensors the converted file would,
so `load_gguf_model` builds the same model classes from it (Llama's Q/K rows permuted and Gemma
3's norm shift applied, exactly as llama.cpp's converter does). The weights live in memory
(the model needs them there anyway); `forgebench models add DIR` writes the file instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from engine.gguf.reader import GGUFFile, TensorInfo
from engine.hf.checkpoint import HFCheckpoint
from engine.hf.convert import plan_conversion


def source_dtype(ckpt: HFCheckpoint) -> str:
    """The float type the checkpoint's matrices are stored in (the lossless target)."""
    matrices = {t.dtype for t in ckpt.tensors.values() if len(t.shape) >= 2}
    return "f32" if "F32" in matrices else "f16" if "F16" in matrices else "bf16"


def open_hf(folder: str | os.PathLike) -> GGUFFile:
    ckpt = HFCheckpoint.open(folder)
    metadata, entries = plan_conversion(ckpt, source_dtype(ckpt))
    tensors = {}
    for entry in entries:
        buffer = np.empty(entry.n_bytes, np.uint8)
        at = 0
        for chunk in entry.data():
            raw = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
            buffer[at:at + raw.nbytes] = raw
            at += raw.nbytes
        tensors[entry.name] = TensorInfo(entry.name, tuple(entry.shape), entry.ggml_type, buffer)
    return GGUFFile(Path(folder), {k: v.python() for k, v in metadata.items()}, tensors,
                    fields=metadata)
