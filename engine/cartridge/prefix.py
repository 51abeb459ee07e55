"""The cartridge file, its rows from a prefill, and the base model reading a cartridge first.

A cartridge is p key/value rows per layer (`keys[i]`, `values[i]`: [n_kv_heads, p, head_dim]),
saved as safetensors (`k.<layer>`, `v.<layer>`, f32) with a JSON metadata entry `cartridge`:
the base's SHA-256 (a cartridge is refused on any other base), p, the corpus hash, whether row
0 is the BOS token, the frozen rows and the training config.

RoPE, as the paper's implementation treats it: the rows are cache rows, so their keys are
already rotated, at positions 0..p-1 (where their prefill put them; training moves them freely
after that). A prompt read after the cartridge takes the positions after them. When the
tokenizer starts every text with BOS, row 0 *is* that BOS (the rows are the prefill of BOS +
corpus), so a prompt's own leading BOS is not read again: its token i (i >= 1) takes position
p - 1 + i, exactly where it would sit after the document's first p - 1 tokens in context. With
p rows initialised from a prefix and no training, the model therefore reads the prompt exactly
as it would after that prefix. (On Gemma 3's sliding-window layers, a token further than the
window past the rows no longer sees them there, as with a real prefix.)

`CartridgeModel` wraps a base (Llama, Qwen, Gemma 3 or a GGUF-loaded one): `new_cache` seeds
the rows (engine/models/kv_prefix.py) and `hidden` offsets the positions, so
engine.llm.generate, the chat worker and the OpenAI server use it as any model. Everything
else (layers, gguf, numerics, ...) is the base's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.errors import ForgebenchError
from engine.models.kv_prefix import prefix_cache, prefix_rows

CARTRIDGE_FILE = "cartridge.safetensors"
FORMAT = "forgebench-cartridge/1"


@dataclass
class Cartridge:
    """Rows per layer [n_kv_heads, p, head_dim] and the metadata that travels with them."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    meta: dict

    @property
    def tokens(self) -> int:
        return self.keys[0].shape[1]

    def nbytes(self, bytes_per_value: int = 2) -> int:
        """The KV memory the rows take in a cache of `bytes_per_value` (2: llama.cpp's f16)."""
        return sum(t.numel() for t in (*self.keys, *self.values)) * bytes_per_value


