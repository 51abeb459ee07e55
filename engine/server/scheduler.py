"""Concurrent generation for one loaded model: requests share it slot by slot, each with its
own KV cache, sampler and cancellation, on one engine thread per model.

The engine's own pieces do the work: `model.hidden`/`model.logits` against a `KVCache` (the C
forward under llama.cpp numerics, engine/models/native_forward.py), `engine.sampling.next_token`
(greedy or llama.cpp's sampler order, a torch.Generator per request seeded as `generate` seeds
it), and `engine.llm.generate.TextStream` (stop strings, incomplete UTF-8 held back). A slot
therefore produces exactly the tokens `engine.llm.generate.generate` would for the same prompt,
settings and seed.

Scheduling: up to `slots` requests are active at once; each round admits waiting requests
(their prompts are processed), then samples every active request's next token and advances them
all in one batched decode step (engine/models/native_forward.py decode_batch): each weight is
read once per step for all of them, attention runs per request on its own cache, and each
request's logits are the bits it would get alone (the one-token kernels), so an answer does not
depend on what else is being served. More than `queue_limit` waiting
requests (beyond the free slots) are refused (`Busy`, a 503). A request whose client went
away is cancelled at its next token and its slot freed.

Prefix reuse: the KV caches of the last finished requests are kept (`prefix_entries`); a new
prompt that starts with one of them copies those positions and processes only the rest, as
llama.cpp's server does with `cache_prompt` (a conversation's next turn re-reads only the
new messages).

Shared bases: a model with an `adapter_bank` (engine/server/shared_base.py) serves several LoRA
checkpoints; the bank selects each request's adapter (`Job.adapter`) before its forward, a
decode step advances the requests of one adapter together, and a cached prefix is reused only
by a request of the same adapter (its keys and values depend on it).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.llm.generate import TextStream
from engine.models.native_forward import decode_batch
from engine.sampling import SamplingSettings, next_token


class Busy(Exception):
    """The model's queue is full."""


@dataclass
class Job:
    """One generation request. `emit` receives, on the engine thread, {"type": "start",
    "prompt_tokens", "cached_tokens"}, {"type": "token", "id", "text"} per token, then
    {"type": "done", "text", "ids", "finish_reason", "prompt_tokens", "completion_tokens",
    ...} or {"type": "error", "message"}."""

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[dict], None]
    settings: SamplingSettings = SamplingSettings()
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    constraint: Any = None          # engine.server.constrained.JsonConstraint or None
    adapter: str | None = None      # the LoRA checkpoint of a shared base it runs (shared_base.py)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Slot:
    job: Job
    cache: Any
    history: list[int]
    fed: int                              # positions written to the cache
    logits: torch.Tensor
    generator: torch.Generator
    stream: TextStream
    out: list[int] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    first_token_s: float | None = None


class EngineThread:
    """A loaded model's bounded request queue and the one thread that serves it: `submit`
    queues a job, or raises Busy when the requests running (`running()`) and waiting fill
    `slots + queue_limit`; `close` cancels the waiting ones and stops the thread. Subclasses
    give `_loop` and `running`."""

    def _open_queue(self, name: str, slots: int, queue_limit: int) -> None:
        self.name, self.slots, self.queue_limit = name, slots, queue_limit
        self.waiting: collections.deque[Job] = collections.deque()
        self.condition = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"serve-{name}", daemon=True)
        self.thread.start()

    def running(self) -> int:
        raise NotImplementedError

    def _loop(self) -> None:
        raise NotImplementedError

    def load(self) -> dict:
        with self.condition:
            return {"active": self.running(), "waiting": len(self.waiting)}

    def submit(self, job: Job) -> None:
        with self.condition:
            if self.running() + len(self.waiting) >= self.slots + self.queue_limit:
                raise Busy(f"{self.name}: {self.running()} request(s) generating and "
                           f"{len(self.waiting)} waiting, the most this server queues")
            self.waiting.append(job)
            self.condition.notify()

    def close(self) -> None:
        with self.condition:
            self.stopping = True
            for job in self.waiting:
                job.cancelled.set()
            self.condition.notify()
        self.thread.join(timeout=30)


