"""Append-only JSONL logs of a run (metrics, events, invocations) that survive a crash.

Contract:
- `append_line(path, obj)` writes one line with one `write()` and fsyncs it (starting a new
  line first if the file ends in a torn one). When the write
  fails (a full disk: ENOSPC, a file-size limit: EFBIG) the file is cut back to its previous
  length, so no partial line stays behind, and a `ForgebenchError` says what to do.
- `repair_torn_tail(path)` is what the single writer (the job holding the run lock) calls on
  open: a last line without its newline is the remains of a killed append; it is truncated
  away and its size returned so the caller can record an event.
- `read_log(path)` never fails on a damaged log: a final line without its newline is an append
  in progress (skipped silently); a line that is not JSON is reported with a warning on
  stderr and skipped, so `status` keeps working on a log a crash damaged.

Dataset files are not logs: they keep the strict reader `engine.fsutil.read_jsonl`.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

from engine.errors import ForgebenchError

_SPACE_ERRORS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def append_line(path: str | os.PathLike, obj: Any) -> None:
    line = (json.dumps(obj, sort_keys=True, default=str, allow_nan=True) + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.fstat(fd).st_size
        if before and os.pread(fd, 1, before - 1) != b"\n":
            # A torn tail that no writer has repaired yet (e.g. `eval` on a killed run): start
            # on a fresh line so this record never merges with it.
            line = b"\n" + line
        try:
            written = os.write(fd, line)
            if written != len(line):  # a short write: the file system is out of room
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(fd)
        except OSError as exc:
            _cut_back(fd, before, len(line))
            if exc.errno in _SPACE_ERRORS:
                raise ForgebenchError(
                    f"could not append to the log: {exc.strerror} (the line was not written "
                    "and the file was left whole)", path=path,
                    hint="free disk space, then continue with: forgebench resume RUN_DIR"
                ) from None
            raise ForgebenchError(f"could not append to the log: {exc.strerror}",
                                  path=path) from None
    finally:
        os.close(fd)


def _cut_back(fd: int, before: int, line_length: int) -> None:
    """Remove a partial line this process just wrote (never more than its own bytes)."""
    try:
        size = os.fstat(fd).st_size
        if before < size <= before + line_length:
            os.ftruncate(fd, before)
    except OSError:
        pass  # the next writer's repair_torn_tail removes it


def repair_torn_tail(path: str | os.PathLike) -> int:
    """Truncate a last line that lacks its newline; return the number of bytes removed."""
    try:
        with open(path, "rb+") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            handle.seek(size - 1)
            if handle.read(1) == b"\n":
                return 0
            keep = _end_of_last_complete_line(handle, size)
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
            return size - keep
    except FileNotFoundError:
        return 0


def _end_of_last_complete_line(handle, size: int, block: int = 65536) -> int:
    position = size
    while position > 0:
        start = max(0, position - block)
        handle.seek(start)
        data = handle.read(position - start)
        newline = data.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0


def read_log(path: str | os.PathLike, warn: bool = True) -> list[dict]:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    out = []
    for number, line in enumerate(lines[:-1], start=1):  # the text after the last \n is torn
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            if warn:
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                print(f"warning: {path}: line {number}: damaged log line skipped ({reason})",
                      file=sys.stderr)
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
