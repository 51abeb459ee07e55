"""Two LoRA checkpoints of one base served at once (engine/server/shared_base.py): the base is
read from its file once, each request runs its own checkpoint's adapter (never merged into the
shared weights), and each checkpoint computes the bits it computes loaded alone. Twins: the two
checkpoints' logits differ (so equal ones are not the base's), and a model that shares nothing
(the library base itself) is a second load (so the count can move).
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from chat_support import chat_answer, chat_workspace
from safetensors.torch import save_file
from serve_support import Served

from engine.fsutil import sha256_file
from engine.lora import ADAPTERS_FILE, read_adapters

openai = pytest.importorskip(
    "openai", reason="the openai client is a test extra: pip install -e '.[serve-test]'")
try:                             # the HTTP client the openai package is built on
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx", reason="httpx comes with the openai client")

PROMPTS = ("hello", "tell me a story")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A copy of the chat workspace (library model `tiny`, LoRA run `sft`) with a second run
    `sft-b`: the same run with its checkpoint's adapter factors B moved by a seeded random
    amount (large: the tiny base's
    answers move only then), so its greedy answers differ, saved in the adapter file format."""
    root = tmp_path_factory.mktemp("shared") / "ws"
    shutil.copytree(chat_workspace(tmp_path_factory), root)
    shutil.copytree(root / "runs" / "sft", root / "runs" / "sft-b")
    (adapters_file,) = (root / "runs" / "sft-b").glob(f"checkpoints/*/{ADAPTERS_FILE}")
    tensors, metadata = read_adapters(adapters_file)
    generator = torch.Generator().manual_seed(7)
    for name, tensor in tensors.items():
        if name.endswith("lora_b"):
            tensors[name] = tensor + 100 * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, str(adapters_file), metadata)
    # the checkpoint's record of its files (engine/train/integrity.py), written anew for it
    state_file = adapters_file.with_name("trainer_state.json")
    state = json.loads(state_file.read_text())
    state["files"][ADAPTERS_FILE] = {"sha256": sha256_file(adapters_file),
                                     "size": adapters_file.stat().st_size}
    state_file.write_text(json.dumps(state))
    return root


def _logits(system, ids) -> torch.Tensor:
    with torch.no_grad():
        model = system.model
        return model.logits(model.hidden(torch.tensor([ids]), 0, model.new_cache(1, 64))[:, -1])


def test_each_checkpoint_of_a_shared_base_computes_its_own_bits(workspace):
    """In one process: the base loaded for `sft`, `sft-b`'s adapter added beside it; with each
    selected, the logits equal that checkpoint's loaded alone, to the bit. Twins: the two
    checkpoints' logits differ, and with no adapter selected the bare base differs from both."""
    from engine.serve_local import load_system, render
    from engine.server.shared_base import AdapterBank, SharedBase, checkpoint_system

    loads = {name: {"run": str(workspace / "runs" / name), "workspace": str(workspace)}
             for name in ("sft", "sft-b")}
    alone = {}
    for name, load in loads.items():
        system = load_system(name, load)
        _, ids = render(system, [{"role": "user", "content": "hello"}])
        alone[name] = _logits(system, ids)
    first = load_system("sft", loads["sft"])
    bank = AdapterBank(first.model)
    bank.adopt("sft")
    checkpoint_system(SharedBase(first, bank, None, ""), "sft-b", loads["sft-b"])
    for name, key in (("sft", "sft"), ("sft-b", json.dumps(loads["sft-b"], sort_keys=True))):
        bank.select(key)
        assert torch.equal(_logits(first, ids), alone[name])
    assert not torch.equal(alone["sft"], alone["sft-b"])
    bank.select(None)
    bare = _logits(first, ids)
    assert not torch.equal(bare, alone["sft"]) and not torch.equal(bare, alone["sft-b"])


def test_two_lora_checkpoints_served_at_once_load_the_base_once(workspace):
    """Over HTTP, both checkpoints at once (streams interleaved on one engine thread): each
    answer equals the Chat pane's worker on that checkpoint alone (serve-local, which loads a
    run as serving does: f32; `forgebench generate` computes a bf16 run in bf16, so on a CPU
    where "auto" chose bf16 it is not the reference), and /health counts one model load."""
    expected = {(name, prompt): chat_answer(workspace / "runs" / name, workspace, prompt, 8)[1]
                for name in ("sft", "sft-b") for prompt in PROMPTS}
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
