"""The tool-conversation record: its one validator, shared by the dataset validator
(`forgebench data validate` on a text-sft folder) and the SFT loader (engine/llm/tool_data.py).

A record carries `tools` (a non-empty list of `{"type": "function", "function": {"name",
"description", "parameters"}}`, the inner object alone also accepted) and `messages`. Every
assistant call must name a tool of its record with arguments valid against that tool's JSON
Schema (training data that shows an invalid call teaches one), a tool result must follow a
call, and the conversation must hold an assistant turn. A bad record is refused with a
ForgebenchError whose message names the exact field (`messages[2].tool_calls[0].function.
arguments`); the caller supplies the file and where (line or record id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.data.formats import MESSAGE_ROLES
from engine.errors import ForgebenchError, excerpt
from engine.eval.tool_calls import check_schema, schema_problem


def schemas_of(tools: list[dict]) -> dict[str, dict]:
    """Each tool's name -> its arguments' JSON Schema."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


def tool_conversation(record: dict, messages_key: str, path: Path | str | None,
                      where: str) -> tuple[list[dict], list[dict]]:
    """(tools, messages) of a valid record, normalized: tools as `{"type": "function",
    "function": {...}}`, calls as `{"name", "arguments"}` with the arguments parsed."""
    def refuse(message: str, hint: str | None = None):
        raise ForgebenchError(message, path=path, where=where, hint=hint)

    tools = _tools_of(record.get("tools"), refuse, path, where)
    schemas = schemas_of(tools)
    turns = record.get(messages_key)
    if not isinstance(turns, list) or not turns:
        refuse(f"field '{messages_key}' must be a non-empty list")
    messages: list[dict] = []
    for k, turn in enumerate(turns):
        messages.append(_message_of(turn, f"{messages_key}[{k}]", messages, schemas, refuse))
    if not any(m["role"] == "assistant" for m in messages):
        refuse("the conversation has no assistant turn, so nothing to learn")
    return tools, messages


def _message_of(turn: Any, name: str, before: list[dict], schemas: dict[str, dict],
                refuse) -> dict:
    """One turn, normalized; `before` are the turns already read (a tool result must follow
    a call)."""
    if not isinstance(turn, dict) or "role" not in turn:
        refuse(f"field '{name}' must be an object with 'role' and 'content'")
    role, content = turn["role"], turn.get("content")
    if role not in MESSAGE_ROLES:
        refuse(f"field '{name}.role' is {excerpt(role)}", "roles: " + ", ".join(MESSAGE_ROLES))
    calls = turn.get("tool_calls")
    if content is None and role == "assistant" and calls:
        content = ""
    if not isinstance(content, str):
        refuse(f"field '{name}.content' must be a string, got {type(content).__name__}")
    message: dict[str, Any] = {"role": role, "content": content}
    if calls is not None:
        if role != "assistant":
            refuse(f"field '{name}.tool_calls' is only for assistant turns")
        message["tool_calls"] = _calls_of(calls, f"{name}.tool_calls", schemas, refuse)
    if role == "tool":
        _check_tool_result(turn, name, before, schemas, refuse)
        if turn.get("name") is not None:
            message["name"] = turn["name"]
    return message


def _check_tool_result(turn: dict, name: str, before: list[dict], schemas: dict[str, dict],
                       refuse) -> None:
    """A tool turn answers a call made before it, by a tool the record declares."""
    previous = next((m for m in reversed(before) if m["role"] != "tool"), None)
    if previous is None or not previous.get("tool_calls"):
        refuse(f"field '{name}' is a tool result that follows no tool call")
    tool_name = turn.get("name")
    if tool_name is not None and tool_name not in schemas:
        refuse(f"field '{name}.name' is {excerpt(tool_name)}, not a tool of this record",
               "tools: " + ", ".join(schemas))


def _tools_of(value: Any, refuse, path, where) -> list[dict]:
    if not isinstance(value, list) or not value:
        refuse("field 'tools' must be a non-empty list of tool schemas",
               '{"type": "function", "function": {"name", "description", "parameters"}}')
    tools, names = [], set()
    for i, tool in enumerate(value):
        spec, name = _function_of(tool, f"tools[{i}]", refuse)
        tool_name = spec.get("name")
        if not isinstance(tool_name, str) or not tool_name:
            refuse(f"field '{name}.name' must be a non-empty string")
        if tool_name in names:
            refuse(f"field '{name}.name' repeats the tool {tool_name!r}")
        description = spec.get("description", "")
        if not isinstance(description, str):
            refuse(f"field '{name}.description' must be a string")
        parameters = spec.get("parameters", {"type": "object", "properties": {}})
        check_schema(parameters, f"{name}.parameters", path=path, where=where)
        names.add(tool_name)
        tools.append({"type": "function", "function": {
            "name": tool_name, "description": description, "parameters": parameters}})
    return tools


def _function_of(item: Any, name: str, refuse) -> tuple[dict, str]:
    """A tool or call object, `{"type": "function", "function": {...}}` or the inner object
    alone, and the field name of the inner object."""
    if isinstance(item, dict) and "function" in item:
        item, name = item["function"], name + ".function"
    if not isinstance(item, dict):
        refuse(f"field '{name}' must be an object with 'name'")
    return item, name


def _calls_of(value: Any, name: str, schemas: dict[str, dict], refuse) -> list[dict]:
    if not isinstance(value, list) or not value:
        refuse(f"field '{name}' must be a non-empty list of calls")
    calls = []
    for j, call in enumerate(value):
        spec, here = _function_of(call, f"{name}[{j}]", refuse)
        tool_name, arguments = spec.get("name"), spec.get("arguments", {})
        if tool_name not in schemas:
            refuse(f"field '{here}.name' is {excerpt(tool_name)}, not a tool of this record",
                   "tools: " + ", ".join(schemas))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                refuse(f"field '{here}.arguments' is not JSON: {exc.msg}")
        if not isinstance(arguments, dict):
            refuse(f"field '{here}.arguments' must be an object")
        problem = schema_problem(arguments, schemas[tool_name])
        if problem:
            refuse(f"field '{here}.arguments' does not match the schema of {tool_name!r}: "
                   f"{problem}", "training calls must be valid calls")
        calls.append({"name": tool_name, "arguments": arguments})
    return calls
