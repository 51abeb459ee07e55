"""Starting, queueing, stopping and resuming `forgebench` jobs, as commands the Qt layer runs,
and the progress of every background job (runs, exports, sampling, generation) as the jobs
panel shows it.

Reading order: `forgebench_argv` / `engine_environment` (how every engine process is started;
`app/views/engine_process.py` is the one Qt launcher built on them), `PendingRun` and the queue,
then `BackgroundJob` and the progress texts.

Training jobs are started detached with their output in `runs/.launch/<run>.log`, so they
outlive the window; the app follows them only through their run-directory files.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app.viewmodels.workspace import REPO_ROOT, Workspace
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, read_json
from engine.rundir import RunDir

if TYPE_CHECKING:     # an annotation: the window's jobs panel imports this before any schema
    from app.viewmodels.forms import RecipeForm

QUEUE_FILE = "queue.json"
PROGRESS = re.compile(r"(\d+)/(\d+)")


def forgebench_argv() -> list[str]:
    """How to call the engine: the venv's `forgebench` script, else `python -m engine`."""
    script = Path(sys.executable).with_name("forgebench")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("forgebench")
    return [found] if found else [sys.executable, "-m", "engine"]


def engine_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of an engine process: the caller's, with this checkout first on
    PYTHONPATH (so a source checkout runs its own engine) and the user's path kept after it."""
    env = dict(environ)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *kept])
    return env


@dataclass(frozen=True)
class PendingRun:
    """A run the user asked for: its written config and the run folder it will create."""

    config: Path
    out: Path
    threads: int | None = None
    processes: int = 1                # > 1: `--nproc N`, one job of N ranks under torchrun

    def argv(self) -> list[str]:
        argv = forgebench_argv() + ["run", str(self.config), "--out", str(self.out)]
        if self.threads:
            argv += ["--threads", str(self.threads)]
        if self.processes > 1:
            argv += ["--nproc", str(self.processes)]
        return argv

    @property
    def log(self) -> Path:
        return self.config.with_suffix(".log")


def prepare_run(workspace: Workspace, form: RecipeForm, stem: str | None = None,
                threads: int | None = None, processes: int = 1,
                out: Path | None = None) -> PendingRun:
    """Write the form's config beside the launch log; the run folder (`out`, else a fresh
    name) is created by the job."""
    out = out or workspace.new_run_dir(stem or form.recipe)
    workspace.launch_dir.mkdir(parents=True, exist_ok=True)
    config = form.write_toml(workspace.launch_dir / f"{out.name}.toml")
    return PendingRun(config, out, threads, processes)


def resume_argv(run_dir: Path, steps: int | None = None, threads: int | None = None) -> list[str]:
    """Resume with the process count the run last trained with (a multi-process run resumes
    like any other)."""
    argv = forgebench_argv() + ["resume", str(run_dir)]
    if steps:
        argv += ["--steps", str(steps)]
    if threads:
        argv += ["--threads", str(threads)]
    processes = recorded_processes(run_dir)
    if processes > 1:
        argv += ["--nproc", str(processes)]
    return argv


def recorded_processes(run_dir: Path) -> int:
    """The processes of the run's last invocation (1 for runs from before --nproc)."""
    invocations = RunDir(run_dir).invocations()
    return int(invocations[-1].get("world_size") or 1) if invocations else 1


def machine_devices(proc: Path = Path("/proc/driver/nvidia/gpus")) -> dict:
    """What this machine offers a job, read without torch (the app never imports it): CPU
    cores, and the NVIDIA GPUs the driver lists. The engine's own view is `forgebench doctor`."""
    gpus = []
    if proc.is_dir():
        for info in sorted(proc.glob("*/information")):
            text = info.read_text(errors="replace")
            model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                          if line.startswith("Model:")), info.parent.name)
            gpus.append(model)
    return {"cpus": os.cpu_count() or 1, "gpus": gpus}


def machine_text(devices: dict) -> str:
    gpus = devices["gpus"]
    listed = ", ".join(gpus) if gpus else "no NVIDIA GPU"
    return f"this machine: {devices['cpus']} CPU cores; {listed}"


