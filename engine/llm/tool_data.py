"""Tool-call SFT data: conversations with a tool schema, assistant tool calls and tool
results -> (input_ids, labels) where only the assistant's calls and answers are supervised.

A record (one JSONL line, or a text-sft dataset record) is the handbook's shape:

    {"tools": [{"type": "function", "function": {"name": "lookup_part", "description": "...",
                "parameters": {JSON Schema of the arguments, type "object"}}}],
     "messages": [{"role": "user", "content": "How many P-101 parts are available?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                   "function": {"name": "lookup_part", "arguments": {"part_id": "P-101"}}}]},
                  {"role": "tool", "name": "lookup_part", "content": "{\"stock\": 8}"},
                  {"role": "assistant", "content": "P-101 has 8 units in bin A."}]}

Every call must name a tool of its record and carry arguments valid against that tool's
schema (training data that shows an invalid call teaches one); a tool result must follow a
call. A bad record is refused with its line and the field (engine/data/tool_records.py, the
same check `forgebench data validate` runs on a text-sft folder).

Rendering: when the model's own chat template prints structured tool calls (probed: a call's
name shows up in its render), the conversation goes to it as is, with `tools`. Otherwise the
documented default (docs/user-guide.md, "Tool calls"): the tool list and the call format are
appended to the system message, a call is `<tool_call>{"name", "arguments"}</tool_call>` text
in the assistant turn, and tool results travel in a user turn between `<tool_response>` lines.

Encoding: the template text before each assistant turn is the render of the conversation up
to it with the generation prompt; the assistant turn is what the render through it adds. Its
tokens up to the first end-of-generation token are supervised; everything else (system, user
turns, tool results, the template's markup) is context with masked labels. Prompt and reply
are tokenized separately, so no merge crosses the boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.data.tool_records import schemas_of, tool_conversation
from engine.errors import ForgebenchError
from engine.eval.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    call_text,
    parse_call,
)
from engine.llm.chat import encode_prompt
from engine.llm.sft_data import (
    EncodedSample,
    SFTExample,
    Truncation,
    eos_to_append,
    finish_sample,
)

DEFAULT_INSTRUCTIONS = (
    "You can call tools. To call one, reply with only\n"
    f"{CALL_OPEN}\n{{\"name\": TOOL, \"arguments\": {{...}}}}\n{CALL_CLOSE}\n"
    f"and wait for its result between {RESPONSE_OPEN} and {RESPONSE_CLOSE}. "
    "If no tool fits or an argument is missing, answer or ask instead. Tools:")
_PROBE = "forgebench_probe_tool"


@dataclass
class ToolExample(SFTExample):
    """A conversation with tools: `messages` are {role, content} with `tool_calls`
    ([{name, arguments}]) on assistant turns that call, `name` on tool turns."""

    tools: list[dict] = field(default_factory=list)   # [{"type": "function", "function": …}]

    @property
    def schemas(self) -> dict[str, dict]:
        return schemas_of(self.tools)


# -- loading and validation (engine/data/tool_records.py, shared with the dataset validator) --
def tool_example(record: dict, keys, system: str | None, path: Path, number: int,
                 where: str) -> ToolExample:
    tools, messages = tool_conversation(record, keys.messages_key, path, where)
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return ToolExample(messages, number, str(path), where, tools=tools)


# -- rendering ------------------------------------------------------------------------------
def renders_tool_calls(renderer) -> bool:
    """Whether the chat template prints structured tool calls itself (its own tool format)."""
    probe = [{"role": "user", "content": "?"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": _PROBE,
                                                               "arguments": {}}}]}]
    tools = [{"type": "function", "function": {"name": _PROBE, "description": "",
                                               "parameters": {"type": "object"}}}]
    try:
        return _PROBE in renderer(probe, add_generation_prompt=False, tools=tools)
    except ForgebenchError:
        return False


def template_messages(messages: list[dict], tools: list[dict],
                      native: bool) -> tuple[list[dict], dict]:
    """The conversation as the template takes it, and the extra render variables: the
    template's own tool format (`native`) or the default one."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m["role"] == "assistant" and not m.get("tool_calls"):
                call = parse_call(m["content"])        # a chat transcript keeps calls as text
                if call and call.name and call.arguments is not None:
                    m = {"role": "assistant", "content": m["content"].split(CALL_OPEN)[0].strip(),
                         "tool_calls": [{"name": call.name, "arguments": call.arguments}]}
            if m.get("tool_calls"):
                m["tool_calls"] = [{"type": "function", "function": c} for c in m["tool_calls"]]
            out.append(m)
        return out, {"tools": tools}
    listing = DEFAULT_INSTRUCTIONS + "".join(
        "\n" + json.dumps(t["function"], ensure_ascii=False) for t in tools)
    head, rest = (messages[0], messages[1:]) if messages and messages[0]["role"] == "system" \
        else (None, messages)
    out = [{"role": "system",
            "content": (head["content"] + "\n\n" if head else "") + listing}]
    for m in rest:
        if m["role"] == "assistant":
            parts = [m["content"]] if m["content"] else []
            parts += [call_text(c["name"], c["arguments"]) for c in m.get("tool_calls") or ()]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif m["role"] == "tool":
            result = f"{RESPONSE_OPEN}\n{m['content']}\n{RESPONSE_CLOSE}"
            if out[-1].get("from_tool"):             # consecutive results share one turn
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "from_tool": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out], {}


