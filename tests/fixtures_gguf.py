"""Tiny random GGUF fixtures for every supported family and quant type, written with the `gguf`
package's GGUFWriter so that llama.cpp, the `gguf` package and the engine can all load them.

    write_tiny_gguf(path, arch="llama", qtype="Q4_K", vocab="spm", seed=0) -> Path

`vocab="spm"` writes a SentencePiece-style (`llama` model) vocabulary with scores and byte-fallback
tokens; `vocab="bpe"` a byte-level BPE (`gpt2` model) vocabulary with merges. Weights are random;
K-quant tensors are random valid blocks (finite f16 scales), the other types are quantized from
random f32 values with `gguf.quantize`.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# Shapes: K-quant rows need multiples of 256 elements.
DIM, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN = 256, 4, 2, 64, 512
SPM_WORDS = ["▁the", "▁a", "▁of", "▁and", "▁to", "▁in", "▁is", "▁that", "▁it", "▁for", "▁hello",
             "▁world", "ing", "er", "ed", "▁th", "he", "in", "an", "re", "on", "at", "en", "▁\n"]
BPE_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"),
              ("o", "n"), ("Ġ", "w"), ("r", "e"), ("Ġ", "s"), ("a", "t"), ("e", "n"),
              ("Ġ", "h"), ("l", "l"), ("Ġh", "e"), ("Ġhe", "ll"), ("Ġhell", "o"), ("Ċ", "Ċ")]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what `gpt2` vocabularies are written
    in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def spm_vocab(arch: str) -> dict:
    """SentencePiece-style vocabulary: <unk>/<s>/</s>, 256 byte tokens, words with scores."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] if arch == "gemma3" else ["<unk>", "<s>",
                                                                              "</s>"]
    tokens, types, scores = [], [], []
    for s in specials:
        tokens.append(s)
        types.append(gguf.TokenType.UNKNOWN if s == "<unk>" else gguf.TokenType.CONTROL)
        scores.append(0.0)
    if arch == "gemma3":
        for s in ("<start_of_turn>", "<end_of_turn>"):
            tokens.append(s)
            types.append(gguf.TokenType.CONTROL)
            scores.append(0.0)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    pieces = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + SPM_WORDS
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1.0 - 0.01 * i)
    unk = tokens.index("<unk>")
    bos = tokens.index("<bos>" if arch == "gemma3" else "<s>")
    eos = tokens.index("<eos>" if arch == "gemma3" else "</s>")
    return dict(model="llama", pre=None, tokens=tokens, types=types, scores=scores, merges=None,
                bos=bos, eos=eos, unk=unk, add_bos=True, add_eos=False)


def bpe_vocab(arch: str) -> dict:
    """Byte-level BPE vocabulary: 256 byte characters, merged pieces, special tokens."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    for a, b in BPE_MERGES:
        tokens.append(a + b)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        tokens.append(s)
        types.append(gguf.TokenType.CONTROL)
    pre = "qwen2" if arch.startswith("qwen") else "llama-bpe"
    eos = tokens.index("<|im_end|>" if arch.startswith("qwen") else "<|endoftext|>")
    return dict(model="gpt2", pre=pre, tokens=tokens, types=types, scores=None,
                merges=[f"{a} {b}" for a, b in BPE_MERGES], bos=tokens.index("<|endoftext|>"),
                eos=eos, unk=None, add_bos=not arch.startswith("qwen"), add_eos=False)


def _random_k_blocks(rng: np.random.Generator, qtype: T, n_blocks: int) -> np.ndarray:
    """Random but valid K-quant blocks with small finite f16 super-block scales."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype in (T.Q4_K, T.Q5_K):
        d = rng.uniform(1e-4, 3e-4, (n_blocks, 2)).astype(np.float16).view(np.uint8)
        blocks[:, 0:4] = d.reshape(n_blocks, 4)
    elif qtype == T.Q6_K:
        blocks[:, 192:208] = rng.integers(-20, 21, (n_blocks, 16)).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = rng.uniform(1e-4, 3e-4, (n_blocks,
                                                      1)).astype(np.float16).view(np.uint8)
    return blocks


