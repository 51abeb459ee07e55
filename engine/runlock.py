"""One writer per run: an advisory `fcntl.flock` on `<run>/job.lock`, held by the job process
for its whole life.

Contract:
- `RunLock(run_dir).acquire(purpose)` takes the lock or raises a `ForgebenchError` naming the
  holder (pid, process start time, host, command). The holder's identity is written into the
  lock file after the lock is taken; the lock itself is the kernel's, so it vanishes with the
  process however it dies (SIGKILL included) and a stale file never blocks anyone.
- `lock_holder(run_dir)` answers "is a job alive in this run, and which?" without disturbing
  it: `status`, `stop` and the app read it while the job runs.
- `signal_holder(run_dir, sig)` signals the holder only if the process with that pid still has
  the recorded start time (a reused pid is never signalled).

- A launched job's ranks (engine/commands/launch.py) each hold a shared lock on
  `<run>/job.ranks.lock` for their whole life (`hold_rank_lock`). `acquire` refuses while any
  rank holds it, even when the launcher that held `job.lock` is gone, and `lock_holder` reports
  such ranks: one writer per run holds across all the processes of a job.

Readers probe with a shared lock for an instant; a writer that meets such a probe retries
briefly before refusing, so a reader never makes a writer fail.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from engine.errors import ForgebenchError

LOCK_NAME = "job.lock"
RANKS_LOCK_NAME = "job.ranks.lock"
_RANK_LOCKS: list[int] = []   # the rank lock descriptors this process holds (never closed)
_WRITER_PATIENCE_S = 2.0


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot, /proc/PID/stat field 22), or
    None when there is no such process. With the boot id it identifies a process uniquely."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if Path("/proc/self/stat").exists():
            return None
        try:  # no procfs (macOS): psutil's creation time
            import psutil

            return repr(psutil.Process(pid).create_time())
        except Exception:  # psutil missing, or no such process
            return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _identity(purpose: str) -> dict:
    return {"pid": os.getpid(), "process_start": process_start_time(os.getpid()),
            "boot_id": boot_id(), "host": socket.gethostname(), "purpose": purpose,
            "command": " ".join(["forgebench"] + sys.argv[1:])[:300], "since": time.time()}


def _read_identity(handle_fd: int) -> dict:
    with contextlib.suppress(OSError, ValueError):
        os.lseek(handle_fd, 0, os.SEEK_SET)
        data = os.read(handle_fd, 65536)
        info = json.loads(data.decode("utf-8"))
        if isinstance(info, dict):
            return info
    return {}


def describe_holder(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {when}"
            f" ({holder.get('purpose', '?')}: {holder.get('command', '?')})")


class RunLock:
    """The exclusive lock of one run directory, held until `release()` or process exit."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, purpose: str) -> "RunLock":
        if self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ForgebenchError(f"cannot create the run lock ({exc.strerror})", path=self.path,
                                  hint="the run folder must be writable") from None
        deadline = time.monotonic() + _WRITER_PATIENCE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_identity(fd)
                    os.close(fd)
                    raise ForgebenchError(
                        "another forgebench job is writing this run: " + describe_holder(holder),
                        path=self.path.parent,
                        hint="wait for it, or stop it: forgebench stop RUN_DIR --wait 60"
                    ) from None
                time.sleep(0.05)
        if ranks_alive(self.path.parent, patience=_WRITER_PATIENCE_S):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise ForgebenchError(
                "ranks of a launched job (forgebench run --nproc) are still running in this "
                "run, though their launcher is gone", path=self.path.parent,
                hint="wait a moment for them to exit (they die with their launcher), or end "
                     "the 'forgebench worker' processes of this run")
        with contextlib.suppress(OSError):
            data = json.dumps(_identity(purpose)).encode("utf-8")
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def hold_rank_lock(run_dir: str | os.PathLike) -> None:
    """A rank of a launched job: hold the run's rank lock (shared) until this process exits."""
    fd = os.open(Path(run_dir) / RANKS_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)   # blocks only through another process's instant probe
    _RANK_LOCKS.append(fd)


def ranks_alive(run_dir: str | os.PathLike, patience: float = 0.0) -> bool:
    """Does any rank of a launched job still hold the run's rank lock?"""
    try:
        fd = os.open(Path(run_dir) / RANKS_LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return True
                time.sleep(0.05)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
    finally:
        os.close(fd)


def lock_holder(run_dir: str | os.PathLike) -> dict | None:
    """The identity of the process holding the run's lock, or None when no process holds it.

    The app shows a run as "running elsewhere" when this is not None and the pid is not one it
    started itself."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_identity(fd)
            return holder or {"pid": None, "purpose": "starting"}
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    if ranks_alive(run_dir):
        return {"pid": None, "purpose": "ranks of a launched job whose launcher is gone",
                "host": socket.gethostname()}
    return None


def signal_holder(run_dir: str | os.PathLike, sig: int) -> dict | None:
    """Send `sig` to the job holding the run's lock; return its identity, or None when no job
    holds it. Refuses (ForgebenchError) when the recorded process cannot be proven to be the
    holder: another host, another boot, or a pid whose start time differs."""
    holder = lock_holder(run_dir)
    if holder is None:
        return None
    pid = holder.get("pid")
    if pid is None and holder.get("purpose", "").startswith("ranks"):
        raise ForgebenchError("ranks of a launched job whose launcher is gone still run here; "
                              "nothing was signalled", path=run_dir,
                              hint="they exit with their launcher within moments")
    if not isinstance(pid, int) or pid <= 0:
        raise ForgebenchError("the job holding this run is still starting; nothing was "
                              "signalled", path=run_dir, hint="try again in a moment")
    if holder.get("host") != socket.gethostname() or holder.get("boot_id") != boot_id():
        raise ForgebenchError("the job holding this run runs on another machine or boot: "
                              + describe_holder(holder), path=run_dir,
                              hint="stop it where it runs")
    if process_start_time(pid) != holder.get("process_start"):
        raise ForgebenchError("cannot identify the job holding this run (its pid now belongs "
                              "to another process); nothing was signalled", path=run_dir,
                              hint="try again in a moment")
    os.kill(pid, sig)
    return holder
