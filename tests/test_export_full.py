"""Full fine-tuning runs export like merged models: the trained weights go into the base GGUF's
layout (metadata, tokenizer, tensor order, the base's dtypes), read back bit-exactly with the
`gguf` package against the checkpoint's safetensors; the staged report verifies the stage, and
llama.cpp answers the exported file as the engine answers the checkpoint. A checkpoint that
does not fit the base is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf_write_fixtures import write_dense_llama
from lm_pretrain_support import forgebench, make_corpus, write_config
from safetensors.torch import load_file

from engine.errors import ForgebenchError
from engine.export.merge import write_full_weights
from engine.fsutil import sha256_file
from engine.gguf.constants import FULL_WEIGHTS_KEY, gguf_tensor_name

torch.set_num_threads(1)

FULL_SFT = """\
recipe = "lm-sft"
seed = 3
steps = 3
save_every = 0

[model]
{model}

[data]
path = "{data}"
max_len = 64

[lora]
method = "full"

[optim]
lr = {lr}

[train]
window = 3
micro_batch = 3
"""

PAIRS = [("Say hello.", "Ahoy there!"), ("Name a color.", "Ahoy! Red."),
         ("What is the sea?", "Ahoy! Our home.")]


def _full_run(root: Path, model: str, lr: float = 1e-3) -> Path:
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"instruction": q, "response": a}) + "\n" for q, a in PAIRS))
    (root / "sft.toml").write_text(FULL_SFT.format(model=model, data=root / "pairs.jsonl", lr=lr))
    forgebench("run", str(root / "sft.toml"), "--out", str(root / "run"))
    return root / "run"


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("full")
    base = write_dense_llama(root / "base-f32.gguf", dim=128, ffn=256, head_dim=32,
                             n_kv_heads=2, n_layers=2, dtype="F32", seed=4)
    return _full_run(root, f'gguf = "{base}"'), base


def _checkpoint_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(sorted((run / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))


def test_the_loaders_names_map_every_trained_tensor_to_the_base(gguf_run):
    run, base = gguf_run
    names = {gguf_tensor_name(k) for k in _checkpoint_weights(run)}
    assert names == {t.name for t in GGUFReader(str(base)).tensors}
    assert gguf_tensor_name("layers.1.attn.q.weight") == "blk.1.attn_q.weight"
    assert gguf_tensor_name("layers.0.attn.k.bias") == "blk.0.attn_k.bias"
    assert gguf_tensor_name("rope.cos") is None


@pytest.mark.llamacpp
def test_a_full_run_exports_with_verified_weights_and_llamacpp_agrees(tmp_path, gguf_run):
    run, base = gguf_run
    forgebench("export", str(run), "--dtype", "f16", "--out", str(tmp_path / "e"))
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["checkpoint", "full weights", "converted"]
    full = report["stages"][1]
    assert full["vs_checkpoint"]["top1_agreement"] >= 0.99 and full["passed"]
    assert full["vs_checkpoint"]["max_abs_logit_diff"] < 1e-3      # f32 base: the same weights
    assert report["llamacpp"]["available"]
    # The checkpoint answers in f32, llama.cpp in its f16 arithmetic over f16 weights, and this
    # random base three steps from its init amplifies rounding (logits up to ~50, a different
    # op order alone moves them ~1e-3): a near-tie can flip a token or two, and which depends on
    # the CPU's kernels and on the last bits of training. Seen: on an AVX-512 machine answer 2
    # diverged at token 6 (top-1 agreement 99.5 %); on an AMX Xeon, with the fused training
    # passes, answers 5 and 6 diverged at token 30 of 32 (2 of 198 positions, 98.99 %) where
    # torch's op chains gave none. A trained model's agreement is held tighter below
    # (test_a_full_run_over_an_lm_pretrain_run_exports_and_llamacpp_agrees), and the bit-exact
    # comparison of one file is tests/test_gguf_llamacpp.py's (llama-F16 fixture).
    matches = report["llamacpp"]["greedy_vs_checkpoint"]["matches"]
    assert sum(matches) >= len(matches) - 2, matches
    assert report["llamacpp"]["vs_checkpoint"]["top1_agreement"] >= 0.98

    trained = _checkpoint_weights(run)
    exported = GGUFReader(str(tmp_path / "e" / "model.gguf"))
    original = {t.name: t for t in GGUFReader(str(base)).tensors}
    assert [t.name for t in exported.tensors] == list(original)         # the base's order
    changed = 0
    for tensor in exported.tensors:
        key = next(k for k in trained if gguf_tensor_name(k) == tensor.name)
        values = trained[key].float().numpy()
        if values.ndim == 2:        # f16 matrices: the checkpoint rounded to nearest f16
            assert tensor.tensor_type.name == "F16"
            expected = values.astype(np.float16)
        else:                       # norms stay f32
            assert tensor.tensor_type.name == "F32"
            expected = values
        np.testing.assert_array_equal(np.asarray(tensor.data).reshape(values.shape), expected)
        changed += not np.array_equal(values, np.asarray(original[tensor.name].data)
                                      .reshape(values.shape))
    assert changed == len(original)                                     # training moved them all
    meta = exported.fields[FULL_WEIGHTS_KEY]
    assert bytes(meta.parts[-1]).decode() == sha256_file(
        sorted((run / "checkpoints").glob("step-*"))[-1] / "model.safetensors")
    assert "tokenizer.chat_template" in exported.fields


def test_a_checkpoint_that_does_not_fit_the_base_is_refused_and_nothing_is_written(
        tmp_path, gguf_run):
    run, base = gguf_run
    weights = sorted((run / "checkpoints").glob("step-*"))[-1] / "model.safetensors"
    wider = write_dense_llama(tmp_path / "wider.gguf", dim=256, ffn=256, head_dim=32,
                              n_kv_heads=2, n_layers=2, dtype="F32", seed=4)
    with pytest.raises(ForgebenchError) as shape:
        write_full_weights(wider, weights, tmp_path / "out.gguf", sha256_file(wider))
    assert "[64, 128], but the base's blk.0.attn_k.weight is [64, 256]" in str(shape.value)
    assert shape.value.path == str(weights)
    deeper = write_dense_llama(tmp_path / "deeper.gguf", dim=128, ffn=256, head_dim=32,
                               n_kv_heads=2, n_layers=3, dtype="F32", seed=4)
    with pytest.raises(ForgebenchError) as missing:
        write_full_weights(deeper, weights, tmp_path / "out.gguf", sha256_file(deeper))
    assert "no weights for 9 base tensors" in str(missing.value)
    with pytest.raises(ForgebenchError) as other:
        write_full_weights(deeper, weights, tmp_path / "out.gguf", sha256_file(base))
    assert "trained on a different base" in str(other.value)
    assert not (tmp_path / "out.gguf").exists()
    refused = forgebench("export", str(run), "--dtype", "f16", "--base", str(wider),
                         "--out", str(tmp_path / "e"), "--no-report", check=False)
    assert refused.returncode != 0 and "different base" in refused.stderr
    assert not (tmp_path / "e").exists()
    adapter = forgebench("export", str(run), "--dtype", "adapter", "--out",
                         str(tmp_path / "a"), "--no-report", check=False)
    assert adapter.returncode != 0 and "full fine-tuned weights" in adapter.stderr


@pytest.mark.llamacpp
def test_a_full_run_over_an_lm_pretrain_run_exports_and_llamacpp_agrees(tmp_path):
    pretrain = write_config(tmp_path / "pretrain.toml", make_corpus(tmp_path), steps=8)
    forgebench("run", str(pretrain), "--out", str(tmp_path / "pre"))
    run = _full_run(tmp_path, f'run = "{tmp_path / "pre"}"', lr=3e-3)
    forgebench("export", str(run), "--dtype", "f32", "--out", str(tmp_path / "e"))
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["checkpoint", "full weights"]
    full = report["stages"][1]
    assert full["passed"] and full["vs_checkpoint"]["max_abs_logit_diff"] < 1e-3
    assert report["llamacpp"]["available"] and report["llamacpp"]["tokenizer_matches"]
    assert all(report["llamacpp"]["greedy_vs_checkpoint"]["matches"])
    exported = GGUFReader(str(tmp_path / "e" / "model.gguf"))
    trained = _checkpoint_weights(run)
    for tensor in exported.tensors:                       # f32: the checkpoint's exact values
        key = next(k for k in trained if gguf_tensor_name(k) == tensor.name)
        np.testing.assert_array_equal(np.asarray(tensor.data).reshape(trained[key].shape),
                                      trained[key].numpy())
