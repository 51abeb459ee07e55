"""Shared set-up for the samples / blind A/B / export-wizard tests: one workspace per test
session holding real tiny image-generate, audio-generate and lm-pretrain runs trained by the
engine (built once, on first use, because training costs tens of seconds on 2 cores)."""

from __future__ import annotations

import time
from pathlib import Path

from lm_pretrain_support import make_corpus
from lm_pretrain_support import write_config as write_lm_config
from media_support import forgebench, make_sfx, make_shapes, write_config

from app.viewmodels.workspace import Workspace

_BUILT: dict[str, Path] = {}


def media_workspace(tmp_path_factory) -> Workspace:
    """A workspace with `runs/image` and `runs/audio`, each with checkpoints step-2 and step-4."""
    if "media" not in _BUILT:
        root = tmp_path_factory.mktemp("part2")
        workspace = Workspace.create(root / "ws")
        data = root / "data"
        for recipe, name, dataset in (("image-generate", "image", make_shapes(data, 24, 16)),
                                      ("audio-generate", "audio", make_sfx(data, 8))):
            config = write_config(root / f"{name}.toml", recipe, dataset, steps=4,
                                  save_every=2)
            forgebench("run", str(config), "--out", str(workspace.runs_dir / name))
        _BUILT["media"] = workspace.root
    return Workspace.open(_BUILT["media"])


def lm_run(tmp_path_factory) -> Path:
    """A tiny lm-pretrain run in its own workspace with checkpoints at steps 10, 20 and 30."""
    if "lm" not in _BUILT:
        root = tmp_path_factory.mktemp("part2-lm")
        workspace = Workspace.create(root / "ws")
        config = write_lm_config(root / "lm.toml", make_corpus(root), steps=30, save_every=10)
        config.write_text(config.read_text().replace("keep_last = 2", "keep_last = 3"))
        forgebench("run", str(config), "--out", str(workspace.runs_dir / "lm"))
        _BUILT["lm"] = workspace.runs_dir / "lm"
    return _BUILT["lm"]


def wait_for(qtbot, runner, timeout_s: float = 300) -> None:
    """Wait until a JobRunner's process has finished (and its `finished` signal was handled)."""
    deadline = time.monotonic() + timeout_s
    qtbot.waitUntil(lambda: not runner.running or time.monotonic() > deadline,
                    timeout=int(timeout_s * 1000))
    assert not runner.running, "the job did not finish"


def go_and_wait(qtbot, pane, step: int, timeout_s: int = 120) -> None:
    """Show an export wizard step and wait until its worker-thread preparation is done."""
    pane.go(step)
    qtbot.waitUntil(lambda: not pane.call.running, timeout=timeout_s * 1000)
