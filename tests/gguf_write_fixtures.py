"""Dense (f32/f16/bf16) tiny llama GGUF files for the quantize / convert / writer tests.

tests/fixtures_gguf.py writes every family at one width (rows of 256); the quantizer needs dense
sources at two widths: rows that are a multiple of 256 (K-quants apply) and Gemma-3-270m's 640
(K-quants fall back to Q5_0 / Q8_0), and weights with the awkward blocks a real checkpoint has:
an all-zero row, a constant run, outliers, tiny and large row scales.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from fixtures_gguf import spm_vocab
from gguf import GGMLQuantizationType as T

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def awkward_weights(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Gaussian rows with per-row scales over five decades, plus the blocks quantizers trip on."""
    rows, cols = shape
    x = rng.standard_normal(shape) * np.exp(rng.uniform(np.log(1e-3), np.log(2.0), (rows, 1)))
    x[0] = 0.0                                         # all-zero row (zero-scale blocks)
    x[1, : min(cols, 96)] = 0.125                      # constant run
    x[2, ::7] *= 40.0                                  # outliers
    x[3] = np.abs(x[3])                                # one-signed rows (min clamps to 0)
    x[4] = -np.abs(x[4])
    x[5, :64] = rng.integers(-4, 5, 64) / 8.0          # values exactly on a coarse grid
    return x.astype(np.float32)


def _encode(values: np.ndarray, dtype: T) -> np.ndarray:
    if dtype == T.F32:
        return values
    if dtype == T.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, dtype)


def write_dense_llama(path: str | Path, *, dim: int = 256, ffn: int = 512, n_layers: int = 2,
                      head_dim: int = 64, n_kv_heads: int = 2, dtype: str = "F16",
                      seed: int = 0, tie_embeddings: bool = False) -> Path:
    """A llama-architecture GGUF that llama.cpp's llama_model_quantize accepts, with every
    matrix stored as `dtype` (F32, F16 or BF16) and norms as f32."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    kind = T[dtype]
    voc = spm_vocab("llama")
    n_vocab = len(voc["tokens"])
    n_heads = dim // head_dim

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"dense-llama-{dim}-{dtype}")
    w.add_context_length(128)
    w.add_embedding_length(dim)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "BF16": gguf.LlamaFileType.MOSTLY_BF16}[dtype])
    w.add_tokenizer_model(voc["model"])
    w.add_token_list(voc["tokens"])
    w.add_token_types(voc["types"])
    w.add_token_scores(voc["scores"])
    w.add_bos_token_id(voc["bos"])
    w.add_eos_token_id(voc["eos"])
    w.add_unk_token_id(voc["unk"])
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_int32("forgebench.test_signed", -7)          # typed values must survive as typed
    w.add_array("forgebench.test_floats", [0.5, -1.25, 3.0])

    def matrix(name: str, shape: tuple[int, int]) -> None:
        w.add_tensor(name, _encode(awkward_weights(rng, shape), kind), raw_dtype=kind)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32))

    matrix("token_embd.weight", (n_vocab, dim))
    kv = n_kv_heads * head_dim
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", (dim, dim))
        matrix(p + "attn_k.weight", (kv, dim))
        matrix(p + "attn_v.weight", (kv, dim))
        matrix(p + "attn_output.weight", (dim, dim))
        norm(p + "ffn_norm.weight")
        matrix(p + "ffn_gate.weight", (ffn, dim))
        matrix(p + "ffn_up.weight", (ffn, dim))
        matrix(p + "ffn_down.weight", (dim, ffn))
    norm("output_norm.weight")
    if not tie_embeddings:
        matrix("output.weight", (n_vocab, dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_quantize(src: Path, dst: Path, dtype: str) -> Path:
    """llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize, one thread) on `src`
    with the file type forgebench names `dtype` — the oracle for the quantize tests."""
    import ctypes

    import llama_cpp

    from engine.gguf.quant_policy import FILE_TYPES

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(FILE_TYPES[dtype])
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                            ctypes.byref(params))
    assert status == 0, f"llama_model_quantize failed on {src}"
    return Path(dst)