def resume_log(workspace: Workspace, run_dir: Path) -> Path:
    workspace.launch_dir.mkdir(parents=True, exist_ok=True)
    return workspace.launch_dir / f"{run_dir.name}.log"


def launch_failure(pending: PendingRun) -> str | None:
    """Why a started job never created its run folder (a refused config): the engine's error
    block from its log (the whole log when it has none)."""
    if RunDir(pending.out).exists() or not pending.log.is_file():
        return None
    text = pending.log.read_text(encoding="utf-8", errors="replace").strip()
    return job_error(text) if text else None


class JobQueue:
    """Runs waiting for the one running job to finish, persisted in runs/.launch/queue.json."""

    def __init__(self, workspace: Workspace):
        self.path = workspace.launch_dir / QUEUE_FILE
        try:
            items = read_json(self.path)
        except ForgebenchError:
            items = []
        self.items = [PendingRun(Path(i["config"]), Path(i["out"]), i.get("threads"),
                                 int(i.get("processes") or 1))
                      for i in items if isinstance(i, dict) and "config" in i and "out" in i]

    def _save(self) -> None:
        atomic_write_json(self.path, [{"config": str(p.config), "out": str(p.out),
                                       "threads": p.threads, "processes": p.processes}
                                      for p in self.items])

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



def parse_progress(text: str) -> tuple[int, int] | None:
    """The last `done/total` a tqdm bar printed in a chunk of a job's stderr."""
    found = PROGRESS.findall(text)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def job_error(output: str) -> str:
    """The engine's message from a failed job's output: its `error:` block, else the tail."""
    lines = [line for line in re.split(r"[\r\n]", output) if line.strip()]
    for i, line in enumerate(lines):
        if line.lower().startswith("error"):
            return "\n".join(lines[i:])
    return "\n".join(lines[-8:])


# -- background jobs and their progress -----------------------------------------------------
def duration_text(seconds: float) -> str:
    """A short human duration: 45 s, 4 min, 1 h 20 min."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def eta_seconds(started: float, first_done: int, done: int, total: int,
                now: float) -> float | None:
    """Time left at the rate since `started` (when `first_done` units were already done)."""
    if total <= 0 or done <= first_done or done >= total or now <= started:
        return None
    return (now - started) / (done - first_done) * (total - done)


@dataclass(frozen=True)
class Pace:
    """A running job's progress as its metrics show it (the lines the charts draw): the last
    logged train step of its latest invocation and the steady seconds per step, measured from
    that invocation's first logged step on, so loading and the first step's warm-up are left
    out (None until two steps are logged)."""

    step: int | None = None
    step_s: float | None = None


def run_stage_line(status: dict, pace: Pace | None = None) -> str:
    """What a run is doing, in words: the engine's announced stage ("loading base 250 MB")
    before its first step, else "step 3/30, ETA 4 min" while it trains (the step and the ETA
    from the metrics the charts read: `pace`), else its state."""
    state = str(status.get("state", "unknown"))
    step, target = status.get("step") or 0, status.get("target_steps") or 0
    if state not in ("running", "stopping", "queued"):
        return state
    if status.get("stage_detail"):
        return str(status["stage_detail"])
    if pace is not None and pace.step is not None:
        step = pace.step
    text = f"step {step}/{target}" if target else f"step {step}"
    if pace is not None and pace.step_s is not None and target > step:
        text += f", ETA {duration_text(pace.step_s * (target - step))}"
    return text + (" (stopping)" if state == "stopping" else "")


@dataclass
class BackgroundJob:
    """One entry of the jobs panel. `cancel` asks the job to stop; `done`/`total` is its
    progress (total 0: not known yet)."""

    key: str
    kind: str                   # run, export, sampling, conversion, generation, check
    title: str
    cancel: Callable[[], None] | None = None
    done: int = 0
    total: int = 0
    stage: str = ""
    started: float = field(default_factory=time.time)

    def progress_text(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        if self.stage:
            return self.stage
        if not self.total:
            return f"running for {duration_text(now - self.started)}"
        text = f"{self.done}/{self.total}"
        eta = eta_seconds(self.started, 0, self.done, self.total, now)
        return text + (f", ETA {duration_text(eta)}" if eta is not None else "")
