"""engine/nanochat_calculator.py against nanochat's own use_calculator: the value the reference gave
for each expression of a table (tests/data/nanochat/chat_goldens.json, made by
make_chat_goldens.py from karpathy/nanochat 92d63d4 on this project's Python), with the rows
where this module refuses what the reference evaluates named one by one, and twins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import nanochat_calculator as calculator
from engine.nanochat_calculator import render_result, use_calculator

GOLDENS = Path(__file__).parent / "data" / "nanochat" / "chat_goldens.json"

# Where the whitelist is narrower than the reference's eval (module docstring): `is` on
# literals, a generator expression, a method object returned uncalled, an integer whose str()
# fails (the reference's Engine would raise on it).
DIVERGENT = {
    "'abc'.count('a') is 1": "bool",
    "'x'.join(c for c in 'abc').count('x')": "int",
    "'abc'.count('a').bit_length": "builtin_function_or_method",
    "99999999999*" * 400 + "9": "int",
}


@pytest.fixture(scope="module")
def table() -> list[dict]:
    if not GOLDENS.is_file():
        pytest.skip(f"no calculator goldens at {GOLDENS} (make_chat_goldens.py writes them)")
    return json.loads(GOLDENS.read_text("utf-8"))["calculator"]


def record(value) -> dict | None:
    """Our value in the goldens' form (type name, str())."""
    if value is None:
        return None
    return {"type": type(value).__name__, "str": str(value)}


def mismatches(table: list[dict], function=use_calculator) -> list[str]:
    return [row["expr"][:60] for row in table
            if row["expr"] not in DIVERGENT and record(function(row["expr"])) != row["value"]]


def test_every_row_matches_the_reference(table):
    assert len(table) >= 100
    assert mismatches(table) == []


def test_divergent_rows_are_refused_here_and_evaluated_there(table):
    rows = {row["expr"]: row["value"] for row in table}
    for expr, ref_type in DIVERGENT.items():
        assert rows[expr] is not None and rows[expr]["type"] == ref_type, expr
        assert use_calculator(expr) is None, expr
    # the long product: the reference returns it, and its own str() then fails
    assert rows["99999999999*" * 400 + "9"].get("str_error") == "ValueError"


def test_worked_examples():
    # the rules, each by a case whose answer is plain arithmetic or counting
    assert use_calculator("1,000*3") == 3000
    assert use_calculator("10/4") == 2.5 and render_result(use_calculator("10/5")) == "2.0"
    assert use_calculator("2**8") is None                   # powers refused
    assert use_calculator("'strawberry'.count('r')") == 3
    assert use_calculator("'strawberry'.upper()") is None   # the string rule needs .count(
    assert use_calculator("'direction'.count('i')") is None  # holds "dir"
    assert render_result(None) is None


def test_twin_power_allowed_breaks_the_table(table, monkeypatch):
    original = calculator.use_calculator

    def with_powers(expr):
        if "**" in expr and all(c in calculator.MATH_CHARS for c in expr.replace(",", "")):
            return calculator.evaluate(expr.replace(",", "").replace("**", "*"))
        return original(expr)
    assert "2**8" in mismatches(table, with_powers)


def test_twin_commas_kept_breaks_the_table(table):
    def no_comma_removal(expr):
        return None if "," in expr else use_calculator(expr)
    assert "1,000*3" in mismatches(table, no_comma_removal)


def test_twin_dangerous_words_unchecked_breaks_the_table(table, monkeypatch):
    monkeypatch.setattr(calculator, "DANGEROUS", ("__",))
    assert "'direction'.count('i')" in mismatches(table)


@pytest.mark.parametrize("expr", [
    "__import__('os').system('echo hi')", "open('x').read().count('a')",
    "eval('1').count(1)", "globals().count(1)", "'a'.__class__.count('a')",
])
def test_hostile_names_refused_by_the_walk_even_without_the_text_filter(expr, monkeypatch):
    # the walk is the real guard: with the reference's word list emptied it still never
    # reaches a name, a builtin or an underscore attribute
    monkeypatch.setattr(calculator, "DANGEROUS", ())
    monkeypatch.setattr(calculator, "STRING_CHARS", calculator.STRING_CHARS + "[]0")
    assert use_calculator(expr) is None
    # twin: an allowed method on a literal does run
    assert use_calculator("'a'.count('a')") == 1


def test_hostile_sizes_are_bounded_and_the_twin_shows_the_bound_bites(monkeypatch):
    product = "99999999999*" * 400 + "9"
    assert use_calculator(product) is None
    assert use_calculator("'a'.zfill(99999999999).count('0')") is None
    assert use_calculator("'a'.center(1000).count(' ')") == 999
    monkeypatch.setattr(calculator, "_INT_LIMIT", 10 ** 10 ** 5)
    value = use_calculator(product)
    assert isinstance(value, int) and value.bit_length() > 4300 * 3.3
    with pytest.raises(ValueError):     # what the reference's Engine would then hit
        str(value)


def test_long_chains_and_deep_nesting_are_bounded(monkeypatch):
    assert use_calculator("-" * 150 + "1") == 1
    assert use_calculator("1+" * 1000 + "1") == 1001
    assert use_calculator("-" * 5000 + "1") is None          # past MAX_NODES
    assert use_calculator("'a'.lower()" + ".lower()" * 300 + ".count('a')") is None  # depth
    monkeypatch.setattr(calculator, "MAX_NODES", 100)
    assert use_calculator("-" * 150 + "1") is None
    monkeypatch.setattr(calculator, "MAX_DEPTH", 400)
    assert use_calculator("'a'.lower()" + ".lower()" * 300 + ".count('a')") is None  # nodes
    monkeypatch.setattr(calculator, "MAX_NODES", 5000)
    assert use_calculator("'a'.lower()" + ".lower()" * 300 + ".count('a')") == 1
