"""The OpenAI-compatible HTTP API (`forgebench serve`), a Starlette app served by uvicorn.

Endpoints: GET /v1/models, POST /v1/chat/completions, /v1/completions, /v1/embeddings, and
GET /health. Request bodies are bounded (413), parsed with the nesting check and validated
with the shared schema (engine/server/requests.py, engine/server/openai_schema.py); every
refusal is OpenAI's error shape `{"error": {"message", "type", "param", "code"}}` with its
status: 400 malformed JSON or bad field, 401 missing/wrong key, 404 unknown model, 400 prompt
over the context (with the counts), 413 body too large, 400 a chat template that fails to
render (with the template's line), 503 when the model's queue is full.

Models load on first use (one load at a time per model; aliases such as a run's latest
checkpoint share one), then each has an engine thread (engine/server/scheduler.py) that
advances its requests together in batched decode steps. LoRA checkpoints of one base
share one loaded copy of it and its engine thread, each request running its own
checkpoint's adapter (engine/server/shared_base.py); /health lists the loaded bases.
Chat prompts are rendered by serve-local's `render` (the model's own template: the training
one for a run), completions encoded as `forgebench generate` encodes a prompt. A nanochat model
(an lm-pretrain run of nanochat's GPT, or its lm-sft fine-tune) renders nanochat's format and
answers on its own engine thread as nanochat's Engine does, its calculator run inside the reply
(engine/server/nanochat_runner.py). `on_log`
receives one dict per finished request (the app's request log).
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import threading
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import ForgebenchError
from engine.server import openai_schema as api
from engine.server.catalog import Catalog, Entry
from engine.server.requests import MAX_REQUEST_BYTES, RequestError, parse_json, validate

DEFAULT_MAX_TOKENS = 4096     # a request without max_tokens: the rest of the context, at most


def error_response(status: int, message: str, *, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def _refusal(exc: ForgebenchError) -> JSONResponse:
    if isinstance(exc, RequestError):
        return error_response(exc.status, exc.render(), param=exc.param, code=exc.code)
    return error_response(400, exc.render(), param=exc.where)


class Loaded:
    """A model ready to serve: the serve-local System (or an embedding encoder) and, for text
    models, its engine thread."""

    def __init__(self, entry: Entry, system=None, runner=None, encoder=None,
                 adapter: str | None = None):
        self.entry, self.system, self.runner, self.encoder = entry, system, runner, encoder
        self.adapter = adapter            # the shared base's adapter key its requests select
        self.encode_lock = threading.Lock()


class Server:
    def __init__(self, catalog: Catalog, *, api_key: str | None = None, slots: int = 4,
                 queue_limit: int = 16, on_log: Callable[[dict], None] | None = None,
                 max_body: int = MAX_REQUEST_BYTES, token_delay: float = 0.0):
        self.catalog, self.api_key = catalog, api_key
        self.slots, self.queue_limit, self.max_body = slots, queue_limit, max_body
        self.token_delay = token_delay    # tests only (--token-delay): a slot held long enough
        self.on_log = on_log
        self.loaded: dict[str, Loaded] = {}
        self.loading: dict[str, asyncio.Lock] = {}
        self.bases: dict[str, Any] = {}        # share_key -> engine.server.shared_base.SharedBase
        self.base_loads = 0                    # how many times a model was read from its files
        self.sharing = threading.Lock()

    # -- models ---------------------------------------------------------------------------
    def entry(self, model: str) -> Entry:
        entry = self.catalog.entries.get(model)
        if entry is None:
            raise RequestError(f"The model '{model}' does not exist or is not served here",
                               status=404, code="model_not_found", param="model",
                               hint="GET /v1/models lists the served ids")
        return entry

    async def model(self, model: str) -> Loaded:
        entry = self.entry(model)
        key = json.dumps(entry.load, sort_keys=True)      # aliases share one loaded model
        lock = self.loading.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self.loaded:
                self.loaded[key] = await run_in_threadpool(self._load, entry)
        return self.loaded[key]

    def _load(self, entry: Entry) -> Loaded:
        if entry.type == "embedding":
            from engine.config import recipe_module
            from engine.rundir import RunDir

            run = RunDir(entry.load["embedding_run"]).require()
            recipe = recipe_module(run.manifest()["recipe"])
            return Loaded(entry, encoder=recipe.checkpoint_encoder(
                run, run.checkpoint(entry.load["checkpoint"])))
        from engine.server.shared_base import share_key

        share = share_key(entry.load)
        if share is None:
            system, runner = self._load_model(entry)
            return Loaded(entry, system=system, runner=runner)
        from engine.server.shared_base import AdapterBank, SharedBase, checkpoint_system

        adapter = json.dumps(entry.load, sort_keys=True)
        with self.sharing:              # a second checkpoint waits for its base, then shares it
            shared = self.bases.get(share)
            if shared is None:
                system, runner = self._load_model(entry)
                bank = AdapterBank(system.model)
                bank.adopt(adapter)
                system.model.adapter_bank = bank
                shared = self.bases[share] = SharedBase(system, bank, runner,
                                                        system.info.get("base", ""))
            else:
                system = checkpoint_system(shared, entry.id, entry.load)
            shared.systems[entry.id] = system
        return Loaded(entry, system=system, runner=shared.runner, adapter=adapter)

    def _load_model(self, entry: Entry):
        from engine.serve_local import is_nanochat, load_system
        from engine.server.nanochat_runner import NanochatRunner
        from engine.server.scheduler import Runner

        system = load_system(entry.id, dict(entry.load))
        self.base_loads += 1
        # a nanochat model answers as nanochat's Engine, its calculator inside the reply
        runner = (NanochatRunner if is_nanochat(system) else Runner)(
            system.model, system.tokenizer, slots=self.slots, queue_limit=self.queue_limit,
            name=entry.id, token_delay=self.token_delay)
        return system, runner

    def bases_report(self) -> list[dict]:
        """/health's loaded bases: each base file, the served ids sharing it, its weights'
        bytes."""
        from engine.models.gguf_model import packed_weights

        report = []
        for shared in self.bases.values():
            model = shared.system.model
            weights = sum(w.packed_bytes for w in packed_weights(model))
            report.append({"base": shared.base_path, "models": sorted(shared.systems),
                           "packed_weight_bytes": weights})
        return report

    def close(self) -> None:
        for loaded in self.loaded.values():
            if loaded.runner is not None:
                loaded.runner.close()

    # -- requests -------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(),
                                                                    self.api_key):
            raise RequestError("Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                               status=401, code="invalid_api_key")

    async def body(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body:
            raise RequestError(f"the request body is {declared} bytes, over the "
                               f"{self.max_body} byte limit", status=413,
                               code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise RequestError(f"the request body is over the {self.max_body} byte limit",
                                   status=413, code="request_too_large")
            chunks.append(chunk)
        return parse_json(b"".join(chunks), where="body")

    def log(self, **entry: Any) -> None:
        if self.on_log is not None:
            self.on_log({"time": time.time(), **entry})


def _prompt_for_chat(loaded: Loaded, body: api.ChatCompletionRequest) -> list[int]:
    from engine.serve_local import render

    messages = [m.plain() for m in body.messages]
    _, ids = render(loaded.system, messages, body.tools)
    return ids


def _prompt_for_completion(loaded: Loaded, body: api.CompletionRequest) -> list[int]:
    from engine.serve_local import is_nanochat

    text = body.text()
    if not text:
        raise RequestError("prompt: the prompt is empty", param="prompt")
    if is_nanochat(loaded.system):
        from engine.server.nanochat_runner import completion_ids

        return completion_ids(loaded.system.tokenizer, text)
    return loaded.system.tokenizer.encode(text, add_special=True, parse_special=True)


def _constraint(loaded: Loaded, body) -> Any:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    from engine.server.constrained import JsonConstraint

    schema = None
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError("response_format.json_schema.schema: required for "
                               "type json_schema", param="response_format.json_schema")
        schema = fmt.json_schema.schema_
    return JsonConstraint.build(loaded.system.tokenizer, schema)


def _max_tokens(body, ids: list[int], context: int, kind: str) -> int:
    """The completion budget: the request's, or the rest of the context (at most
    DEFAULT_MAX_TOKENS); a prompt and budget over the context is refused with the counts."""
    asked = (getattr(body, "max_completion_tokens", None) or body.max_tokens)
    max_tokens = asked or min(DEFAULT_MAX_TOKENS, context - len(ids))
    if max_tokens < 1 or len(ids) + max_tokens > context:
        raise RequestError(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(ids) + max(max_tokens, 1)} tokens ({len(ids)} in the prompt, "
            f"{max(max_tokens, 1)} for the completion). Please reduce the prompt or the "
            "completion length.", param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded")
    return max_tokens


class _Reply:
    """The OpenAI response shapes of one chat or text completion: the whole reply, the
    streamed chunks and the usage block, all with the request's id, time and model."""

    def __init__(self, body, ids: list[int], kind: str) -> None:
        self.body, self.ids, self.kind = body, ids, kind
        self.ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.include_usage = bool(getattr(body, "stream_options", None)
                                  and body.stream_options.include_usage)

    def usage(self, done: dict, cached: int) -> dict:
        ids = self.ids
        return {"prompt_tokens": len(ids), "completion_tokens": done["completion_tokens"],
                "total_tokens": len(ids) + done["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def reason(done: dict) -> str:
        return {"length": "length"}.get(done["finish_reason"], "stop")

    def whole(self, event: dict, cached: int) -> JSONResponse:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": event["text"]},
                      "finish_reason": self.reason(event), "logprobs": None}
            shape = "chat.completion"
        else:
            choice = {"index": 0, "text": event["text"], "finish_reason": self.reason(event),
                      "logprobs": None}
            shape = "text_completion"
        return JSONResponse({"id": self.ident, "object": shape, "created": self.created,
                             "model": self.body.model, "choices": [choice],
                             "usage": self.usage(event, cached), "system_fingerprint": None})

    @property
    def chunk_shape(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> str:
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish,
                      "logprobs": None}
        payload = {"id": self.ident, "object": self.chunk_shape, "created": self.created,
                   "model": self.body.model, "choices": [choice], "system_fingerprint": None}
        if self.include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def final_chunks(self, event: dict, cached: int):
        if event.get("tail"):
            yield self.chunk(event["tail"])
        yield self.chunk(None, self.reason(event))
        if self.include_usage:
            payload = {"id": self.ident, "object": self.chunk_shape, "created": self.created,
                       "model": self.body.model, "choices": [],
                       "usage": self.usage(event, cached)}
            yield f"data: {json.dumps(payload)}\n\n"


async def _whole_reply(reply: _Reply, request: Request, events: asyncio.Queue,
                       job) -> Response:
    """Waits for the job's end (cancelling it if the client disconnects) and answers at once."""
    cached = 0
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                continue
            if event["type"] == "start":
                cached = event["cached_tokens"]
            elif event["type"] == "error":
                return error_response(500, event["message"], kind="server_error")
            elif event["type"] == "done":
                break
    finally:
        job.cancelled.set()         # a handler cancelled while waiting frees the slot
    return reply.whole(event, cached)


async def _stream_reply(reply: _Reply, events: asyncio.Queue, job):
    """The server-sent events of a streamed completion, ending in `[DONE]`."""
    cached = 0
    try:
        if reply.kind == "chat":
            yield reply.chunk("", first=True)
        while True:
            event = await events.get()
            if event["type"] == "start":
                cached = event["cached_tokens"]
            elif event["type"] == "token":
                if event["text"]:
                    yield reply.chunk(event["text"])
            elif event["type"] == "error":
                yield "data: " + json.dumps({"error": {"message": event["message"],
                                                       "type": "server_error"}}) + "\n\n"
                break
            else:
                for text in reply.final_chunks(event, cached):
                    yield text
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()         # the client went away: its slot ends at the next token


async def _generate(server: Server, request: Request, body, kind: str) -> Response:
    from engine.sampling import SamplingSettings
    from engine.server.scheduler import Busy, Job

    loaded = await server.model(body.model)
    if loaded.runner is None:
        raise RequestError(f"'{body.model}' is an embedding model: use /v1/embeddings",
                           param="model", code="wrong_model_type")
    from engine.serve_local import is_nanochat

    if is_nanochat(loaded.system):
        from engine.server.nanochat_runner import refusal

        reason = refusal(body, kind)
        if reason is not None:
            raise RequestError(reason, param=reason.split(":")[0], code="unsupported_parameter")
    prompt_of = _prompt_for_chat if kind == "chat" else _prompt_for_completion
    ids = await run_in_threadpool(prompt_of, loaded, body)
    constraint = await run_in_threadpool(_constraint, loaded, body)
    max_tokens = _max_tokens(body, ids, loaded.runner.context, kind)
    reply = _Reply(body, ids, kind)
    started = time.perf_counter()
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(event: dict) -> None:          # on the model's engine thread
        if event["type"] in ("done", "error"):  # logged even when the client has gone
            finished(event, 200 if event["type"] == "done" else 500)
        loop.call_soon_threadsafe(events.put_nowait, event)

    job = Job(ids, max_tokens, emit, SamplingSettings(body.temperature, body.top_k, body.top_p,
                                                      body.repetition_penalty),
              body.seed, body.stops(), constraint, adapter=loaded.adapter)
    try:
        loaded.runner.submit(job)
    except Busy as exc:
        raise RequestError(f"the server is busy: {exc}; retry shortly", status=503,
                           code="server_busy") from None

    def finished(done: dict, status: int = 200) -> None:
        seconds = done.get("total_s") or (time.perf_counter() - started)
        server.log(model=body.model, endpoint=request.url.path, status=status,
                   error=done.get("message"),
                   stream=body.stream, prompt_tokens=len(ids),
                   completion_tokens=done.get("completion_tokens", 0),
                   finish_reason=done.get("finish_reason"),
                   first_token_s=done.get("first_token_s"), seconds=seconds,
                   tokens_per_s=done.get("completion_tokens", 0) / seconds if seconds else None)

    if not body.stream:
        return await _whole_reply(reply, request, events, job)
    return StreamingResponse(_stream_reply(reply, events, job), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _embeddings(server: Server, request: Request) -> Response:
    body = validate(api.EmbeddingRequest, await server.body(request))
    loaded = await server.model(body.model)
    if loaded.encoder is None:
        raise RequestError(f"'{body.model}' is not an embedding model (serve an "
                           "embed-retrieval run)", param="model", code="wrong_model_type")
    texts = [body.input] if isinstance(body.input, str) else list(body.input)

    def encode():
        with loaded.encode_lock:
            vectors = loaded.encoder.encode(texts)
            tokens = sum(len(loaded.encoder.tokenizer.encode(t).ids) for t in texts) \
                if hasattr(loaded.encoder, "tokenizer") else 0
            return vectors, tokens

    vectors, tokens = await run_in_threadpool(encode)
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise RequestError(f"dimensions: this model's vectors have {vectors.shape[1]} "
                           "dimensions", param="dimensions")
    data = []
    for i, vector in enumerate(vectors):
        value = (base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
                 if body.encoding_format == "base64" else vector.tolist())
        data.append({"object": "embedding", "index": i, "embedding": value})
    server.log(model=body.model, endpoint=request.url.path, status=200,
               prompt_tokens=tokens, completion_tokens=0)
    return JSONResponse({"object": "list", "data": data, "model": body.model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return error_response(exc.status_code, exc.detail or "error",
                          code="not_found" if exc.status_code == 404 else None)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error_response(500, f"internal error: {type(exc).__name__}", kind="server_error")


def create_app(server: Server) -> Starlette:
    def handler(function):
        async def endpoint(request: Request) -> Response:
            try:
                server.authorize(request)
                return await function(request)
            except ForgebenchError as exc:
                if request.url.path.startswith("/v1/") and request.method == "POST":
                    server.log(model=None, endpoint=request.url.path,
                               status=getattr(exc, "status", 400), error=exc.message)
                return _refusal(exc)
        return endpoint

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": server.catalog.cards()})

    async def chat(request: Request) -> Response:
        body = validate(api.ChatCompletionRequest, await server.body(request))
        return await _generate(server, request, body, "chat")

    async def completions(request: Request) -> Response:
        body = validate(api.CompletionRequest, await server.body(request))
        return await _generate(server, request, body, "completion")

    async def embeddings(request: Request) -> Response:
        return await _embeddings(server, request)

    async def health(request: Request) -> Response:
        """Liveness, per loaded model how many requests generate and wait, how many times a
        model was read from its files and the bases LoRA checkpoints share."""
        return JSONResponse({"status": "ok", "served": len(server.catalog.entries),
                             "loaded": {loaded.entry.id: loaded.runner.load()
                                        for loaded in server.loaded.values()
                                        if loaded.runner is not None},
                             "model_loads": server.base_loads,
                             "shared_bases": server.bases_report()})

    routes = [Route("/v1/models", handler(models), methods=["GET"]),
              Route("/v1/chat/completions", handler(chat), methods=["POST"]),
              Route("/v1/completions", handler(completions), methods=["POST"]),
              Route("/v1/embeddings", handler(embeddings), methods=["POST"]),
              Route("/health", handler(health), methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error,
                                                        Exception: _internal_error})
