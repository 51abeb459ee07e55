"""Next-token sampling shared by every text model: logits in, token id out.

Greedy when temperature is 0; otherwise llama.cpp's order: repetition penalty, top-k, top-p
(on the untempered distribution), temperature, then a draw from the given torch.Generator, so a
seed reproduces a generation. The repetition penalty is llama.cpp's `penalty_repeat` over its
`penalty_last_n` window: the last n tokens of the history (prompt and reply so far), -1 = all.

Every default is off (1.0, what llama.cpp and an OpenAI endpoint do unasked) except for chat:
CHAT_DEFAULTS is the one default of the Chat pane and `forgebench chat`, a 1.1 penalty over the
last 64 tokens (Ollama's repeat_penalty/repeat_last_n defaults; LM Studio's 1.1), because a small
base model under greedy decoding otherwise loops on one sentence.

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

    def recent(self, previous: Sequence[int]) -> Sequence[int]:
        """The tokens the repetition penalty counts (llama.cpp's penalty_last_n window)."""
        n = self.repetition_last_n
        return previous if n < 0 else previous[-n:] if n else ()

    def as_dict(self) -> dict:
        return asdict(self)


CHAT_DEFAULTS = SamplingSettings(repetition_penalty=1.1, repetition_last_n=64)


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
               generator: torch.Generator | None = None, previous: Sequence[int] = ()) -> int:
    """Pick the next token from the logits [vocab] of the last position (a torch tensor or a
    numpy f32 array)."""
    if isinstance(logits, np.ndarray):
        logits = apply_repetition_penalty(logits.reshape(-1).astype(np.float32, copy=False),
                                          settings.recent(previous), settings.repetition_penalty)
        if settings.temperature <= 0:
            return int(np.argmax(logits))
        import torch

        logits = torch.from_numpy(logits)
        return _draw(logits, settings, generator)
    logits = apply_repetition_penalty(logits.detach().float().reshape(-1),
                                      settings.recent(previous), settings.repetition_penalty)
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


def generate_tokens(step: Callable[[list[int], int], torch.Tensor], prompt: list[int], *,
                    max_new_tokens: int, settings: SamplingSettings,
                    generator: torch.Generator | None = None,
                    stop_ids: Iterable[int] = (),
                    should_stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Generate with a KV-cached model: `step(ids, start_pos)` feeds `ids` at `start_pos` and
    returns the logits [vocab] of the last one. Returns the new tokens (stop token excluded)."""
    stop_ids = set(stop_ids)
    history = list(prompt)
    logits = step(list(prompt), 0)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = next_token(logits, settings, generator, history)
        if token in stop_ids:
            break
        out.append(token)
        history.append(token)
        if should_stop is not None and should_stop(out):
            break
        if len(out) < max_new_tokens:
            logits = step([token], len(history) - 1)
    return out
