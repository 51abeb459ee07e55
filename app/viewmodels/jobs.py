"""Starting, queueing, stopping and resuming `forgebench` jobs, as commands the Qt layer runs.

Jobs are started detached with their output in `runs/.launch/<run>.log`, so they outlive the
window; the app follows them only through their run-directory files.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, read_json
from engine.rundir import RunDir

from app.viewmodels.forms import RecipeForm
from app.viewmodels.workspace import Workspace

QUEUE_FILE = "queue.json"


def forgebench_argv() -> list[str]:
    """How to call the engine: the venv's `forgebench` script, else `python -m engine`."""
    script = Path(sys.executable).with_name("forgebench")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("forgebench")
    return [found] if found else [sys.executable, "-m", "engine"]


@dataclass(frozen=True)
class PendingRun:
    """A run the user asked for: its written config and the run folder it will create."""

    config: Path
    out: Path
    threads: int | None = None

    def argv(self) -> list[str]:
        argv = forgebench_argv() + ["run", str(self.config), "--out", str(self.out)]
        if self.threads:
            argv += ["--threads", str(self.threads)]
        return argv

    @property
    def log(self) -> Path:
        return self.config.with_suffix(".log")


def prepare_run(workspace: Workspace, form: RecipeForm, stem: str | None = None,
                threads: int | None = None) -> PendingRun:
    """Write the form's config beside the launch log; the run folder is created by the job."""
    out = workspace.new_run_dir(stem or form.recipe)
    workspace.launch_dir.mkdir(parents=True, exist_ok=True)
    config = form.write_toml(workspace.launch_dir / f"{out.name}.toml")
    return PendingRun(config, out, threads)


def resume_argv(run_dir: Path, steps: int | None = None, threads: int | None = None) -> list[str]:
    argv = forgebench_argv() + ["resume", str(run_dir)]
    if steps:
        argv += ["--steps", str(steps)]
    if threads:
        argv += ["--threads", str(threads)]
    return argv


def resume_log(workspace: Workspace, run_dir: Path) -> Path:
    workspace.launch_dir.mkdir(parents=True, exist_ok=True)
    return workspace.launch_dir / f"{run_dir.name}.log"


def launch_failure(pending: PendingRun) -> str | None:
    """Why a started job never created its run folder (a refused config), from its log."""
    if RunDir(pending.out).exists() or not pending.log.is_file():
        return None
    text = pending.log.read_text(encoding="utf-8", errors="replace").strip()
    return text or None


class JobQueue:
    """Runs waiting for the one running job to finish, persisted in runs/.launch/queue.json."""

    def __init__(self, workspace: Workspace):
        self.path = workspace.launch_dir / QUEUE_FILE
        try:
            items = read_json(self.path)
        except ForgebenchError:
            items = []
        self.items = [PendingRun(Path(i["config"]), Path(i["out"]), i.get("threads"))
                      for i in items if isinstance(i, dict) and "config" in i and "out" in i]

    def _save(self) -> None:
        atomic_write_json(self.path, [{"config": str(p.config), "out": str(p.out),
                                       "threads": p.threads} for p in self.items])

    def push(self, pending: PendingRun) -> None:
        self.items.append(pending)
        self._save()

    def remove(self, out: Path) -> None:
        self.items = [p for p in self.items if p.out != out]
        self._save()

    def pop_ready(self, any_active: bool) -> PendingRun | None:
        """The next run to start, when nothing is running."""
        if any_active or not self.items:
            return None
        pending = self.items.pop(0)
        self._save()
        return pending