def encode_tensor(rng: np.random.Generator, shape: tuple[int, ...], qtype: T, std: float = 0.05,
                  mean: float = 0.0) -> np.ndarray:
    """Random tensor of torch-order `shape` in `qtype` block format (as GGUFWriter takes it)."""
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        bs, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[:-1]))
        return _random_k_blocks(rng, qtype, rows * shape[-1] // bs).reshape(rows, -1) \
            .reshape(*shape[:-1], shape[-1] // bs * size)
    x = (mean + std * rng.standard_normal(shape)).astype(np.float32)
    if qtype == T.F32:
        return x
    if qtype == T.F16:
        return x.astype(np.float16)
    return gguf.quantize(x, qtype)


def write_tiny_gguf(path: str | Path, arch: str = "llama", qtype: str = "Q4_K",
                    vocab: str = "spm", seed: int = 0, *, n_layers: int | None = None,
                    tie_embeddings: bool | None = None, metadata: dict | None = None,
                    context_length: int = 256) -> Path:
    """Write a tiny random `arch` model whose 2-D weights are stored as `qtype`.

    `metadata` adds or overrides keys ({arch} in a key is replaced), for bad-input tests.
    Returns the path.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}")
    path = Path(path)
    rng = np.random.default_rng(seed)
    qt = T[qtype]
    voc = spm_vocab(arch) if vocab == "spm" else bpe_vocab(arch)
    n_vocab = len(voc["tokens"])
    n_layers = n_layers or (6 if arch == "gemma3" else 2)
    tie = tie_embeddings if tie_embeddings is not None else arch in ("gemma3", "qwen3")

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{qtype}")
    _add_hyperparameters(w, arch, n_layers, context_length)
    _add_vocab(w, voc)
    _add_metadata(w, arch, metadata or {})
    _add_tensors(w, rng, arch, qt, n_vocab, n_layers, tie)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_hyperparameters(w, arch: str, n_layers: int, context_length: int) -> None:
    w.add_context_length(context_length)
    w.add_embedding_length(DIM)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6 if arch != "llama" else 1e-5)
    w.add_rope_freq_base(1_000_000.0 if arch != "llama" else 10_000.0)
    if arch == "gemma3":
        w.add_sliding_window(4)          # tiny window so the local/global pattern matters in tests
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _add_vocab(w, voc: dict) -> None:
    w.add_tokenizer_model(voc["model"])
    if voc["pre"]:
        w.add_tokenizer_pre(voc["pre"])
    w.add_token_list(voc["tokens"])
    w.add_token_types(voc["types"])
    if voc["scores"] is not None:
        w.add_token_scores(voc["scores"])
    if voc["merges"] is not None:
        w.add_token_merges(voc["merges"])
    w.add_bos_token_id(voc["bos"])
    w.add_eos_token_id(voc["eos"])
    if voc["unk"] is not None:
        w.add_unk_token_id(voc["unk"])
    w.add_add_bos_token(voc["add_bos"])
    w.add_add_eos_token(voc["add_eos"])


def _add_metadata(w, arch: str, metadata: dict) -> None:
    """Added or overriding keys ({arch} in a key is replaced), typed by their Python value."""
    for key, value in metadata.items():
        key = key.replace("{arch}", arch)
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))


def _add_tensors(w, rng, arch: str, qt, n_vocab: int, n_layers: int, tie: bool) -> None:
    """Every tensor, drawn from `rng` in file order."""
    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", encode_tensor(rng, (n_vocab, DIM), qt, std=0.5), raw_dtype=qt)
    kv = N_KV_HEADS * HEAD_DIM
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(DIM))
        for name, shape in (("attn_q", (N_HEADS * HEAD_DIM, DIM)), ("attn_k", (kv, DIM)),
                            ("attn_v", (kv, DIM)), ("attn_output", (DIM, N_HEADS * HEAD_DIM)),
                            ("ffn_gate", (FFN, DIM)), ("ffn_up", (FFN, DIM)), ("ffn_down", (DIM,
                                                                                            FFN))):
            w.add_tensor(p + name + ".weight", encode_tensor(rng, shape, qt), raw_dtype=qt)
        if arch == "qwen2":
            for name, n in (("attn_q", N_HEADS * HEAD_DIM), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(p + name + ".bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            w.add_tensor(p + "attn_q_norm.weight", norm(HEAD_DIM))
            w.add_tensor(p + "attn_k_norm.weight", norm(HEAD_DIM))
        w.add_tensor(p + "ffn_norm.weight", norm(DIM))
        if arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", norm(DIM))
            w.add_tensor(p + "post_ffw_norm.weight", norm(DIM))
    w.add_tensor("output_norm.weight", norm(DIM))
    if not tie:
        w.add_tensor("output.weight", encode_tensor(rng, (n_vocab, DIM), qt), raw_dtype=qt)
