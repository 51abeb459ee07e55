"""A nanochat checkpoint that calls the calculator, for the chat tests (tests/
test_nanochat_chat_serve.py, tests/test_app_chat.py): a real one-step lm-pretrain run of
nanochat's GPT with the architecture of the Engine goldens, its checkpoint then given the
goldens' scripted weights and tokenizer (tests/data/nanochat/make_chat_goldens.py), whose
greedy reply to "What is 6 times 7?" is a calculator call, the forced 42, and " It is 42."."""

from __future__ import annotations

import json
from pathlib import Path

from lm_pretrain_support import forgebench, make_corpus, write_config

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


def scripted_nanochat_run(root: Path, out: Path) -> Path:
    """The run folder `out` (trained under `root`), its last checkpoint holding the goldens'
    weights and tokenizer, the checkpoint's file records updated as the trainer writes them.
    Numpy only: the app's tests stay torch-free."""
    from safetensors.numpy import load_file, save_file

    from engine.nanochat_tokenizer import NanochatTokenizer
    from engine.rundir import SENTINEL
    from engine.train.integrity import file_records

    goldens = json.loads(GOLDENS.read_text("utf-8"))
    config = nanochat_run_config(root / "nanochat.toml", make_corpus(root), goldens["config"])
    forgebench("run", str(config), "--out", str(out), "--threads", "1")
    checkpoint = sorted((out / "checkpoints").glob("step-*"))[-1]
    tensors = load_file(str(DATA / "chat_goldens.safetensors"))
    save_file({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")},
              str(checkpoint / "model.safetensors"))
    text = (DATA / "tokenizer_train.txt").read_bytes().decode("utf-8")
    tokenizer = NanochatTokenizer.train([text], goldens["config"]["vocab_size"])
    (checkpoint / "tokenizer.json").write_text(tokenizer.to_json(), "utf-8")
    state = json.loads((checkpoint / SENTINEL).read_text("utf-8"))
    state["files"].update(file_records(checkpoint, ["model.safetensors", "tokenizer.json"]))
    (checkpoint / SENTINEL).write_text(json.dumps(state), "utf-8")
    return out
