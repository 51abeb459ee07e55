"""The engine thread of a served nanochat model (an lm-pretrain run of nanochat's GPT, or an
lm-sft run that fine-tuned one): its requests are answered as nanochat's Engine answers,
with the calculator run inside the reply (engine/llm/nanochat_chat.py `generate_reply`): an
expression between <|python_start|> and <|python_end|> is evaluated and its result forced
into the reply between <|output_start|> and <|output_end|>, exactly as `forgebench chat` and
the Chat pane do. The reply's text keeps the tool parts as their special tokens' text.

The same surface as engine/server/scheduler.py's Runner (submit, load, context, close, the
same Job and events), but one request at a time in arrival order: nanochat's model keeps its
own cache (NanochatCache) that the batched decode step of the Llama family cannot advance,
and the Engine loop is per row. What a nanochat model cannot take is refused before a job is
queued (`refusal`): stop strings (the Engine stops at <|assistant_end|>), a response_format
(the JSON constraint masks the Llama family's tokenizer), and tool schemas (the calculator is
built into the format).
"""

from __future__ import annotations

import time

from engine.errors import ForgebenchError
from engine.server.scheduler import EngineThread, Job

FINISH = {"eos": "stop", "max_tokens": "length", "cancelled": "cancelled"}


def refusal(body, kind: str) -> str | None:
    """Why a request cannot run on a nanochat model, or None."""
    if body.stops():
        return "stop: nanochat's Engine ends a reply at <|assistant_end|>; stop strings are " \
               "not supported for a nanochat model"
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        return "response_format: a nanochat model answers in text only"
    if kind == "chat" and getattr(body, "tools", None):
        return "tools: a nanochat model runs its calculator inside the reply; no tool " \
               "schemas are rendered"
    return None


def completion_ids(tokenizer, text: str) -> list[int]:
    """A text completion's prompt: <|bos|> and the text's tokens (specials in it are plain
    text, as tiktoken's encode_ordinary reads them)."""
    return [tokenizer.bos_id] + tokenizer.encode(text)


class NanochatRunner(EngineThread):
    """One nanochat model's request queue and engine thread (see the module docstring)."""

    def __init__(self, model, tokenizer, *, slots: int = 4, queue_limit: int = 16,
                 name: str = "model", **_):
        self.model, self.tokenizer = model, tokenizer
        self.generating = 0
        self._open_queue(name, slots, queue_limit)

    def running(self) -> int:
        return self.generating

    @property
    def context(self) -> int:
        return self.model.config.sequence_len

    def _loop(self) -> None:
        while True:
            with self.condition:
                while not self.stopping and not self.waiting:
                    self.condition.wait()
                if self.stopping:
                    return
                job = self.waiting.popleft()
                self.generating = 1
            try:
                self._answer(job)
            except Exception as exc:  # noqa: BLE001 - one request's failure ends it only
                message = exc.message if isinstance(exc, ForgebenchError) else \
                    f"{type(exc).__name__}: {exc}"
                job.emit({"type": "error", "message": message})
            finally:
                with self.condition:
                    self.generating = 0

    def _answer(self, job: Job) -> None:
        from engine.llm.nanochat_chat import generate_reply

        if job.cancelled.is_set():         # the client went away while it waited
            job.emit({"type": "done", "text": "", "tail": "", "ids": [],
                      "finish_reason": "cancelled", "prompt_tokens": len(job.prompt_ids),
                      "completion_tokens": 0, "cached_tokens": 0})
            return
        job.emit({"type": "start", "prompt_tokens": len(job.prompt_ids), "cached_tokens": 0})
        first: list[float] = []

        def on_token(line: dict) -> None:
            if not first:
                first.append(time.perf_counter() - job.submitted)
            job.emit({"type": "token", "id": line["id"], "text": line["text"],
                      "forced": line["forced"]})

        reply = generate_reply(self.model, self.tokenizer, job.prompt_ids,
                               max_tokens=job.max_tokens, settings=job.settings, seed=job.seed,
                               on_token=on_token, should_cancel=job.cancelled.is_set)
        job.emit({"type": "done", "text": self.tokenizer.decode_with_specials(reply.ids),
                  "tail": "", "ids": list(reply.ids),
                  "finish_reason": FINISH[reply.stop_reason],
                  "prompt_tokens": len(job.prompt_ids), "completion_tokens": len(reply.ids),
                  "tool_calls": [c.as_dict() for c in reply.calls],
                  "first_token_s": first[0] if first else None,
                  "total_s": time.perf_counter() - job.submitted})
