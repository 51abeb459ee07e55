"""`forgebench serve --model FILE.gguf --cartridge FILE` (engine/server/catalog.py): a cartridge
beside the GGUF it was trained on, served over the OpenAI-compatible API as a model of its own
(`BASE+LABEL`) whose replies are `forgebench generate --model FILE --cartridge FILE`'s, the
base still served bare beside it; a cartridge of another base is refused before the server
listens, with the recipe's error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_gguf import write_tiny_gguf  # noqa: E402
from lm_pretrain_support import forgebench  # noqa: E402
from serve_support import Served  # noqa: E402


def openai_client():
    """The official client (a test extra); the library-base test speaks HTTP without it."""
    return pytest.importorskip(
        "openai", reason="the openai client is a test extra: pip install -e '.[serve-test]'")


CORPUS = ("Forgebench trains models on one CPU machine. A run folder holds run.json, "
          "metrics.jsonl and its checkpoints; resume continues a stopped run exactly. ") * 3
PROMPT = "a run folder holds"
SAMPLING = {"temperature": 1.5, "seed": 3}     # the seeded sampler, not only the argmax


@pytest.fixture(scope="module")
def base_and_cartridge(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Gemma 3 GGUF and a cartridge of it: the rows of its corpus's first 12 tokens, at
    runs/guide/checkpoints/step-000003/ as an lm-cartridge run writes it. (This random
    model's logits move by 1e-4 with or without any rows: that the rows are read shows on the
    real model, below.)"""
    import torch

    from engine.cartridge.prefix import cartridge_bytes, prefill_rows
    from engine.cartridge.self_study import context_ids
    from engine.fsutil import sha256_file
    from engine.models.gguf_model import load_gguf_model

    root = tmp_path_factory.mktemp("cartserve")
    gguf = write_tiny_gguf(root / "tiny-gemma3.gguf", arch="gemma3", context_length=2048)
    model, tok = load_gguf_model(gguf, numerics="f32", weights="packed")
    with torch.no_grad():
        keys, values = prefill_rows(model, context_ids(tok, CORPUS)[:12])
    path = root / "runs" / "guide" / "checkpoints" / "step-000003" / "cartridge.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(cartridge_bytes(keys, values, {
        "base_sha256": sha256_file(gguf), "base_name": gguf.name, "tokens": 12,
        "leading_bos": True}))
    return gguf, path


def generated(gguf: Path, *extra: str) -> str:
    done = forgebench("generate", "--model", str(gguf), "--prompt", PROMPT, "--max-tokens",
                      "10", "--temperature", str(SAMPLING["temperature"]), "--top-k", "0",
                      "--seed", str(SAMPLING["seed"]), "--json", *extra)
    return json.loads(done.stdout.splitlines()[-1])["text"]


def test_a_cartridge_by_path_is_served_beside_its_base_as_generate_reads_it(
        base_and_cartridge):
    openai = openai_client()
    gguf, cartridge = base_and_cartridge
    with_rows, bare = generated(gguf, "--cartridge", str(cartridge)), generated(gguf)
    server = Served("--model", str(gguf), "--cartridge", str(cartridge))
    try:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=300)
        cards = {m.id: m.model_dump() for m in client.models.list().data}
        assert set(cards) == {"tiny-gemma3", "tiny-gemma3+guide/step-000003"}
        card = cards["tiny-gemma3+guide/step-000003"]
        assert card["type"] == "cartridge" and "12 rows" in card["origin"]
        assert card["context_length"] == 2048 - 11     # row 0 is the prompt's BOS
        for model, expected in (("tiny-gemma3+guide/step-000003", with_rows),
                                ("tiny-gemma3", bare)):
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=10,
                                              extra_body={"top_k": 0}, **SAMPLING)
            assert reply.choices[0].text == expected
    finally:
        server.close()


def test_a_cartridge_of_another_base_is_refused_before_the_server_listens(
        tmp_path, base_and_cartridge):
    _, cartridge = base_and_cartridge
    other = write_tiny_gguf(tmp_path / "other.gguf", arch="gemma3", seed=1, context_length=2048)
    refused = forgebench("serve", "--port", "0", "--model", str(other), "--cartridge",
                         str(cartridge), check=False)
    assert refused.returncode != 0
    assert "trained on another base model" in refused.stderr
    assert str(cartridge) in refused.stderr and "--cartridge" in refused.stderr
    (tmp_path / "workspace.json").write_text(json.dumps({"format": 1, "name": "empty"}))
    alone = forgebench("serve", "--port", "0", "--cartridge", str(cartridge),
                       "--workspace", str(tmp_path), check=False)
    assert alone.returncode != 0 and "served beside its base model" in alone.stderr


