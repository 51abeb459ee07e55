"""HF -> GGUF against llama.cpp's own converter, and the logits against transformers and llama.cpp.

Oracles: llama.cpp's `convert_hf_to_gguf.py` (extracted from the llama-cpp-python sdist by
`make verify-extra`), `llama_model_quantize` for the k-quants (on the converter's f16 file),
`transformers` for the logits of the HF folder, llama-cpp-python for the logits of the files.
The models are tiny random ones `transformers` builds from a config (one per family) with a
SentencePiece tokenizer trained offline (tests/hf_fixtures.py).

Nothing llama.cpp writes differs: the whole files are compared byte for byte. (A k-quant file is
what llama-quantize makes of the converter's f16 file: its tensors in llama.cpp's loader order
and general.quantization_version / general.file_type moved to the end, as llama-quantize writes
them; engine.hf.convert writes the same.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_fixtures import FAMILIES, llama_convert, make_checkpoint, require_converter

from engine.gguf.writer import read_gguf_content
from engine.hf.convert import convert_hf

pytestmark = [pytest.mark.llamacpp, pytest.mark.peft]   # llama-cpp-python + transformers
DTYPES = ("f16", "q8_0", "q4_k_m")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (folder, {dtype: llama.cpp's file}), built once per module."""
    require_converter()
    from gguf_write_fixtures import llama_quantize

    root = tmp_path_factory.mktemp("hf-oracle")
    out = {}
    for family in FAMILIES:
        folder = make_checkpoint(family, root / f"tiny-{family}")
        refs = {d: llama_convert(folder, root / f"{family}-{d}.gguf", d) for d in ("f16", "q8_0")}
        refs["q4_k_m"] = llama_quantize(refs["f16"], root / f"{family}-q4_k_m.gguf", "q4_k_m")
        out[family] = folder, refs
    return out


def _diff(ours: Path, ref: Path) -> list[str]:
    """What differs between two GGUF files, key by key and tensor by tensor."""
    a, b = read_gguf_content(ours), read_gguf_content(ref)
    problems = []
    if list(a.metadata) != list(b.metadata):
        problems.append(f"key order: {list(a.metadata)} != {list(b.metadata)}")
    problems += [f"key {k}" for k in b.metadata if k in a.metadata
                 and a.metadata[k] != b.metadata[k]]
    if [t.name for t in a.tensors] != [t.name for t in b.tensors]:
        problems.append("tensor order")
    refs = {t.name: t for t in b.tensors}
    for t in a.tensors:
        r = refs.get(t.name)
        if r is None or (t.ggml_type, t.shape) != (r.ggml_type, r.shape) \
                or bytes(t.data) != bytes(r.data):
            problems.append(f"tensor {t.name}")
    return problems


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_file_equals_llama_cpps(tmp_path, checkpoints, family, dtype):
    folder, refs = checkpoints[family]
    ours = convert_hf(folder, tmp_path / "ours.gguf", dtype).path
    assert _diff(ours, refs[dtype]) == []
    assert ours.read_bytes() == refs[dtype].read_bytes()
    if dtype == "q4_k_m":    # the k-quant policy ran (not a float file in disguise)
        kinds = {t.ggml_type.name for t in read_gguf_content(ours).tensors}
        assert {"Q4_K", "Q6_K"} <= kinds


