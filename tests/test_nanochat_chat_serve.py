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

from engine import serve_local
from engine.cli import main
from engine.errors import ForgebenchError
from engine.nanochat_tokenizer import NanochatTokenizer
from engine.rundir import SENTINEL, RunDir
from engine.train.integrity import file_records

DATA = Path(__file__).parent / "data" / "nanochat"
GOLDENS = DATA / "chat_goldens.json"


def nanochat_run_config(path: Path, corpus: Path, config: dict) -> Path:
    """A one-step lm-pretrain config with the goldens' architecture."""
    write_config(path, corpus, steps=1, save_every=1, precision="f32", tokenizer="nanochat")
    text = path.read_text()
    text = text.replace("vocab_size = 300", f"vocab_size = {config['vocab_size']}")
    text = text.replace("dim = 32\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\nffn_dim = 64\n"
                        "context = 32\n",
                        f"family = \"nanochat\"\nwindow_pattern = \"{config['window_pattern']}\"\n"
                        f"dim = {config['n_embd']}\nn_layers = {config['n_layer']}\n"
                        f"n_heads = {config['n_head']}\nn_kv_heads = {config['n_kv_head']}\n"
                        f"context = {config['sequence_len']}\n")
    text = text.replace("[sample]\nprompts = [\"Record item\"]\nmax_tokens = 16",
                        "[sample]\nprompts = [\"Record\"]\nmax_tokens = 2")
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def goldens():
    if not GOLDENS.is_file():
        pytest.skip(f"no chat goldens at {GOLDENS} (make_chat_goldens.py writes them)")
    return json.loads(GOLDENS.read_text("utf-8"))


@pytest.fixture(scope="module")
def scripted_run(goldens, tmp_path_factory) -> Path:
    """A nanochat lm-pretrain run whose last checkpoint holds the goldens' weights and
    tokenizer (the reference's merges, trained again here)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("ncchat")
    config = nanochat_run_config(root / "c.toml", make_corpus(root), goldens["config"])
    assert main(["run", str(config), "--out", str(root / "run"), "--threads", "1"]) == 0
    checkpoint = RunDir(root / "run").checkpoint("latest").path
    tensors = load_file(str(DATA / "chat_goldens.safetensors"))
    save_file({k[len("model/"):]: v.contiguous() for k, v in tensors.items()
               if k.startswith("model/")}, str(checkpoint / "model.safetensors"))
    text = (DATA / "tokenizer_train.txt").read_bytes().decode("utf-8")
    tokenizer = NanochatTokenizer.train([text], goldens["config"]["vocab_size"])
    (checkpoint / "tokenizer.json").write_text(tokenizer.to_json(), "utf-8")
    # the sentinel's file records, as the trainer writes them, for the replaced files
    state = json.loads((checkpoint / SENTINEL).read_text("utf-8"))
    state["files"].update(file_records(checkpoint, ["model.safetensors", "tokenizer.json"]))
    (checkpoint / SENTINEL).write_text(json.dumps(state), "utf-8")
    return root / "run"


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
    assert main(["chat", str(scripted_run), "--prompt", "What is 6 times 7?",
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
