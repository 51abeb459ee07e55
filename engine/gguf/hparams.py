"""A decoder GGUF's hyper-parameters as its family config takes them (engine.models.gemma3
Gemma3Config, engine.models.llama LlamaConfig and the Qwen variants), read and checked without
torch: engine.models.gguf_model builds the torch model's config from them, and the torch-free
generate path (engine/llm/native_lm.py) reads the same values."""

from __future__ import annotations

from engine.errors import ForgebenchError
from engine.gguf.reader import GGUFFile, check_architecture


def model_hparams(gf: GGUFFile) -> tuple[str, dict]:
    """(architecture, the family config's fields) from GGUF metadata, keys as llama.cpp's
    llama-model.cpp reads them, each checked."""
    arch = check_architecture(gf)
    dim = gf.require_int("{arch}.embedding_length")
    n_heads = gf.require_int("{arch}.attention.head_count")
    n_kv_heads = gf.require_int("{arch}.attention.head_count_kv", n_heads)
    if n_heads % n_kv_heads:
        raise ForgebenchError(f"{n_heads} attention heads cannot be shared by {n_kv_heads} "
                              "key/value heads", path=gf.path,
                              where=f"{arch}.attention.head_count_kv",
                              hint="the file's metadata is corrupt")
    head_dim = gf.require_int("{arch}.attention.key_length", dim // n_heads or 1)
    if gf.require_int("{arch}.attention.value_length", head_dim) != head_dim:
        raise ForgebenchError("key_length != value_length is not supported", path=gf.path,
                              where=f"{arch}.attention.value_length")
    if gf.require_int("{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ForgebenchError("partial rotary embeddings are not supported", path=gf.path,
                              where=f"{arch}.rope.dimension_count")
    n_vocab = gf.tensor("token_embd.weight").shape[0]
    tokens = gf.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != n_vocab:
        raise ForgebenchError(f"vocabulary has {len(tokens)} tokens but token_embd.weight has "
                              f"{n_vocab} rows", path=gf.path, where="token_embd.weight",
                              hint="the tokenizer and the weights come from different models")
    scaling = gf.get("{arch}.rope.scaling.type", "none")
    factor = gf.require_float("{arch}.rope.scaling.factor", 1.0) or 1.0
    common = dict(vocab_size=n_vocab, dim=dim, n_layers=gf.require_int("{arch}.block_count"),
                  n_heads=n_heads, n_kv_heads=n_kv_heads,
                  ffn_dim=gf.require_int("{arch}.feed_forward_length"),
                  norm_eps=gf.require_float("{arch}.attention.layer_norm_rms_epsilon"),
                  max_seq_len=gf.require_int("{arch}.context_length", 4096),
                  tie_embeddings="output.weight" not in gf.tensors)
    if arch == "gemma3":
        n_layers = common["n_layers"]
        period = gf.require_int("{arch}.attention.sliding_window_pattern", 6)
        if scaling not in ("none", "linear"):
            raise ForgebenchError(f"rope scaling {scaling!r} is not supported", path=gf.path,
                                  where=f"{arch}.rope.scaling.type")
        return arch, dict(**common, head_dim=head_dim,
                          rope_theta=gf.require_float("{arch}.rope.freq_base", 1_000_000.0),
                          rope_scale=factor if scaling == "linear" else 1.0,
                          sliding_window=gf.require_int("{arch}.attention.sliding_window"),
                          sliding=[(i % period) < period - 1 for i in range(n_layers)],
                          final_softcap=gf.require_float("{arch}.final_logit_softcapping",
                                                         0.0) or None)
    if scaling not in ("none",) and not (scaling == "linear" and factor == 1.0):
        raise ForgebenchError(f"rope scaling {scaling!r} is not supported for {arch}", path=gf.path,
                              where=f"{arch}.rope.scaling.type")
    return arch, dict(**common, head_dim=head_dim,
                      rope_theta=gf.require_float("{arch}.rope.freq_base", 10_000.0))


__all__ = ["model_hparams"]
