"""The Models pane's Serve switch, without Qt: the `forgebench serve` command line it starts,
what the server's JSON lines say (its URL, key and models, then one line per request), the
request log as rows with tokens/s, and the copyable `curl` and Python snippets.

The server is the engine's (engine/commands/serve.py); this only reads its stdout, so the
figures shown (tokens, tokens/s, status) are the server's own.
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.server import is_loopback

LOG_ROWS = 500          # the newest requests kept in the log


@dataclass
class ServeSession:
    root: Path
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    url: str | None = None
    models: list[str] = field(default_factory=list)
    log: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def args(self) -> list[str]:
        """`forgebench serve` arguments. Off loopback a key is generated when none is set
        (the engine refuses to expose models without one)."""
        if not is_loopback(self.host) and not self.api_key:
            self.api_key = secrets.token_urlsafe(24)
        args = ["serve", "--workspace", str(self.root), "--host", self.host, "--port",
                str(self.port)]
        if self.api_key:
            args += ["--api-key", self.api_key]
        return args

    def reset(self) -> None:
        self.url, self.models = None, []

    def feed(self, line: str) -> dict | None:
        """One stdout line of the server; the request row it added, if any."""
        try:
            event = json.loads(line)
        except ValueError:
            return None
        if not isinstance(event, dict):
            return None
        if event.get("event") == "listening":
            self.url, self.models = event["url"], list(event.get("models") or [])
            self.api_key = event.get("api_key")
        elif event.get("event") == "request":
            self.log.append(event)
            del self.log[:-LOG_ROWS]
            return event
        return None

    @property
    def running(self) -> bool:
        return self.url is not None

    def key_text(self) -> str:
        return self.api_key or "none needed (loopback only)"

    # -- what the pane shows ------------------------------------------------------------
    @staticmethod
    def row(entry: dict) -> str:
        """One request as a log line: time, model, endpoint, status, tokens and tokens/s."""
        stamp = time.strftime("%H:%M:%S", time.localtime(entry.get("time", 0)))
        parts = [stamp, entry.get("model") or "-",
                 (entry.get("endpoint") or "").removeprefix("/v1/"), str(entry.get("status"))]
        if entry.get("error"):
            parts.append(entry["error"][:120])
        else:
            parts.append(f"{entry.get('prompt_tokens', 0)} + "
                         f"{entry.get('completion_tokens', 0)} tokens")
            if entry.get("tokens_per_s"):
                parts.append(f"{entry['tokens_per_s']:.1f} tok/s")
            if entry.get("finish_reason"):
                parts.append(entry["finish_reason"])
        return "  ".join(parts)

    def curl_snippet(self, model: str | None = None) -> str:
        model = model or (self.models[0] if self.models else "MODEL")
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                           "max_tokens": 64})
        lines = [f"curl {self.url or 'http://127.0.0.1:8080/v1'}/chat/completions \\",
                 "  -H 'Content-Type: application/json' \\"]
        if self.api_key:
            lines.append(f"  -H 'Authorization: Bearer {self.api_key}' \\")
        lines.append(f"  -d {shlex.quote(body)}")
        return "\n".join(lines)

    def python_snippet(self, model: str | None = None) -> str:
        model = model or (self.models[0] if self.models else "MODEL")
        return "\n".join([
            "from openai import OpenAI",
            "",
            f"client = OpenAI(base_url={self.url or 'http://127.0.0.1:8080/v1'!r}, "
            f"api_key={self.api_key or 'unused'!r})",
            "reply = client.chat.completions.create(",
            f"    model={model!r},",
            "    messages=[{\"role\": \"user\", \"content\": \"Hello!\"}],",
            "    max_tokens=64,",
            ")",
            "print(reply.choices[0].message.content)",
        ])