def post(url: str, body: dict) -> dict:
    """One JSON POST to the server (the standard library's client: this test needs no extra)."""
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def get(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def test_a_cartridge_is_served_beside_a_library_base_named_by_its_id(
        tmp_path, base_and_cartridge):
    """`serve --workspace WS --model <library id> --cartridge FILE`: the library's copy of the
    base (found by its id, its SHA-256 the cartridge's) reads the rows as `generate --model
    FILE --cartridge` does; the id is the library name's. A library base the cartridge was not
    trained on is refused with the recipe's error, naming the library id."""
    from app.viewmodels.workspace import Workspace
    from engine import model_library

    gguf, cartridge = base_and_cartridge
    with_rows, bare = generated(gguf, "--cartridge", str(cartridge)), generated(gguf)
    workspace = Workspace.create(tmp_path / "ws").root
    model_library.add_model(workspace, gguf, name="tiny")       # a copy in models/
    server = Served("--workspace", str(workspace), "--model", "tiny", "--cartridge",
                    str(cartridge))
    try:
        cards = {m["id"]: m for m in get(server.url + "/models")["data"]}
        assert set(cards) == {"tiny", "tiny+guide/step-000003"}
        card = cards["tiny+guide/step-000003"]
        assert card["type"] == "cartridge" and "12 rows" in card["origin"]
        assert "model library" in card["origin"]
        assert card["context_length"] == 2048 - 11
        for model, expected in (("tiny+guide/step-000003", with_rows), ("tiny", bare)):
            reply = post(server.url + "/completions", {
                "model": model, "prompt": PROMPT, "max_tokens": 10, "top_k": 0, **SAMPLING})
            assert reply["choices"][0]["text"] == expected, model
    finally:
        server.close()
    # twin: another base in the library under the id given: refused before listening
    other = write_tiny_gguf(tmp_path / "other.gguf", arch="gemma3", seed=1, context_length=2048)
    model_library.add_model(workspace, other, name="other")
    refused = forgebench("serve", "--port", "0", "--workspace", str(workspace), "--model",
                         "other", "--cartridge", str(cartridge), check=False)
    assert refused.returncode != 0
    assert "trained on another base model" in refused.stderr and "--cartridge" in refused.stderr


@pytest.mark.realmodel
def test_gemma_270m_served_with_a_cartridge_answers_from_its_rows(tmp_path, gemma_gguf):
    """gemma-3-270m with untrained rows of a text that names a colour (its prefill, as the
    recipe initialises a cartridge): the served reply is `generate --cartridge`'s and differs
    from the bare base's, served beside it."""
    import torch

    from engine.cartridge.prefix import cartridge_bytes, prefill_rows
    from engine.cartridge.self_study import context_ids
    from engine.fsutil import sha256_file
    from engine.models.gguf_model import load_gguf_model

    openai = openai_client()
    text = "The secret colour of the Forgebench logo is teal. " * 4
    model, tok = load_gguf_model(gemma_gguf, numerics="llamacpp", weights="dense-cache")
    ids = context_ids(tok, text)
    with torch.no_grad():
        keys, values = prefill_rows(model, ids)
    path = tmp_path / "logo.safetensors"
    path.write_bytes(cartridge_bytes(keys, values, {
        "base_sha256": sha256_file(gemma_gguf), "base_name": gemma_gguf.name,
        "tokens": len(ids), "leading_bos": True}))
    del model
    prompt = "The secret colour of the Forgebench logo is"

    def generate(*extra: str) -> str:
        done = forgebench("generate", "--model", str(gemma_gguf), "--prompt", prompt,
                          "--max-tokens", "8", "--json", *extra, timeout=900)
        return json.loads(done.stdout.splitlines()[-1])["text"]

    with_rows, bare = generate("--cartridge", str(path)), generate()
    assert with_rows != bare
    server = Served("--model", str(gemma_gguf), "--cartridge", str(path), "--threads", "2",
                    timeout=600)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=900)
        base_id = gemma_gguf.name.removesuffix(".gguf")
        for model_id, expected in ((f"{base_id}+logo", with_rows), (base_id, bare)):
            reply = client.completions.create(model=model_id, prompt=prompt, max_tokens=8,
                                              temperature=0)
            assert reply.choices[0].text == expected
    finally:
        server.close()
