"""A nanochat checkpoint in the chat worker and `forgebench chat`: an lm-pretrain run of
nanochat's GPT (trained one step, then given the scripted weights of the Engine goldens, whose
greedy reply calls the calculator) loads in nanochat's format, streams the forced output with
its tool line, and answers as the reference Engine did; a llama run is refused with the
reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_pretrain_support import make_corpus, write_config
from nanochat_chat_support import GOLDENS, scripted_nanochat_run

from engine import serve_local
from engine.cli import main
from engine.errors import ForgebenchError


@pytest.fixture(scope="module")
def goldens():
    if not GOLDENS.is_file():
        pytest.skip(f"no chat goldens at {GOLDENS} (make_chat_goldens.py writes them)")
    return json.loads(GOLDENS.read_text("utf-8"))


@pytest.fixture(scope="module")
def scripted_run(goldens, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ncchat")
    return scripted_nanochat_run(root, root / "run")


def test_worker_chats_in_nanochats_format_and_runs_the_calculator(goldens, scripted_run):
    system = serve_local.load_system("A", {"run": str(scripted_run), "checkpoint": "latest"})
    assert system.info["format"] == "nanochat" and system.info["recipe"] == "lm-pretrain"
    case = goldens["cases"][0]
    messages = [{"role": "user", "content": case["user"]}]
    text, ids = serve_local.render(system, messages)
    assert ids == case["prompt"]
    assert text.startswith("<|bos|><|user_start|>What is 6 times 7?<|user_end|>")
    lines: list[dict] = []
    done = serve_local.chat(system, {"messages": messages, "max_tokens": goldens["max_tokens"],
                                     "settings": {}, "seed": 0}, lines.append, lambda: False)
    assert done["stop_reason"] == "eos"
    assert done["ids"] + [goldens["special_ids"]["<|assistant_end|>"]] == case["tokens"]
    assert done["text"] == ("<|python_start|>6*7<|python_end|><|output_start|>42<|output_end|>"
                            " It is 42.")
    assert done["tool_calls"] == [{"expr": "6*7", "result": "42"}]
    tokens = [line for line in lines if line["event"] == "token"]
    assert [0 if t["forced"] else 1 for t in tokens] == case["masks"][:len(tokens)]
    assert [line for line in lines if line["event"] == "tool"] == [
        {"event": "tool", "expr": "6*7", "result": "42"}]
    assert "".join(t["text"] for t in tokens) == done["text"]
    # the next turn renders this reply back to the tokens the reply was
    follow = messages + [{"role": "assistant", "content": done["text"]},
                         {"role": "user", "content": "Thanks"}]
    _, again = serve_local.render(system, follow)
    assert again[:len(case["prompt"]) + len(case["tokens"])] == case["prompt"] + case["tokens"]


def test_twin_a_tool_message_has_no_place_in_nanochats_format(scripted_run):
    system = serve_local.load_system("A", {"run": str(scripted_run), "checkpoint": "latest"})
    with pytest.raises(ForgebenchError, match="no place in nanochat's format"):
        serve_local.render(system, [{"role": "user", "content": "hi"},
                                    {"role": "tool", "content": "{}"}])
    with pytest.raises(ForgebenchError, match="should be from 'assistant'"):
        serve_local.render(system, [{"role": "user", "content": "a"},
                                    {"role": "user", "content": "b"}])


def test_forgebench_chat_on_the_checkpoint_shows_the_call(goldens, scripted_run, capsys,
                                                          tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                   # no workspace: the transcript is not saved
    assert main(["chat", str(scripted_run), "--prompt", "What is 6 times 7?", "--calculator",
                 "--repetition-penalty", "1", "--max-tokens", "32"]) == 0
    out, err = capsys.readouterr()
    assert "<|python_start|>6*7<|python_end|><|output_start|>42<|output_end|> It is 42." in out
    assert "[calculator 6*7 -> 42]" in err and "nanochat sampler" in err


def test_llama_pretrain_run_is_refused_with_the_reason(tmp_path):
    config = write_config(tmp_path / "c.toml", make_corpus(tmp_path), steps=1, save_every=1,
                          precision="f32")
    assert main(["run", str(config), "--out", str(tmp_path / "run"), "--threads", "1"]) == 0
    with pytest.raises(ForgebenchError, match="chat format only as nanochat"):
        serve_local.load_system("A", {"run": str(tmp_path / "run"), "checkpoint": "latest"})