class Runner(EngineThread):
    """The engine thread of one loaded model (see the module docstring)."""

    def __init__(self, model, tokenizer, *, slots: int = 4, queue_limit: int = 16,
                 prefix_entries: int = 2, name: str = "model", token_delay: float = 0.0):
        self.model, self.tokenizer = model, tokenizer
        # a pause after each decode round, for tests that need a slot to stay taken while they
        # send the next request (a tiny model can finish a whole answer before that)
        self.token_delay = token_delay
        self.prefix_entries = prefix_entries
        self.stop_ids = sorted({i for i in (tokenizer.eos_id, *tokenizer.eot_ids)
                                if i is not None})
        self.active: list[_Slot] = []
        # taken from the queue, prompt still being read: they hold their slots already (a
        # request arriving meanwhile must see the model as busy, not find an empty one)
        self.starting = 0
        # (adapter, positions' ids, cache), newest last
        self.prefixes: list[tuple[str | None, list[int], Any]] = []
        self.bank = getattr(model, "adapter_bank", None)
        self._open_queue(name, slots, queue_limit)

    @property
    def context(self) -> int:
        return self.model.config.max_seq_len

    def running(self) -> int:
        return len(self.active) + self.starting

    # -- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.condition:
                while not self.stopping and not self.waiting and not self.active:
                    self.condition.wait()
                if self.stopping:
                    for slot in self.active:
                        self._finish(slot, "cancelled")
                    return
                admitted = []
                while self.waiting and len(self.active) + len(admitted) < self.slots:
                    admitted.append(self.waiting.popleft())
                self.starting = len(admitted)
            for job in admitted:
                self._guard(job, lambda job=job: self._start(job))
                with self.condition:
                    self.starting -= 1
            stepping: dict[str | None, list[_Slot]] = {}     # by adapter
            for slot in list(self.active):
                self._guard(slot.job, lambda slot=slot, into=stepping: self._advance(slot)
                            and into.setdefault(slot.job.adapter, []).append(slot), slot)
            for slots in stepping.values():
                self._decode(slots)
            if self.token_delay and self.active:
                time.sleep(self.token_delay)

    def _guard(self, job: Job, work: Callable[[], None], slot: _Slot | None = None) -> None:
        """Run one request's step; whatever it raises ends that request only."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop others
            self._fail(job, exc, slot)

    def _fail(self, job: Job, exc: Exception, slot: _Slot | None = None) -> None:
        if slot is not None and slot in self.active:
            self.active.remove(slot)
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        job.emit({"type": "error", "message": message})

    def _select(self, job: Job) -> None:
        if self.bank is not None:
            self.bank.select(job.adapter)

    def _step(self, slot_cache, ids: list[int], start: int) -> torch.Tensor:
        with torch.no_grad():
            h = self.model.hidden(torch.tensor([ids]), start, slot_cache)
            return self.model.logits(h[:, -1])[0].float()

    def _reuse(self, prompt: list[int], size: int, adapter: str | None) -> tuple[Any, int]:
        """A cache for `prompt` holding the longest cached prefix of it (at most all but its
        last token: the last one must run to give the next token's logits) that the same
        adapter computed."""
        cache = self.model.new_cache(1, size)
        best, source = 0, None
        for owner, ids, cached in self.prefixes:
            if owner != adapter:
                continue
            n = 0
            limit = min(len(ids), len(prompt) - 1)
            while n < limit and ids[n] == prompt[n]:
                n += 1
            if n > best:
                best, source = n, cached
        if source is not None:
            for dst, src in zip((*cache.k, *cache.v), (*source.k, *source.v)):
                dst[:, :, :best] = src[:, :, :best]
        return cache, best

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.emit({"type": "done", "text": "", "ids": [], "finish_reason": "cancelled",
                      "prompt_tokens": len(job.prompt_ids), "completion_tokens": 0,
                      "cached_tokens": 0})
            return
        prompt = list(job.prompt_ids)
        cache, cached = self._reuse(prompt, len(prompt) + job.max_tokens, job.adapter)
        self._select(job)
        job.emit({"type": "start", "prompt_tokens": len(prompt), "cached_tokens": cached})
        started = time.perf_counter()
        logits = self._step(cache, prompt[cached:], cached)
        slot = _Slot(job, cache, prompt, len(prompt), logits,
                     torch.Generator().manual_seed(job.seed), None)
        slot.stream = TextStream(self.tokenizer, list(job.stop), slot.released.append)
        slot.prompt_s = time.perf_counter() - started
        self.active.append(slot)

    def _advance(self, slot: _Slot) -> bool:
        """Sample and send the slot's next token; True when it goes on (its token is then fed
        in the round's decode step), False when it finished."""
        job = slot.job
        logits = slot.logits
        if job.constraint is not None:
            logits = job.constraint.mask(logits)
        token = next_token(logits, job.settings, slot.generator, slot.history)
        if token in self.stop_ids and (job.constraint is None or job.constraint.complete):
            return self._finish(slot, "stop")
        slot.out.append(token)
        slot.history.append(token)
        if slot.first_token_s is None:
            slot.first_token_s = time.perf_counter() - job.submitted
        if job.constraint is not None:
            job.constraint.advance(token)
        slot.released.clear()
        hit = slot.stream.update(slot.out)
        job.emit({"type": "token", "id": token, "text": "".join(slot.released)})
        if hit or (job.constraint is not None and job.constraint.complete):
            return self._finish(slot, "stop")
        if job.cancelled.is_set():
            return self._finish(slot, "cancelled")
        if len(slot.out) >= job.max_tokens:
            return self._finish(slot, "length")
        return True

    def _decode(self, slots: list[_Slot]) -> None:
        """Feed each slot's newest token in one batched step; a failure ends those requests."""
        try:
            self._select(slots[0].job)
            logits = decode_batch(self.model, [s.history[-1] for s in slots],
                                  [len(s.history) - 1 for s in slots], [s.cache for s in slots])
        except Exception as exc:  # noqa: BLE001 - the requests fail, the server goes on
            for slot in slots:
                self._fail(slot.job, exc, slot)
            return
        for slot, row in zip(slots, logits):
            slot.logits = row
            slot.fed = len(slot.history)

    def _finish(self, slot: _Slot, reason: str) -> None:
        if slot in self.active:
            self.active.remove(slot)
        slot.released.clear()
        text = slot.stream.finish(slot.out)
        tail = "".join(slot.released)
        self.prefixes = [p for p in self.prefixes if p[2] is not slot.cache][
            -(self.prefix_entries - 1):] if self.prefix_entries > 1 else []
        if self.prefix_entries:
            self.prefixes.append((slot.job.adapter, slot.history[:slot.fed], slot.cache))
        slot.job.emit({"type": "done", "text": text, "tail": tail, "ids": list(slot.out),
                       "finish_reason": reason, "prompt_tokens": len(slot.job.prompt_ids),
                       "completion_tokens": len(slot.out),
                       "first_token_s": slot.first_token_s,
                       "total_s": time.perf_counter() - slot.job.submitted})
