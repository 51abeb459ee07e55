"""KV-cached generation from GGUF models: greedy equals a no-cache argmax loop, stop strings cut the
text and streaming delivers exactly that text, seeded sampling repeats, and the
`forgebench generate --model` command works end to end (and refuses bad files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures_gguf import write_tiny_gguf

from engine.llm.generate import generate
from engine.models.gguf_model import load_gguf_model
from engine.sampling import SamplingSettings

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gemma_tiny(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("g") / "gemma.gguf", "gemma3", "Q8_0", seed=3,
                           n_layers=2)
    return path, *load_gguf_model(path, numerics="llamacpp", weights="dense-cache")


@pytest.fixture(scope="module")
def llama_tiny(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("l") / "llama.gguf", "llama", "Q8_0")
    return path, *load_gguf_model(path, numerics="f32", weights="dense-cache")


def test_greedy_matches_uncached_argmax_loop(gemma_tiny):
    path, model, tok = gemma_tiny
    prompt = tok.encode("hello the world")
    got = generate(model, tok, prompt, max_new_tokens=8, stop_ids=[])
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert got.ids == ids[len(prompt):]
    assert got.stop_reason == "max_tokens" and got.text == tok.decode(got.ids)


def test_stop_string_and_streaming(llama_tiny):
    _, model, tok = llama_tiny
    prompt = tok.encode("the cat and the dog")
    settings = SamplingSettings(temperature=1.0)
    full = generate(model, tok, prompt, max_new_tokens=24, settings=settings, seed=5, stop_ids=[])
    assert len(full.text) >= 6
    stop = full.text[3:5]
    pieces: list[str] = []
    cut = generate(model, tok, prompt, max_new_tokens=24, settings=settings, seed=5, stop=[stop],
                   on_text=pieces.append, stop_ids=[])
    assert cut.stop_reason == "stop_string"
    assert cut.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == cut.text
    assert cut.ids == full.ids[: len(cut.ids)]


def test_seeded_sampling_repeats(llama_tiny):
    _, model, tok = llama_tiny
    prompt = tok.encode("in the")
    s = SamplingSettings(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.2)
    a = generate(model, tok, prompt, max_new_tokens=10, settings=s, seed=11, stop_ids=[])
    b = generate(model, tok, prompt, max_new_tokens=10, settings=s, seed=11, stop_ids=[])
    c = generate(model, tok, prompt, max_new_tokens=10, settings=s, seed=12, stop_ids=[])
    assert a.ids == b.ids
    assert a.ids != c.ids


def test_eos_stops_generation(gemma_tiny):
    _, model, tok = gemma_tiny
    prompt = tok.encode("hello")
    first = generate(model, tok, prompt, max_new_tokens=3, stop_ids=[]).ids
    stopped = generate(model, tok, prompt, max_new_tokens=3, stop_ids=[first[0]])
    assert stopped.ids == [] and stopped.stop_reason == "eos" and stopped.text == ""


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_generate_json_matches_library(gemma_tiny):
    path, model, tok = gemma_tiny
    proc = _cli("generate", "--model", str(path), "--prompt", "hello the world", "--max-tokens",
                "6",
                "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    out = lines[-1]
    lib = generate(model, tok, tok.encode("hello the world"), max_new_tokens=6)
    assert out["event"] == "done" and out["ids"] == lib.ids and out["numerics"] == "llamacpp"
    # one line per token, streamed before the result: the ids, texts adding up to the answer
    # (a held-back tail may come only with the result), log-probabilities of a distribution
    tokens = lines[:-1]
    assert [t["event"] for t in tokens] == ["token"] * len(lib.ids)
    assert [t["id"] for t in tokens] == lib.ids
    assert lib.text.startswith("".join(t["text"] for t in tokens))
    assert all(t["logprob"] <= 0 for t in tokens)
    assert out["prompt_tokens"] == len(tok.encode("hello the world"))


def test_cli_generate_chat_streams_text(gemma_tiny):
    path, _, _ = gemma_tiny
    proc = _cli("generate", "--model", str(path), "--prompt", "hi", "--chat", "--max-tokens", "2",
                "--numerics", "f32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n")


def test_cli_generate_refuses_a_non_gguf_file(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"PK\x03\x04 not a model")
    proc = _cli("generate", "--model", str(bad), "--prompt", "hi")
    assert proc.returncode == 2
    assert "not a GGUF file" in proc.stderr and str(bad) in proc.stderr
