"""The Chat pane's rendered-prompt preview and chat requests, without Qt or a worker: every
thread the view-model sends renders under the engine's built-in Gemma template, which refuses
two user turns in a row. Seen in the app: while a reply streamed (the message box cleared by
Send, so the preview was asked for again), the preview read "the template cannot render …
Gemma turns must alternate … (got user)"."""

from __future__ import annotations

import json

import pytest
from gguf import Keys

from app.viewmodels.chat import ChatSession, Source
from engine.errors import ForgebenchError
from engine.llm.chat import render_chat

GEMMA = {Keys.General.ARCHITECTURE: "gemma3", Keys.Tokenizer.LIST: ["<pad>", "<eos>", "<bos>"],
         Keys.Tokenizer.BOS_ID: 2, Keys.Tokenizer.EOS_ID: 1}


def side_by_side(tmp_path) -> ChatSession:
    """Two systems chosen and loaded, as the worker's "loaded" lines leave them."""
    session = ChatSession(tmp_path)
    for side, name in (("A", "base"), ("B", "pirate")):
        for line in session.choose(side, Source(f"model: {name}", "library",
                                                {"library": name, "workspace": str(tmp_path)})):
            session.feed(json.dumps({"event": "loaded", "request": json.loads(line)["request"],
                                     "info": {"numerics": "f32"}}))
    assert set(session.loaded) == {"A", "B"}
    return session


def requests(lines: list[str]) -> dict[str, dict]:
    """The request lines by system."""
    return {r["system"]: r for r in map(json.loads, lines)}


def stream(session: ChatSession, request: dict, *pieces: str, done: bool) -> None:
    rid = request["request"]
    session.feed(json.dumps({"event": "start", "request": rid, "prompt_tokens": 9}))
    for piece in pieces:
        session.feed(json.dumps({"event": "token", "request": rid, "text": piece}))
    if done:
        session.feed(json.dumps({"event": "done", "request": rid, "text": "".join(pieces),
                                 "stop_reason": "eos"}))


def test_the_preview_renders_while_one_reply_still_streams(tmp_path):
    session = side_by_side(tmp_path)
    sent = requests(session.send("Where is Paris?"))
    stream(session, sent["A"], "In ", "France.", done=True)
    stream(session, sent["B"], "Arr, ", "in Fra", done=False)       # B is still streaming
    preview = requests(session.render_lines(""))
    assert set(preview) == {"A", "B"}
    for request in preview.values():
        text = render_chat(GEMMA, request["messages"])      # raises on two user turns in a row
        assert text.count("Where is Paris?") == 1 and text.endswith(
            "<start_of_turn>user\n…<end_of_turn>\n<start_of_turn>model\n")
    assert "In France." in render_chat(GEMMA, preview["A"]["messages"])
    assert "Arr, in Fra" in render_chat(GEMMA, preview["B"]["messages"])
    # twin: B's thread as the conversation holds it, with the draft after it, is what the
    # preview used to send, and the template refuses it
    with pytest.raises(ForgebenchError, match="alternate"):
        render_chat(GEMMA, session.conversation.thread("B") + [{"role": "user",
                                                                "content": "…"}])


def test_a_reply_that_failed_does_not_make_later_prompts_unrenderable(tmp_path):
    session = side_by_side(tmp_path)
    sent = requests(session.send("First question"))
    stream(session, sent["A"], "An answer.", done=True)
    session.feed(json.dumps({"event": "error", "request": sent["B"]["request"],
                             "message": "out of memory"}))
    assert not session.busy()
    for request in requests(session.render_lines("Second")).values():
        assert render_chat(GEMMA, request["messages"]).endswith(
            "<start_of_turn>user\nSecond<end_of_turn>\n<start_of_turn>model\n")
    again = requests(session.send("Second question"))
    a_text = render_chat(GEMMA, again["A"]["messages"])
    b_text = render_chat(GEMMA, again["B"]["messages"])
    assert "First question" in a_text and "An answer." in a_text
    assert "First question" not in b_text and "Second question" in b_text   # never answered
    # twin: B's thread after the failed reply holds two user turns in a row
    with pytest.raises(ForgebenchError, match="alternate"):
        render_chat(GEMMA, session.conversation.thread("B"))