def test_twin_a_missing_row_permutation_is_caught(tmp_path, checkpoints, monkeypatch):
    """Without Llama's Q/K permutation the comparison names exactly those tensors."""
    import engine.hf.convert as conv

    monkeypatch.setattr(conv, "_permute_rows", lambda x, n_heads: x)
    folder, refs = checkpoints["llama"]
    ours = convert_hf(folder, tmp_path / "ours.gguf", "f16").path
    assert sorted(_diff(ours, refs["f16"])) == sorted(
        f"tensor blk.{i}.attn_{k}.weight" for i in range(2) for k in "qk")


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logits_on_the_folder_and_the_file_match_transformers(tmp_path, family):
    """An f32 checkpoint, so converting to f16 really rounds: the engine on the folder equals
    transformers to float error; on the f16 file, to f16 rounding of the weights."""
    import transformers

    from engine.models.gguf_model import load_gguf_model

    folder = make_checkpoint(family, tmp_path / f"tiny-{family}", dtype="float32", seed=3)
    convert_hf(folder, tmp_path / "m.gguf", "f16")
    ids = torch.tensor([[1, 17, 42, 99, 5, 250, 7, 3]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    from_folder, _ = load_gguf_model(folder, tokenizer=False)
    from_file, _ = load_gguf_model(tmp_path / "m.gguf", tokenizer=False)
    with torch.no_grad():
        ref, a, b = hf(ids).logits, from_folder(ids), from_file(ids)
    scale = ref.abs().max().item()
    assert (a - ref).abs().max().item() <= 1e-5 * scale
    f16_err = (b - a).abs().max().item()
    assert 0 < f16_err <= 5e-3 * scale      # rounded (the f16 file is not the f32 folder)...
    assert f16_err < 0.05 * (b - ref).abs().max().item() + 5e-3 * scale   # ...and no more


def test_llama_cpp_logits_on_our_file_equal_its_own(tmp_path, checkpoints):
    from engine.export.llamacpp import open_llama

    ids = [1, 17, 42, 99, 5, 250, 7, 3]
    scores = {}
    for family in ("llama", "gemma3"):
        folder, refs = checkpoints[family]
        ours = convert_hf(folder, tmp_path / f"{family}.gguf", "q4_k_m").path
        for label, path in (("ours", ours), ("theirs", refs["q4_k_m"])):
            llm = open_llama(path, n_ctx=64, logits_all=True, n_threads=1, verbose=False)
            llm.eval(ids)
            scores[family, label] = np.array(llm.scores[: len(ids)])
            llm.close()
        assert np.array_equal(scores[family, "ours"], scores[family, "theirs"])
        assert np.isfinite(scores[family, "ours"]).all()


def test_a_hand_written_config_gets_transformers_defaults_as_llama_cpp_does(tmp_path):
    """config.json without head_dim, rms_norm_eps or rope settings (older or hand-written
    checkpoints): llama.cpp's converter reads it through transformers' AutoConfig, which fills
    the class defaults in; the file records the same values."""
    from hf_fixtures import make_raw_llama

    folder = make_raw_llama(tmp_path / "raw-llama", shards=2)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("rms_norm_eps", "rope_theta"):
        cfg.pop(key)
    (folder / "config.json").write_text(json.dumps(cfg))
    ref = llama_convert(folder, tmp_path / "ref.gguf", "q8_0")
    ours = convert_hf(folder, tmp_path / "ours.gguf", "q8_0").path
    assert _diff(ours, ref) == []
    assert ours.read_bytes() == ref.read_bytes()
    keys = read_gguf_content(ours).metadata
    assert keys["llama.attention.key_length"].value == 32           # hidden // heads
    assert keys["llama.rope.freq_base"].value == 10000.0


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_byte_level_bpe_tokenizer_equals_llama_cpps(tmp_path, monkeypatch, family):
    """The tokenizer.json path (Qwen2/2.5/3, Llama 3): vocabulary, token types, merges, special
    ids. llama.cpp knows a BPE pre-tokenizer only by the hash of its output on a check text;
    this one is trained here, so both sides are told it is "qwen2"."""
    from hf_fixtures import llama_convert_as_known_pre, write_bpe_tokenizer

    import engine.hf.tokenizer as hf_tok

    folder = make_checkpoint(family, tmp_path / f"bpe-{family}")
    digest = write_bpe_tokenizer(folder)
    ref = llama_convert_as_known_pre(folder, tmp_path / "ref.gguf", "f16", "qwen2")
    with pytest.raises(Exception, match="does not know this tokenizer"):
        convert_hf(folder, tmp_path / "unknown.gguf", "f16")      # refused, as llama.cpp does
    monkeypatch.setitem(hf_tok.KNOWN_PRE, digest, "qwen2")
    ours = convert_hf(folder, tmp_path / "ours.gguf", "f16").path
    assert _diff(ours, ref) == []
    assert ours.read_bytes() == ref.read_bytes()
    meta = read_gguf_content(ours).metadata
    assert meta["tokenizer.ggml.model"].python() == "gpt2"
    assert len(meta["tokenizer.ggml.merges"].python()) > 0


def test_mistral_converts_as_llama_cpp_converts_it(tmp_path):
    """MistralForCausalLM: llama.cpp's LlamaModel path (Q/K permuted, llama metadata)."""
    import transformers
    from gguf_write_fixtures import llama_quantize

    from engine.models.gguf_model import load_gguf_model

    folder = make_checkpoint("mistral", tmp_path / "tiny-mistral", dtype="float32")
    ref = llama_convert(folder, tmp_path / "ref.gguf", "f16")
    ours = convert_hf(folder, tmp_path / "ours.gguf", "f16").path
    assert ours.read_bytes() == ref.read_bytes()
    ref_q = llama_quantize(ref, tmp_path / "ref-q.gguf", "q4_k_m")
    assert convert_hf(folder, tmp_path / "q.gguf", "q4_k_m").path.read_bytes() \
        == ref_q.read_bytes()
    ids = torch.tensor([[1, 17, 42, 99, 5, 250, 7, 3]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine_model, _ = load_gguf_model(folder, tokenizer=False)
    with torch.no_grad():
        theirs, mine = hf(ids).logits, engine_model(ids)
    assert (mine - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()
