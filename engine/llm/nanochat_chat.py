"""Chat with a nanochat model (an lm-pretrain run of `model.family = "nanochat"`) as nanochat's
Engine does it (karpathy/nanochat, nanochat/engine.py `Engine.generate` at commit 92d63d4):
its conversation format and its calculator tool, run while the model generates.

- The prompt is nanochat's render (engine.nanochat_tokenizer.render_conversation): <|bos|>,
  <|user_start|> … <|user_end|>, <|assistant_start|> … <|assistant_end|>, a system message
  merged into the first user turn, then <|assistant_start|> for the reply. An assistant turn of
  the transcript keeps its tool parts as their special tokens' text
  ("<|python_start|>6*7<|python_end|><|output_start|>42<|output_end|>"), which
  engine.nanochat_tokenizer.assistant_parts reads back into the parts render_conversation
  takes.
- Generation, token for token the Engine's loop for one row: every step samples (so a seeded
  draw consumes the generator as the reference does, even when the token is then forced); a
  token waiting in the forced queue replaces the sampled one; <|python_start|> opens an
  expression, <|python_end|> closes it, and the tokens between, decoded with specials as their
  text, go to the calculator (engine/nanochat_calculator.py: the reference's use_calculator with
  a safe evaluator); a result queues <|output_start|>, the tokens of str(result) and
  <|output_end|> to be forced. <|assistant_end|> or <|bos|> ends the reply (and is not part of
  its text).
- Sampling: greedy at temperature 0 (argmax, the first maximum), else nanochat's
  sample_next_token (top-k of the logits, softmax of those over the temperature, one
  torch.multinomial draw from a generator seeded with `seed`) when the settings ask nothing
  nanochat lacks (top-p 1, no repetition penalty); with a top-p or a repetition penalty, the
  engine's own sampler (engine.sampling, llama.cpp's order), said in the reply as `sampler`.

tests/test_nanochat_chat_engine.py holds the tokens, the forced-token masks and the logits of
every step to the reference Engine's on a scripted model (tests/data/nanochat/
chat_goldens.safetensors), and the sampler's seeded draws to sample_next_token's on the same
logits.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.errors import ForgebenchError
from engine.llm.generate import TextStream
from engine.nanochat_calculator import render_result, use_calculator
from engine.nanochat_tokenizer import NanochatTokenizer, assistant_parts, render_conversation
from engine.sampling import SamplingSettings
from engine.sampling import next_token as engine_next_token


@dataclass
class ToolCall:
    """One calculator call: the expression's text and the result forced after it (None: the
    calculator refused it, and nothing was forced)."""

    expr: str
    result: str | None

    def as_dict(self) -> dict:
        return {"expr": self.expr, "result": self.result}


@dataclass
class ToolState:
    """The Engine's RowState: the forced queue and the python block being read."""

    tokenizer: NanochatTokenizer
    forced: deque = field(default_factory=deque)
    in_python_block: bool = False
    python_expr_tokens: list = field(default_factory=list)

    def choose(self, sampled: int) -> tuple[int, bool]:
        """The next token: the first forced one waiting, else the sampled one; and whether it
        was forced."""
        if self.forced:
            return self.forced.popleft(), True
        return sampled, False

    def observe(self, token: int) -> ToolCall | None:
        """Update the state with the token just chosen; the call when it closes a block."""
        special = self.tokenizer.special_ids
        if token == special["<|python_start|>"]:
            self.in_python_block, self.python_expr_tokens = True, []
        elif token == special["<|python_end|>"] and self.in_python_block:
            self.in_python_block = False
            tokens, self.python_expr_tokens = self.python_expr_tokens, []
            if not tokens:
                return None
            expr = self.tokenizer.decode_with_specials(tokens)
            result = render_result(use_calculator(expr))
            if result is not None:
                self.forced.append(special["<|output_start|>"])
                self.forced.extend(self.tokenizer.encode(result))
                self.forced.append(special["<|output_end|>"])
            return ToolCall(expr, result)
        elif self.in_python_block:
            self.python_expr_tokens.append(token)
        return None


