"""The Chat pane's state: what can be chatted with, the conversation, and the replies as they
stream from the engine's `forgebench serve-local` worker. No Qt: the view writes `ChatSession`'s
request lines to the worker's stdin and feeds it the worker's stdout lines.

- `sources(workspace)`: library models, checkpoints of lm-sft, lm-dpo and lm-es runs (base +
  adapter, or full weights), checkpoints of lm-pretrain runs of nanochat's GPT with nanochat's
  tokenizer and of the lm-sft runs that fine-tuned one (they chat in nanochat's format, its
  calculator run inside the reply, sampled by default as nanochat samples) and exported
  GGUF files, each with the `load` request that loads it, or the reason it cannot be chatted
  with (a run whose base is not in the library, an unusable file).
- `reply_segments(text)`: a reply as the pane shows it: text, and each calculator call of a
  nanochat model (its expression and the result forced after it) as one segment of its own.
- `ChatSession`: one conversation (engine/conversations.py, saved as JSONL under chats/) with
  one or two systems. `send(prompt)` returns the request lines; `feed(line)` folds a worker
  line into the state and says what changed; finished replies are appended to the transcript.
- `worker_side`: which side's worker process a request line is for (one per side, so the two
  columns stream side by side).
- `send_pair_to_ab`: the last prompt's two answers as a new blind A/B session in ratings/,
  the store the A/B pane reads (engine/ratings.py through app/viewmodels/ab.py).
- `export_sft`: the conversation as SFT records into a new dataset (version).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.viewmodels.ab import ABSession
from engine import model_library
from engine.conversations import Conversation, export_sft, list_conversations
from engine.errors import ForgebenchError
from engine.nanochat_tokenizer import assistant_parts
from engine.rundir import RunDir
from engine.sampling import CHAT_DEFAULTS, NANOCHAT_CHAT_DEFAULTS
from engine.serve_local import CHAT_RECIPES, is_nanochat_chat, pretrain_base_run

SIDES = ("A", "B")
DEFAULT_SETTINGS = CHAT_DEFAULTS.as_dict()   # the engine's one chat default (`forgebench chat`'s)
# a nanochat model's default: nanochat's own sampler, which has no repetition penalty and no DRY
# (with either, the engine's sampler would replace nanochat's: engine/llm/nanochat_chat.py)
NANOCHAT_SETTINGS = NANOCHAT_CHAT_DEFAULTS.as_dict()


@dataclass(frozen=True)
class Source:
    """Something to chat with: its label, the worker's load request, or why it cannot be."""

    label: str
    kind: str                     # "library", "run", "export"
    load: dict | None
    reason: str | None = None
    format: str | None = None     # "nanochat": chats in nanochat's format, calculator inside

    @property
    def usable(self) -> bool:
        return self.load is not None


def sources(root: Path) -> list[Source]:
    """Every chat source of the workspace, usable or not (the reason says why not)."""
    root = Path(root)
    found = []
    for entry in model_library.entries(root):
        path = model_library.entry_path(root, entry)
        reason = None if path.is_file() else f"the file is missing ({path})"
        found.append(Source(f"model: {entry['name']}", "library",
                            None if reason else {"library": entry["name"],
                                                 "workspace": str(root)}, reason))
    for run_dir in sorted(p for p in (root / "runs").glob("*") if (p / "run.json").is_file()):
        run = RunDir(run_dir)
        try:
            manifest = run.manifest()
        except ForgebenchError:
            continue
        if manifest.get("recipe") == "lm-pretrain":
            found += _nanochat_sources(root, run, manifest)
            continue
        if manifest.get("recipe") not in CHAT_RECIPES:
            continue
        base = manifest.get("base_model") or {}
        # a GGUF base is read from the library; an lm-pretrain run's checkpoint where it is
        in_library = pretrain_base_run(manifest) is not None or \
            model_library.find_by_sha256(root, base.get("sha256", ""))
        reason = None if in_library else (
            f"its base ({Path(base.get('path', '?')).name}) is not in the model library: "
            "add it in the Models pane")
        nanochat = is_nanochat_chat(manifest)
        for checkpoint in run.checkpoints():
            found.append(Source(f"run: {run_dir.name}/{checkpoint.name}"
                                + (" (nanochat)" if nanochat else ""), "run",
                                None if reason else {"run": str(run_dir),
                                                     "checkpoint": checkpoint.name,
                                                     "workspace": str(root)}, reason,
                                "nanochat" if nanochat else None))
    for gguf in sorted((root / "exports").glob("*/model.gguf")):
        found.append(Source(f"export: {gguf.parent.name}", "export", {"model": str(gguf)}))
    return found


