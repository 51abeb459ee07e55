"""Helpers for the merge / export / equivalence tests: LoRA adapters with non-zero B over a GGUF
base, and llama.cpp logits of a token sequence."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import torch

from engine.fsutil import sha256_file

ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def make_adapter(base: Path, out: Path, *, targets=ALL_TARGETS, rank: int = 4,
                 alpha: float = 8.0, seed: int = 0, b_std: float = 0.05,
                 base_sha256: str | None = None):
    """Attach LoRA to the engine model of `base`, give B random values (a trained adapter's
    shape of update), save it as adapters.safetensors; return the adapted model (f32)."""
    from engine.lora import attach_lora, save_adapters
    from engine.models.gguf_model import load_gguf_model

    model, tokenizer = load_gguf_model(base, numerics="f32")
    adapters = attach_lora(model, targets=list(targets), rank=rank, alpha=alpha, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.lora_b.copy_(torch.randn(adapter.lora_b.shape, generator=generator) * b_std)
    save_adapters(out, adapters, base_sha256 or sha256_file(base))
    return model.eval(), tokenizer


@torch.no_grad()
def engine_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]))[0].double()                            # [T, V]


def llamacpp_logits(path: Path, ids: list[int], lora: Path | None = None) -> torch.Tensor:
    from engine.export.llamacpp import open_llama

    llm = open_llama(path, lora_path=str(lora) if lora else None, n_ctx=64,
                     logits_all=True, n_threads=1, verbose=False)
    llm.eval(ids)
    out = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float64))
    llm.close()
    return out


def fill_disk_after(monkeypatch, limit: int) -> None:
    """Make every GGUF write fail like a full disk once `limit` bytes went into one file."""
    import engine.gguf.writer as writer

    real = writer.atomic_writer

    class FillingHandle:
        def __init__(self, handle):
            self.handle, self.written = handle, 0

        def write(self, data) -> int:
            self.written += len(data)
            if self.written > limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.handle.write(data)

    class Context:
        def __init__(self, path, mode="wb"):
            self.inner = real(path, mode)

        def __enter__(self):
            return FillingHandle(self.inner.__enter__())

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(writer, "atomic_writer", Context)


SFT_CONFIG = """\
recipe = "lm-sft"
seed = 1
steps = {steps}
save_every = 0

[model]
gguf = "{gguf}"

[data]
path = "{data}"
max_len = 96

[lora]
rank = 4
alpha = 8.0
targets = ["q", "v", "down"]

[optim]
lr = 2e-2

[train]
window = 3
micro_batch = 3
"""


def tiny_sft_over_quantized_base(folder: Path, steps: int) -> tuple[Path, Path]:
    """(a tiny Q4_K gemma3 base, an lm-sft config training LoRA over it on three pirate pairs)."""
    from fixtures_gguf import write_tiny_gguf

    quantized = write_tiny_gguf(folder / "base-q4k.gguf", arch="gemma3", qtype="Q4_K",
                                n_layers=2)
    (folder / "pairs.jsonl").write_text("".join(
        json.dumps({"instruction": q, "response": a}) + "\n" for q, a in
        [("Say hello.", "Ahoy there!"), ("Name a color.", "Ahoy! Red."),
         ("What is the sea?", "Ahoy! Our home.")]))
    config = folder / "sft.toml"
    config.write_text(SFT_CONFIG.format(steps=steps, gguf=quantized, data=folder / "pairs.jsonl"))
    return quantized, config


def with_block_outliers(src: Path, dst: Path, magnitude: float) -> Path:
    """A copy of a dense (f16) GGUF whose layer matrices hold one weight of ±`magnitude` in
    every 32-weight block (the rest ~0.05). A 4-bit block type's step is set by its largest
    weight, so it rounds the others coarsely; 8-bit and 5/6-bit K types much less."""
    from gguf import GGMLQuantizationType as T

    from engine.gguf.writer import TensorEntry, read_gguf_content, write_gguf

    content = read_gguf_content(src)
    tensors = []
    for t in content.tensors:
        if t.ggml_type == T.F16 and len(t.shape) == 2 and t.name.startswith("blk."):
            w = np.asarray(t.data, dtype=np.uint8).view(np.float16).reshape(t.shape).copy()
            w[:, ::32] = magnitude * np.where(w[:, ::32] >= 0, 1, -1)
            t = TensorEntry(t.name, t.ggml_type, t.shape, w.view(np.uint8).reshape(-1))
        tensors.append(t)
    write_gguf(Path(dst), dict(content.metadata), tensors, version=content.version)
    return Path(dst)


def sharp_fine_tune(folder: Path) -> Path:
    """An lm-sft run whose gain quantization to Q4_0 wipes out while Q5_K_M / Q8_0 keep it:
    a tiny gemma3 base with outlier blocks (with_block_outliers) fine-tuned once at a high
    rate (the coarse adaptation, merged into an f16 base), then fine-tuned again at a low rate
    for 30 steps: a small, precise gain next to Q4_0's rounding. Returns the second run."""
    from lm_pretrain_support import forgebench

    quantized, config = tiny_sft_over_quantized_base(folder, steps=30)
    forgebench("convert", str(quantized), "--dtype", "f16", "--out", str(folder / "dense.gguf"))
    sharp = with_block_outliers(folder / "dense.gguf", folder / "outliers.gguf", 4.0)
    first = config.read_text().replace(str(quantized), str(sharp))
    (folder / "first.toml").write_text(first)
    forgebench("run", str(folder / "first.toml"), "--out", str(folder / "first"))
    forgebench("export", str(folder / "first"), "--dtype", "f16", "--out",
               str(folder / "first-f16"), "--no-report")
    second = first.replace(str(sharp), str(folder / "first-f16" / "model.gguf")) \
        .replace("lr = 2e-2", "lr = 1.5e-3")
    (folder / "second.toml").write_text(second)
    forgebench("run", str(folder / "second.toml"), "--out", str(folder / "runs" / "sharp"))
    return folder / "runs" / "sharp"
