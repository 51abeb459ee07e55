"""Chat transcripts: the one format the Chat pane and `forgebench chat` save and reopen, and
their export as SFT records into a dataset. No torch, no Qt.

A conversation is `chats/<name>.jsonl` in the workspace, append-only (each line flushed as it
is written, so a crash keeps every finished message):

    {"type": "conversation", "format": 1, "name": "...", "created": 1796000000.0,
     "systems": {"A": {"label": "gemma-3-270m", "load": {...}}, "B": {...}}}
    {"type": "message", "role": "system", "content": "You are a pirate.", "time": ...}
    {"type": "message", "role": "user", "content": "Hello", "time": ...}
    {"type": "message", "role": "assistant", "system": "A", "content": "...", "time": ...,
     "settings": {...}, "seed": 0, "max_tokens": 128, "stop_reason": "eos",
     "new_tokens": 12, "timings": {...}}
    {"type": "message", "role": "tool", "system": "A", "name": "calculator",
     "content": "{\"result\": 42}", "time": ...}

A tool message is the result of a call in the assistant message before it (`forgebench chat
--calculator`); the same system's next assistant message reads it.

A side-by-side turn is one user message followed by one assistant message per system. The
thread a system saw (`thread`) is the system prompt, every user message and that system's own
replies; that is what it is asked next, and what an SFT record of it holds.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from engine.errors import ForgebenchError
from engine.fsutil import append_jsonl, atomic_write_text, read_jsonl, sha256_file, staged_dir

FORMAT = 1
CHATS_DIR = "chats"
ROLES = ("system", "user", "assistant", "tool")
ASSISTANT_FIELDS = ("settings", "seed", "max_tokens", "stop_reason", "new_tokens", "timings",
                    "prompt_tokens", "name")


def chat_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")
    if not name:
        raise ForgebenchError("a conversation needs a name (letters, digits, . _ -)",
                              where="name")
    return name


class Conversation:
    """One transcript file: its header, its messages, appends."""

    def __init__(self, path: str | os.PathLike | None, header: dict, messages: list[dict]):
        self.path = Path(path) if path is not None else None     # None: kept in memory only
        self.header, self.messages = header, messages

    @classmethod
    def unsaved(cls, systems: dict[str, dict], name: str = "chat") -> "Conversation":
        """A conversation held in memory only (`forgebench chat FILE.gguf` outside a workspace
        without --save): the same threads, nothing written."""
        return cls(None, {"type": "conversation", "format": FORMAT, "name": name,
                          "created": time.time(), "systems": systems}, [])

    @classmethod
    def create(cls, path: str | os.PathLike, systems: dict[str, dict],
               name: str | None = None) -> "Conversation":
        path = Path(path)
        if path.exists() and path.stat().st_size:
            raise ForgebenchError("a conversation with this name exists already", path=path,
                                  hint="open it, or choose another name")
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"type": "conversation", "format": FORMAT, "name": name or path.stem,
                  "created": time.time(), "systems": systems}
        append_jsonl(path, header)
        return cls(path, header, [])

    @classmethod
    def new_in(cls, workspace: str | os.PathLike, systems: dict[str, dict],
               stem: str = "chat") -> "Conversation":
        """A fresh file chats/<stem>-<date>-<time>[-n].jsonl in the workspace."""
        folder = Path(workspace) / CHATS_DIR
        base = f"{chat_name(stem)}-{time.strftime('%Y%m%d-%H%M%S')}"
        path, n = folder / f"{base}.jsonl", 1
        while path.exists():
            n += 1
            path = folder / f"{base}-{n}.jsonl"
        return cls.create(path, systems)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Conversation":
        path = Path(path)
        records = read_jsonl(path)
        if not records or records[0].get("type") != "conversation":
            raise ForgebenchError("not a conversation file (no conversation header)", path=path,
                                  where="line 1")
        if records[0].get("format") != FORMAT:
            raise ForgebenchError(f"conversation format {records[0].get('format')!r} is not "
                                  f"{FORMAT}", path=path, where="line 1")
        messages = []
        for number, record in enumerate(records[1:], start=2):
            if record.get("type") != "message" or record.get("role") not in ROLES \
                    or not isinstance(record.get("content"), str):
                raise ForgebenchError("not a message (type, role, content)", path=path,
                                      where=f"line {number}")
            messages.append(record)
        return cls(path, records[0], messages)

    @property
    def systems(self) -> dict[str, dict]:
        return self.header.get("systems", {})

    def add(self, role: str, content: str, system: str | None = None, **details) -> dict:
        """Append one message (durably) and return it."""
        if role not in ROLES:
            raise ForgebenchError(f"role must be one of {ROLES}", where="role")
        if role in ("assistant", "tool") and system not in self.systems:
            raise ForgebenchError(f"no system {system!r} in this conversation", path=self.path,
                                  where="system")
        message = {"type": "message", "role": role, "content": content, "time": time.time()}
        if system is not None:
            message["system"] = system
        message.update({k: v for k, v in details.items() if k in ASSISTANT_FIELDS})
        if self.path is not None:
            append_jsonl(self.path, message)
        self.messages.append(message)
        return message

    def add_reply(self, system: str, done: dict) -> dict:
        """Append a finished reply from the worker's `done` line (its text, stop reason,
        settings, seed, token counts and timings)."""
        return self.add("assistant", done["text"], system=system,
                        **{k: done[k] for k in ASSISTANT_FIELDS if k in done})

    def thread(self, system: str, *, complete_only: bool = False) -> list[dict]:
        """{role, content} messages as `system` saw them: the system prompt(s), every user
        turn and its own replies. `complete_only` drops a turn whose reply was cancelled or
        never came (for training data)."""
        out: list[dict] = []
        pending: dict | None = None
        for m in self.messages:
            if m["role"] == "system":
                out.append({"role": "system", "content": m["content"]})
            elif m["role"] == "user":
                if pending is not None and not complete_only:
                    out.append(pending)
                pending = {"role": "user", "content": m["content"]}
            elif m.get("system") == system:
                pending = _add_own(out, pending, m, complete_only)
        if pending is not None and not complete_only:
            out.append(pending)
        return out

    def sft_record(self, system: str) -> dict | None:
        """The thread of `system` as one {messages} SFT record, or None without a reply. Its
        id names the file, the system and the thread's length, so a conversation that went on
        exports as a new record and the same thread twice as the same one."""
        messages = self.thread(system, complete_only=True)
        if not any(m["role"] == "assistant" for m in messages):
            return None
        return {"id": f"{chat_name(self.path.stem)}-{system}-{len(messages):03d}",
                "messages": messages,
                "source": f"chat {self.path.name}, system {system} "
                          f"({self.systems[system].get('label', system)})"}


def list_conversations(workspace: str | os.PathLike) -> list[Path]:
    folder = Path(workspace) / CHATS_DIR
    return sorted(folder.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True) \
        if folder.is_dir() else []


def export_sft(conversations: list[Conversation], systems: dict[str, list[str]] | None,
               out_dir: str | os.PathLike, name: str | None = None) -> Path:
    """Write the conversations' threads as a `text-sft` dataset (records.jsonl + dataset.json
    with provenance): a new folder, or, when `out_dir` is an existing text-sft dataset, a new
    version of it (`DIR-v2`...) holding its records and these. `systems` picks which systems'
    threads of each conversation (by path); None takes every system. Returns the folder."""
    from engine.data.dataset import load_dataset, save_new_version, write_manifest

    records, sources = [], []
    for conversation in conversations:
        chosen = (systems or {}).get(str(conversation.path)) or list(conversation.systems)
        for system in chosen:
            record = conversation.sft_record(system)
            if record is not None:
                records.append(record)
        sources.append({"conversation": str(conversation.path), "systems": chosen,
                        "sha256": sha256_file(conversation.path)})
    if not records:
        raise ForgebenchError("no finished reply to export (cancelled and empty replies are "
                              "left out)", where="conversation", hint="chat first")
    provenance = {"exported_from": "chat", "conversations": sources, "records": len(records),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out_dir = Path(out_dir)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if (out_dir / "dataset.json").is_file():
        dataset = load_dataset(out_dir)
        if dataset.kind != "text-sft":
            raise ForgebenchError(f"the dataset is {dataset.kind!r}, not text-sft",
                                  path=out_dir, hint="export into a text-sft dataset or a new "
                                                     "folder")
        old = (out_dir / "records.jsonl").read_text(encoding="utf-8")
        if old and not old.endswith("\n"):
            old += "\n"
        present = {json.loads(line).get("id") for line in old.splitlines() if line.strip()}
        fresh = [r for r in records if r["id"] not in present]
        if not fresh:
            raise ForgebenchError("these conversations are in the dataset already",
                                  path=out_dir, hint="chat on, or export another conversation")
        provenance["records"] = len(fresh)
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in fresh)
        version = save_new_version(dataset, {"records.jsonl": (old + lines).encode("utf-8")},
                                   note=f"{len(fresh)} SFT records from chat",
                                   manifest_updates={"provenance": provenance})
        return version.root
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ForgebenchError("the folder exists and is not a dataset", path=out_dir,
                              hint="choose a new dataset name")
    with staged_dir(out_dir) as staging:
        atomic_write_text(staging / "records.jsonl", lines)
        write_manifest(staging, "text-sft", name or out_dir.name, provenance=provenance)
    return out_dir


def _add_own(out: list[dict], pending: dict | None, m: dict,
             complete_only: bool) -> dict | None:
    """Add one of the system's own messages to a thread (`Conversation.thread`): a tool's
    result, or a reply with the user turn it answers (dropped with it under `complete_only`
    when cancelled or empty), or the reply that reads a tool's result. Returns the user turn
    still waiting for a reply (None once answered)."""
    if m["role"] == "tool":             # a tool's result for this system's call
        out.append({"role": "tool", "name": m.get("name"), "content": m["content"]})
        return pending
    if pending is not None:
        if not (complete_only and (m.get("stop_reason") == "cancelled" or not m["content"])):
            out += [pending, {"role": "assistant", "content": m["content"]}]
        return None
    if out and out[-1]["role"] == "tool":          # the reply that reads the result
        out.append({"role": "assistant", "content": m["content"]})
    return None
