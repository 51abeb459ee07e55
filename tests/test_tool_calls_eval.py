"""The 6-level tool-call scorer (engine/eval/tool_calls.py): a worked output for every level,
the other call shapes it reads, and the summary of a set of decisions. It never executes."""

from __future__ import annotations

import pytest

from engine.eval.tool_calls import (
    LEVELS,
    call_text,
    level_distribution,
    parse_call,
    schema_problem,
    score_call,
    summarize,
)

SCHEMA = {"type": "object",
          "properties": {"part_id": {"type": "string", "pattern": "^P-[0-9]{3}$"},
                         "count": {"type": "integer", "minimum": 1}},
          "required": ["part_id"], "additionalProperties": False}
TOOLS = {"lookup_part": SCHEMA, "calculator": {"type": "object"}}
EXPECTED = ("lookup_part", {"part_id": "P-901"})


@pytest.mark.parametrize("output, level", [
    # 0 no call: an answer, a clarification, or JSON that names no tool
    ("P-901 has 8 units.", 0),
    ("Which part do you mean?", 0),
    ('{"part_id": "P-901"}', 0),
    # 1 call: a call, but of another tool (or of none that can be read)
    (call_text("calculator", {"expression": "1+1"}), 1),
    ("<tool_call>\nlookup something\n</tool_call>", 1),
    # 2 right tool: the name is right, the arguments do not parse as an object
    ('<tool_call>\n{"name": "lookup_part", "arguments": {"part_id": P-901}}\n</tool_call>', 2),
    ('<tool_call>\n{"name": "lookup_part", "arguments": "P-901"}\n</tool_call>', 2),
    # 3 parsable args: an object, but against the schema (pattern, extra key, missing key)
    (call_text("lookup_part", {"part_id": "901"}), 3),
    (call_text("lookup_part", {"part_id": "P-901", "colour": "red"}), 3),
    (call_text("lookup_part", {}), 3),
    # 4 valid args: valid, but not the expected ones
    (call_text("lookup_part", {"part_id": "P-101"}), 4),
    (call_text("lookup_part", {"part_id": "P-901", "count": 2}), 4),
    # 5 exact args
    (call_text("lookup_part", {"part_id": "P-901"}), 5),
    ('Let me check.\n<tool_call>\n{"name": "lookup_part", "arguments": {"part_id": "P-901"}}',
     5),                                    # an unclosed block at the end still reads
    ('{"name": "lookup_part", "parameters": {"part_id": "P-901"}}', 5),   # bare, Llama 3.1
    ('<tool_call>{"name": "lookup_part", "arguments": "{\\"part_id\\": \\"P-901\\"}"}'
     '</tool_call>', 5),                     # OpenAI style: arguments as a JSON string
])
def test_each_level_has_a_worked_case(output, level):
    assert score_call(output, *EXPECTED, TOOLS) == level, LEVELS[level]


def test_only_the_first_call_counts_and_nothing_is_executed():
    output = call_text("lookup_part", {"part_id": "P-101"}) + call_text(*EXPECTED)
    assert parse_call(output).arguments == {"part_id": "P-101"}
    assert score_call(output, *EXPECTED, TOOLS) == 4
    # an expression is data to the scorer: scoring a calculator call does not evaluate it
    call = parse_call(call_text("calculator", {"expression": "__import__('os').getcwd()"}))
    assert call.arguments == {"expression": "__import__('os').getcwd()"}


def test_schema_problems_name_the_argument():
    assert schema_problem({"part_id": "P-1"}, SCHEMA).endswith("(at arguments['part_id'])")
    assert schema_problem({"part_id": "P-100"}, SCHEMA) is None


def test_summary_counts_levels_and_abstentions():
    levels = [0, 5, 5, 3, 4, 1]
    summary = summarize(levels, [True, False, True])
    assert summary["levels"] == {"no call": 1, "call": 1, "right tool": 0, "parsable args": 1,
                                 "valid args": 1, "exact args": 2}
    assert sum(summary["levels"].values()) == len(levels) == summary["call_decisions"]
    assert summary["at_least"]["exact args"] == pytest.approx(2 / 6)
    assert summary["at_least"]["call"] == pytest.approx(5 / 6)
    assert summary["mean_level"] == pytest.approx(18 / 6)
    assert (summary["no_call_decisions"], summary["abstained"]) == (3, 2)
    assert level_distribution([]) == dict.fromkeys(LEVELS, 0)
