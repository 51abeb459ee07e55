"""Tool calls: the one text format of a call, reading a call out of a model's output, and the
6-level score of that output against the expected call. Nothing here executes a call.

The format (docs/user-guide.md, "Tool calls") is the Hermes/Qwen one: a call is a JSON object
with `name` and `arguments` between `<tool_call>` and `</tool_call>` lines. A GGUF whose own
chat template renders tool calls prints them its way; the reader also accepts a bare JSON
object with `name` and `arguments` (or `parameters`, Llama 3.1's key), so those outputs score
too.

The levels of one expected call, each implying the ones before it:

    0 no call          the output holds no tool call
    1 call             it holds one (an opening marker, or a JSON object naming a tool)
    2 right tool       the call names the expected tool
    3 parsable args    its arguments parse as a JSON object
    4 valid args       they are valid against the tool's JSON Schema (`parameters`)
    5 exact args       they equal the expected arguments

An output that should not call a tool (a clarification, a final answer) is scored only as
"abstained" or not. No torch here: the app reads the reports.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from engine.errors import ForgebenchError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
LEVELS = ("no call", "call", "right tool", "parsable args", "valid args", "exact args")

_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')


def call_text(name: str, arguments: dict) -> str:
    """A call in the default format (what a tool-call SFT sample teaches)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


@dataclass(frozen=True)
class ParsedCall:
    """What could be read of the first call in an output. `arguments` is None when they do
    not parse as a JSON object; `name` is None when no tool name could be read."""

    name: str | None
    arguments: dict | None
    raw: str


def _first_json_object(text: str) -> Any:
    """The first JSON value that starts at a '{' in `text` and parses, else None."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        return value
    return None


def parse_call(text: str) -> ParsedCall | None:
    """The first tool call in a model's output, or None when it holds none."""
    block = _BLOCK.search(text)
    body = block.group(1) if block else None
    if body is None:        # no marker: a bare {"name": ..., "arguments": ...} object counts
        value = _first_json_object(text)
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                and ("arguments" in value or "parameters" in value)):
            return None
        body = text
    value = _first_json_object(body)
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        found = _NAME.search(body)        # a broken object may still name its tool
        name = found.group(1) if found else None
    arguments = None
    if isinstance(value, dict):
        arguments = value.get("arguments", value.get("parameters"))
        if isinstance(arguments, str):    # OpenAI style: arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            arguments = None
    return ParsedCall(name, arguments, body)


def schema_problem(arguments: Any, schema: dict) -> str | None:
    """Why `arguments` are not valid against the JSON Schema `schema`, or None if they are."""
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"{error.message}" + (f" (at arguments{where})" if where else "")


def check_schema(schema: Any, field_name: str, *, path=None, where: str | None = None) -> None:
    """Refuse a tool's `parameters` that is not a usable JSON Schema object."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise ForgebenchError(f"field '{field_name}' is not a valid JSON Schema: {exc.message}",
                              path=path, where=where) from None
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ForgebenchError(f"field '{field_name}' must be a JSON Schema with type "
                              '"object"', path=path, where=where,
                              hint="tool arguments are an object")


def score_call(output: str, expected_name: str, expected_arguments: dict,
               tools: dict[str, dict]) -> int:
    """The level (0-5, `LEVELS`) of `output` against the expected call. `tools` maps each
    tool name to its `parameters` schema."""
    call = parse_call(output)
    if call is None:
        return 0
    if call.name != expected_name:
        return 1
    if call.arguments is None:
        return 2
    if schema_problem(call.arguments, tools[expected_name]) is not None:
        return 3
    return 5 if call.arguments == expected_arguments else 4


def level_distribution(levels: list[int]) -> dict[str, int]:
    """How many outputs reached each level, keyed by the level's name (every level listed)."""
    return {name: sum(1 for level in levels if level == k) for k, name in enumerate(LEVELS)}


def summarize(levels: list[int], abstentions: list[bool]) -> dict:
    """The report of one model on the held-out decisions: the level distribution of the
    call decisions, the share reaching each level or higher, and the no-call decisions
    answered without a call."""
    n = len(levels)
    return {"call_decisions": n,
            "levels": level_distribution(levels),
            "at_least": {name: (sum(1 for x in levels if x >= k) / n if n else None)
                         for k, name in enumerate(LEVELS) if k},
            "mean_level": sum(levels) / n if n else None,
            "no_call_decisions": len(abstentions),
            "abstained": sum(abstentions)}
