"""lm-sft on the nanochat family, end to end: a tiny nanochat GPT pretrained with its MuonAdamW,
then fine-tuned on a few conversations with calculator calls as nanochat's chat_sft does
(nanochat's render and training mask, its optimizer), resumed bit for bit, and its checkpoint
chatting in nanochat's format in the chat worker, `forgebench chat` and the Chat pane's list
(with nanochat's sampler as the default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lm_pretrain_support import make_corpus, write_config

from app.viewmodels import chat as chat_vm
from engine import serve_local
from engine.cli import main
from engine.errors import ForgebenchError
from engine.llm.nanochat_chat import uses_nanochat_sampler
from engine.rundir import RunDir
from engine.sampling import CHAT_DEFAULTS, SamplingSettings
from engine.train.checkpoint import load_checkpoint

CALL = "<|python_start|>{expr}<|python_end|><|output_start|>{result}<|output_end|>"
CONVERSATIONS = [("What is 6 times 7?", CALL.format(expr="6*7", result="42") + " It is 42."),
                 ("What is 12 plus 30?", CALL.format(expr="12+30", result="42") + " It is 42."),
                 ("What is 9 times 9?", CALL.format(expr="9*9", result="81") + " It is 81."),
                 ("Say hello.", "Hello!")]
STEPS = 30

SFT_CONFIG = """\
recipe = "lm-sft"
seed = 5
steps = {steps}
save_every = {save_every}
keep_last = 5
log_every = 1

[model]
run = "{base}"

[data]
path = "{data}"
val_path = "{data}"

[lora]
method = "{method}"

[optim]
lr = 0.02
grad_clip = 0.0

[train]
window = 4
micro_batch = 2
precision = "f32"

[sample]
prompts = ["What is 6 times 7?"]
max_tokens = 24
"""


def pretrain_config(path: Path, corpus: Path) -> Path:
    """Four MuonAdamW steps of a two-layer nanochat GPT with nanochat's tokenizer."""
    write_config(path, corpus, steps=4, save_every=4, precision="f32", tokenizer="nanochat")
    text = path.read_text()
    for old, new in [
            ("dim = 32\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\nffn_dim = 64\ncontext = 32\n",
             'family = "nanochat"\nwindow_pattern = "L"\ndim = 64\nn_layers = 2\n'
             "n_heads = 2\nn_kv_heads = 1\ncontext = 128\n"),
            ("[optim]\nlr = 3e-3\nwarmup = 2\n", '[optim]\nkind = "muon"\nlr = 0.02\nwarmup = 0\n'),
            ('[sample]\nprompts = ["Record item"]\nmax_tokens = 16',
             '[sample]\nprompts = ["Record"]\nmax_tokens = 2')]:
        assert old in text
        text = text.replace(old, new)
    path.write_text(text)
    return path


