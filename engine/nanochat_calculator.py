"""nanochat's calculator tool (karpathy/nanochat, nanochat/engine.py `use_calculator` at commit
92d63d4e8bb4): what a nanochat model's <|python_start|> expr <|python_end|> evaluates to, with
the reference's text rules kept exactly and its `eval` replaced by a walk of the parsed tree.

The reference's rules, restated (tests/test_nanochat_chat_calculator.py holds this module to the
values the reference function gives on a table of expressions, tests/data/nanochat/
chat_goldens.json, made by make_chat_goldens.py):

1. Commas are removed first ("1,000" is 1000).
2. An expression made only of the characters `0123456789*+-/.() ` is arithmetic: refused
   (None) when it holds `**` (no powers), else evaluated.
3. Otherwise every character must be a letter, digit, quote, `(`, `)`, `.`, `_` or space; the
   lowercased text must hold none of `__`, import, exec, eval, compile, open, file, input,
   raw_input, globals, locals, vars, dir, getattr, setattr, delattr, hasattr (as substrings:
   "direction" is refused too); and it must contain the text `.count(`. Then it is evaluated.
4. Any failure (syntax, a name, division by zero, a type error, the 3 s timeout) is None.

Where the reference calls `eval(expr, {"__builtins__": {}}, {})`, this module parses the text
with `ast` and evaluates a whitelist: numbers, `...`, strings and bytes (f-strings without
fields), the empty tuple, + - * / // and unary + -, `not`, `and`/`or`, `in`/`not in`,
`x if c else y`, and calls of pure methods of str, bytes, tuples, lists and numbers
(`METHODS`), with every size bounded. No Python runs that the whitelist does not name, so no
model output reaches a builtin, an import or an attribute with an underscore.

Where the two differ (each a row of the golden table, with the reference's value):

- the whitelist is smaller than Python: `is`, generator expressions, method objects returned
  uncalled (whose text is a memory address) and methods outside `METHODS` give None here;
- bounds instead of the timeout: nesting deeper than MAX_DEPTH, a string, bytes or list past
  MAX_ITEMS items, or a size argument past it (`'a'.center(10**9)` would allocate 1 GB in the
  reference) give None;
- an integer past Python's 4300-digit string limit (a long product) is None here; the
  reference returns it and its Engine then fails on `str(result)`.

`render_result` is the text the Engine encodes between <|output_start|> and <|output_end|>.

Not engine/calculator.py, the arithmetic-only tool of `chat --calculator` (JSON tool calls,
powers allowed, magnitudes bounded at 1e100): that one is a contract of our own, this one is
the reference's, differences and all, which is why the two are kept apart.
"""

from __future__ import annotations

import ast
import operator

MATH_CHARS = "0123456789*+-/.() "
STRING_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ "
DANGEROUS = ("__", "import", "exec", "eval", "compile", "open", "file", "input", "raw_input",
             "globals", "locals", "vars", "dir", "getattr", "setattr", "delattr", "hasattr")

MAX_DEPTH = 200             # nested operations, a chain of + - * / counting as one level
MAX_NODES = 5000            # expression nodes in all (the work bound in place of the timeout)
MAX_ITEMS = 1_000_000       # characters, bytes or items of any value, and of a size argument
MAX_INT_DIGITS = 4300       # sys.int_info.default_max_str_digits: str() of a larger int fails

_INT_LIMIT = 10 ** MAX_INT_DIGITS

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_}

_TEXT_METHODS = frozenset("""
    count find rfind index rindex startswith endswith lower upper casefold swapcase title
    capitalize strip lstrip rstrip split rsplit splitlines partition rpartition join
    removeprefix removesuffix replace center ljust rjust zfill expandtabs isalpha isdigit
    isalnum isspace islower isupper istitle isdecimal isnumeric isascii isidentifier
    isprintable encode decode""".split())
# str.format of a text without fields is the text itself; no text here can hold a brace (the
# character filter refuses them, and no whitelisted method makes one), checked anyway
_STR_METHODS = _TEXT_METHODS | {"format"}
_NUMBER_METHODS = frozenset("bit_length bit_count conjugate is_integer as_integer_ratio".split())
# the methods a value may call, by its exact type (bool is not int here: True.bit_length()
# is fine, and found under bool)
METHODS: dict[type, frozenset[str]] = {
    str: _STR_METHODS, bytes: _TEXT_METHODS, tuple: frozenset({"count", "index"}),
    list: frozenset({"count", "index"}), int: _NUMBER_METHODS, bool: _NUMBER_METHODS,
    float: _NUMBER_METHODS,
}
# data attributes read without a call
ATTRIBUTES: dict[type, frozenset[str]] = {
    t: frozenset({"real", "imag", "numerator", "denominator"}) for t in (int, bool)}
ATTRIBUTES[float] = frozenset({"real", "imag"})
_SIZED_ARGUMENT = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


class Refused(Exception):
    """An expression outside the whitelist or its bounds (the reference's None)."""


