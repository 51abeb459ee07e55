"""The built-in calculator tool of `forgebench chat --calculator`: its schema, and a sandboxed
evaluator that does arithmetic and nothing else.

The expression is parsed with `ast` and only a whitelist of nodes is evaluated: numbers (int,
float), + - * / // % ** and unary + -, and parentheses. Names, calls, attributes, subscripts,
strings, comparisons and everything else are refused, so no model output can reach Python.
Sizes are bounded: the text length, the nesting depth, the exponent, and every intermediate
result's magnitude, so `9**9**9` is refused instead of eating the machine.

A nanochat model's own tool (text between <|python_start|> and <|python_end|>, nanochat's rules:
string .count(), no powers) is engine/nanochat_calculator.py.
"""

from __future__ import annotations

import ast
import json
import math
import operator

from engine.errors import ForgebenchError

NAME = "calculator"
SCHEMA = {"type": "function", "function": {
    "name": NAME,
    "description": "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** "
                   "and parentheses.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. (17 + 5) * 3"}},
                   "required": ["expression"], "additionalProperties": False}}}

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_EXPONENT = 256
MAX_MAGNITUDE = 10 ** 100

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ForgebenchError):
    """An expression the calculator refuses or cannot evaluate."""

    def __init__(self, message: str):
        super().__init__(message, where="calculator")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    return _value(tree.body, 0)


def _value(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression nests deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):        # bool, str, bytes, None, complex
            raise CalculatorError(f"{type(node.value).__name__} is not a number")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed: arithmetic only")


def _check_power(base, exponent) -> None:
    """Refuse a power before computing it: a huge exponent, 0 to a negative power, or a result
    past the magnitude bound (checked by logarithms, since the bound applies after it)."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponents are limited to ±{MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if base and abs(exponent) * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculatorError("the result is too large")


def _bounded(value):
    if isinstance(value, complex):     # (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("the result is too large")
    return value


def run(arguments: dict) -> str:
    """The tool's observation for one call: {"result": value} or {"error": reason}, as JSON."""
    try:
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        return json.dumps({"result": evaluate(expression)})
    except CalculatorError as exc:
        return json.dumps({"error": exc.message})