def sft_config(root: Path, base: Path, *, steps: int = STEPS, save_every: int = STEPS // 2,
               method: str = "full", name: str = "sft.toml") -> Path:
    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]})
                            + "\n" for q, a in CONVERSATIONS))
    path = root / name
    path.write_text(SFT_CONFIG.format(steps=steps, save_every=save_every, base=base, data=data,
                                      method=method))
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A workspace with the pretrained base (runs/base) and its fine-tune (runs/sft)."""
    from app.viewmodels.workspace import Workspace

    root = Workspace.create(tmp_path_factory.mktemp("nanosft") / "ws").root
    config = pretrain_config(root / "pretrain.toml", make_corpus(root))
    assert main(["run", str(config), "--out", str(root / "runs" / "base"), "--threads",
                 "1"]) == 0
    assert main(["run", str(sft_config(root, root / "runs" / "base")), "--out",
                 str(root / "runs" / "sft"), "--threads", "1"]) == 0
    return root


def answers(run: Path) -> dict[str, str]:
    return {p.parent.name: json.loads(p.read_text())["answer"]
            for p in sorted((run / "samples").glob("*/generations.jsonl"))}


def test_sft_learns_the_calculator_call_with_nanochats_optimizer(workspace):
    run = RunDir(workspace / "runs" / "sft")
    losses = [m["loss"] for m in run.metrics() if m.get("split", "train") == "train"]
    assert len(losses) == STEPS and losses[-1] < losses[0] / 10
    # the greedy answer after training makes the call; the calculator's 42 is forced
    found = answers(run.path)
    assert found[f"step-{STEPS:06d}"] == CALL.format(expr="6*7", result="42") + " It is 42."
    assert "<|python_start|>" not in found["step-000000"]       # twin: before, no call
    # nanochat's MuonAdamW (Muon state on the block matrices), weight decay 0 as chat_sft
    _, optimizer, _ = load_checkpoint(run.checkpoint("latest"))
    kinds = [g["kind"] for g in optimizer["param_groups"]]
    assert kinds.count("adamw") == 6 and "muon" in kinds
    assert all(g["weight_decay"] == 0.0 for g in optimizer["param_groups"] if g["kind"] == "muon")
    assert any("momentum_buffer" in s for s in optimizer["state"].values())


def test_eval_reads_the_conversations_in_nanochats_format(workspace, capsys):
    """`forgebench eval` on the fine-tune: the held-out loss (here the training
    conversations) falls from the middle checkpoint to the last one."""
    run = workspace / "runs" / "sft"
    losses = {}
    for name in (f"step-{STEPS // 2:06d}", f"step-{STEPS:06d}"):
        capsys.readouterr()
        assert main(["eval", str(run), "--split", "val", "--checkpoint", name]) == 0
        losses[name] = json.loads((run / "evals" / f"val-{name}.json").read_text())["loss"]
    assert losses[f"step-{STEPS:06d}"] < losses[f"step-{STEPS // 2:06d}"] < 0.5


def test_training_mask_is_nanochats(workspace):
    """The supervised tokens of a conversation are the assistant's text, its call with the
    call's delimiters and <|assistant_end|>: not the user's turn nor the calculator's output
    (which comes from Python at chat time)."""
    from engine.jobs import run_config
    from engine.train.lm_base import encode_nanochat, load_base

    config = run_config(RunDir(workspace / "runs" / "sft"))
    base = load_base(config)
    samples, report = encode_nanochat(config, base)
    assert report["format"] == "nanochat" and report["kept"] == len(CONVERSATIONS)
    first = samples[0]
    supervised = [t for t in first.labels if t != -100]
    assert base.tokenizer.decode_with_specials(supervised) == (
        "<|python_start|>6*7<|python_end|> It is 42.<|assistant_end|>")
    text = base.tokenizer.decode_with_specials(first.sequence)
    assert text == ("<|bos|><|user_start|>What is 6 times 7?<|user_end|><|assistant_start|>"
                    + CONVERSATIONS[0][1] + "<|assistant_end|>")
    # twin: the whole reply, output included, is more than what is supervised
    assert len(supervised) < len(base.tokenizer.encode(CONVERSATIONS[0][1])) + 1


def test_resume_is_bit_exact(workspace, tmp_path):
    config = sft_config(tmp_path, workspace / "runs" / "base", steps=6, save_every=3)
    assert main(["run", str(config), "--out", str(tmp_path / "full"), "--threads", "1"]) == 0
    assert main(["run", str(config), "--out", str(tmp_path / "half"), "--stop-after-step", "3",
                 "--threads", "1"]) == 0
    assert main(["resume", str(tmp_path / "half"), "--threads", "1"]) == 0
    full, half = RunDir(tmp_path / "full"), RunDir(tmp_path / "half")
    a, sa, _ = load_checkpoint(full.checkpoint("step-000006"))
    b, sb, _ = load_checkpoint(half.checkpoint("step-000006"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    loss = {m["step"]: m["loss"] for m in full.metrics() if "loss" in m}
    assert loss == {m["step"]: m["loss"] for m in half.metrics() if "loss" in m}
    c, _, _ = load_checkpoint(full.checkpoint("step-000003"))  # twin: training moved them
    assert not torch.equal(a["transformer.h.0.mlp.c_fc.weight"],
                           c["transformer.h.0.mlp.c_fc.weight"])


def test_checkpoint_chats_as_nanochat_in_the_worker_and_the_cli(workspace, capsys, tmp_path,
                                                              monkeypatch):
    run = workspace / "runs" / "sft"
    system = serve_local.load_system("A", {"run": str(run), "checkpoint": "latest",
                                           "workspace": str(workspace)})
    assert system.info["format"] == "nanochat" and system.info["recipe"] == "lm-sft"
    messages = [{"role": "user", "content": "What is 9 times 9?"}]
    lines: list[dict] = []
    done = serve_local.chat(system, {"messages": messages, "max_tokens": 24, "settings": {},
                                     "seed": 0}, lines.append, lambda: False)
    assert done["tool_calls"] == [{"expr": "9*9", "result": "81"}]
    assert done["text"] == CALL.format(expr="9*9", result="81") + " It is 81."
    assert done["stop_reason"] == "eos" and done["sampler"] == "nanochat"
    forced = [line["text"] for line in lines if line["event"] == "token" and line["forced"]]
    assert "".join(forced) == "<|output_start|>81<|output_end|>"
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["chat", str(run), "--prompt", "What is 12 plus 30?", "--repetition-penalty",
                 "1", "--max-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert CALL.format(expr="12+30", result="42") + " It is 42." in out
    assert "[calculator 12+30 -> 42]" in err


def test_chat_pane_lists_the_fine_tune_as_nanochat_with_nanochats_sampler(workspace):
    found = {s.label: s for s in chat_vm.sources(workspace)}
    sft = found[f"run: sft/step-{STEPS:06d} (nanochat)"]
    assert sft.usable and sft.format == "nanochat"
    session = chat_vm.ChatSession(workspace)
    assert session.settings["repetition_penalty"] == 1.1
    session.choose("A", sft)
    assert session.settings["repetition_penalty"] == 1.0
    assert session.settings["dry_multiplier"] == 0.0
    assert uses_nanochat_sampler(SamplingSettings(**session.settings))
    # twin: the engine's chat default would replace nanochat's sampler
    assert not uses_nanochat_sampler(CHAT_DEFAULTS)


def test_default_settings_follow_the_sources_unless_changed():
    nanochat = chat_vm.Source("run: x (nanochat)", "run", {"run": "x"}, format="nanochat")
    gguf = chat_vm.Source("model: m", "library", {"library": "m"})
    assert chat_vm.default_settings([nanochat])["repetition_penalty"] == 1.0
    assert chat_vm.default_settings([nanochat])["dry_multiplier"] == 0.0
    assert chat_vm.default_settings([gguf])["repetition_penalty"] == 1.1      # twin
    assert chat_vm.default_settings([nanochat, gguf])["repetition_penalty"] == 1.1
    session = chat_vm.ChatSession(Path("."))
    session.choose("A", nanochat)
    session.choose("A", gguf)
    assert session.settings == chat_vm.DEFAULT_SETTINGS
    session.settings["repetition_penalty"] = 1.3          # the user's own value stays
    session.choose("A", nanochat)
    assert session.settings["repetition_penalty"] == 1.3


def test_lora_and_other_recipes_are_refused_with_the_reason(workspace, tmp_path, capsys):
    config = sft_config(tmp_path, workspace / "runs" / "base", steps=1, method="lora")
    assert main(["run", str(config), "--out", str(tmp_path / "lora"), "--threads", "1"]) != 0
    assert "nanochat's GPT is fine-tuned whole" in capsys.readouterr().err
    from engine.train.lm_base import load_nanochat

    class Other:
        recipe = "lm-dpo"

    base = RunDir(workspace / "runs" / "base")
    with pytest.raises(ForgebenchError, match="lm-dpo does not start from nanochat's GPT"):
        load_nanochat(Other(), base, base.path)


def post(url: str, body: dict) -> tuple[int, dict | str]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            text = reply.read().decode()
            return reply.status, text if body.get("stream") else json.loads(text)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_openai_server_runs_the_calculator_inside_the_reply(workspace):
    """`forgebench serve` lists the fine-tune and its pretrained base, answers a chat as
    nanochat's Engine (the call, its result forced, the rest), streams the same text, and
    refuses what a nanochat model cannot take with the reason."""
    from serve_support import Served

    server = Served("--workspace", str(workspace))
    try:
        import urllib.request

        with urllib.request.urlopen(server.url + "/models", timeout=60) as listing:
            models = json.loads(listing.read())
        ids = {m["id"] for m in models["data"]}
        assert {"sft", f"sft/step-{STEPS:06d}", "base"} <= ids
        chat = {"model": "sft", "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": "What is 9 times 9?"}]}
        status, reply = post(server.url + "/chat/completions", chat)
        assert status == 200, reply
        expected = CALL.format(expr="9*9", result="81") + " It is 81."
        assert reply["choices"][0]["message"]["content"] == expected
        assert reply["choices"][0]["finish_reason"] == "stop"
        status, stream = post(server.url + "/chat/completions", {**chat, "stream": True})
        deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                  for line in stream.splitlines()
                  if line.startswith("data: {") and '"choices": [{' in line]
        assert "".join(deltas) == expected
        # twin: the pretrained base never learnt the call, so its reply has none
        status, base = post(server.url + "/chat/completions", {**chat, "model": "base"})
        assert status == 200 and "<|output_start|>81" not in base["choices"][0]["message"][
            "content"]
        status, refused = post(server.url + "/chat/completions", {**chat, "stop": ["."]})
        assert status == 400 and "stop strings are not supported" in refused["error"]["message"]
        status, text = post(server.url + "/completions", {"model": "sft", "prompt": "Record",
                                                          "max_tokens": 4, "temperature": 0})
        assert status == 200 and text["usage"]["prompt_tokens"] >= 2
    finally:
        server.close()
