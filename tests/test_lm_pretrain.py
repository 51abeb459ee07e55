"""lm-pretrain: the model's causality, learning, bits per byte against a hand value, KV-cached
generation against full recomputation, the record corpus, and eval/generate from a run."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from lm_pretrain_support import make_corpus, write_config

from engine.cli import main
from engine.config import load_config
from engine.data.generators.records import generate_records
from engine.recipes.lm_pretrain import bits_per_byte, build_model, complete, token_stream, windows
from engine.rundir import RunDir
from engine.sampling import SamplingSettings
from engine.text_tokenizers import BPETokenizer, ByteTokenizer
from engine.train.optim import build_adamw, clip_and_step

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    corpus = make_corpus(root)
    return corpus, load_config(write_config(root / "tiny.toml", corpus))


def test_changing_a_future_token_leaves_earlier_logits_unchanged(tiny):
    _, config = tiny
    torch.manual_seed(0)
    model = build_model(config, 258).eval()
    tokens = torch.randint(0, 256, (2, 20))
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 7) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_one_batch_overfit(tiny):
    _, config = tiny
    torch.manual_seed(0)
    model = build_model(config, 258)
    optimizer = build_adamw(model.named_parameters(), lr=1e-2, weight_decay=0.0)
    batch = torch.tensor([list(b"Record item0001: the red mug is in the hall. It is full.")])
    losses = []
    for _ in range(60):
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        clip_and_step(model.parameters(), optimizer, 1.0, "stop")
        losses.append(loss.item())
    assert losses[0] > 5.0 and losses[-1] < 0.05  # from ~ln(258) = 5.55 to memorised


def test_windows_cover_the_stream_once():
    tok = ByteTokenizer()
    stream = token_stream(tok, "abcdefghij")  # <bos> + 10 bytes
    assert stream[0] == tok.bos_id and len(stream) == 11
    w = windows(stream, 4)  # [2, 5]: targets stream[1:5] and stream[5:9]
    assert w.tolist() == [stream[0:5].tolist(), stream[4:9].tolist()]


class Uniform(torch.nn.Module):
    """A model whose logits are all zero: every token costs ln(vocab) nats."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens):
        return torch.zeros(*tokens.shape, self.vocab)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_bits_per_byte_of_a_uniform_model(tiny, kind):
    corpus, config = tiny
    text = (corpus / "val.txt").read_text()
    tok = ByteTokenizer() if kind == "byte" else BPETokenizer.train([text], 400)
    result = bits_per_byte(Uniform(tok.vocab_size), tok, text, config)
    n_bytes = len(text.encode("utf-8"))
    tokens = len(tok.encode(text))
    assert result.bytes == n_bytes and result.tokens == tokens
    assert result.bpb == pytest.approx(tokens * math.log2(tok.vocab_size) / n_bytes, rel=1e-6)
    if kind == "byte":
        assert result.bpb == pytest.approx(math.log2(258), rel=1e-6)


def test_bf16_autocast_forward_is_close_to_fp32(tiny):
    _, config = tiny
    torch.manual_seed(0)
    model = build_model(config, 258).eval()
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        ref = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(tokens).float()
    assert not torch.equal(ref, low)
    assert torch.allclose(ref, low, atol=0.05)


def test_kv_cached_generation_matches_full_recomputation(tiny):
    _, config = tiny
    torch.manual_seed(1)
    model = build_model(config, 258).eval()
    tok = ByteTokenizer()
    prompt = "Record item"
    text = complete(model, tok, prompt, max_tokens=12, settings=SamplingSettings(), seed=0)
    ids = [tok.bos_id] + tok.encode(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert text == tok.decode(ids[1 + len(prompt):])
    sampled = complete(model, tok, prompt, max_tokens=12, seed=5,
                       settings=SamplingSettings(temperature=1.0, top_k=20, top_p=0.9))
    assert sampled == complete(model, tok, prompt, max_tokens=12, seed=5,
                               settings=SamplingSettings(temperature=1.0, top_k=20, top_p=0.9))


def test_record_corpus_splits_are_entity_disjoint_and_hashed(tmp_path):
    from engine.fsutil import sha256_file

    root = generate_records(tmp_path / "a", n=200, seed=4)
    manifest = json.loads((root / "dataset.json").read_text())
    entities = {}
    for split in ("train", "val", "test"):
        lines = (root / f"{split}.txt").read_text().splitlines()
        ids = {line.split(":")[0].removeprefix("Record ") for line in lines}
        assert len(ids) == len(lines) == manifest["splits"][split]["entities"]
        assert manifest["files"][f"{split}.txt"] == sha256_file(root / f"{split}.txt")
        entities[split] = ids
        for line in lines:  # each record answers its own questions
            entity = line.split(":")[0].removeprefix("Record ")
            room = line.split(" is in the ")[1].split(".")[0]
            assert f"Where is {entity}? Answer: the {room}." in line
    assert [len(entities[s]) for s in ("train", "val", "test")] == [160, 20, 20]
    assert not (entities["train"] & entities["val"] or entities["train"] & entities["test"]
                or entities["val"] & entities["test"])
    again = generate_records(tmp_path / "b", n=200, seed=4)
    assert json.loads((again / "dataset.json").read_text())["files"] == manifest["files"]
    with pytest.raises(Exception, match="not empty"):
        generate_records(root, n=200)


def test_eval_generate_and_sample_from_a_run(tiny, tmp_path, capsys):
    corpus, _ = tiny
    config = write_config(tmp_path / "bpe.toml", corpus, steps=3, tokenizer="bpe")
    assert main(["run", str(config), "--out", str(tmp_path / "run"), "--threads", "1"]) == 0
    run = RunDir(tmp_path / "run")
    assert json.loads((run.path / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert not any(m.get("split") == "test" for m in run.metrics())  # test only on request
    capsys.readouterr()

    assert main(["eval", str(run.path), "--split", "test"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == "test" and result["checkpoint"] == "step-000003"
    assert result["bytes"] == len((corpus / "test.txt").read_bytes())
    assert (run.evals_dir / "test-step-000003.json").is_file()
    assert run.metrics()[-1]["split"] == "test"

    assert main(["generate", str(run.path), "--prompt", "Record", "--max-tokens", "5",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint"] == "step-000003" and out["settings"]["temperature"] == 0.0
    assert main(["sample", str(run.path), "--n", "2", "--seed", "9",
                 "--out", str(tmp_path / "s")]) == 0
    lines = (tmp_path / "s" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["seed"] for x in lines] == [9, 10]
    assert json.loads((tmp_path / "s" / "samples.json").read_text())["checkpoint"] == "step-000003"