def kv_bytes_per_token(model, bytes_per_value: int = 2) -> int:
    """KV cache bytes one position takes over every layer (K and V)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.dim // c.n_heads
    return 2 * c.n_layers * c.n_kv_heads * head_dim * bytes_per_value


def leading_bos(tokenizer) -> bool:
    """Whether every text starts with BOS (then a cartridge's row 0 is that BOS)."""
    return bool(getattr(tokenizer, "add_bos", False)) and tokenizer.bos_id is not None


# -- rows -----------------------------------------------------------------------------------
@torch.no_grad()
def prefill_rows(model, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The KV rows [n_kv_heads, len(ids), head_dim] per layer that a prefill of `ids` leaves in
    the cache (keys rotated at positions 0..len-1): the paper's first-p-tokens initialisation."""
    cache = model.new_cache(1, len(ids))
    model.hidden(torch.tensor([ids]), 0, cache)
    keys, values = prefix_rows(cache, len(ids))
    return [k[0] for k in keys], [v[0] for v in values]


# -- the file -------------------------------------------------------------------------------
def cartridge_bytes(keys: list[torch.Tensor], values: list[torch.Tensor], meta: dict) -> bytes:
    """The safetensors bytes of a cartridge (f32 rows, metadata as JSON)."""
    from safetensors.torch import save

    tensors = {f"k.{i}": k.detach().float().cpu().contiguous() for i, k in enumerate(keys)}
    tensors |= {f"v.{i}": v.detach().float().cpu().contiguous() for i, v in enumerate(values)}
    return save(tensors, metadata={"format": FORMAT, "cartridge": json.dumps(meta,
                                                                             sort_keys=True)})


def read_cartridge(path: str | Path) -> Cartridge:
    """A cartridge file's rows and metadata (no base check: `load_cartridge` does that)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ForgebenchError("cartridge file not found", path=path, where="--cartridge")
    try:
        with safe_open(str(path), "pt") as handle:
            header = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # safetensors raises its own types for a damaged file
        raise ForgebenchError(f"not a readable safetensors file ({exc})", path=path,
                              where="--cartridge") from None
    if header.get("format") != FORMAT or "cartridge" not in header:
        raise ForgebenchError("not a cartridge (no cartridge metadata)", path=path,
                              where="--cartridge",
                              hint="give the cartridge.safetensors of an lm-cartridge run")
    meta = json.loads(header["cartridge"])
    layers = len([n for n in tensors if n.startswith("k.")])
    keys = [tensors[f"k.{i}"] for i in range(layers)]
    values = [tensors[f"v.{i}"] for i in range(layers)]
    return Cartridge(keys, values, meta)


def load_cartridge(path: str | Path, base_sha256: str) -> Cartridge:
    """A cartridge for the base whose file hashes to `base_sha256`; one trained on another base
    is refused (its rows mean nothing to other weights)."""
    cartridge = read_cartridge(path)
    trained_on = cartridge.meta.get("base_sha256")
    if trained_on != base_sha256:
        raise ForgebenchError(
            f"this cartridge was trained on another base model (SHA-256 "
            f"{str(trained_on)[:12]}…, the model given is {base_sha256[:12]}…)",
            path=path, where="--cartridge",
            hint=f"use it with its own base ({cartridge.meta.get('base_name', 'see its run')}), "
                 "or train a cartridge for this base with the lm-cartridge recipe")
    return cartridge


# -- the base reading a cartridge first -----------------------------------------------------
class CartridgeModel(nn.Module):
    """`base` with the rows in front of every sequence (see the module docstring). `keys` and
    `values` may be parameters (the recipe trains through this) or plain tensors (serving)."""

    def __init__(self, base: nn.Module, keys: list[torch.Tensor], values: list[torch.Tensor],
                 bos_id: int | None):
        super().__init__()
        if len(keys) != len(base.layers):
            raise ForgebenchError(f"the cartridge has rows for {len(keys)} layers; the model "
                                  f"has {len(base.layers)}", where="--cartridge")
        self.base = base
        self.keys, self.values = keys, values
        self.tokens = keys[0].shape[1]
        self.bos_id = bos_id                  # row 0 is this BOS: a prompt's own is not read
        self.shift = self.tokens - 1 if bos_id is not None else self.tokens
        self.config = dataclasses.replace(base.config,
                                          max_seq_len=base.config.max_seq_len - self.shift)

    @classmethod
    def of(cls, base: nn.Module, cartridge: Cartridge, tokenizer) -> "CartridgeModel":
        bos = tokenizer.bos_id if cartridge.meta.get("leading_bos") else None
        first = next(base.parameters(), None)
        dtype = first.dtype if first is not None else torch.float32
        return cls(base, [k.to(dtype) for k in cartridge.keys],
                   [v.to(dtype) for v in cartridge.values], bos)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    def new_cache(self, batch: int, max_len: int):
        """A cache of the base with the rows in its first p positions, `max_len` more after."""
        def rows(tensors):
            return [t.unsqueeze(0).expand(batch, -1, -1, -1) for t in tensors]

        cache, _ = prefix_cache(self.base, rows(self.keys), rows(self.values),
                                max_len + self.shift)
        return cache

    def hidden(self, tokens: torch.Tensor, start_pos: int = 0, cache=None,
               lengths: list[int] | None = None, rows: torch.Tensor | None = None):
        """The base's hidden states of `tokens` read after the rows: prompt position i at
        p - 1 + i (row 0 is the BOS; the prompt's own BOS is dropped, its row not returned)
        or, without a BOS row, at p + i."""
        if lengths is not None:
            raise ValueError("a cartridge reads one sequence per batch row (no packing)")
        if cache is None:
            cache = self.new_cache(tokens.shape[0], tokens.shape[1])
        if start_pos == 0 and self.bos_id is not None:
            if not bool((tokens[:, 0] == self.bos_id).all()) or tokens.shape[1] < 2:
                raise ValueError("a prompt read after a cartridge starts with BOS and has a "
                                 "token after it")
            tokens, start_pos = tokens[:, 1:], 1
            rows = rows[:, 1:] if rows is not None else None
        return self.base.hidden(tokens, start_pos + self.shift, cache, rows=rows)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.base.logits(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden(tokens))


def attach_cartridge(model: nn.Module, tokenizer, path: str | Path) -> CartridgeModel:
    """A GGUF-loaded model reading the cartridge at `path` first (`--cartridge`, a load
    request's "cartridge"): refused unless it was trained on this very file."""
    return CartridgeModel.of(model, load_cartridge(path, model.gguf.sha256()), tokenizer)
