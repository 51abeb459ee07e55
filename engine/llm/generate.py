"""KV-cached text generation from a GGUF model: greedy or sampled (engine.sampling), stop strings,
streamed text, timing figures. (`forgebench generate` is engine.commands.generate.)

Streaming: `on_text` receives text increments as they become safe to show (TextStream), and
`on_token` one `TokenEvent` per generated token (id, the text it released, its log-probability
under the model); `should_cancel` is asked after every token and ends the reply early
(stop reason "cancelled"). The long-lived worker (engine/serve_local.py) streams through these.

The prompt is processed in one batch, then one token per step against the KV cache, as llama.cpp
does. Under "llamacpp" numerics (the default for GGUF files) the cache is f16 and matmuls quantize
their activations, so the continuation is the one llama.cpp serves.

`model` is a torch model (engine.models.gguf_model) or a torch-free `NativeLM`
(engine/llm/native_lm.py, `model.torch_free`): the same logits bit for bit, numpy arrays instead
of tensors; a greedy generation on it never imports torch (a sampled one imports it for the
generator, engine.sampling).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine.errors import ForgebenchError
from engine.sampling import SamplingSettings, dry_breakers, generate_tokens


@dataclass
class Generation:
    prompt_ids: list[int]
    ids: list[int]
    text: str
    stop_reason: str                      # "eos", "stop_string", "max_tokens", "cancelled"
    timings: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"text": self.text, "ids": self.ids, "prompt_tokens": len(self.prompt_ids),
                "new_tokens": len(self.ids), "stop_reason": self.stop_reason,
                "timings": self.timings}


@dataclass(frozen=True)
class TokenEvent:
    """One generated token as it streams: the text it released may be empty (held back: part
    of a multi-byte character or of a possible stop string; it arrives with a later token or
    in the final text). `logprob` is log softmax of the model's logits, before any sampling
    filter or temperature."""

    id: int
    text: str
    logprob: float

    def as_dict(self) -> dict:
        return {"id": self.id, "text": self.text, "logprob": self.logprob}


class TextStream:
    """Turns a growing token list into text increments, holding back incomplete UTF-8 sequences
    and anything that could still become a stop string."""

    def __init__(self, tokenizer, stop: list[str], emit: Callable[[str], None] | None):
        self.tokenizer, self.stop, self.emit = tokenizer, [s for s in stop if s], emit
        self.sent = 0
        self.hit: int | None = None      # character index where a stop string starts

    def update(self, ids: list[int]) -> bool:
        """Feed all tokens so far; True once a stop string appeared."""
        text = self.tokenizer.decode(ids)
        for s in self.stop:
            at = text.find(s)
            if at >= 0 and (self.hit is None or at < self.hit):
                self.hit = at
        if self.hit is not None:
            self._send(text[: self.hit])
            return True
        safe = len(text)
        if text.endswith("\ufffd"):                              # partial multi-byte character
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:                                       # a stop string may be starting
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        self._send(text[:safe])
        return False

    def finish(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        if self.hit is not None:
            text = text[: self.hit]
        self._send(text)
        return text

    def _send(self, text: str) -> None:
        if self.emit and len(text) > self.sent:
            self.emit(text[self.sent:])
        self.sent = max(self.sent, len(text))


def log_softmax_at(logits, index: int) -> float:
    """log softmax(logits)[index] of a torch tensor or (torch-free path) a numpy f32 array."""
    if isinstance(logits, np.ndarray):
        x = logits.astype(np.float64)
        top = x.max()
        return float(x[index] - top - math.log(np.exp(x - top).sum()))
    import torch

    return float(torch.log_softmax(logits, dim=-1)[index])


def generate(model, tokenizer, prompt_ids: list[int], *, max_new_tokens: int = 64,
             settings: SamplingSettings = SamplingSettings(), seed: int = 0,
             stop: list[str] = (), on_text: Callable[[str], None] | None = None,
             stop_ids: list[int] | None = None,
             on_token: Callable[[TokenEvent], None] | None = None,
             should_cancel: Callable[[], bool] | None = None) -> Generation:
    """Generate up to `max_new_tokens` after `prompt_ids`, stopping at an end-of-generation token
    or a stop string (excluded from the text); `on_text` receives the text as it is produced,
    `on_token` every token, and `should_cancel() -> True` ends the reply after a token."""
    _check_budget(model, prompt_ids, max_new_tokens)
    torch_free = getattr(model, "torch_free", False)
    forward = _last_logits_fn(model, len(prompt_ids) + max_new_tokens)
    clock = {"prompt_s": 0.0, "decode_s": 0.0, "steps": 0}
    last_logits: list = []           # the distribution the newest token came from
    start = time.perf_counter()

    def step(ids: list[int], start_pos: int):
        t0 = time.perf_counter()
        logits = forward(ids, start_pos)
        dt = time.perf_counter() - t0
        if start_pos == 0:
            clock["prompt_s"] += dt
        else:
            clock["decode_s"] += dt
            clock["steps"] += 1
        last_logits[:] = [logits]
        return logits

    if stop_ids is None:
        stop_ids = sorted({i for i in (tokenizer.eos_id, *tokenizer.eot_ids) if i is not None})
    released: list[str] = []

    def emit(text: str) -> None:
        released.append(text)
        if on_text is not None:
            on_text(text)

    stream = TextStream(tokenizer, list(stop), emit)
    cancelled = False

    def after_token(ids: list[int]) -> bool:
        nonlocal cancelled
        released.clear()
        hit = stream.update(ids)
        if on_token is not None:
            logprob = log_softmax_at(last_logits[0], ids[-1])
            on_token(TokenEvent(ids[-1], "".join(released), logprob))
        if not hit and should_cancel is not None and should_cancel():
            cancelled = True
        return hit or cancelled

    generator = None
    if not torch_free or settings.temperature > 0:   # a draw needs torch's generator
        import torch

        generator = torch.Generator().manual_seed(seed)
    breakers = dry_breakers(tokenizer) if settings.dry_on() and hasattr(tokenizer, "decode_bytes") \
        else None
    ids = generate_tokens(step, list(prompt_ids), max_new_tokens=max_new_tokens, settings=settings,
                          generator=generator, stop_ids=stop_ids, should_stop=after_token,
                          breakers=breakers)
    text = stream.finish(ids)
    reason = _finish_reason(stream, cancelled, len(ids), max_new_tokens)
    total = time.perf_counter() - start
    return Generation(list(prompt_ids), ids, text, reason, _timings(len(prompt_ids), clock, total))


def _check_budget(model, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Refuses an empty prompt, or a prompt and budget over the model's context."""
    if not prompt_ids:
        raise ForgebenchError("the prompt is empty", where="--prompt")
    limit = model.config.max_seq_len
    if len(prompt_ids) + max_new_tokens > limit:
        raise ForgebenchError(f"prompt ({len(prompt_ids)} tokens) + max tokens ({max_new_tokens}) "
                              f"exceeds the model's context of {limit}", where="--max-tokens",
                              hint="shorten the prompt or lower --max-tokens")


