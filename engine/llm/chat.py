"""Chat templates: the Jinja2 `tokenizer.chat_template` of a GGUF file rendered the way llama.cpp
and transformers render it, in a sandbox because a downloaded template is untrusted code.

The environment matches transformers' `apply_chat_template`: `ImmutableSandboxedEnvironment`,
`trim_blocks` and `lstrip_blocks`, the loop-controls extension, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, and a `{% generation %}` block that renders
its body. Files without a template get a built-in one for their family (Gemma's turns, ChatML
for Qwen2/SmolLM, Qwen3's ChatML with its thinking switch, Llama-3's headers).

A template is bounded as well as sandboxed (`RenderBudget`), on any thread: every loop
iteration (`{% for %}` items, recursive `loop(...)` calls included), every call and every
attribute lookup draws one step from a budget per render, and the same hooks check a
wall-clock deadline, so nested loops over long strings or a 10^9-item loop are stopped within
about a second, whichever thread renders (no signals: the engine worker and the HTTP server
render off the main thread). Ranges draw from a budget of items, string and list repetition,
`%` and `format` widths and `**` are capped, and the output is cut off at a size limit. Over
budget, recursion too deep, or an overflow, the render is refused with the template's file,
the limit and the reason; it never hangs. `ChatTemplate.render` is the one place a template is
rendered: the CLI, `serve-local` (the app's chat and preview) and `forgebench serve` all use it,
and one compiled template may render on several threads at once (the budget is per thread).
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

from gguf import Keys
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from engine.errors import ForgebenchError

K = Keys.Tokenizer
ROLES = ("system", "user", "assistant", "tool")

# Gemma: no system role (it opens the first user turn), "assistant" is "model", turns alternate.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Gemma turns must alternate user/assistant/user/... after an '
                           'optional system message (got ' + message['role'] + ')') }}
    {%- endif -%}
    {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])
       + '\n' }}
    {{- first_user_prefix if loop.first else '' -}}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

# ChatML (Qwen2/2.5, SmolLM): tool results travel in a user turn, consecutive ones grouped.
CHATML_TEMPLATE = """{%- for message in messages -%}
    {%- if message['role'] == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}
            {{ '<|im_start|>user' }}
        {%- endif -%}
        {{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}
            {{ '<|im_end|>\n' }}
        {%- endif -%}
    {%- else -%}
        {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
{%- endif -%}
"""

# Qwen3: ChatML; an assistant turn after the last user turn carries its <think> block (empty
# when there is no reasoning); enable_thinking=false pre-fills an empty one in the prompt.
QWEN3_TEMPLATE = """{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- if message['role'] == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}
            {{ '<|im_start|>user' }}
        {%- endif -%}
        {{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}
            {{ '<|im_end|>\n' }}
        {%- endif -%}
    {%- elif message['role'] == 'assistant' and loop.index0 > ns.last_user
             and (loop.last or message.get('reasoning_content')) -%}
        {{ '<|im_start|>assistant\n<think>\n' + (message.get('reasoning_content') or '').strip('\n')
           + '\n</think>\n\n' + message['content'].lstrip('\n') + '<|im_end|>\n' }}
    {%- else -%}
        {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{ '<think>\n\n</think>\n\n' }}
    {%- endif -%}
{%- endif -%}
"""

LLAMA3_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {{- message['content'] | trim -}}
    {{ '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif -%}
"""

BUILTIN_TEMPLATES = {"gemma": GEMMA_TEMPLATE, "chatml": CHATML_TEMPLATE, "qwen3": QWEN3_TEMPLATE,
                     "llama3": LLAMA3_TEMPLATE}


def builtin_family(metadata: Mapping[str, Any]) -> str | None:
    """The built-in template for a file without one, from its architecture and vocabulary."""
    arch = metadata.get(Keys.General.ARCHITECTURE, "")
    if arch.startswith("gemma"):
        return "gemma"
    if arch == "qwen3":
        return "qwen3"
    if arch == "qwen2":
        return "chatml"
    tokens = set(metadata.get(K.LIST) or ())
    if "<|start_header_id|>" in tokens:
        return "llama3"
    if "<|im_start|>" in tokens:
        return "chatml"
    return None


class _GenerationBlock(Extension):
    """transformers' `{% generation %}…{% endgeneration %}` marks assistant text; render it."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class TemplateBudgetError(Exception):
    """A template went over its render budget (the message says which limit)."""


class RenderBudget:
    """Limits of one render. Generous for real chat templates (a few hundred loop items and a
    few kilobytes of output), fatal to loops and repetitions built to hang or exhaust memory.
    Steps and the deadline are checked from the environment's hooks (loop items, calls,
    attribute lookups), so they hold on any thread."""

    STEPS = 1_000_000            # loop items + calls + attribute lookups of one render
    LOOP_ITEMS = 100_000         # items all range() calls of one render may produce together
    OUTPUT_CHARS = 4_000_000     # rendered text, and any one repeated string or list
    SECONDS = 5.0                # wall clock, checked at every step
    _WIDTH = re.compile(r"\d{7,}")  # a %- or {}-format width/precision of a million or more

    def __init__(self) -> None:
        self.loop_items = 0
        self.steps = 0
        self.deadline = time.monotonic() + self.SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.STEPS:
            raise TemplateBudgetError(f"it took more than {self.STEPS} steps (loop items, calls "
                                      "and lookups; nested loops over long values)")
        if not self.steps & 63 and time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"it ran longer than {self.SECONDS:g} s")

    def iterate(self, iterable: Any):
        """The items of a template loop, one step each."""
        for item in iterable:
            self.step()
            yield item

    def range(self, *args: int) -> range:
        items = range(*args)
        self.loop_items += len(items)
        if self.loop_items > self.LOOP_ITEMS:
            raise TemplateBudgetError(f"its loops draw more than {self.LOOP_ITEMS} range items "
                                      "(nested or huge range())")
        return items

    def check_length(self, length: int) -> None:
        if length > self.OUTPUT_CHARS:
            raise TemplateBudgetError(f"it builds a value of {length} items, over the "
                                      f"{self.OUTPUT_CHARS} limit")

    def check_size(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple)):
            self.check_length(len(value))
        return value

    def check_format(self, spec: Any) -> None:
        if isinstance(spec, str) and self._WIDTH.search(spec):
            raise TemplateBudgetError("it formats with a width of a million or more")

    def check_replace(self, text: Any, old: Any, new: Any, count: Any = None) -> None:
        """Refuse a str.replace whose result would pass the size limit, before building it."""
        if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
            hits = text.count(old) if old else len(text) + 1
            if isinstance(count, int) and count >= 0:
                hits = min(hits, count)
            self.check_length(len(text) + hits * (len(new) - len(old)))

    def check_method(self, method: Any, args: tuple) -> None:
        """Sizes that str methods called from a template would allocate."""
        text, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if not isinstance(text, str):
            return
        if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
            self.check_length(args[0])
        elif name == "expandtabs":
            tab = args[0] if args and isinstance(args[0], int) else 8
            self.check_length(len(text) + text.count("\t") * tab)
        elif name == "replace" and len(args) >= 2:
            self.check_replace(text, *args[:3])


_ITERATE = "forgebench_budget_iterate"   # the filter every {% for %} iterable goes through


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the render budget wired into its loops, calls, lookups, operators,
    range and formatting. The budget lives per thread: one compiled template may render on
    several threads at once."""

    intercepted_binops = frozenset(["*", "**", "%"])

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._local = threading.local()
        self.filters[_ITERATE] = lambda iterable: self.budget.iterate(iterable)

    @property
    def budget(self) -> RenderBudget:
        budget = getattr(self._local, "budget", None)
        if budget is None:
            budget = self._local.budget = RenderBudget()
        return budget

    @budget.setter
    def budget(self, value: RenderBudget) -> None:
        self._local.budget = value

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Every `{% for %}` iterates through the budget: its iterable becomes
        `iterable | forgebench_budget_iterate` (nested loops over long strings hang otherwise,
        with no call or lookup in their bodies to count)."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _ITERATE, [], [], None, None,
                                     lineno=loop.iter.lineno)
        return tree

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget
        budget.step()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    budget.check_length(len(seq) * times)
        elif operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 1000 or (
                    isinstance(left, int) and isinstance(right, int) and right > 64
                    and abs(left) > 1):
                raise TemplateBudgetError("it raises to a huge power")
        elif operator == "%":
            budget.check_format(left)
        return budget.check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __self.budget
        budget.step()
        budget.check_method(__obj, args)
        if isinstance(__obj, LoopContext) and args:   # a recursive loop(...) iterates its argument
            args = (budget.iterate(args[0]), *args[1:])
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.budget.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.budget.step()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        spec = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            self.budget.check_format(spec)
            return self.budget.check_size(wrapped(*args, **kwargs))
        return checked


def _environment() -> _BoundedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    plain = dict(env.filters)

    def bounded_format(value: str, *args: Any, **kwargs: Any) -> str:
        env.budget.check_format(value)
        return env.budget.check_size(plain["format"](value, *args, **kwargs))

    def bounded_center(value: str, width: int = 80) -> str:
        env.budget.check_length(int(width))
        return plain["center"](value, width)

    def bounded_indent(value: str, width: int | str = 4, *args: Any, **kwargs: Any) -> str:
        pad = width if isinstance(width, int) else len(str(width))
        env.budget.check_length(len(str(value)) + (str(value).count("\n") + 1) * pad)
        return plain["indent"](value, width, *args, **kwargs)

    def bounded_replace(eval_ctx, value: str, old: str, new: str, count: int | None = None):
        env.budget.check_replace(str(value), old, new, count)
        return plain["replace"](eval_ctx, value, old, new, count)

    bounded_replace.jinja_pass_arg = plain["replace"].jinja_pass_arg  # receives eval_ctx
    env.filters.update(format=bounded_format, center=bounded_center, indent=bounded_indent,
                       replace=bounded_replace)
    env.globals.pop("lipsum")  # random text of any length: nothing a chat template needs
    env.globals["range"] = lambda *args: env.budget.range(*args)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template with the BOS/EOS texts it may print."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 origin: str = "template", path: str | Path | None = None,
                 enable_thinking: bool | None = None):
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.origin, self.path, self.enable_thinking = origin, path, enable_thinking
        try:
            self._template = _environment().from_string(source)
        except TemplateError as exc:
            line = getattr(exc, "lineno", None)
            where = origin if line is None else f"{origin} line {line}"
            raise ForgebenchError(f"the chat template does not compile: {exc}", path=path,
                                  where=where, hint="fix the template or pass another one") \
                from None

    @classmethod
    def from_gguf(cls, gguf_file, template: str | None = None,
                  enable_thinking: bool | None = None) -> ChatTemplate:
        """The template of a GGUF file (an open `GGUFFile`, a path, or a metadata dict), or its
        family's built-in one when the file has none. `template` overrides both.
        `enable_thinking` is the default for every render (False: Qwen3 thinking off)."""
        if isinstance(gguf_file, (str, Path)):
            from engine.gguf.reader import open_gguf
            gguf_file = open_gguf(gguf_file)
        metadata, path = (gguf_file, None) if isinstance(gguf_file, Mapping) else \
            (gguf_file.metadata, gguf_file.path)
        tokens = metadata.get(K.LIST) or []

        def text_of(key: str) -> str:
            token = metadata.get(key)
            return tokens[token] if token is not None and 0 <= token < len(tokens) else ""

        common = dict(bos_token=text_of(K.BOS_ID), eos_token=text_of(K.EOS_ID), path=path,
                      enable_thinking=enable_thinking)
        if template is not None:
            return cls(template, origin="given template", **common)
        if metadata.get(K.CHAT_TEMPLATE):
            return cls(metadata[K.CHAT_TEMPLATE], origin=K.CHAT_TEMPLATE, **common)
        family = builtin_family(metadata)
        if family is None:
            raise ForgebenchError(
                "the file has no chat template and no built-in one fits its architecture "
                f"{metadata.get(Keys.General.ARCHITECTURE, '?')!r}", path=path,
                where=K.CHAT_TEMPLATE, hint="use a GGUF whose metadata carries a chat template "
                "(instruct models do), or one of the families with a built-in template: "
                + ", ".join(BUILTIN_TEMPLATES))
        return cls(BUILTIN_TEMPLATES[family], origin=f"built-in {family} template", **common)

    def __call__(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True,
                 **variables) -> str:
        return self.render(messages, add_generation_prompt, **variables)

    def render(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, **variables) -> str:
        """Render a conversation. `enable_thinking=False` switches Qwen3's reasoning off (other
        templates ignore it); None takes the template's default set at construction, and when
        that is None too the variable stays undefined (the template's own default)."""
        if enable_thinking is None:
            enable_thinking = self.enable_thinking
        context = dict(variables, messages=[dict(m) for m in messages],
                       add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        env = self._template.environment
        env.budget = budget = RenderBudget()     # this thread's render starts a fresh budget
        try:
            pieces, size = [], 0
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > budget.OUTPUT_CHARS:
                    raise TemplateBudgetError(f"its output passed {budget.OUTPUT_CHARS} "
                                              "characters")
                budget.step()
                pieces.append(piece)
            return "".join(pieces)
        except TemplateBudgetError as exc:
            raise ForgebenchError(f"the chat template is over its render budget: {exc}",
                                  path=self.path, where=self._where(exc),
                                  hint="the template is not trusted; fix it or pass a "
                                       "built-in one") from None
        except (RecursionError, MemoryError, OverflowError) as exc:
            raise ForgebenchError(f"the chat template is over its render budget: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}", path=self.path,
                                  where=self._where(exc),
                                  hint="the template is not trusted; fix it or pass a "
                                       "built-in one") from None
        except _TemplateRaised as exc:
            raise ForgebenchError(f"the chat template refused the conversation: {exc}",
                                  path=self.path, where=self._where(exc)) from None
        except SecurityError as exc:
            raise ForgebenchError(f"the chat template tried an unsafe operation ({exc})",
                                  path=self.path, where=self._where(exc),
                                  hint="the template is not trusted; use a built-in one") from None
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError,
                ValueError, ZeroDivisionError) as exc:
            raise ForgebenchError(f"the chat template failed: {type(exc).__name__}: "
                                  f"{str(exc)[:300]}",
                                  path=self.path, where=self._where(exc)) from None

    def _where(self, exc: BaseException) -> str:
        """The template's origin and the template line the failure happened on (Jinja
        rewrites a render's traceback to the template's own lines)."""
        line, tb = None, exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == "<template>":
                line = tb.tb_lineno
            tb = tb.tb_next
        return self.origin if line is None else f"{self.origin} line {line}"


def render_chat(gguf_file_or_metadata, messages: list[Mapping[str, Any]],
                add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> str:
    """Render `messages` with a GGUF file's chat template (or its family's built-in one)."""
    return ChatTemplate.from_gguf(gguf_file_or_metadata, enable_thinking=enable_thinking)(
        messages, add_generation_prompt=add_generation_prompt)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt: special tokens parsed, BOS added when the tokenizer wants
    one and the template did not already print it (no double BOS)."""
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids.insert(0, tokenizer.bos_id)
    return ids