def nanochat_sample(logits: torch.Tensor, generator: torch.Generator, temperature: float,
                    top_k: int | None) -> int:
    """nanochat's sample_next_token for one row: logits [V] (fp32)."""
    row = logits.reshape(1, -1)
    if temperature == 0.0:
        return int(torch.argmax(row, dim=-1, keepdim=True)[0, 0])
    if top_k is not None and top_k > 0:
        vals, idx = torch.topk(row, min(top_k, row.size(-1)), dim=-1)
        probs = torch.softmax(vals / temperature, dim=-1)
        choice = torch.multinomial(probs, num_samples=1, generator=generator)
        return int(idx.gather(1, choice)[0, 0])
    probs = torch.softmax(row / temperature, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])


def uses_nanochat_sampler(settings: SamplingSettings) -> bool:
    """Whether the settings are ones nanochat's sampler has (temperature and top-k only)."""
    return settings.top_p >= 1.0 and (settings.repetition_penalty == 1.0
                                      or settings.repetition_last_n == 0) \
        and not settings.dry_on()


# -- the conversation ------------------------------------------------------------------------
def conversation_of(messages: list[dict]) -> dict:
    """Chat messages (role, content) as a nanochat conversation."""
    out = []
    for m in messages:
        role = m.get("role")
        if role not in ("system", "user", "assistant"):
            raise ForgebenchError(f"a {role!r} message has no place in nanochat's format",
                                  where="messages", hint="the calculator runs inside the "
                                  "reply: no tool messages (and no --calculator) are needed")
        content = m.get("content") or ""
        out.append({"role": role, "content": assistant_parts(content) if role == "assistant"
                    else content})
    return {"messages": out}


def prompt_ids(tokenizer: NanochatTokenizer, messages: list[dict]) -> list[int]:
    """The ids a reply starts from: the conversation rendered (not cut), <|assistant_start|>
    (render_for_completion's prompt, for a thread that ends with the user)."""
    ids, _ = render_conversation(tokenizer, conversation_of(messages), max_tokens=None)
    return ids + [tokenizer.special_ids["<|assistant_start|>"]]


# -- generation ------------------------------------------------------------------------------
@dataclass
class Reply:
    ids: list[int]
    forced: list[bool]
    calls: list[ToolCall]
    stop_reason: str
    sampler: str
    timings: dict


class _SpecialsAsText:
    """The tokenizer as TextStream reads it: the reply's text writes special tokens (a tool
    call's <|python_start|> ...) as their text."""

    def __init__(self, tokenizer: NanochatTokenizer):
        self.decode = tokenizer.decode_with_specials


def _streamer(tokenizer: NanochatTokenizer) -> Callable[[list[int]], str]:
    """Text increments of a growing token list (engine.llm.generate.TextStream, no stop
    strings: a partial UTF-8 character is held back until it completes)."""
    pieces: list[str] = []
    stream = TextStream(_SpecialsAsText(tokenizer), [], pieces.append)

    def update(ids: list[int]) -> str:
        pieces.clear()
        stream.update(ids)
        return "".join(pieces)
    return update


