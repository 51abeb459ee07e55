"""HF checkpoint folders in: conversion streaming under a memory limit, resuming, bad input,
the library entry, and the in-memory loader — no oracle needed (tests/test_hf_llamacpp.py holds
the comparisons with llama.cpp's converter and transformers)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_fixtures import make_raw_llama

from engine import cli, model_library
from engine.errors import ForgebenchError
from engine.gguf.writer import partial_paths, read_gguf_content
from engine.hf.convert import convert_hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_raw_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", shards=2)


def _run_limited(code: str, limit: int | None) -> subprocess.CompletedProcess:
    def cap():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          preexec_fn=cap, env=env, timeout=300)


CONVERT = """
import sys
import engine.hf.convert as c
c.CHUNK_BYTES = 1 << 20
c.convert_hf({src!r}, {out!r}, 'q8_0', threads=1)
print(open('/proc/self/status').read().split('VmPeak:')[1].split()[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_conversion_streams_under_an_address_space_limit(tmp_path, folder):
    """The limit leaves a third of the model's size above what converting a tiny model takes,
    so holding the model (or one of its shards) would fail: streaming row blocks converts it,
    byte for byte as without a limit. The twin: reading one shard whole under that limit fails."""
    tiny = make_raw_llama(tmp_path / "tiny", hidden=64, ffn=128, layers=1)
    base = _run_limited(CONVERT.format(src=str(tiny), out=str(tmp_path / "tiny.gguf")), None)
    assert base.returncode == 0, base.stderr
    baseline = int(base.stdout.split()[-1]) * 1024
    big = make_raw_llama(tmp_path / "big", hidden=512, ffn=1536, layers=4, shards=2, seed=1)
    model_bytes = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    headroom = model_bytes // 3
    limit = baseline + headroom
    limited = _run_limited(CONVERT.format(src=str(big), out=str(tmp_path / "limited.gguf")),
                           limit)
    assert limited.returncode == 0, limited.stderr[-2000:]
    free = tmp_path / "free.gguf"
    convert_hf(big, free, "q8_0")
    assert (tmp_path / "limited.gguf").read_bytes() == free.read_bytes()
    shard = max(big.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    assert shard.stat().st_size > headroom
    whole = _run_limited(f"import engine.hf.convert\nopen({str(shard)!r}, 'rb').read()\n", limit)
    assert whole.returncode != 0 and "MemoryError" in whole.stderr


def test_sharded_and_single_file_checkpoints_convert_alike(tmp_path):
    """The index's shards are read as one checkpoint."""
    one = make_raw_llama(tmp_path / "m", shards=1)
    convert_hf(one, tmp_path / "one.gguf", "f16")
    (one / "model.safetensors").unlink()
    make_raw_llama(tmp_path / "m2", shards=3)
    for f in (tmp_path / "m2").glob("model*"):
        f.rename(one / f.name)
    convert_hf(one, tmp_path / "three.gguf", "f16")
    a, b = read_gguf_content(tmp_path / "one.gguf"), read_gguf_content(tmp_path / "three.gguf")
    assert a.metadata == b.metadata
    # the same tensors; their order follows the shards, as llama.cpp's converter walks them
    assert {t.name: bytes(t.data) for t in a.tensors} == {t.name: bytes(t.data) for t in b.tensors}
    assert [t.name for t in a.tensors] != [t.name for t in b.tensors]


class Stop(Exception):
    pass


def test_an_interrupted_conversion_resumes_at_the_first_unfinished_tensor(tmp_path, folder):
    clean = convert_hf(folder, tmp_path / "clean.gguf", "q4_k_m").path
    out = tmp_path / "out.gguf"
    seen = []

    def stop_after_five(tensor, done, total, written, size):
        seen.append(tensor.name)
        if done == 5:
            raise Stop

    with pytest.raises(Stop):
        convert_hf(folder, out, "q4_k_m", progress=stop_after_five)
    partial, record = partial_paths(out)
    assert not out.exists() and partial.exists()
    assert json.loads(record.read_text())["done"] == 5
    resumed = []
    result = convert_hf(folder, out, "q4_k_m",
                        progress=lambda t, *a: resumed.append(t.name))
    assert result.resumed_at == 5
    assert resumed == [t.name for t in read_gguf_content(clean).tensors][5:]
    assert out.read_bytes() == clean.read_bytes()
    assert not partial.exists() and not record.exists()


def test_a_leftover_from_another_conversion_is_started_afresh(tmp_path, folder):
    out = tmp_path / "out.gguf"

    def stop(tensor, done, *rest):
        if done == 3:
            raise Stop

    with pytest.raises(Stop):
        convert_hf(folder, out, "f16", progress=stop)
    result = convert_hf(folder, out, "q8_0")       # another dtype: another header
    assert result.resumed_at == 0
    convert_hf(folder, tmp_path / "clean.gguf", "q8_0")
    assert out.read_bytes() == (tmp_path / "clean.gguf").read_bytes()


# -- bad input: one error naming the file, exit 2, nothing at --out ---------------------------

def _break_missing_config(d: Path):
    (d / "config.json").unlink()
    return "config.json"


def _break_missing_tokenizer(d: Path):
    (d / "tokenizer.model").unlink()
    return "tokenizer.json"


def _break_no_weights(d: Path):
    for f in d.glob("model*"):
        f.unlink()
    return "model.safetensors"


def _break_index_names_missing_shard(d: Path):
    (d / "model-00002-of-00002.safetensors").unlink()
    return "model-00002-of-00002.safetensors"


def _break_truncated_shard(d: Path):
    shard = d / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    return "model-00001-of-00002.safetensors"


def _break_architecture(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    return "config.json"


def _break_vocab_size(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 500
    (d / "config.json").write_text(json.dumps(cfg))
    return "config.json"


def _break_dtype(d: Path):
    from safetensors.torch import load_file, save_file

    shard = d / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    name = next(n for n in tensors if "q_proj" in n)
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, shard)
    return "model-00001-of-00002.safetensors"


BREAKS = [_break_missing_config, _break_missing_tokenizer, _break_no_weights,
          _break_index_names_missing_shard, _break_truncated_shard, _break_architecture,
          _break_vocab_size, _break_dtype]


@pytest.mark.parametrize("breaker", BREAKS, ids=[b.__name__[7:] for b in BREAKS])
def test_bad_input_is_one_error_naming_the_file(tmp_path, capsys, breaker):
    d = make_raw_llama(tmp_path / "m", shards=2)
    named = breaker(d)
    out = tmp_path / "out.gguf"
    assert cli.main(["convert", str(d), "--dtype", "q8_0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err, err
    assert not out.exists() and not partial_paths(out)[0].exists()


def test_twin_an_intact_folder_converts(tmp_path, capsys):
    d = make_raw_llama(tmp_path / "m", shards=2)
    assert cli.main(["convert", str(d), "--dtype", "q8_0", "--out",
                     str(tmp_path / "out.gguf")]) == 0
    assert "wrote" in capsys.readouterr().out


def test_the_output_is_never_overwritten(tmp_path, folder):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(ForgebenchError, match="already exists"):
        convert_hf(folder, out, "f16")
    assert out.read_bytes() == b"keep me"


# -- the library and the loader ---------------------------------------------------------------

def test_models_add_records_a_folder_with_the_facts_of_a_gguf(tmp_path, folder, capsys):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "workspace.json").write_text(json.dumps({"name": "ws", "models": []}))
    assert cli.main(["models", "--workspace", str(root), "add", str(folder), "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["mode"] == "hf" and entry["hf_dtype"] == "bf16"
    assert entry["source"] == str(folder.resolve())
    facts = entry["facts"]
    assert facts["usable"] and facts["family"] == "Llama"
    assert facts["support"]["full_finetune"] and facts["memory"]
    assert facts["tensor_types"].keys() == {"BF16", "F32"}
    lib_file = model_library.entry_path(root, model_library.get_entry(root, entry["name"]))
    convert_hf(folder, tmp_path / "ref.gguf", "bf16")          # lossless: the source's dtype
    assert lib_file.read_bytes() == (tmp_path / "ref.gguf").read_bytes()
    model_library.remove_model(root, entry["name"])
    assert not lib_file.exists() and folder.is_dir()


def test_the_engine_runs_a_folder_as_its_lossless_gguf(tmp_path, folder):
    from engine.models.gguf_model import load_gguf_model

    convert_hf(folder, tmp_path / "m.gguf", "bf16")
    ids = torch.tensor([[1, 17, 42, 99, 5, 250]])
    from_folder, tok = load_gguf_model(folder)
    from_file, _ = load_gguf_model(tmp_path / "m.gguf", tokenizer=False)
    with torch.no_grad():
        a, b = from_folder(ids), from_file(ids)
    assert torch.equal(a, b)
    assert tok.encode("the model") == tok.encode("the model") and len(tok.encode("the")) > 0


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_c_kquants_equal_the_numpy_port(kind):
    """engine/hf/kquants.c against engine/gguf/quantize.py (itself tested against ggml) on
    awkward rows: zero blocks, outliers, scales over five decades."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf_write_fixtures import awkward_weights

    from engine.gguf.quantize import quantize_numpy
    from engine.hf.kquants import quantize_rows

    x = awkward_weights(np.random.default_rng(7), (48, 512)).astype(np.float32)
    x[3, :256] = 0.0
    native = quantize_rows(x, T[kind])
    if native is None:
        pytest.skip("no C compiler here (or FORGEBENCH_NATIVE=0): the numpy port runs")
    assert np.array_equal(native, quantize_numpy(x, T[kind]))
    # the twin: one block's signs flipped, and only that row's bytes differ
    y = x.copy()
    y[5, :32] *= -1
    changed = np.flatnonzero((quantize_rows(y, T[kind]) != native).any(axis=1))
    assert changed.tolist() == [5]


def test_the_models_pane_adds_a_folder(qtbot, tmp_path, monkeypatch, folder):
    """Add HF folder… picks a folder, converts it off the GUI thread and lists it with the
    facts of its GGUF; a broken folder is shown with the file to fix."""
    from PySide6.QtWidgets import QFileDialog

    from app.viewmodels.workspace import Workspace
    from app.views.models_pane import ModelsPane

    workspace = Workspace.create(tmp_path / "ws")
    pane = ModelsPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    qtbot.waitUntil(lambda: not pane.call.running)
    chosen = [str(folder)]
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: chosen[0])
    pane.add_folder.click()
    qtbot.waitUntil(lambda: not pane.busy, timeout=60_000)
    assert pane.list.count() == 1 and "Llama" in pane.list.item(0).text()
    pane.list.setCurrentRow(0)
    assert "full fine-tune yes" in pane.summary.text()
    assert {pane.tensors.item(r, 0).text() for r in range(pane.tensors.rowCount())} \
        == {"BF16", "F32"}
    broken = make_raw_llama(tmp_path / "broken")
    (broken / "tokenizer.model").unlink()
    chosen[0] = str(broken)
    pane.add_folder.click()
    qtbot.waitUntil(lambda: not pane.busy, timeout=60_000)
    assert "tokenizer" in pane.status.text() and pane.list.count() == 1


def test_the_cli_shows_tensor_bytes_and_eta_on_stderr(tmp_path, folder):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = tmp_path / "m.gguf"
    done = subprocess.run([sys.executable, "-m", "engine", "convert", str(folder), "--dtype",
                           "q4_k_m", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    last = done.stderr.replace("\r", "\n").strip().splitlines()
    bars = [line for line in last if "convert → q4_k_m" in line]
    assert any(" blk.1.ffn_up.weight" in line for line in bars)       # each tensor named
    assert any("kB/" in line or "MB/" in line or "B/s" in line for line in bars)   # bytes
    assert any("<" in line for line in bars)                          # tqdm's ETA
    assert f"wrote {out}" in done.stdout and "Q4_K" in done.stdout
