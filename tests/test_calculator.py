"""The chat's calculator tool (engine/calculator.py): arithmetic evaluated exactly, everything
else refused before it runs, sizes bounded."""

from __future__ import annotations

import json

import pytest

from engine.calculator import MAX_MAGNITUDE, CalculatorError, evaluate, run


@pytest.mark.parametrize("expression, value", [
    ("17 * 23", 391), ("(17 + 5) * 3", 66), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 % 3", 2),
    ("2 ** 10", 1024), ("2 ** -1", 0.5), ("-(3 - 5)", 2), ("+4", 4), ("1.5e3 + 1", 1501.0),
    ("  12 - 4 - 3 ", 5),
])
def test_arithmetic_matches_python(expression, value):
    assert evaluate(expression) == value == eval(expression)     # the reference, trusted input


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("open('/etc/passwd')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("[1, 2][0]", "Subscript is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("'a' * 3", "str is not a number"),
    ("True + 1", "bool is not a number"),
    ("1j * 1j", "complex is not a number"),
    ("1 << 4", "BinOp is not allowed"),
    ("2 ** 1000", "exponents are limited"),
    ("9 ** 9 ** 9", "exponents are limited"),
    ("10 ** 200", "the result is too large"),
    (f"{MAX_MAGNITUDE} * 10", "the result is too large"),
    ("1e308 * 10", "the result is too large"),
    ("1 / 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1; 2", "not an arithmetic expression"),
    ("1" + "+1" * 150, "longer than 200 characters"),
    ("1" + "+1" * 40, "nests deeper"),
    ("-" * 60 + "1", "nests deeper"),
])
def test_anything_but_arithmetic_is_refused(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)


def test_the_tool_answers_with_a_result_or_an_error_never_raises():
    assert json.loads(run({"expression": "6 * 7"})) == {"result": 42}
    assert json.loads(run({"expression": "__import__('os')"})) == {
        "error": "Call is not allowed: arithmetic only"}
    assert "error" in json.loads(run({"expr": "1"}))
    assert "error" in json.loads(run("1 + 1"))
