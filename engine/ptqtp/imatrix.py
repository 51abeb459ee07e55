"""Importance of each weight column from calibration text, as llama-imatrix collects it.

For a projection y = W·x the error a quantized Ŵ adds to the outputs over inputs X is
‖(W − Ŵ)·X‖²; its diagonal part is Σ_i E[x_i²]·‖W[:, i] − Ŵ[:, i]‖², so the mean square of each
input column's activation is the weight that column's error gets (llama-imatrix stores the same
sum of squares and count per tensor, and llama-quantize's K-quants weight their fits by it).

`collect_importance` runs the model (the engine, f32 numerics) over calibration text cut into
`ctx`-token chunks, each a fresh context starting with the tokenizer's BOS as llama-imatrix's
chunks do, and records, for every block projection, Σ x_i² / tokens over every token of every
chunk. The text must be disjoint from any text the result is later measured on.

With `covariance` (GGUF tensor-name patterns, e.g. attn_output and ffn_down) it also records,
for the matching projections, the full second-moment matrix H = Σ xxᵀ / tokens, whose diagonal
is the mean squares above: what the error-feedback fit (engine/ptqtp/decompose.py, GPTQ) needs
to move one column's error onto the correlated columns after it. gemma-3-270m: 18 × (1024² +
2048²) values, 0.4 GB in f32 (twice that while they are summed in f64).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.errors import ForgebenchError
from engine.gguf.constants import gguf_tensor_name
from engine.kernels.cpu import torch_threads

DEFAULT_CTX = 512


@dataclass
class Importance:
    """values: GGUF tensor name (`blk.3.ffn_down.weight`) -> mean square of its input columns
    (f64 [cols]); dataset/text_sha256/tokens/chunks describe the calibration (recorded in the
    converted file's metadata)."""

    values: dict[str, np.ndarray]
    dataset: str
    text_sha256: str
    tokens: int
    chunks: int
    covariances: dict[str, np.ndarray] = field(default_factory=dict)   # name -> H f32 [cols, cols]


def _projection_modules(model) -> dict[str, torch.nn.Module]:
    """GGUF weight name -> the module that multiplies by it, for the block projections."""
    out = {}
    for name, module in model.named_modules():
        tensor = gguf_tensor_name(name + ".weight") if name.startswith("layers.") else None
        if tensor is not None and hasattr(module, "in_features"):
            out[tensor] = module
    return out


def collect_importance(model_path: str | Path, text: str, *, dataset: str = "",
                       max_tokens: int = 4096, ctx: int = DEFAULT_CTX,
                       threads: int = 2, covariance: str | set[str] | None = None
                       ) -> Importance:
    """Run `model_path` over `text` (at most `max_tokens` tokens, in `ctx`-token chunks) and
    return each block projection's input mean squares, and with `covariance` (GGUF tensor
    names, or a regular expression searched in them) the full second moments of those
    inputs."""
    from engine.models.gguf_model import load_gguf_model

    if ctx < 2 or max_tokens < 1:
        raise ForgebenchError(f"ctx {ctx} and max_tokens {max_tokens} must be positive",
                              where="imatrix", hint="ctx ≥ 2, e.g. 512")
    model, tok = load_gguf_model(model_path)
    bos = [tok.bos_id] if getattr(tok, "add_bos", False) and tok.bos_id is not None else []
    ids = tok.encode(text, add_special=False)[:max_tokens]
    step = ctx - len(bos)
    chunks = [bos + ids[i:i + step] for i in range(0, len(ids), step)]
    chunks = [c for c in chunks if len(c) > len(bos) + 1]
    if not chunks:
        raise ForgebenchError("the calibration text holds too few tokens", where=dataset or "text",
                              hint="give at least a few hundred tokens of ordinary text")
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    outer: dict[str, torch.Tensor] = {}
    modules = _projection_modules(model)
    if covariance is None:
        full = set()
    elif isinstance(covariance, str):
        full = {n for n in modules if re.search(covariance, n)}
    else:
        full = set(covariance) & set(modules)

    def hook(name):
        def record(_module, inputs, _output):
            x = inputs[0].detach().double().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.square().sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
            if name in full:
                outer[name] = outer.get(name, 0) + x.T @ x
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        with torch_threads(threads), torch.no_grad():
            for chunk in chunks:
                model.hidden(torch.tensor([chunk]), 0, model.new_cache(1, len(chunk)))
    finally:
        for h in handles:
            h.remove()
    missing = sorted(set(modules) - set(sums))
    if missing:
        raise ForgebenchError("the forward pass did not reach every projection",
                              where=", ".join(missing[:3]),
                              hint="run the model under f32 numerics (module hooks)")
    values = {n: (sums[n] / counts[n]).numpy() for n in modules}
    covariances = {n: (outer[n] / counts[n]).float().numpy() for n in sorted(full)}
    return Importance(values, dataset, hashlib.sha256(text.encode()).hexdigest(),
                      sum(len(c) for c in chunks), len(chunks), covariances)