def default_settings(sources: list[Source | None]) -> dict:
    """The sampling settings a chat starts from: nanochat's (repetition penalty 1 and DRY off, so
    its own sampler runs) when every chosen source is a nanochat model, the engine's chat
    default (penalty 1.1, DRY 0.8) otherwise."""
    chosen = [s for s in sources if s is not None]
    if chosen and all(s.format == "nanochat" for s in chosen):
        return dict(NANOCHAT_SETTINGS)
    return dict(DEFAULT_SETTINGS)


def _nanochat_sources(root: Path, run: RunDir, manifest: dict) -> list[Source]:
    if not is_nanochat_chat(manifest):
        return []
    return [Source(f"run: {run.path.name}/{checkpoint.name} (nanochat)", "run",
                   {"run": str(run.path), "checkpoint": checkpoint.name,
                    "workspace": str(root)}, format="nanochat")
            for checkpoint in run.checkpoints()]


def reply_segments(text: str) -> list[dict]:
    """An assistant reply's text as the pane shows it: {"kind": "text", "text"} runs and
    {"kind": "tool", "expr", "result"} calls. A nanochat model's call is its
    <|python_start|> expr <|python_end|> and the result forced after it between
    <|output_start|> and <|output_end|>; result None: none came (the calculator refused the
    expression, or the reply is still streaming it)."""
    content = assistant_parts(text)
    if isinstance(content, str):
        return [{"kind": "text", "text": content}] if content else []
    segments: list[dict] = []
    for part in content:
        if part["type"] == "text":
            segments.append({"kind": "text", "text": part["text"]})
        elif part["type"] == "python":
            segments.append({"kind": "tool", "expr": part["text"], "result": None})
        elif segments and segments[-1]["kind"] == "tool" and segments[-1]["result"] is None:
            segments[-1]["result"] = part["text"]
        else:                       # an output without its call (an edited transcript)
            segments.append({"kind": "tool", "expr": None, "result": part["text"]})
    return segments


def saved_conversations(root: Path) -> list[Path]:
    """The workspace's saved conversations (chats/*.jsonl), newest first."""
    return list_conversations(root)


@dataclass
class Reply:
    """One system's answer to one prompt, as it streams."""

    system: str
    request: str
    text: str = ""
    tokens: int = 0
    prompt_tokens: int | None = None
    finished: bool = False
    stop_reason: str | None = None
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    done: dict | None = None
    tool_calls: list = field(default_factory=list)    # a nanochat model's calculator calls