def render_prompt(renderer, messages: list[dict], tools: list[dict]) -> str:
    """The prompt text that asks the model for its next turn after `messages`."""
    native = renders_tool_calls(renderer)
    shaped, extra = template_messages(messages, tools, native)
    return renderer(shaped, add_generation_prompt=True, **extra)


# -- encoding -------------------------------------------------------------------------------
def encode_tool_sft(example: ToolExample, tokenizer, chat_renderer, max_len: int,
                    truncation: Truncation = "error") -> EncodedSample | None:
    """Token ids and labels of one tool conversation: every assistant turn (calls and
    answers) and its end-of-turn token supervised, nothing else."""
    native = renders_tool_calls(chat_renderer)
    shaped, extra = template_messages(example.messages, example.tools, native)

    def render(upto: int, prompt: bool) -> str:
        try:
            return chat_renderer(shaped[:upto], add_generation_prompt=prompt, **extra)
        except ForgebenchError as exc:       # name the record, not only the template
            raise ForgebenchError(exc.message, path=example.source, where=example.where,
                                  hint=exc.hint or f"the template is the {exc.where}") from None

    ids: list[int] = []
    supervised: list[bool] = []
    done = ""
    for k, message in enumerate(shaped):
        if message["role"] != "assistant":
            continue
        prompt, through = render(k, True), render(k + 1, False)
        if not (prompt.startswith(done) and through.startswith(prompt)):
            raise ForgebenchError(
                "the chat template does not render this conversation as a growing prefix "
                f"(turn {k}), so its assistant turns cannot be separated from the context",
                path=example.source, where=example.where)
        context = prompt[len(done):]
        context_ids = (encode_prompt(tokenizer, context) if not ids else
                       tokenizer.encode(context, add_special=False, parse_special=True))
        reply_ids = tokenizer.encode(through[len(prompt):], add_special=False,
                                     parse_special=True)
        end = next((j for j, t in enumerate(reply_ids) if t in tokenizer.eog_ids), None)
        if end is None:        # the template closes no turn: teach the model to stop with EOS
            reply_ids.append(eos_to_append(tokenizer, example))
            end = len(reply_ids) - 1
        ids += context_ids + reply_ids
        supervised += [False] * len(context_ids) + [True] * (end + 1) \
            + [False] * (len(reply_ids) - end - 1)
        done = through
    return finish_sample(ids, supervised, example, max_len, truncation)


# -- held-out decisions (what the tool-call score is computed on) --------------------------
@dataclass(frozen=True)
class Decision:
    """One assistant turn to predict: the conversation before it and the call it makes
    (None: it answers or asks without calling)."""

    context: list[dict]
    expected: dict | None          # {"name", "arguments"} of its first call
    line: int


def decisions(example: ToolExample) -> list[Decision]:
    return [Decision(example.messages[:k], (m.get("tool_calls") or [None])[0], example.line)
            for k, m in enumerate(example.messages) if m["role"] == "assistant"]