def use_calculator(expr: str):
    """The value nanochat's use_calculator gives for `expr`, or None (see the module
    docstring for the rules and where this differs)."""
    expr = expr.replace(",", "")
    if all(c in MATH_CHARS for c in expr):
        if "**" in expr:
            return None
        return evaluate(expr)
    if not all(c in STRING_CHARS for c in expr):
        return None
    lowered = expr.lower()
    if any(pattern in lowered for pattern in DANGEROUS):
        return None
    if ".count(" not in expr:
        return None
    return evaluate(expr)


def render_result(value) -> str | None:
    """The text the Engine puts between <|output_start|> and <|output_end|>: str(value), or
    None when there is nothing to put there."""
    if value is None:
        return None
    return str(value)


def evaluate(text: str):
    """The walk's value of `text` (eval's rules: leading spaces and tabs are skipped), or
    None for anything refused or failing."""
    try:
        tree = ast.parse(text.lstrip(" \t"), mode="eval")
        if sum(isinstance(n, ast.expr) for n in ast.walk(tree)) > MAX_NODES:
            return None
        return _bounded(_value(tree.body, 0))
    except (Refused, SyntaxError, ValueError, TypeError, ArithmeticError, MemoryError,
            RecursionError, LookupError, AttributeError, UnicodeError):
        return None


def _value(node: ast.AST, depth: int):
    if depth > MAX_DEPTH:
        raise Refused("too deep")
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float, str, bytes, bool, type(None), type(...)):
            raise Refused("constant")        # complex: 1j needs a j, but be explicit
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        ops = []                               # -(-(-x)): a chain, walked without recursion
        while isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            ops.append(_UNARY[type(node.op)])
            node = node.operand
        value = _value(node, depth + 1)
        for op in reversed(ops):
            value = _bounded(op(value))
        return value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        spine = []                             # a + b + c parses as ((a + b) + c): its left
        while isinstance(node, ast.BinOp) and type(node.op) in _BINARY:   # spine, unrolled
            spine.append(node)
            node = node.left
        value = _value(node, depth + 1)
        for link in reversed(spine):
            value = _bounded(_binary(link.op, value, _value(link.right, depth + 1)))
        return value
    return _other(node, depth)


def _other(node: ast.AST, depth: int):
    """The nodes of the string rule: tuples, f-strings, boolean logic, membership, calls."""
    if isinstance(node, ast.Tuple) and isinstance(node.ctx, ast.Load):
        return tuple(_value(e, depth + 1) for e in node.elts)
    if isinstance(node, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in node.values):
        return "".join(v.value for v in node.values)
    if isinstance(node, ast.BoolOp):
        is_and = isinstance(node.op, ast.And)
        for operand in node.values:               # short-circuit, returning the operand
            value = _value(operand, depth + 1)
            if bool(value) != is_and:
                return value
        return value
    if isinstance(node, ast.IfExp):
        taken = node.body if _value(node.test, depth + 1) else node.orelse
        return _value(taken, depth + 1)
    if isinstance(node, ast.Compare):
        return _compare(node, depth)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
        return _call(node, depth)
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        owner = _value(node.value, depth + 1)
        if node.attr not in ATTRIBUTES.get(type(owner), ()):
            raise Refused(node.attr)
        return getattr(owner, node.attr)
    raise Refused(type(node).__name__)


def _binary(op: ast.operator, left, right):
    # a sequence repeated: the reference's * of a tuple or string; bound the size first
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, tuple)) and isinstance(times, int) \
                and len(seq) * max(times, 0) > MAX_ITEMS:
            raise Refused("too large")
    return _BINARY[type(op)](left, right)


def _compare(node: ast.Compare, depth: int):
    left = _value(node.left, depth + 1)
    for op, comparator in zip(node.ops, node.comparators):
        if not isinstance(op, (ast.In, ast.NotIn)):     # `is` depends on interning: refused
            raise Refused(type(op).__name__)
        right = _value(comparator, depth + 1)
        found = operator.contains(right, left)
        if found != isinstance(op, ast.In):
            return False
        left = right
    return True


def _call(node: ast.Call, depth: int):
    owner = _value(node.func.value, depth + 1)
    name = node.func.attr
    if name not in METHODS.get(type(owner), ()):
        raise Refused(name)
    args = [_value(a, depth + 1) for a in node.args]
    if name == "format" and ("{" in owner or "}" in owner):
        raise Refused("format fields")
    if name in ("encode", "decode") and args:
        raise Refused("codec")                  # only the default UTF-8, no codec lookups
    if name in _SIZED_ARGUMENT and any(isinstance(a, int) and a > MAX_ITEMS for a in args):
        raise Refused("size")
    if name == "join" and isinstance(args[0] if args else None, (str, bytes, tuple, list)) \
            and len(owner) * len(args[0]) > MAX_ITEMS:
        raise Refused("size")
    return getattr(owner, name)(*args)


def _bounded(value):
    if isinstance(value, (str, bytes, tuple, list)) and len(value) > MAX_ITEMS:
        raise Refused("too large")
    if isinstance(value, int) and abs(value) >= _INT_LIMIT:
        raise Refused("too many digits")      # str() of it fails, as in the reference's Engine
    return value