def generate_reply(model, tokenizer: NanochatTokenizer, prompt: list[int], *,
                   max_tokens: int, settings: SamplingSettings = SamplingSettings(),
                   seed: int = 42,
                   on_token: Callable[[dict], None] | None = None,
                   on_tool: Callable[[ToolCall], None] | None = None,
                   should_cancel: Callable[[], bool] | None = None,
                   on_logits: Callable[[torch.Tensor], None] | None = None) -> Reply:
    """One assistant reply after `prompt` (ids ending in <|assistant_start|>), the tool run as
    the Engine runs it. `on_token` gets {"id", "text", "logprob", "forced"} per token,
    `on_tool` each call as its block closes, `on_logits` the logits of every forward."""
    if not prompt:
        raise ForgebenchError("the prompt is empty", where="messages")
    context = model.config.sequence_len
    if len(prompt) + max_tokens > context:
        raise ForgebenchError(f"prompt ({len(prompt)} tokens) + max tokens ({max_tokens}) "
                              f"exceeds the model's context of {context}",
                              where="max_tokens", hint="start a new chat or lower max tokens")
    special = tokenizer.special_ids
    enders = {special["<|assistant_end|>"], tokenizer.bos_id}
    nanochat = uses_nanochat_sampler(settings)
    generator = torch.Generator().manual_seed(seed)
    top_k = settings.top_k or None
    cache = model.new_cache()
    clock = {"prompt_s": 0.0, "decode_s": 0.0}
    stream = _streamer(tokenizer)

    @torch.no_grad()
    def forward(ids: list[int], start: int) -> torch.Tensor:
        t0 = time.perf_counter()
        h = model.hidden(torch.tensor([ids]), start_pos=start, cache=cache)
        logits = model.logits(h[:, -1])[0].float()                      # [V]
        clock["prompt_s" if start == 0 else "decode_s"] += time.perf_counter() - t0
        if on_logits is not None:
            on_logits(logits)
        return logits

    state = ToolState(tokenizer)
    history = list(prompt)
    ids: list[int] = []
    forced_flags: list[bool] = []
    calls: list[ToolCall] = []
    logits = forward(history, 0)
    reason = "max_tokens"
    while len(ids) < max_tokens:
        sampled = nanochat_sample(logits, generator, settings.temperature, top_k) if nanochat \
            else engine_next_token(logits, settings, generator, history)
        token, forced = state.choose(sampled)
        history.append(token)
        call = state.observe(token)
        if token in enders:
            reason = "eos"
            break
        ids.append(token)
        forced_flags.append(forced)
        if on_token is not None:
            on_token({"id": token, "text": stream(ids), "forced": forced,
                      "logprob": float(torch.log_softmax(logits, -1)[token])})
        if call is not None:
            calls.append(call)
            if on_tool is not None:
                on_tool(call)
        if should_cancel is not None and should_cancel():
            reason = "cancelled"
            break
        if len(ids) < max_tokens:
            logits = forward([token], len(history) - 1)
    return Reply(ids, forced_flags, calls, reason, "nanochat" if nanochat else "forgebench",
                 {"time_to_first_token_s": clock["prompt_s"],
                  "decode_tokens_per_s": (len(ids) / clock["decode_s"]
                                          if clock["decode_s"] else None)})


# -- the chat worker's side (engine/serve_local.py) -----------------------------------------
class NanochatFormat:
    """A loaded nanochat system's "template": nanochat's render, with the calculator built in
    (the tool schemas a request offers are not rendered: the format has its own)."""

    origin = "nanochat's conversation format (render_conversation), calculator built in"

    def __init__(self, tokenizer: NanochatTokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: list[dict]) -> tuple[str, list[int]]:
        ids = prompt_ids(self.tokenizer, messages)
        return self.tokenizer.decode_with_specials(ids), ids


def chat(model, tokenizer: NanochatTokenizer, messages: list[dict], *, settings:
         SamplingSettings, seed: int, max_tokens: int, send: Callable[[dict], None],
         should_cancel: Callable[[], bool]) -> dict:
    """One streamed reply as serve-local's chat lines: start, a token line per token (with
    `forced`), a `tool` line as each calculator block closes ({"expr", "result"}), and the
    done fields (returned; the caller adds its own and sends it)."""
    text, ids = NanochatFormat(tokenizer).render(messages)
    send({"event": "start", "prompt_tokens": len(ids), "settings": settings.as_dict(),
          "seed": seed, "max_tokens": max_tokens, "format": "nanochat"})
    started = time.perf_counter()
    first: list[float] = []

    def on_token(line: dict) -> None:
        if not first:
            first.append(time.perf_counter() - started)
        send({"event": "token", **line})

    reply = generate_reply(model, tokenizer, ids, max_tokens=max_tokens, settings=settings,
                           seed=seed, on_token=on_token, should_cancel=should_cancel,
                           on_tool=lambda call: send({"event": "tool", **call.as_dict()}))
    timings = {**reply.timings, "total_s": time.perf_counter() - started,
               "first_streamed_token_s": first[0] if first else None}
    return {"text": tokenizer.decode_with_specials(reply.ids), "ids": reply.ids,
            "prompt_tokens": len(ids), "new_tokens": len(reply.ids),
            "stop_reason": reply.stop_reason, "timings": timings,
            "forced": [i for i, f in enumerate(reply.forced) if f],
            "tool_calls": [c.as_dict() for c in reply.calls], "sampler": reply.sampler}