@dataclass
class ChatSession:
    """A conversation with one system ("A") or two side by side ("A" and "B")."""

    root: Path
    conversation: Conversation | None = None
    labels: dict[str, str] = field(default_factory=dict)
    loads: dict[str, dict] = field(default_factory=dict)
    chosen: dict[str, Source] = field(default_factory=dict)   # side -> its source
    loaded: dict[str, dict] = field(default_factory=dict)     # system -> worker info
    load_errors: dict[str, str] = field(default_factory=dict)
    replies: dict[str, Reply] = field(default_factory=dict)   # request -> reply
    rendered: dict[str, tuple[str, int]] = field(default_factory=dict)
    pending_renders: dict[str, str] = field(default_factory=dict)   # request -> system
    pending_loads: dict[str, str] = field(default_factory=dict)     # request -> system
    system_prompt: str = ""
    numerics: str = "llamacpp"     # GGUF systems: llama.cpp's arithmetic, or f32 as runs train
    settings: dict = field(default_factory=lambda: dict(DEFAULT_SETTINGS))
    seed: int = 0
    max_tokens: int = 128
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    # -- systems --------------------------------------------------------------------------
    def _request_id(self) -> str:
        return f"r{next(self._ids)}"

    def choose(self, side: str, source: Source | None) -> list[str]:
        """Pick (or clear) a side's source; returns the lines that load it. A new choice
        starts a new conversation. Settings still at the defaults of the sources chosen before
        move to the new choice's (`default_settings`); settings the user changed stay."""
        if source is not None and not source.usable:
            raise ForgebenchError(f"{source.label} cannot be chatted with: {source.reason}",
                                  where="source")
        untouched = self.settings == default_settings(list(self.chosen.values()))
        self.chosen.pop(side, None)
        if source is not None:
            self.chosen[side] = source
        if untouched:
            self.settings = default_settings(list(self.chosen.values()))
        self.conversation = None
        self.loaded.pop(side, None)
        self.load_errors.pop(side, None)
        if source is None:
            self.labels.pop(side, None)
            self.loads.pop(side, None)
            return [self.line({"op": "unload", "system": side})]
        load = dict(source.load)
        if source.kind != "run":
            load["numerics"] = self.numerics
        self.labels[side], self.loads[side] = source.label, load
        return [self.load_line(side)]

    def load_line(self, side: str) -> str:
        for stale in [rid for rid, s in self.pending_loads.items() if s == side]:
            del self.pending_loads[stale]     # an earlier choice's reply is ignored
        line = self.line({"op": "load", "system": side, **self.loads[side]})
        self.pending_loads[json.loads(line)["request"]] = side
        return line

    @property
    def sides(self) -> list[str]:
        return [s for s in SIDES if s in self.loads]

    def line(self, request: dict) -> str:
        request = {"request": self._request_id(), **request}
        return json.dumps(request, ensure_ascii=False) + "\n"

    # -- the conversation ---------------------------------------------------------------
    def start_conversation(self) -> Conversation:
        if not self.sides:
            raise ForgebenchError("choose a model to chat with first", where="source")
        systems = {s: {"label": self.labels[s], "load": self.loads[s],
                       "info": self.loaded.get(s, {})} for s in self.sides}
        self.conversation = Conversation.new_in(self.root, systems)
        if self.system_prompt.strip():
            self.conversation.add("system", self.system_prompt.strip())
        return self.conversation

    def open(self, path: Path) -> Conversation:
        """Reopen a saved conversation: its systems are chosen again, its messages shown."""
        conversation = Conversation.open(path)
        self.labels = {s: v.get("label", s) for s, v in conversation.systems.items()}
        self.loads = {s: v["load"] for s, v in conversation.systems.items()}
        self.loaded, self.load_errors = {}, {}
        self.conversation = conversation
        prompts = [m for m in conversation.messages if m["role"] == "system"]
        self.system_prompt = prompts[-1]["content"] if prompts else ""
        return conversation

    def reload_lines(self) -> list[str]:
        return [self.load_line(s) for s in self.sides]

    def busy(self) -> bool:
        return any(not r.finished for r in self.replies.values())

    def send(self, prompt: str) -> list[str]:
        """The user's turn: recorded, then one chat request per system."""
        prompt = prompt.strip()
        if not prompt:
            raise ForgebenchError("type a message first", where="prompt")
        missing = [s for s in self.sides if s not in self.loaded]
        if missing:
            raise ForgebenchError("still loading " + ", ".join(self.labels[s] for s in missing)
                                  + (f": {self.load_errors[missing[0]]}"
                                     if missing[0] in self.load_errors else ""),
                                  where="source")
        if self.busy():
            raise ForgebenchError("a reply is still streaming", where="prompt",
                                  hint="wait, or press Stop")
        conversation = self.conversation or self.start_conversation()
        conversation.add("user", prompt)
        lines = []
        for side in self.sides:
            line = self.line({"op": "chat", "system": side,
                              "messages": alternating(conversation.thread(side)),
                              "settings": dict(self.settings), "seed": self.seed,
                              "max_tokens": self.max_tokens})
            rid = json.loads(line)["request"]
            self.replies[rid] = Reply(side, rid)
            lines.append(line)
        return lines

    def stop(self) -> list[str]:
        return [self.line({"op": "cancel", "target": r.request})
                for r in self.replies.values() if not r.finished]

    def render_lines(self, draft: str = "") -> list[str]:
        """Ask the worker for the rendered template and token count of the next prompt: the
        side's thread, a reply still streaming as far as it came (the next prompt follows
        it), then the draft as the next user turn."""
        lines = []
        for side in self.sides:
            if side not in self.loaded:
                continue
            line = self.line({"op": "render", "system": side, "messages": alternating(
                self._thread_so_far(side) + [{"role": "user", "content": draft or "…"}])})
            self.pending_renders[json.loads(line)["request"]] = side
            lines.append(line)
        return lines

    def _thread_so_far(self, side: str) -> list[dict]:
        """The side's thread with the reply it is streaming now as the last assistant turn
        (the conversation gets that turn only when the reply is done)."""
        if self.conversation is None:
            prompt = self.system_prompt.strip()
            return [{"role": "system", "content": prompt}] if prompt else []
        thread = self.conversation.thread(side)
        live = [r for r in self.replies.values() if r.system == side and not r.finished]
        if live and thread and thread[-1]["role"] == "user":
            thread.append({"role": "assistant", "content": live[-1].text})
        return thread

    # -- the worker's lines -------------------------------------------------------------
    def feed(self, raw: str) -> tuple[str, str | None]:
        """Fold one worker line in; (what happened, which side) for the view to refresh:
        "ready", "loaded", "load_error", "token", "done", "error", "rendered", "other"."""
        line = json.loads(raw)
        event, rid = line.get("event"), line.get("request")
        reply = self.replies.get(rid)
        if event == "ready":
            return "ready", None
        if rid in self.pending_loads:
            return self._feed_load(self.pending_loads.pop(rid), event, line)
        if event == "rendered" or (event == "error" and rid in self.pending_renders):
            side = self.pending_renders.pop(rid)
            self.rendered[side] = (line["text"], line["tokens"]) if event == "rendered" \
                else (f"the template cannot render: {error_text(line)}", 0)
            return "rendered", side
        if reply is None:
            return "other", None
        return self._feed_reply(reply, event, line), reply.system

    def _feed_load(self, side: str, event: str, line: dict) -> tuple[str, str]:
        if self.loads.get(side) is None:
            return "other", side                  # a load the user replaced since
        if event == "loaded":
            self.loaded[side] = line["info"]
            self.load_errors.pop(side, None)
            return "loaded", side
        self.load_errors[side] = error_text(line)
        return "load_error", side

    def _feed_reply(self, reply: Reply, event: str, line: dict) -> str:
        if event == "start":
            reply.prompt_tokens = line["prompt_tokens"]
        elif event == "token":
            if reply.first_token_s is None:
                reply.first_token_s = time.monotonic() - reply.started
            reply.tokens += 1
            reply.text += line["text"]
            return "token"
        elif event == "tool":          # a nanochat calculator call closed: shown from the text
            reply.tool_calls.append({"expr": line.get("expr"), "result": line.get("result")})
            return "token"
        elif event == "done":
            reply.text, reply.finished, reply.done = line["text"], True, line
            reply.stop_reason = line["stop_reason"]
            if self.conversation is not None:
                self.conversation.add_reply(reply.system, line)
            return "done"
        elif event == "error":
            reply.finished, reply.error = True, error_text(line)
            return "error"
        return "other"

    # -- what the pane shows -------------------------------------------------------------
    def transcript(self, side: str) -> list[dict]:
        """The messages of one column, a streaming reply included at its end."""
        shown = [] if self.conversation is None else [
            m for m in self.conversation.messages
            if m["role"] not in ("assistant", "tool") or m.get("system") == side]
        live = [r for r in self.replies.values() if r.system == side and not r.finished]
        if live:
            shown.append({"role": "assistant", "system": side, "content": live[-1].text,
                          "streaming": True})
        mine = [r for r in self.replies.values() if r.system == side]
        if mine and mine[-1].error:
            shown.append({"role": "error", "content": mine[-1].error})
        return shown

    def last_pair(self) -> tuple[str, dict[str, dict]] | None:
        """The last prompt and each side's finished answer to it, when both answered."""
        if self.conversation is None or len(self.sides) != 2:
            return None
        messages = self.conversation.messages
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            return None
        answers = {m["system"]: m for m in messages[users[-1]:] if m["role"] == "assistant"}
        if set(answers) != set(SIDES) or any(a.get("stop_reason") == "cancelled"
                                             for a in answers.values()):
            return None
        return messages[users[-1]]["content"], answers

    def send_pair_to_ab(self, name: str | None = None, rater: str = "me") -> Path:
        """Start a blind A/B session in ratings/ with the last prompt and its two answers."""
        pair = self.last_pair()
        if pair is None:
            raise ForgebenchError("a pair needs one prompt answered in full by both systems",
                                  where="side by side", hint="choose two systems and send "
                                                             "a prompt")
        prompt, answers = pair
        systems = {}
        for side, answer in answers.items():
            load = self.loads[side]
            label = self.labels[side].split(": ", 1)[-1]
            settings = {k: answer.get(k) for k in ("settings", "seed", "max_tokens")}
            systems[label if label not in systems else f"{label} ({side})"] = {
                "run": load.get("run") or load.get("model") or load.get("library"),
                "checkpoint": load.get("checkpoint", "model"), "kind": "text",
                "settings": settings, "outputs": {prompt: answer["content"]},
                "numerics": self.loaded.get(side, {}).get("numerics"),
                "chat": str(self.conversation.path)}
        session = ABSession.create(self.root / "ratings",
                                   name or f"chat-{time.strftime('%Y%m%d-%H%M%S')}", systems,
                                   rater, items=[prompt])
        return session.store.path

    def export_sft(self, dataset: str) -> Path:
        if self.conversation is None:
            raise ForgebenchError("no conversation to export", where="conversation",
                                  hint="chat first, or reopen a saved conversation")
        return export_sft([self.conversation], None, self.root / "datasets" / dataset,
                          name=dataset)


def worker_side(session: ChatSession, line: str) -> str:
    """Which side's worker a request line goes to: each side has its own `serve-local`
    process, so one column streams while the other does (a worker runs its requests one at
    a time). A cancel goes where the reply it cancels streams."""
    request = json.loads(line)
    if request.get("system") in SIDES:
        return request["system"]
    reply = session.replies.get(request.get("target", ""))
    return reply.system if reply is not None else SIDES[0]


def alternating(messages: list[dict]) -> list[dict]:
    """`messages` without the user turns that another user turn follows: their reply never
    came (the worker reported an error), and templates such as Gemma's refuse two user turns
    in a row, so one failed reply would otherwise make every later prompt unrenderable."""
    return [m for m, after in zip(messages, messages[1:] + [None])
            if not (m["role"] == "user" and after is not None and after["role"] == "user")]


def error_text(line: dict) -> str:
    text = line.get("message") or "error"
    if line.get("path"):
        text = f"{line['path']}" + (f": {line['where']}" if line.get("where") else "") \
               + f": {text}"
    if line.get("hint"):
        text += f" (hint: {line['hint']})"
    return text
