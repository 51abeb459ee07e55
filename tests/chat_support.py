"""Shared set-up of the model library and chat tests: a workspace whose library holds a tiny
Gemma 3 GGUF, and a tiny lm-sft LoRA run trained by the engine over that same file (so the
run's base is found in the library by its SHA-256). Built once per test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lm_sft_support import tiny_base, write_config

from app.viewmodels.workspace import Workspace
from engine import model_library

REPO = Path(__file__).resolve().parents[1]
_BUILT: dict[str, Path] = {}


def forgebench(*args: str, timeout: int = 600, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def tiny_model(folder: Path, name: str = "tiny-gemma3.gguf", **kwargs) -> Path:
    return tiny_base(folder, name, **kwargs)


def chat_workspace(tmp_path_factory) -> Path:
    """workspace/ with models/tiny (the library's copy) and runs/sft (2 LoRA steps over the
    same file, checkpoint step-000002)."""
    if "ws" not in _BUILT:
        root = tmp_path_factory.mktemp("chat")
        workspace = Workspace.create(root / "ws")
        base = tiny_model(root / "src")
        model_library.add_model(workspace.root, base, name="tiny")
        config = write_config(root, base, steps=2, dropout=0.0, targets='["q", "v"]')
        done = forgebench("run", str(config), "--out", str(workspace.runs_dir / "sft"),
                          "--threads", "1")
        assert done.returncode == 0, done.stderr
        _BUILT["ws"] = workspace.root
    return _BUILT["ws"]


class Worker:
    """A `forgebench serve-local` process driven line by line (what the Chat pane does)."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve-local"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        self.ready = self.read()

    def send(self, **request) -> None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def read(self) -> dict:
        line = self.process.stdout.readline()
        assert line, self.process.stderr.read()
        return json.loads(line)

    def until(self, request: str, event: str) -> list[dict]:
        """Every line of `request` up to and including its `event` (or an error)."""
        lines = []
        while True:
            line = self.read()
            if line.get("request") == request:
                lines.append(line)
                if line["event"] in (event, "error"):
                    return lines

    def close(self) -> int:
        self.send(op="shutdown")
        self.process.stdin.close()
        code = self.process.wait(60)
        self.process.stdout.close()
        self.process.stderr.close()
        return code


def chat_answer(run: Path, workspace: Path, prompt: str, max_tokens: int) -> tuple[dict, str]:
    """(the worker's load info, its greedy reply) for a run's latest checkpoint, loaded as
    the Chat pane loads it: the base looked up in `workspace`'s library by its SHA-256."""
    worker = Worker()
    try:
        worker.send(request="1", op="load", system="T", run=str(run), workspace=str(workspace))
        loaded = worker.until("1", "loaded")[-1]
        assert loaded["event"] == "loaded", loaded
        worker.send(request="2", op="chat", system="T", max_tokens=max_tokens,
                    messages=[{"role": "user", "content": prompt}])
        done = worker.until("2", "done")[-1]
        assert done["event"] == "done", done
        return loaded["info"], done["text"]
    finally:
        worker.close()


def generated_answer(run: Path, prompt: str, max_tokens: int) -> str:
    """`forgebench generate RUN`'s greedy answer: the recipe's own decode loop."""
    done = forgebench("generate", str(run), "--prompt", prompt, "--max-tokens",
                      str(max_tokens), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["text"]
