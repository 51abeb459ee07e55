"""`forgebench chat --calculator`: the model is offered the calculator, the calls it makes are
run in the sandbox (engine/calculator.py), each result is a tool message in the transcript,
and the model's next reply reads it. The model is scripted here (what it says is not under
test; the loop around it is); the prompt it would see is rendered by the real worker code."""

from __future__ import annotations

import json

import pytest

from engine import calculator, serve_local
from engine.cli import main
from engine.conversations import Conversation
from engine.eval.tool_calls import call_text


class ScriptedModel:
    """Stands in for serve_local.chat: says the next scripted text, records each request."""

    def __init__(self, *texts: str):
        self.texts, self.requests = list(texts), []

    def __call__(self, system, request, send, should_cancel):
        self.requests.append(json.loads(json.dumps(request)))
        text = self.texts.pop(0)
        send({"event": "token", "text": text})
        return {"event": "done", "text": text, "stop_reason": "eos", "new_tokens": 3,
                "timings": {}}


def chat(tmp_path, monkeypatch, model: ScriptedModel, *prompts: str) -> Conversation:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read: the model is scripted")
    monkeypatch.setattr(serve_local, "load_system",
                        lambda name, request, **_: serve_local.System(name, None, None, None, {}))
    monkeypatch.setattr(serve_local, "chat", model)
    transcript = tmp_path / "t.jsonl"
    args = ["chat", str(gguf), "--save", str(transcript), "--calculator"]
    assert main(args + [x for p in prompts for x in ("--prompt", p)]) == 0
    return Conversation.open(transcript)


def test_a_calculator_call_is_run_and_the_model_reads_the_result(tmp_path, monkeypatch):
    model = ScriptedModel(call_text("calculator", {"expression": "17 * 23"}), "It is 391.")
    conversation = chat(tmp_path, monkeypatch, model, "What is 17 * 23?")
    roles = [(m["role"], m.get("name")) for m in conversation.messages]
    assert roles == [("user", None), ("assistant", None), ("tool", "calculator"),
                     ("assistant", None)]
    assert json.loads(conversation.messages[2]["content"]) == {"result": 391}
    first, second = model.requests
    assert first["tools"] == second["tools"] == [calculator.SCHEMA]
    assert second["messages"][-1] == {"role": "tool", "name": "calculator",
                                      "content": '{"result": 391}'}
    assert [m["role"] for m in conversation.thread("A")] == ["user", "assistant", "tool",
                                                             "assistant"]
    # the Chat pane reopens it and shows the result as the calculator's
    from app.viewmodels.chat import ChatSession
    from app.views.chat_pane import transcript_html

    session = ChatSession(tmp_path)
    session.open(conversation.path)
    shown = session.transcript("A")
    assert [m["role"] for m in shown] == ["user", "assistant", "tool", "assistant"]
    assert "calculator result:</b> {&quot;result&quot;: 391}" in transcript_html(shown, "m")


@pytest.mark.parametrize("call, error", [
    (call_text("calculator", {"expression": "__import__('os').system('touch pwned')"}),
     "Call is not allowed: arithmetic only"),
    (call_text("calculator", {"expression": "9 ** 9 ** 9"}), "exponents are limited"),
    (call_text("shell", {"cmd": "ls"}), "unknown tool 'shell'"),
    ('<tool_call>\n{"name": "calculator", "arguments": [1]}\n</tool_call>',
     "the arguments are not a JSON object"),
])
def test_a_call_that_is_not_arithmetic_is_answered_with_an_error(tmp_path, monkeypatch, call,
                                                                 error):
    conversation = chat(tmp_path, monkeypatch, ScriptedModel(call, "Sorry."), "Do it.")
    tool = conversation.messages[2]
    assert tool["role"] == "tool" and error in json.loads(tool["content"])["error"]
    assert not (tmp_path / "pwned").exists()


def test_calls_per_turn_are_bounded(tmp_path, monkeypatch):
    from engine.commands.chat import MAX_TOOL_ROUNDS

    loop = call_text("calculator", {"expression": "1 + 1"})
    model = ScriptedModel(*[loop] * (MAX_TOOL_ROUNDS + 1), "never asked")
    conversation = chat(tmp_path, monkeypatch, model, "Loop.")
    assert sum(m["role"] == "tool" for m in conversation.messages) == MAX_TOOL_ROUNDS
    assert len(model.requests) == MAX_TOOL_ROUNDS + 1


def test_the_prompt_offers_the_calculator_and_carries_results(tmp_path):
    from fixtures_gguf import write_tiny_gguf

    from engine.gguf.reader import open_gguf
    from engine.llm.chat import ChatTemplate
    from engine.llm.tokenizer import GGUFTokenizer

    gguf = open_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q8_0",
                                     n_layers=1))
    system = serve_local.System("A", None, GGUFTokenizer.from_gguf(gguf),
                                ChatTemplate.from_gguf(gguf), {})   # what load_system builds
    messages = [{"role": "user", "content": "6*7?"},
                {"role": "assistant", "content": call_text("calculator", {"expression": "6*7"})},
                {"role": "tool", "name": "calculator", "content": '{"result": 42}'}]
    text, ids = serve_local.render(system, messages, [calculator.SCHEMA])
    assert json.dumps(calculator.SCHEMA["function"]) in text
    assert text.endswith('<tool_response>\n{"result": 42}\n</tool_response><end_of_turn>\n'
                         '<start_of_turn>model\n') and ids
    plain, _ = serve_local.render(system, messages[:1])
    assert "tool" not in plain                       # without tools, nothing is offered
