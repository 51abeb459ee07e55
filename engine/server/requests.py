"""The one request schema of every serving entry point: `forgebench serve-local`'s JSON lines
and the OpenAI-compatible HTTP server (`forgebench serve`).

A request is refused before anything runs when it is too large (`MAX_REQUEST_BYTES`), nested
too deeply (`MAX_DEPTH`, checked by a scan before `json.loads`, whose recursion a line of
50,000 `[` would otherwise exhaust), not JSON, or not what its schema says: pydantic models
with `extra="forbid"` and strict types (a string is not a number, a float not a seed) and the
ranges the CLI applies (temperature >= 0 and finite, top_p in (0, 1], top_k >= 0,
repetition_penalty > 0, max_tokens >= 1). Every refusal is one `RequestError` (a
`ForgebenchError`) naming the field and what to send instead.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from engine.errors import ForgebenchError

MAX_REQUEST_BYTES = 8 * 1024 * 1024     # one request line / HTTP body
MAX_DEPTH = 64                          # nesting of [ and { in one request
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOP = 16
MAX_TOKENS_LIMIT = 1_000_000            # beyond any context a GGUF declares; context is checked
ROLES = ("system", "user", "assistant", "tool")


class RequestError(ForgebenchError):
    """A request the schema refuses; `status` is the HTTP status the server answers with."""

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None,
                 status: int = 400, code: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message, where=where, hint=hint)
        self.status, self.code, self.param = status, code, param


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def nesting_depth(text: str) -> int:
    """The deepest nesting of JSON arrays and objects in `text`, brackets inside strings not
    counted; a linear scan that never recurses."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRINGS.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def parse_json(raw: str | bytes, where: str = "request") -> Any:
    """A request's JSON, refused as a RequestError when too large, too deep or malformed."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise RequestError(f"the request is {len(raw)} bytes, over the {MAX_REQUEST_BYTES} limit",
                           where=where, status=413, hint="send a smaller request")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"the request is not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start})", where=where) from None
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise RequestError(f"the request nests {depth} levels deep, over the {MAX_DEPTH} limit",
                           where=where, hint="flatten the request")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"not a JSON request: {exc}", where=where,
                           hint="send one JSON object") from None
    except RecursionError:      # unreachable past the depth check; kept so it can never end us
        raise RequestError("the request nests too deeply", where=where) from None


# -- field types, shared by serve-local and the HTTP API -------------------------------------
Temperature = Annotated[float, Field(ge=0.0, le=1000.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, le=10_000_000)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=1000.0, allow_inf_nan=False)]
RepetitionLastN = Annotated[int, Field(ge=-1, le=MAX_TOKENS_LIMIT)]    # -1 = all, 0 = off
DryMultiplier = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]   # 0 = off
DryBase = Annotated[float, Field(ge=1.0, le=100.0, allow_inf_nan=False)]
DryAllowedLength = Annotated[int, Field(ge=0, le=1000)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
Name = Annotated[str, Field(min_length=1, max_length=256)]
RequestId = Union[Annotated[str, Field(max_length=256)], int, None]


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Message(Schema):
    role: Literal[ROLES]
    content: str
    name: Annotated[str, Field(max_length=256)] | None = None
    reasoning_content: str | None = None


class Settings(Schema):
    temperature: Temperature = 0.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    repetition_penalty: RepetitionPenalty = 1.0
    repetition_last_n: RepetitionLastN = -1
    dry_multiplier: DryMultiplier = 0.0
    dry_base: DryBase = 1.75
    dry_allowed_length: DryAllowedLength = 2
    dry_last_n: RepetitionLastN = -1


Tools = Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)]
Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]


class ChatOptions(Schema):
    """What one chat reply is generated with (serve-local's `chat` and `forgebench chat`)."""

    messages: Messages
    max_tokens: MaxTokens = 128
    seed: Seed = 0
    settings: Settings = Settings()
    tools: Tools | None = None


# -- serve-local's operations ----------------------------------------------------------------
class _Op(Schema):
    request: RequestId = None


class LoadOp(_Op):
    op: Literal["load"]
    system: Name = "default"
    model: Name | None = None
    library: Name | None = None
    run: Name | None = None
    checkpoint: Name | None = None
    workspace: Name | None = None
    lora: Name | None = None
    cartridge: Name | None = None       # an lm-cartridge file read before every prompt
    numerics: Literal["llamacpp", "f32"] | None = None
    enable_thinking: bool | None = None


class RenderOp(_Op):
    op: Literal["render"]
    system: Name
    messages: Messages
    tools: Tools | None = None


class ChatOp(_Op, ChatOptions):
    op: Literal["chat"]
    system: Name


class CancelOp(_Op):
    op: Literal["cancel"]
    target: RequestId


class UnloadOp(_Op):
    op: Literal["unload"]
    system: Name


class PingOp(_Op):
    op: Literal["ping"]


class ShutdownOp(_Op):
    op: Literal["shutdown"]


LocalOp = Annotated[Union[LoadOp, RenderOp, ChatOp, CancelOp, UnloadOp, PingOp, ShutdownOp],
                    Field(discriminator="op")]
OPS = ("load", "render", "chat", "cancel", "unload", "shutdown", "ping")
_LOCAL = TypeAdapter(LocalOp)


def _where(loc: tuple, root: str) -> str:
    parts = [root] if root else []
    for part in loc:
        if isinstance(part, int):
            parts[-1:] = [f"{parts[-1]}[{part}]"] if parts else [f"[{part}]"]
        else:
            parts.append(str(part))
    return ".".join(parts)


def _describe(error: dict) -> str:
    kind, given = error["type"], error.get("input")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required"
    shown = repr(given)
    shown = shown if len(shown) <= 60 else shown[:60] + "..."
    if kind == "finite_number" or (isinstance(given, float) and not math.isfinite(given)):
        return f"must be a finite number, not {shown}"
    return f"{error['msg'][0].lower()}{error['msg'][1:]} (got {shown})"


def refusal(exc: ValidationError, root: str = "", skip: int = 0) -> RequestError:
    """One RequestError for a pydantic refusal: the first bad field (named in the message and
    as `param`), and the next few named too. `skip` drops leading location parts (a tagged
    union's tag)."""
    errors = exc.errors(include_url=False)
    fields = [_where(e["loc"][skip:], root) or "request" for e in errors]
    message = f"{fields[0]}: {_describe(errors[0])}"
    if len(fields) > 1:
        message += f" (also: {', '.join(fields[1:4])}{', ...' if len(fields) > 4 else ''})"
    return RequestError(message, param=fields[0],
                        hint="fix the field; unknown fields are refused, not ignored")


def validate(schema: type[Schema] | TypeAdapter, data: Any, root: str = "",
             skip: int = 0) -> Any:
    """`data` as `schema`, or a RequestError naming the bad field."""
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_python(data)
        return schema.model_validate(data)
    except ValidationError as exc:
        raise refusal(exc, root, skip) from None


def local_op(request: Any) -> Schema:
    """A serve-local request line's object as its operation's schema."""
    if not isinstance(request, dict):
        raise RequestError(f"a request is a JSON object, not {type(request).__name__}",
                           where="request", hint='e.g. {"op": "ping"}')
    if request.get("op") not in OPS:
        raise RequestError(f"unknown op {request.get('op')!r}", where="op",
                           hint="one of " + ", ".join(OPS))
    return validate(_LOCAL, request, skip=1)      # the location starts with the op tag
