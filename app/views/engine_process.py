"""The app's one way to start an engine process. Every `forgebench` child the window starts
(validation, leak checks, SFT inspection, sampling, exports, conversions, training runs) is
built here from `jobs.forgebench_argv` and `jobs.engine_environment`, so all of them see the
same program, working directory and PYTHONPATH.

- `engine_process`: a configured, not yet started QProcess (the caller connects and starts it);
- `run_engine`: a short command whose stdout/stderr come back in one callback;
- `start_detached`: a training job that outlives the window, its output appended to a log.

The GUI thread never waits on any of them: results arrive through Qt signals.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment

from app.viewmodels.jobs import engine_environment, forgebench_argv
from app.viewmodels.workspace import REPO_ROOT
from engine.errors import ForgebenchError


def _environment() -> QProcessEnvironment:
    env = QProcessEnvironment()
    for key, value in engine_environment(os.environ).items():
        env.insert(key, value)
    return env


def engine_process(parent: QObject | None, argv: list[str]) -> QProcess:
    """A QProcess for a full engine command line (from `forgebench_argv() + args`)."""
    process = QProcess(parent)
    process.setProgram(argv[0])
    process.setArguments(argv[1:])
    process.setWorkingDirectory(str(REPO_ROOT))
    process.setProcessEnvironment(_environment())
    return process


def run_engine(parent: QObject, args: list[str],
               done: Callable[[str, str, int], None]) -> QProcess:
    """Start `forgebench ARGS`; `done(stdout, stderr, exit_code)` is called when it exits."""
    process = engine_process(parent, forgebench_argv() + args)

    def finished(code: int, _status) -> None:
        out = bytes(process.readAllStandardOutput()).decode("utf-8", "replace")
        err = bytes(process.readAllStandardError()).decode("utf-8", "replace")
        process.deleteLater()
        done(out, err, code)

    process.finished.connect(finished)
    process.start()
    return process


def start_detached(argv: list[str], log: Path) -> int:
    """Start a job that outlives the window, stdout and stderr appended to `log`; its pid.

    A new session, so closing the window (or its terminal) sends the job no signal; the app
    follows it through its run directory. (PySide's QProcess.startDetached does not return
    the pid of a configured process, which the Runs pane needs to tell a refused start.)
    A daemon thread waits for the job while the window lives, so a job that ends is reaped at
    once: no `forgebench <defunct>` entry stays behind (a zombie also looks alive to
    `pid_alive`). After the window closes the job is adopted and reaped by init.
    """
    try:
        with open(log, "ab") as output:
            job = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output,
                                   stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                   env=engine_environment(os.environ), start_new_session=True)
    except OSError as exc:
        raise ForgebenchError(f"could not start {argv[0]}: {exc.strerror}", path=log,
                              hint="check the installation") from None
    threading.Thread(target=job.wait, name=f"reap {job.pid}", daemon=True).start()
    return job.pid