def _last_logits_fn(model, max_len: int) -> Callable:
    """`forward(ids, start_pos)` -> the logits of the last of `ids`, over a fresh cache of
    `max_len` positions (the torch-free model's own, or the torch model's hidden + logits)."""
    if getattr(model, "torch_free", False):
        cache = model.new_cache(max_len)
        return functools.partial(model.last_logits, cache=cache)
    import torch

    cache = model.new_cache(1, max_len)

    @torch.no_grad()
    def forward(ids: list[int], start_pos: int) -> torch.Tensor:
        h = model.hidden(torch.tensor([ids]), start_pos, cache)
        return model.logits(h[:, -1])[0].float()
    return forward


def _finish_reason(stream: TextStream, cancelled: bool, n_tokens: int,
                   max_new_tokens: int) -> str:
    if stream.hit is not None:
        return "stop_string"
    if cancelled:
        return "cancelled"
    if n_tokens < max_new_tokens:
        return "eos"
    return "max_tokens"


def _timings(prompt_tokens: int, clock: dict, total: float) -> dict:
    return {
        "prompt_tokens_per_s": prompt_tokens / clock["prompt_s"] if clock["prompt_s"] else None,
        "decode_tokens_per_s": clock["steps"] / clock["decode_s"] if clock["decode_s"] else None,
        "time_to_first_token_s": clock["prompt_s"],
        "total_s": total,
    }
