"""`forgebench serve` run as a real subprocess on a loopback port, and the small models and
workspace the HTTP tests serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


class Served:
    """A running `forgebench serve ARGS` on 127.0.0.1 and an OS-chosen port; `url` is its
    /v1 base, `lines` what it printed (the request log)."""

    def __init__(self, *args: str, timeout: float = 120):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", "0",
             "--threads", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                      "OMP_NUM_THREADS": "1"})
        self.lines: list[dict] = []
        self._ready = threading.Event()
        self.listening: dict | None = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or self.listening is None:
            self.process.kill()
            raise AssertionError(f"the server did not start: {self.process.stderr.read()}")
        self.url = self.listening["url"]

    def _read(self) -> None:
        for raw in self.process.stdout:
            line = json.loads(raw)
            self.lines.append(line)
            if line["event"] == "listening":
                self.listening = line
                self._ready.set()
        self._ready.set()

    def requests(self) -> list[dict]:
        return [line for line in self.lines if line["event"] == "request"]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self.process.stderr.close()
