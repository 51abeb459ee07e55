"""An lm-pretrain checkpoint as a llama-architecture GGUF, tokenizer included.

The model is already llama.cpp's LLAMA graph (RMSNorm, adjacent-pair RoPE, GQA, SwiGLU), so the
weights are written as they are, unpermuted. The tokenizer becomes a `gpt2` (byte-level BPE)
vocabulary that llama.cpp tokenizes identically:

- the byte tokenizer: ids 0-255 are GPT-2's printable spellings of the 256 bytes, in byte order,
  then `<bos>` and `<eos>` as control tokens, and no merges — every byte stays its own token;
- the trained BPE: its vocabulary (each token is already spelled in GPT-2's byte alphabet) and
  its merges in rank order, with the GPT-2 word-splitting regex it was trained with ("gpt-2").

Written in f32, f16 or bf16 (norms stay f32); quantized types go through `forgebench convert`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import LlamaFileType, TokenType, quants

from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.gguf.constants import SOURCE_SHA_KEY, gguf_tensor_name
from engine.gguf.quant_policy import FILE_TYPES
from engine.gguf.writer import MetaValue, TensorEntry, write_gguf
from engine.models.llama import Llama
from engine.models.nanochat import gguf_refusal
from engine.rundir import Checkpoint, RunDir

DENSE_TYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16}

# Llama parameters in llama.cpp's file order ("{i}" = layer); GGUF names come from
# engine.gguf.constants.gguf_tensor_name, the loader's own mapping
TENSOR_ORDER = (
    "tok_embeddings.weight",
    "layers.{i}.attn_norm.weight", "layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight",
    "layers.{i}.attn.v.weight", "layers.{i}.attn.o.weight", "layers.{i}.mlp_norm.weight",
    "layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight", "layers.{i}.mlp.down.weight",
    "norm.weight", "output.weight",
)


def _s(value: str) -> MetaValue:
    return MetaValue(V.STRING, value)


def _u32(value: int) -> MetaValue:
    return MetaValue(V.UINT32, int(value))


def _f32(value: float) -> MetaValue:
    return MetaValue(V.FLOAT32, float(value))


def _strings(values: list[str]) -> MetaValue:
    return MetaValue(V.ARRAY, values, V.STRING)


def tokenizer_metadata(tokenizer) -> dict[str, MetaValue]:
    """`tokenizer.ggml.*` keys for a ByteTokenizer or BPETokenizer (engine.text_tokenizers)."""
    from engine.llm.tokenizer import BYTE_TO_CHAR

    if tokenizer.kind == "nanochat":
        raise ForgebenchError(
            "llama.cpp has no pre-tokenizer for nanochat's split pattern (GPT-4's, with digit "
            "runs of at most two), so a GGUF would tokenise differently", where="tokenizer.json",
            hint="train with tokenizer.kind = \"bpe\" for a model to export")
    if tokenizer.kind == "byte":
        tokens = list(BYTE_TO_CHAR) + ["<bos>", "<eos>"]
        merges: list[str] = []
    else:
        data = json.loads(tokenizer.to_json())
        vocab = data["model"]["vocab"]
        tokens = [None] * tokenizer.vocab_size
        for text, index in vocab.items():
            tokens[index] = text
        for added in data.get("added_tokens", []):
            tokens[added["id"]] = added["content"]
        if any(t is None for t in tokens):
            raise ForgebenchError("the BPE vocabulary has gaps in its ids",
                                  where="tokenizer.json", hint="retrain the tokenizer")
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    specials = {tokenizer.bos_id, tokenizer.eos_id}
    types = [int(TokenType.CONTROL if i in specials else TokenType.NORMAL)
             for i in range(len(tokens))]
    return {
        "tokenizer.ggml.model": _s("gpt2"),
        "tokenizer.ggml.pre": _s("gpt-2"),
        "tokenizer.ggml.tokens": _strings(tokens),
        "tokenizer.ggml.token_type": MetaValue(V.ARRAY, np.array(types, dtype=np.int32), V.INT32),
        "tokenizer.ggml.merges": _strings(merges),
        "tokenizer.ggml.bos_token_id": _u32(tokenizer.bos_id),
        "tokenizer.ggml.eos_token_id": _u32(tokenizer.eos_id),
        "tokenizer.ggml.add_bos_token": MetaValue(V.BOOL, True),   # lm-pretrain starts at <bos>
        "tokenizer.ggml.add_eos_token": MetaValue(V.BOOL, False),
    }


def model_metadata(config, name: str, file_type: LlamaFileType) -> dict[str, MetaValue]:
    """`general.*` and `llama.*` keys for an lm-pretrain LlamaConfig."""
    return {
        "general.architecture": _s("llama"),
        "general.type": _s("model"),
        "general.name": _s(name),
        "general.file_type": _u32(int(file_type)),
        "llama.vocab_size": _u32(config.vocab_size),
        "llama.context_length": _u32(config.max_seq_len),
        "llama.embedding_length": _u32(config.dim),
        "llama.block_count": _u32(config.n_layers),
        "llama.feed_forward_length": _u32(config.ffn_dim),
        "llama.rope.dimension_count": _u32(config.head_dim),
        "llama.attention.head_count": _u32(config.n_heads),
        "llama.attention.head_count_kv": _u32(config.n_kv_heads),
        "llama.attention.layer_norm_rms_epsilon": _f32(config.norm_eps),
        "llama.rope.freq_base": _f32(config.rope_theta),
    }


def gguf_tensors(state: dict, n_layers: int, dtype: str) -> list[TensorEntry]:
    """The model's tensors in llama.cpp's file order; matrices in `dtype`, norms in f32."""

    target = DENSE_TYPES[dtype]
    entries = []
    for key in TENSOR_ORDER:
        for i in range(n_layers if "{i}" in key else 1):
            module_name = key.format(i=i)
            if module_name not in state:
                continue                                   # tied: no output.weight
            values = state[module_name].detach().float().contiguous().numpy()
            kind = target if values.ndim == 2 else T.F32
            entries.append(TensorEntry(gguf_tensor_name(module_name), kind, values.shape,
                                       quants.quantize(values, kind)))
    return entries


def write_llama_gguf(model, tokenizer, out: str | Path, dtype: str = "f32", *, name: str,
                     source_sha256: str | None = None, chat_template: str | None = None,
                     progress: Callable | None = None) -> Path:
    """Write a Llama model (engine.models.llama) and its byte/BPE tokenizer as a llama GGUF."""
    if dtype not in DENSE_TYPES:
        raise ForgebenchError(f"lm-pretrain models are written as f32, f16 or bf16, not {dtype}",
                              where="--dtype", hint="quantized types go through convert")
    out = Path(out)
    if out.exists():
        raise ForgebenchError("the output file already exists; refusing to overwrite it",
                              path=out, where="--out", hint="choose a new name")
    cfg = model.config
    metadata = model_metadata(cfg, name, FILE_TYPES[dtype])
    metadata.update(tokenizer_metadata(tokenizer))
    if source_sha256:
        metadata[SOURCE_SHA_KEY] = _s(source_sha256)
    if chat_template:
        metadata["tokenizer.chat_template"] = _s(chat_template)
    tensors = gguf_tensors(model.state_dict(), cfg.n_layers, dtype)
    return write_gguf(out, metadata, tensors, progress=progress)


def write_pretrain_gguf(run: RunDir, checkpoint: Checkpoint, out: str | Path, dtype: str = "f32",
                        progress: Callable | None = None, chat_template: str | None = None) -> Path:
    """Write an lm-pretrain checkpoint as a llama GGUF at `out` (must not exist); lm-sft passes
    the chat layout it fine-tuned with as `chat_template`."""
    from engine.recipes.lm_pretrain import load_model
    from engine.train.checkpoint import MODEL_FILE

    model, tokenizer, _ = load_model(run, checkpoint)
    if not isinstance(model, Llama):
        raise gguf_refusal()
    return write_llama_gguf(model, tokenizer, out, dtype,
                            name=f"{run.path.name}-{checkpoint.name}",
                            source_sha256=sha256_file(checkpoint.path / MODEL_FILE),
                            chat_template=chat_template, progress=progress)
