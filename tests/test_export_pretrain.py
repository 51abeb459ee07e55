"""lm-pretrain models exported as llama GGUF: the tokenizer round-trips through the metadata
(token ids checked against llama.cpp), a trained tiny model's greedy continuation in llama.cpp
equals the engine's for 40 tokens, and `forgebench export` writes a complete, verifiable bundle
whose staged report shows where the numbers move."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from lm_pretrain_support import forgebench, make_corpus

from engine.errors import ForgebenchError
from engine.export.from_pretrain import write_llama_gguf
from engine.models.llama import Llama, LlamaConfig
from engine.text_tokenizers import BPETokenizer, ByteTokenizer

torch.set_num_threads(1)

CONFIG = """\
recipe = "lm-pretrain"
seed = 2
steps = 80
log_every = 10
eval_every = 0
save_every = 0

[data]
dir = "{data}"

[tokenizer]
kind = "bpe"
vocab_size = 320

[model]
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_dim = 128
context = 64

[optim]
lr = 5e-3
warmup = 5

[train]
batch_size = 8
# f32 on every machine: the f16 export's 40 greedy tokens must equal the checkpoint's, and a
# bf16-trained model ("auto" on AVX512-BF16/AMX) left a near-tie that f16 rounding flipped at
# the 30th token on an AMX Xeon
precision = "f32"

[eval]
max_windows = 4

[sample]
prompts = ["Record item"]
max_tokens = 8
"""

TEXTS = ["Record item 12: the price is 3.50 dollars, said Ann.",
         "  two  spaces,\ttabs\nand new\n\nlines", "naïve café — 日本語 🙂 ok?",
         "don't won't it's 1234567 x", ""]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pretrain")
    data = make_corpus(root)
    config = root / "pretrain.toml"
    config.write_text(CONFIG.format(data=data))
    forgebench("run", str(config), "--out", str(root / "run"))
    return root / "run"


def _random_model(vocab_size: int) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=vocab_size, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                             ffn_dim=64, max_seq_len=64)).eval()


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_the_tokenizer_round_trips_through_gguf_metadata_into_llamacpp(tmp_path, kind):
    import llama_cpp

    from engine.llm.tokenizer import GGUFTokenizer

    corpus = " ".join(TEXTS * 20) + " Record item price dollars said"
    tokenizer = ByteTokenizer() if kind == "byte" else BPETokenizer.train([corpus], 300)
    path = write_llama_gguf(_random_model(tokenizer.vocab_size), tokenizer,
                            tmp_path / "m.gguf", "f32", name="tok")
    llm = llama_cpp.Llama(str(path), n_ctx=64, verbose=False, vocab_only=True)
    ours = GGUFTokenizer.from_gguf(path)
    for text in TEXTS:
        expected = [tokenizer.bos_id] + tokenizer.encode(text)
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == expected, text
        assert ours.encode(text, add_special=True, parse_special=False) == expected, text
        assert llm.detokenize(expected[1:]).decode("utf-8") == text
    if kind == "bpe":       # merges are really used: fewer tokens than bytes
        assert len(tokenizer.encode(TEXTS[0])) < len(TEXTS[0].encode())


@pytest.mark.llamacpp
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_a_trained_tiny_model_answers_the_same_in_llamacpp_for_40_tokens(tmp_path, trained_run,
                                                                           dtype):
    from engine.export.from_pretrain import write_pretrain_gguf
    from engine.export.llamacpp import open_llama
    from engine.recipes.lm_pretrain import complete, load_model
    from engine.rundir import RunDir
    from engine.sampling import SamplingSettings

    run = RunDir(trained_run)
    checkpoint = run.checkpoint("latest")
    path = write_pretrain_gguf(run, checkpoint, tmp_path / "m.gguf", dtype)
    model, tokenizer, _ = load_model(run, checkpoint)
    llm = open_llama(path, n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    compared = 0
    for prompt in ["Record item", "The "]:
        ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
        engine_text = complete(model, tokenizer, prompt, max_tokens=40,
                               settings=SamplingSettings(), seed=0)
        llm.reset()
        llm.eval(ids)
        cpp_ids = []
        for _ in range(40):
            token = int(torch.tensor(llm.scores[llm.n_tokens - 1]).argmax())
            if token == tokenizer.eos_id:
                break
            cpp_ids.append(token)
            llm.eval([token])
        assert tokenizer.decode(cpp_ids) == engine_text, prompt
        assert tokenizer.encode(engine_text) == cpp_ids or len(cpp_ids) >= 32
        compared += len(cpp_ids)
    assert compared >= 64                   # two prompts, at least 32 tokens each


def test_export_refuses_an_existing_folder_and_an_adapter_of_a_pretrain_run(tmp_path,
                                                                              trained_run):
    from engine.export.bundle import export_run

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ForgebenchError, match="already exists"):
        export_run(trained_run, tmp_path / "taken", dtype="f16", report=False)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(ForgebenchError, match="no adapter"):
        export_run(trained_run, tmp_path / "new", dtype="adapter", report=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_full_disk_during_export_leaves_no_bundle_and_no_temp_files(tmp_path, trained_run,
                                                                       monkeypatch):
    from export_support import fill_disk_after

    from engine.export.bundle import export_run

    fill_disk_after(monkeypatch, 4096)
    with pytest.raises(ForgebenchError, match="disk filled up"):
        export_run(trained_run, tmp_path / "out", dtype="f32", report=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.llamacpp
@pytest.mark.slow
def test_cli_export_writes_a_verified_bundle_with_a_staged_report(tmp_path, trained_run):
    out = tmp_path / "export"
    result = forgebench("export", str(trained_run), "--dtype", "q8_0", "--out", str(out))
    assert "Export report" in result.stdout
    # llama.cpp answered question 1; an lm-pretrain run has no base, so no question 2
    assert "verdict: Verified: llama.cpp runs the file as the engine does" in result.stdout
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert names == ["SHA256SUMS", "model.gguf", "model_card.md", "report.json", "report.txt"]
    sums = dict(reversed(line.split("  ")) for line in
                (out / "SHA256SUMS").read_text().splitlines())
    assert sorted(sums) == [n for n in names if n != "SHA256SUMS"]
    for name, digest in sums.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest

    report = json.loads((out / "report.json").read_text())
    checkpoint, dense, quantized = report["stages"]
    assert [s["name"] for s in report["stages"]] == ["checkpoint", "dense", "quantized"]
    # the f32 GGUF is the checkpoint, exactly; quantization moves the logits a little
    assert dense["vs_checkpoint"]["max_abs_logit_diff"] == 0.0 and dense["tokenizer_matches"]
    assert dense["greedy_vs_checkpoint"]["all_match"]
    q = quantized["vs_checkpoint"]
    assert 0 < q["max_abs_logit_diff"] < 1.0 and q["top1_agreement"] >= 0.95
    cpp = report["llamacpp"]
    assert cpp["available"] and cpp["tokenizer_matches"]
    assert cpp["vs_engine_same_file"]["top1_agreement"] >= 0.99
    assert cpp["vs_engine_same_file"]["max_abs_logit_diff"] < 0.5

    card = (out / "model_card.md").read_text()
    manifest = json.loads((trained_run / "run.json").read_text())
    for text in ("## Base model", "## Data", "## Training config", "## Evaluation",
                 "## Limitations", "q8_0", manifest["data"]["files"]["train.txt"]):
        assert text in card
    assert str(trained_run.parent) not in card      # a shared card names no local path

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = forgebench("export", str(trained_run), "--dtype", "f16", "--out", str(out),
                       check=False)
    assert again.returncode != 0 and "already exists" in again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]
