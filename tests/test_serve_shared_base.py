"""Two LoRA checkpoints of one base served at once (engine/server/shared_base.py): the base is
read from its file once, each request runs its own checkpoint's adapter, and each answer equals
`forgebench generate` on that checkpoint loaded alone. Twins: the two checkpoints answer
differently (so equal answers are not the base's), and a model that shares nothing (the library
base itself) is a second load (so the count can move).
"""

from __future__ import annotations

import shutil
import threading

import pytest
from chat_support import chat_workspace, forgebench, generated_answer
from lm_sft_support import write_config
from serve_support import Served

from engine import model_library

openai = pytest.importorskip(
    "openai", reason="the openai client is a test extra: pip install -e '.[serve-test]'")
try:                             # the HTTP client the openai package is built on
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx", reason="httpx comes with the openai client")

PROMPTS = ("hello", "tell me a story")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A copy of the chat workspace (library model `tiny`, LoRA run `sft` on q and v) with a
    second LoRA run `sft-b` over the same library file: 3 steps on q and down."""
    root = tmp_path_factory.mktemp("shared") / "ws"
    shutil.copytree(chat_workspace(tmp_path_factory), root)
    base = model_library.entry_path(root, model_library.get_entry(root, "tiny"))
    config = write_config(root.parent, base, steps=3, save_every=3, dropout=0.0,
                          targets='["q", "down"]')
    done = forgebench("run", str(config), "--out", str(root / "runs" / "sft-b"),
                      "--threads", "1")
    assert done.returncode == 0, done.stderr
    return root


def test_two_lora_checkpoints_share_one_base_and_answer_as_each_alone(workspace):
    expected = {(name, prompt): generated_answer(workspace / "runs" / name, prompt, 8)
                for name in ("sft", "sft-b") for prompt in PROMPTS}
    assert any(expected["sft", p] != expected["sft-b", p] for p in PROMPTS)   # twin
    served = Served("--workspace", str(workspace))
    try:
        client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0,
                               timeout=300)
        got: dict = {}

        def ask(name: str, prompt: str) -> None:
            reply = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                temperature=0, stream=True)
            got[name, prompt] = "".join(c.choices[0].delta.content or "" for c in reply)

        threads = [threading.Thread(target=ask, args=key) for key in expected]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert got == expected
        health = httpx.get(served.url.removesuffix("/v1") + "/health", timeout=30).json()
        assert health["model_loads"] == 1
        (shared,) = health["shared_bases"]
        assert shared["models"] == ["sft", "sft-b"] and shared["packed_weight_bytes"] > 0
        # twin: the library base itself shares nothing with the checkpoints: a second load
        client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                "content": "hello"}],
                                       max_tokens=2, temperature=0)
        health = httpx.get(served.url.removesuffix("/v1") + "/health", timeout=30).json()
        assert health["model_loads"] == 2 and len(health["shared_bases"]) == 1
    finally:
        served.close()
