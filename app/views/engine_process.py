"""Short `forgebench` commands (leak checks, SFT inspection) run as QProcess children, so the
GUI thread never decodes media or loads a tokenizer itself."""

from __future__ import annotations

from typing import Callable

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment

from app.viewmodels.jobs import forgebench_argv
from app.viewmodels.workspace import REPO_ROOT


def run_engine(parent: QObject, args: list[str],
               done: Callable[[str, str, int], None]) -> QProcess:
    """Start `forgebench ARGS`; `done(stdout, stderr, exit_code)` is called when it exits."""
    argv = forgebench_argv() + args
    process = QProcess(parent)
    process.setProgram(argv[0])
    process.setArguments(argv[1:])
    process.setWorkingDirectory(str(REPO_ROOT))
    env = QProcessEnvironment.systemEnvironment()
    env.insert("PYTHONPATH", str(REPO_ROOT))
    process.setProcessEnvironment(env)

    def finished(code: int, _status) -> None:
        out = bytes(process.readAllStandardOutput()).decode("utf-8", "replace")
        err = bytes(process.readAllStandardError()).decode("utf-8", "replace")
        process.deleteLater()
        done(out, err, code)

    process.finished.connect(finished)
    process.start()
    return process
