"""`forgebench serve-local`: a long-lived engine process that keeps chat systems loaded and
streams replies as JSON lines over stdin/stdout. The Chat pane and `forgebench chat` drive it.

A *system* is something to chat with, loaded once under a name and kept warm:

- a GGUF file (a library model, an exported `model.gguf`, any file), optionally with LoRA
  adapters (`adapters.safetensors`) attached;
- a checkpoint of a run of a CHAT_RECIPES recipe (lm-sft, lm-dpo, lm-es): its base with the
  checkpoint's adapters, or its full weights. With a workspace, the run's GGUF base is looked
  up in the model library by its SHA-256 (a base missing from the library is refused with the
  reason); a base that is an lm-pretrain run's checkpoint is read where the run is;
- a checkpoint of an lm-pretrain run of nanochat's GPT with nanochat's tokenizer, or of an
  lm-sft run that fine-tuned one: it chats in nanochat's own format with its calculator run
  while it generates, as nanochat's Engine does
  (engine/llm/nanochat_chat.py): its token lines carry `forced` (the tool's output, not
  sampled), a `{"event": "tool", "expr", "result"}` line follows each calculator block, and
  the reply's text keeps the tool parts as their special tokens' text.

Requests, one JSON object per line on stdin; every reply line echoes the request's `request`:

    {"request": "1", "op": "load", "system": "A", "model": "FILE.gguf"}
    {"request": "1", "op": "load", "system": "A", "library": "NAME", "workspace": "DIR"}
    {"request": "1", "op": "load", "system": "B", "run": "RUN_DIR", "checkpoint": "latest",
     "workspace": "DIR"}                       -> {"event": "loaded", "system", "info", ...}
    {"request": "2", "op": "render", "system": "A", "messages": [...]}
                                               -> {"event": "rendered", "text", "tokens"}
    {"request": "3", "op": "chat", "system": "A", "messages": [...], "max_tokens": 128,
     "seed": 0, "settings": {"temperature": 0.7, "top_k": 40, "top_p": 0.95,
                             "repetition_penalty": 1.1},
     "tools": [...]}                           (optional: tool schemas the prompt offers)
                                               -> {"event": "start", "prompt_tokens", ...}
                                                  {"event": "token", "id", "text", "logprob"}…
                                                  {"event": "done", "text", "stop_reason", …}
    {"request": "4", "op": "cancel", "target": "3"}      -> the target ends "cancelled"
    {"request": "5", "op": "unload", "system": "A"}      {"op": "shutdown"}

Work runs on one engine thread in arrival order (one model forward at a time on a CPU);
stdin is read on the main thread, so a cancel reaches a reply while it streams. Every line is
checked against the request schema (engine/server/requests.py: size, nesting depth, types,
ranges, no unknown fields) before anything runs. A bad request or bad input is an
`{"event": "error", "message", "path", "where", "hint", "param"}` line and the worker carries
on; no request ends the process or another request (a chat template is stopped by its render
budget, engine/llm/chat.py); only end of input or `shutdown` ends it. The first line is
`{"event": "ready", "pid": ...}`; at shutdown (or end of input) the reply in progress is
cancelled and queued requests are dropped.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from engine import model_library
from engine.errors import ForgebenchError
from engine.recipe_registry import recipes_with
from engine.server import requests as schema

CHAT_RECIPES = recipes_with("chat")    # the recipes whose runs answer in chat
OPS = schema.OPS
SETTINGS = tuple(schema.Settings.model_fields)


@dataclass
class System:
    """A loaded model with what chatting needs: tokenizer, template, its identity."""

    name: str
    model: Any
    tokenizer: Any
    template: Any
    info: dict
    enable_thinking: bool | None = False


def _error_line(exc: ForgebenchError) -> dict:
    line = {"event": "error", "message": exc.message, "path": exc.path, "where": exc.where,
            "hint": exc.hint}
    if isinstance(exc, schema.RequestError):
        line["param"] = exc.param
    return line


def _plain(messages: list) -> list[dict]:
    """Validated messages as the dicts templates read (unset optional keys left out)."""
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m
            for m in messages]


def load_system(name: str, request: dict, torch_free: bool = False) -> System:
    """Load what a `load` request names (see the module docstring). `torch_free`: a GGUF may
    load as the torch-free C decoder (engine.lm_load.load_generator), for callers that
    only generate (the chat command, this worker); the HTTP server's scheduler needs the torch
    model."""
    from engine.llm.chat import ChatTemplate

    workspace = request.get("workspace")
    if request.get("run"):
        return _load_run(name, Path(request["run"]), request.get("checkpoint") or "latest",
                         workspace)
    if request.get("library"):
        if not workspace:
            raise ForgebenchError("a library model needs the workspace", where="workspace")
        entry = model_library.get_entry(workspace, request["library"])
        path = model_library.verified_entry_path(workspace, entry)   # edited on disk: refused
        origin = {"library": entry["name"]}
    elif request.get("model"):
        path, origin = Path(request["model"]).expanduser(), {}
    else:
        raise ForgebenchError("a load request names a model, a library model or a run",
                              where="load", hint='e.g. {"op": "load", "model": "FILE.gguf"}')
    if not path.is_file():
        raise ForgebenchError("model file not found", path=path, where="model")
    from engine.lm_load import load_generator

    numerics = request.get("numerics") or "llamacpp"
    started = time.perf_counter()
    model, tokenizer = load_generator(path, numerics, "dense-cache", request.get("lora"),
                                      torch_free=torch_free, cartridge=request.get("cartridge"))
    template = ChatTemplate.from_gguf(model.gguf)
    info = {"kind": "gguf", "path": str(path), "sha256": model.gguf.sha256(),
            "numerics": numerics, "lora": request.get("lora"), "template": template.origin,
            "cartridge": request.get("cartridge"),
            "architecture": model.gguf.architecture, "context": model.config.max_seq_len,
            "load_s": time.perf_counter() - started, **origin}
    return System(name, model, tokenizer, template, info, request.get("enable_thinking"))


def run_base_in_library(run_dir: Path, workspace: str | os.PathLike) -> Path:
    """The library's copy of an lm-sft run's base, found by the SHA-256 in run.json."""
    from engine.rundir import RunDir

    base = RunDir(run_dir).require().manifest().get("base_model") or {}
    entry = model_library.find_by_sha256(workspace, base.get("sha256", ""))
    if entry is None:
        raise ForgebenchError(
            f"the run's base model is not in the library ({Path(base.get('path', '?')).name}, "
            f"SHA-256 {base.get('sha256', '?')[:12]}…)", path=run_dir, where="base_model",
            hint="add the base GGUF to the Models pane (forgebench models add FILE.gguf)")
    path = model_library.entry_path(workspace, entry)
    if not path.is_file():
        raise ForgebenchError(f"the library's file for the base {entry['name']!r} is missing",
                              path=path, where="models")
    return path


def _load_run(name: str, run_dir: Path, checkpoint: str, workspace) -> System:
    from engine.jobs import recipe_for_run
    from engine.lora import ADAPTERS_FILE
    from engine.rundir import RunDir

    run = RunDir(run_dir).require()
    recipe = run.manifest().get("recipe")
    if recipe == "lm-pretrain":
        return _load_nanochat_run(name, run, checkpoint)
    if recipe not in CHAT_RECIPES:
        raise ForgebenchError(f"recipe '{recipe}' has no chat model",
                              path=run.path, where="run",
                              hint=f"chat with a run of {', '.join(CHAT_RECIPES)}")
    module = recipe_for_run(run)
    # a GGUF base is found in the library; an lm-pretrain run's weights are the base itself
    gguf_base = Path((run.manifest().get("base_model") or {}).get("path", "")).suffix == ".gguf"
    base_path = run_base_in_library(run_dir, workspace) if workspace and gguf_base else None
    started = time.perf_counter()
    ckpt = run.checkpoint(checkpoint)
    base, config = module.load_trained(run, ckpt, base_path=base_path)
    info = {"kind": "run", "run": str(run.path), "checkpoint": ckpt.name, "step": ckpt.step,
            "base": str(base.path), "numerics": getattr(base.model, "numerics", "f32"),
            "recipe": recipe,
            "method": "lora" if (ckpt.path / ADAPTERS_FILE).is_file() else "full",
            "template": base.template.origin,
            "context": base.model.config.max_seq_len, "load_s": time.perf_counter() - started}
    if getattr(base, "nanochat", None) is not None:   # lm-sft of nanochat's GPT: its format
        info |= {"format": "nanochat", "tool": "calculator"}
    data = getattr(config, "data", None)       # an lm-cartridge run has no data section
    return System(name, base.model, base.tokenizer, base.template, info,
                  data.enable_thinking if data is not None else False)


def _load_nanochat_run(name: str, run, checkpoint: str) -> System:
    """An lm-pretrain checkpoint of nanochat's GPT, chatting in nanochat's format; any other
    lm-pretrain model has no chat format and is refused with the reason."""
    from engine.jobs import recipe_for_run
    from engine.llm.nanochat_chat import NanochatFormat
    from engine.models.nanochat import NanochatGPT
    from engine.train.pretrain_model import load_model

    recipe_for_run(run)                          # torch's threads, as the run trained
    started = time.perf_counter()
    ckpt = run.checkpoint(checkpoint)
    model, tokenizer, _ = load_model(run, ckpt)
    if not isinstance(model, NanochatGPT) or getattr(tokenizer, "kind", None) != "nanochat":
        raise ForgebenchError(
            "an lm-pretrain run has a chat format only as nanochat (model.family = "
            "\"nanochat\" with tokenizer.kind = \"nanochat\", whose special tokens mark the "
            "turns); this run trained another model or tokenizer", path=run.path, where="run",
            hint="fine-tune it with lm-sft to chat, or use forgebench generate")
    info = {"kind": "run", "run": str(run.path), "checkpoint": ckpt.name, "step": ckpt.step,
            "recipe": "lm-pretrain", "format": "nanochat", "tool": "calculator",
            "numerics": "f32", "method": "full", "base": None,
            "template": NanochatFormat.origin, "context": model.config.sequence_len,
            "load_s": time.perf_counter() - started}
    return System(name, model, tokenizer, NanochatFormat(tokenizer), info)


def is_nanochat_chat(manifest: dict) -> bool:
    """Whether a run chats as nanochat: an lm-pretrain run that trained nanochat's GPT with
    nanochat's tokenizer (whose special tokens mark chat turns and calculator calls), or a
    fine-tune (lm-sft) whose base is a checkpoint of such a run. Reads run.json files only."""
    if manifest.get("recipe") != "lm-pretrain":
        base_run = pretrain_base_run(manifest)
        try:
            base = base_run.manifest() if base_run is not None else {}
        except ForgebenchError:
            return False
        return base.get("recipe") == "lm-pretrain" and is_nanochat_chat(base)
    config = manifest.get("config") or {}
    return (config.get("model") or {}).get("family") == "nanochat" \
        and (config.get("tokenizer") or {}).get("kind") == "nanochat"


def pretrain_base_run(manifest: dict):
    """The lm-pretrain run (a RunDir) whose checkpoint a fine-tune started from (its base is
    that checkpoint's weights file, RUN/checkpoints/NAME/model.safetensors), or None for a GGUF
    base or none."""
    from engine.rundir import RunDir

    path = (manifest.get("base_model") or {}).get("path")
    if not path or Path(path).suffix == ".gguf" or len(Path(path).parents) < 3:
        return None
    return RunDir(Path(path).parents[2])


def is_nanochat(system: System) -> bool:
    return system.info.get("format") == "nanochat"


_MESSAGES = schema.TypeAdapter(schema.Messages)


def render(system: System, messages: list[dict],
           tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """The prompt of the next reply; with `tools` ([{"type": "function", "function": …}]),
    in the template's own tool format or the default one (engine/llm/tool_data.py)."""
    import functools

    from engine.llm.chat import encode_prompt
    from engine.llm.tool_data import render_prompt

    messages = _plain(schema.validate(_MESSAGES, messages, root="messages"))
    if is_nanochat(system):                      # its own format, the calculator built in
        return system.template.render(messages)
    renderer = functools.partial(system.template.render, enable_thinking=system.enable_thinking)
    text = render_prompt(renderer, messages, tools) if tools else \
        renderer(messages, add_generation_prompt=True)
    return text, encode_prompt(system.tokenizer, text)


def sampling_settings(request: dict):
    from engine.sampling import SamplingSettings

    given = schema.validate(schema.Settings, request.get("settings") or {}, root="settings")
    return SamplingSettings(**given.model_dump())


def chat(system: System, request: dict, send: Callable[[dict], None],
         should_cancel: Callable[[], bool]) -> dict:
    """Stream one reply: a start line, a line per token, and the done line (returned)."""
    from engine.llm.generate import generate

    options = schema.validate(schema.ChatOptions, {
        key: request[key] for key in schema.ChatOptions.model_fields
        if request.get(key) is not None})
    settings = sampling_settings(request)
    max_tokens, seed = options.max_tokens, options.seed
    if is_nanochat(system):
        return _chat_nanochat(system, options, settings, send, should_cancel)
    text, ids = render(system, options.messages, options.tools)
    send({"event": "start", "system": system.name, "prompt_tokens": len(ids),
          "settings": settings.as_dict(), "seed": seed, "max_tokens": max_tokens})
    started = time.perf_counter()
    first: list[float] = []

    def on_token(event) -> None:
        if not first:
            first.append(time.perf_counter() - started)
        send({"event": "token", **event.as_dict()})

    result = generate(system.model, system.tokenizer, ids, max_new_tokens=max_tokens,
                      settings=settings, seed=seed, on_token=on_token,
                      should_cancel=should_cancel)
    result.timings["first_streamed_token_s"] = first[0] if first else None
    done = {"event": "done", "system": system.name, **result.as_dict(),
            "settings": settings.as_dict(), "seed": seed, "max_tokens": max_tokens}
    send(done)
    return done


def _chat_nanochat(system: System, options, settings, send, should_cancel) -> dict:
    from engine.llm import nanochat_chat

    messages = _plain(options.messages)
    fields = nanochat_chat.chat(
        system.model, system.tokenizer, messages, settings=settings, seed=options.seed,
        max_tokens=options.max_tokens, should_cancel=should_cancel,
        send=lambda line: send({**line, "system": system.name} if line["event"] == "start"
                               else line))
    done = {"event": "done", "system": system.name, **fields, "settings": settings.as_dict(),
            "seed": options.seed, "max_tokens": options.max_tokens}
    send(done)
    return done


@dataclass
class Worker:
    """The request loop: `serve(stdin, stdout)` until end of input or shutdown."""

    out: TextIO
    systems: dict[str, System] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    work: queue.Queue = field(default_factory=queue.Queue)
    current: str | None = None          # the request the engine thread is working on
    stopping: bool = False

    def send(self, line: dict) -> None:
        with self.lock:
            self.out.write(json.dumps(line, ensure_ascii=False) + "\n")
            self.out.flush()

    def serve(self, lines) -> None:
        engine = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        engine.start()
        self.send({"event": "ready", "pid": os.getpid(), "ops": list(OPS)})
        for raw in lines:
            if raw is not None and not raw.strip():
                continue
            rid = None
            try:
                if raw is None:
                    raise schema.RequestError(
                        f"the request line is over the {schema.MAX_REQUEST_BYTES} character "
                        "limit", where="stdin", status=413, hint="send a smaller request")
                parsed = schema.parse_json(raw, where="stdin")
                if isinstance(parsed, dict) and isinstance(parsed.get("request"), (str, int)):
                    rid = parsed["request"]
                request = schema.local_op(parsed).model_dump(exclude_none=True)
            except ForgebenchError as exc:
                self.send({"request": rid, **_error_line(exc)})
                continue
            except Exception as exc:  # noqa: BLE001 - no request may end the worker
                self.send({"request": rid, "event": "error",
                           "message": f"internal error: {type(exc).__name__}"})
                continue
            op = request.get("op")
            if op == "cancel":
                self.cancelled.add(str(request.get("target")))
                self.send({"request": request.get("request"), "event": "ok", "op": "cancel"})
            elif op == "ping":
                self.send({"request": request.get("request"), "event": "ok", "op": "ping"})
            elif op == "shutdown":
                break
            else:
                self.work.put(request)
        # end of input or shutdown: the reply in progress ends at its next token, queued
        # work is dropped, then the process exits
        self.stopping = True
        if self.current is not None:
            self.cancelled.add(self.current)
        self.work.put(None)
        engine.join()

    def _engine_loop(self) -> None:
        while (request := self.work.get()) is not None:
            if self.stopping:
                continue
            rid = request.get("request")
            self.current = str(rid)

            def send(line: dict, rid=rid) -> None:
                self.send({"request": rid, **line})

            try:
                self._handle(request, send)
            except ForgebenchError as exc:
                send(_error_line(exc))
            except Exception as exc:  # noqa: BLE001 - a worker that dies loses every model
                send({"event": "error", "message": f"internal error: {type(exc).__name__}: "
                                                   f"{exc}", "traceback": traceback.format_exc()})

    def _system(self, request: dict) -> System:
        name = request.get("system")
        if name not in self.systems:
            raise ForgebenchError(f"no system {name!r} is loaded", where="system",
                                  hint="send a load request first; loaded: "
                                       + (", ".join(self.systems) or "none"))
        return self.systems[name]

    def _handle(self, request: dict, send: Callable[[dict], None]) -> None:
        op, rid = request.get("op"), str(request.get("request"))
        if op == "load":
            name = str(request.get("system") or "default")
            self.systems.pop(name, None)        # the old one is freed before the new one loads
            system = load_system(name, request, torch_free=True)
            self.systems[name] = system
            send({"event": "loaded", "system": name, "info": system.info})
        elif op == "render":
            text, ids = render(self._system(request), request.get("messages"))
            send({"event": "rendered", "text": text, "tokens": len(ids)})
        elif op == "chat":
            if rid in self.cancelled:            # cancelled while it waited its turn
                send({"event": "done", "text": "", "ids": [], "stop_reason": "cancelled",
                      "system": request.get("system")})
                return
            chat(self._system(request), request, send, lambda: rid in self.cancelled)
        elif op == "unload":
            self.systems.pop(str(request.get("system")), None)
            send({"event": "ok", "op": "unload"})
        else:
            raise ForgebenchError(f"unknown op {op!r}", where="op",
                                  hint="one of " + ", ".join(OPS))


def bounded_lines(stream: TextIO, limit: int = schema.MAX_REQUEST_BYTES):
    """The lines of `stream`, none held longer than `limit` characters: a longer line is read
    to its end in pieces, dropped, and yielded as None (answered with an error)."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith("\n"):
            while (rest := stream.readline(limit)) and not rest.endswith("\n"):
                pass
            yield None
            continue
        yield line


def serve(stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    if hasattr(stdin, "reconfigure"):     # bytes that are not UTF-8 reach the JSON check as
        stdin.reconfigure(errors="replace")   # U+FFFD instead of ending the worker
    Worker(stdout).serve(bounded_lines(stdin))
    return 0
