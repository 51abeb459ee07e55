"""Next-token sampling shared by every text model: logits in, token id out.

Greedy when temperature is 0; otherwise llama.cpp's order: repetition penalty, DRY, top-k,
top-p (on the untempered distribution), temperature, then a draw from the given
torch.Generator, so a seed reproduces a generation. The repetition penalty is llama.cpp's
`penalty_repeat` over its `penalty_last_n` window: the last n tokens of the history (prompt and
reply so far), -1 = all.

DRY ("Don't Repeat Yourself", pi6am's sampler from KoboldCpp, as llama.cpp's `llama_sampler_dry`
computes it) penalises a token by `multiplier * base ** (n - allowed_length)` when emitting it
would extend a sequence of n >= allowed_length tokens that already occurred earlier in the
window; a sequence breaker (a token whose text holds "\n", ":", '"' or "*", llama.cpp's default
breakers) ends the repetition a match may look back through and is never penalised itself. The
per-token repetition penalty cannot stop a loop longer than its window or one whose tokens are
all common; DRY does, because it counts repeated *sequences*. The breakers are token ids, so
they come from the tokenizer: `dry_breakers(tokenizer)` builds the table once per vocabulary.

Every default is off (1.0 and multiplier 0, what llama.cpp and an OpenAI endpoint do unasked)
except for chat: CHAT_DEFAULTS is the one default of the Chat pane and `forgebench chat`, a 1.1
penalty over the last 64 tokens (Ollama's repeat_penalty/repeat_last_n defaults; LM Studio's
1.1) and DRY at multiplier 0.8, base 1.75, allowed length 2 over the whole history (the
settings DRY's author recommends), because a small base model under greedy decoding otherwise
loops, on one sentence or on a paragraph longer than the penalty's window.

Logits may be a torch tensor or a numpy array (the torch-free generate path,
engine/llm/native_lm.py): greedy picks on a numpy array stay in numpy (the repetition penalty
in the same f32 operations, argmax's first maximum alike), so a greedy generation never imports
torch; a draw converts the array to a tensor and samples exactly as from the tensor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already present
    repetition_last_n: int = -1      # the penalty looks at the last n tokens; -1 = all, 0 = off
    dry_multiplier: float = 0.0      # 0 = off; the DRY penalty of a token extending a repeat
    dry_base: float = 1.75           # ... is multiplier * base ** (repeat length - allowed length)
    dry_allowed_length: int = 2      # repeats up to this length are free
    dry_last_n: int = -1             # DRY looks at the last n tokens; -1 = all, 0 = off

    def recent(self, previous: Sequence[int]) -> Sequence[int]:
        """The tokens the repetition penalty counts (llama.cpp's penalty_last_n window)."""
        n = self.repetition_last_n
        return previous if n < 0 else previous[-n:] if n else ()

    def dry_window(self, previous: Sequence[int]) -> Sequence[int]:
        """The tokens DRY searches for repeats (llama.cpp's dry_penalty_last_n window)."""
        n = self.dry_last_n
        return previous if n < 0 else previous[-n:] if n else ()

    def dry_on(self) -> bool:
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0 and self.dry_last_n != 0

    def as_dict(self) -> dict:
        return asdict(self)


CHAT_DEFAULTS = SamplingSettings(repetition_penalty=1.1, repetition_last_n=64,
                                 dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2,
                                 dry_last_n=-1)

# a nanochat model's chat default: nanochat's own sampler (temperature and top-k only), which a
# repetition penalty or DRY would replace by this one (engine/llm/nanochat_chat.py)
NANOCHAT_CHAT_DEFAULTS = SamplingSettings(**{**CHAT_DEFAULTS.as_dict(), "repetition_penalty": 1.0,
                                             "dry_multiplier": 0.0})

# llama.cpp's default DRY sequence breakers (common.h: dry_sequence_breakers)
DRY_BREAKERS = ("\n", ":", "\"", "*")
_DRY_MAX_CHARS, _DRY_MAX_TAIL = 40, 20       # llama.cpp truncates a breaker and its tail to these
_FLOAT_MAX_LOG = np.float32(88.7228391)     # log of f32's largest value: caps the exponent

# A breaker table: head token id -> the tails (token-id tuples) that complete a breaker after it;
# an empty tail means the head alone is a breaker.
Breakers = dict[int, tuple[tuple[int, ...], ...]]


def dry_breakers(tokenizer, breakers: Sequence[str] = DRY_BREAKERS) -> Breakers:
    """llama.cpp's processed sequence breakers (`get_overlapping_token_sequences`) for this
    vocabulary: a token whose text (special tokens as text) contains a breaker is a breaker; a
    token whose text ends with the breaker's beginning heads a breaker whose rest, tokenized
    without special handling, must follow. Cached on the tokenizer (one scan per vocabulary)."""
    cache = tokenizer.__dict__.setdefault("_dry_breakers", {})
    key = tuple(breakers)
    if key not in cache:
        cache[key] = _scan_breakers(tokenizer, key)
    return cache[key]


def _scan_breakers(tokenizer, breakers: tuple[str, ...]) -> Breakers:
    table: dict[int, list[tuple[int, ...]]] = {}
    words = [tokenizer.decode_bytes([i], special=True) for i in range(tokenizer.vocab_size)]
    for text in breakers:
        needle = text.encode()[:_DRY_MAX_CHARS]
        if not needle:
            continue
        for token, word in enumerate(words):
            tails = table.setdefault(token, []) if needle[:1] in word else None
            if tails is None:
                continue
            if needle in word:
                if () not in tails:
                    tails.append(())
                continue
            pos = word.find(needle[:1])
            while pos != -1:                     # the word's end overlaps the breaker's start
                i = 1
                while i < len(needle) and pos + i < len(word) and word[pos + i] == needle[i]:
                    i += 1
                if i == len(needle) or pos + i == len(word):
                    rest = needle[i:].decode("utf-8", errors="replace")
                    tail = tuple(tokenizer.encode(rest, add_special=False,
                                                  parse_special=False)[:_DRY_MAX_TAIL])
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(needle[:1], pos + 1)
    return {token: tuple(tails) for token, tails in table.items() if tails}


def dry_penalties(previous: Sequence[int], settings: SamplingSettings,
                  breakers: Breakers | None = None) -> dict[int, np.float32]:
    """The DRY penalty of every token that would extend a repeat, as llama.cpp's
    `llama_sampler_dry_apply` computes it (steps as numbered there): {token: penalty}."""
    if not settings.dry_on():
        return {}
    window = list(settings.dry_window(previous))
    n, allowed = len(window), settings.dry_allowed_length
    if n <= allowed:
        return {}
    breakers = breakers or {}

    def rat(i: int) -> int:                      # the i-th token from the end
        return window[n - 1 - i]

    # 1: the nearest breaker bounds how far back a repeat may reach
    rep_limit = n
    for i in range(n):
        tails = breakers.get(rat(i))
        if not tails:
            continue
        longest = -1
        for tail in tails:
            if longest < len(tail) <= i and \
                    all(t == rat(i - o - 1) for o, t in enumerate(tail)):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    # 2: the reversed Z-algorithm: count[last - k] = how many of the newest tokens reappear
    # ending k tokens earlier (capped at rep_limit)
    count, last, lt, rt = [0] * n, n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p, right = k - lt, rt - k + 1
            if count[last - p] < right:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    # 3: the token after each repeat would extend it: keep each token's longest
    longest_by_token: dict[int, int] = {}
    for i in range(n - 1):
        if count[i] >= allowed:
            token = rat(n - 2 - i)
            if longest_by_token.get(token, -1) < count[i]:
                longest_by_token[token] = count[i]
    # 4: multiplier * base ** (length - allowed), in llama.cpp's precisions: std::pow(float, int)
    # is computed in double, the product rounded to f32 once
    base, multiplier = np.float32(settings.dry_base), np.float32(settings.dry_multiplier)
    max_exponent = int(_FLOAT_MAX_LOG / np.log(base)) if base > np.float32(1.000001) else 0
    penalties = {}
    for token, length in longest_by_token.items():
        if () in breakers.get(token, ()):
            continue                             # a single-token breaker is never penalised
        exponent = length - allowed
        if max_exponent > 0 and exponent > max_exponent:
            exponent = max_exponent
        penalties[token] = np.float32(float(multiplier) * float(base) ** exponent)
    return penalties


def apply_dry(logits: torch.Tensor | np.ndarray, previous: Sequence[int],
              settings: SamplingSettings, breakers: Breakers | None = None):
    """Subtract the DRY penalties from the f32 logits (a copy when anything changes)."""
    penalties = dry_penalties(previous, settings, breakers)
    penalties = {t: p for t, p in penalties.items() if 0 <= t < logits.shape[-1]}
    if not penalties:
        return logits
    index = sorted(penalties)
    amount = np.array([penalties[t] for t in index], dtype=np.float32)
    if isinstance(logits, np.ndarray):
        logits = logits.copy()
        logits[index] = logits[index] - amount
        return logits
    import torch

    logits = logits.clone()
    logits[torch.tensor(index)] -= torch.from_numpy(amount)
    return logits


def apply_repetition_penalty(logits: torch.Tensor | np.ndarray, previous: Iterable[int],
                             penalty: float) -> torch.Tensor | np.ndarray:
    """Divide positive logits (multiply negative ones) of tokens already seen by `penalty`
    (f32 logits, the penalty rounded to f32 first: torch's arithmetic with a Python scalar)."""
    seen = sorted(set(previous))
    if penalty == 1.0 or not seen:
        return logits
    if isinstance(logits, np.ndarray):
        logits = logits.copy()
        picked, p = logits[seen], np.float32(penalty)
        logits[seen] = np.where(picked > 0, picked / p, picked * p)
        return logits
    import torch

    logits = logits.clone()
    index = torch.tensor(seen, dtype=torch.long)
    picked = logits[index]
    logits[index] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    import torch

    if k <= 0 or k >= logits.numel():
        return logits
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches `p`."""
    import torch

    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # drop a token when the mass before it already reaches p (the first token always stays)
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token(logits: torch.Tensor, settings: SamplingSettings,
               generator: torch.Generator | None = None, previous: Sequence[int] = (),
               breakers: Breakers | None = None) -> int:
    """Pick the next token from the logits [vocab] of the last position (a torch tensor or a
    numpy f32 array); `breakers` are DRY's sequence breakers (`dry_breakers(tokenizer)`)."""
    if isinstance(logits, np.ndarray):
        logits = apply_repetition_penalty(logits.reshape(-1).astype(np.float32, copy=False),
                                          settings.recent(previous), settings.repetition_penalty)
        logits = apply_dry(logits, previous, settings, breakers)
        if settings.temperature <= 0:
            return int(np.argmax(logits))
        import torch

        logits = torch.from_numpy(logits)
        return _draw(logits, settings, generator)
    logits = apply_repetition_penalty(logits.detach().float().reshape(-1),
                                      settings.recent(previous), settings.repetition_penalty)
    logits = apply_dry(logits, previous, settings, breakers)
    if settings.temperature <= 0:
        import torch

        return int(torch.argmax(logits))
    return _draw(logits, settings, generator)


def _draw(logits: torch.Tensor, settings: SamplingSettings,
          generator: torch.Generator | None) -> int:
    """top-k, top-p, temperature, then one draw (after the repetition penalty)."""
    import torch

    logits = filter_top_p(filter_top_k(logits, settings.top_k), settings.top_p)
    probs = torch.softmax(logits / settings.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class TokenStream:
    """One sequence's sampling loop, a token at a time, for whoever runs the forwards:
    `take(logits)` picks the next token from the logits after the last token fed, and answers
    whether that token must be fed for more (False once a stop token, `should_stop` or
    `max_new_tokens` ends the reply). `out` holds the new tokens (stop token excluded), `position`
    where the last of them goes. generate_tokens drives one stream with its own forwards; a batch
    decoder (equivalence._Runner.decode_many) drives several with one forward per step."""

    def __init__(self, prompt: list[int], *, max_new_tokens: int, settings: SamplingSettings,
                 generator: torch.Generator | None = None, stop_ids: Iterable[int] = (),
                 should_stop: Callable[[list[int]], bool] | None = None,
                 breakers: Breakers | None = None):
        self.settings, self.generator, self.breakers = settings, generator, breakers
        self.max_new_tokens, self.should_stop = max_new_tokens, should_stop
        self.stop_ids = set(stop_ids)
        self.history = list(prompt)
        self.out: list[int] = []
        self.done = max_new_tokens <= 0

    @property
    def position(self) -> int:
        """The position of the last token in the history: where a forward of out[-1] starts."""
        return len(self.history) - 1

    def take(self, logits: torch.Tensor | np.ndarray) -> bool:
        if self.done:
            return False
        token = next_token(logits, self.settings, self.generator, self.history, self.breakers)
        if token in self.stop_ids:
            self.done = True
            return False
        self.out.append(token)
        self.history.append(token)
        # should_stop sees every token, the last one too: callers stream through it
        stopped = self.should_stop is not None and self.should_stop(self.out)
        self.done = stopped or len(self.out) >= self.max_new_tokens
        return not self.done


def generate_tokens(step: Callable[[list[int], int], torch.Tensor], prompt: list[int], *,
                    max_new_tokens: int, settings: SamplingSettings,
                    generator: torch.Generator | None = None,
                    stop_ids: Iterable[int] = (),
                    should_stop: Callable[[list[int]], bool] | None = None,
                    breakers: Breakers | None = None) -> list[int]:
    """Generate with a KV-cached model: `step(ids, start_pos)` feeds `ids` at `start_pos` and
    returns the logits [vocab] of the last one. Returns the new tokens (stop token excluded)."""
    stream = TokenStream(prompt, max_new_tokens=max_new_tokens, settings=settings,
                         generator=generator, stop_ids=stop_ids, should_stop=should_stop,
                         breakers=breakers)
    logits = step(list(prompt), 0)
    while stream.take(logits):
        logits = step([stream.out[-1]], stream.position)
    return stream.out
