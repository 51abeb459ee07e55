"""lm-pretrain with model.family = "nanochat" and optim.kind = "muon": the config, a real run
(bits per byte, generate, resume bit for bit), the GGUF refusal, and the shipped template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lm_pretrain_support import make_corpus, write_config

from engine.cli import main
from engine.config import load_config
from engine.errors import ForgebenchError
from engine.models.nanochat import NanochatGPT
from engine.recipes.lm_pretrain import build_model, build_optimizer
from engine.rundir import RunDir
from engine.train.muon import MuonAdamW
from engine.train.optim import set_lr
from engine.train.pretrain_model import TOKENIZER_FILE
from engine.train.pretrain_model import nanochat_config as nanochat_config_of

REPO = Path(__file__).resolve().parents[1]
NANOCHAT = """family = "nanochat"
window_pattern = "SL"
"""


def nanochat_config(path: Path, corpus: Path, *, steps: int = 4, save_every: int = 0,
                    optimizer: str = "muon") -> Path:
    write_config(path, corpus, steps=steps, save_every=save_every, precision="f32",
                 tokenizer="nanochat")
    text = path.read_text()
    # the tiny llama config, minus what nanochat's architecture fixes
    text = text.replace("ffn_dim = 64\n", "").replace("[model]\n", "[model]\n" + NANOCHAT)
    text = text.replace("[optim]\n", f'[optim]\nkind = "{optimizer}"\ngrad_clip = 0.0\n')
    text = text.replace("[data]\n", '[data]\npacking = "bos_bestfit"\n')
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("nc"))


def test_config_builds_nanochat_with_muon_groups(corpus, tmp_path):
    config = load_config(nanochat_config(tmp_path / "c.toml", corpus))
    model = build_model(config, 258)
    assert isinstance(model, NanochatGPT)
    assert model.config.n_embd == 32 and model.window_sizes == [128, 32]   # S then L
    optimizer = build_optimizer(config, model)
    assert isinstance(optimizer, MuonAdamW)
    kinds = [g["kind"] for g in optimizer.param_groups]
    assert kinds[:6] == ["adamw"] * 6 and set(kinds[6:]) == {"muon"}
    set_lr(optimizer, config.optim.lr / 2)          # the loop's schedule keeps each group's share
    assert all(g["lr"] == pytest.approx(g["initial_lr"] / 2) for g in optimizer.param_groups)


def test_depth_reads_nanochat_settings(corpus, tmp_path):
    path = nanochat_config(tmp_path / "c.toml", corpus)
    path.write_text(path.read_text().replace("dim = 32\n", "depth = 2\nhead_dim = 16\n"))
    model = build_model(load_config(path), 258)
    assert (model.config.n_layer, model.config.n_embd, model.config.n_head) == (2, 128, 8)


@pytest.mark.parametrize("bad, message", [
    ('ffn_dim = 64\n', "fixed by nanochat's architecture"),
    ('rope_theta = 500000.0\n', "fixed by nanochat's architecture"),
    ('norm_eps = 1e-6\n', "fixed by nanochat's architecture"),
])
def test_settings_nanochat_fixes_are_refused(corpus, tmp_path, bad, message):
    path = nanochat_config(tmp_path / "c.toml", corpus)
    path.write_text(path.read_text().replace("[model]\n", "[model]\n" + bad))
    with pytest.raises(ForgebenchError, match=message):
        load_config(path)


def test_muon_needs_the_nanochat_family(corpus, tmp_path):
    path = nanochat_config(tmp_path / "c.toml", corpus)
    path.write_text(path.read_text().replace(NANOCHAT, ""))
    with pytest.raises(ForgebenchError, match="needs model.family"):
        load_config(path)


def test_nanochat_tokenizer_needs_room_for_its_specials(corpus, tmp_path):
    path = nanochat_config(tmp_path / "c.toml", corpus)
    assert load_config(path).tokenizer.vocab_size == 300                   # twin: room enough
    path.write_text(path.read_text().replace("vocab_size = 300", "vocab_size = 264"))
    with pytest.raises(ForgebenchError, match="vocab_size >= 265"):
        load_config(path)


def test_run_reports_bpb_generates_resumes_exactly_and_refuses_gguf(corpus, tmp_path, capsys):
    config = nanochat_config(tmp_path / "c.toml", corpus, steps=4, save_every=2)
    args = ["--threads", "1"]
    assert main(["run", str(config), "--out", str(tmp_path / "full"), *args]) == 0
    full = RunDir(tmp_path / "full")
    val = [m for m in full.metrics() if m.get("split") == "val"]
    assert val and 0 < val[-1]["bpb"] < 8.5                     # bits per byte, as today
    saved = json.loads((full.path / TOKENIZER_FILE).read_text())
    assert saved["forgebench_tokenizer"] == "nanochat" and saved["merges"]
    capsys.readouterr()
    assert main(["generate", str(full.path), "--prompt", "Record", "--max-tokens", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == "step-000004"

    # stop after step 2, resume to 4: the same weights as the uninterrupted run
    assert main(["run", str(config), "--out", str(tmp_path / "half"), "--stop-after-step", "2",
                 *args]) == 0
    assert main(["resume", str(tmp_path / "half"), *args]) == 0
    from engine.train.checkpoint import load_checkpoint
    a, _, _ = load_checkpoint(full.checkpoint("step-000004"))
    b, _, _ = load_checkpoint(RunDir(tmp_path / "half").checkpoint("step-000004"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    c, _, _ = load_checkpoint(full.checkpoint("step-000002"))     # twin: training moved them
    assert not torch.equal(a["transformer.h.0.mlp.c_fc.weight"],
                           c["transformer.h.0.mlp.c_fc.weight"])

    capsys.readouterr()
    assert main(["export", str(full.path), "--out", str(tmp_path / "x.gguf")]) != 0
    assert "llama.cpp has no architecture for nanochat" in capsys.readouterr().err


def test_shipped_template_is_nanochat_d6():
    for path in (REPO / "resources/configs/lm-pretrain-nanochat-d6.toml",
                 REPO / "resources/sample-workspace/configs/lm-pretrain-nanochat-d6.toml"):
        config = load_config(path)
        model = nanochat_config_of(config, 2048)
        assert (model.n_layer, model.n_embd, model.n_head, model.sequence_len,
                model.window_pattern) == (6, 384, 6, 512, "L")
        assert config.optim.kind == "muon"
        assert config.tokenizer.kind == "nanochat" and config.data.packing == "bos_bestfit"
