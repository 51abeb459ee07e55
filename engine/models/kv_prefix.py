"""The attention prefix hook: a KV cache whose first P positions hold given key/value rows, so a
decoder attends to them as to P tokens it has already seen, and the tokens after them start at
position P (their RoPE angles offset by P; the rows' keys carry their own positions already).

Rows come from anywhere: a real prefix's cache (`prefix_rows`), or trained tensors (a
trained-KV-prefix recipe: the rows are parameters, and the cache write keeps them in the
autograd graph, so gradients reach them through every attention that reads them). Any decoder
with `new_cache(batch, max_len)` and `hidden(tokens, start_pos, cache)` takes it (Llama, Qwen,
Gemma 3).
"""

from __future__ import annotations

import torch

from engine.models.blocks import KVCache


def prefix_cache(model, keys: list[torch.Tensor], values: list[torch.Tensor],
                 max_len: int) -> tuple[KVCache, int]:
    """(a cache of `max_len` positions seeded with the rows, the position the next token takes).

    `keys[i]` and `values[i]` are layer i's rows [B, n_kv_heads, P, head_dim], rotary already
    applied to the keys (as a cache holds them)."""
    layers = len(model.layers)
    if len(keys) != layers or len(values) != layers:
        raise ValueError(f"a prefix needs rows for each of the {layers} layers; got "
                         f"{len(keys)} key and {len(values)} value tensors")
    batch, heads, length, dim = keys[0].shape
    cache = model.new_cache(batch, max_len)
    expected = (batch, cache.k[0].shape[1], length, cache.k[0].shape[3])
    for layer, (k, v) in enumerate(zip(keys, values)):
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"layer {layer}: prefix rows must be {list(expected)} "
                             f"(batch, kv heads, positions, head dim); got {list(k.shape)} "
                             f"and {list(v.shape)}")
        cache.update(layer, 0, k, v)
    return cache, length


def prefix_rows(cache: KVCache, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The first `length` positions of a cache, per layer (copies): what `prefix_cache` takes."""
    return ([k[:, :, :length].clone() for k in cache.k],
            [v[:, :, :length].clone() for v in cache.v])
