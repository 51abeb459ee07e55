"""Crash-safe file primitives: atomic replace, staged folders, durable appends, tolerant JSONL
reads, hashing, and the cache folder. Every "write it beside, then rename" in the engine goes
through here (docs/design.md, "Whole files appear atomically").

A write that the file system refuses for want of room or rights (ENOSPC, EDQUOT, EFBIG, EROFS)
becomes one `ForgebenchError` naming the path and the space free there (`disk_error`): the CLI
turns any such OSError into that message and exit code 2, a job records it in its `failed`
status, and `write_in_place` lets that status be written when a new file cannot be.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from engine.errors import ForgebenchError


def cache_dir() -> Path:
    """Where forgebench keeps what it builds or measures once per machine (the native kernels,
    the matmul peaks)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "forgebench"


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """Open a temp file beside `path`; on success fsync and rename it over `path`.

    On any error the temp file is removed and `path` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not exc.filename:   # say which file could not be written
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


@contextlib.contextmanager
def staged_dir(target: str | os.PathLike, *, staging: str | os.PathLike | None = None,
               replace: bool = False) -> Iterator[Path]:
    """Yield a fresh hidden folder beside `target` to fill; when the block ends normally it is
    renamed to `target`, on any error it is removed. Readers see no folder or the whole one.

    `staging` names the folder (default `.<name>.partial-<pid>`, so two processes never share
    one). An empty `target` folder is replaced; a non-empty one only with `replace=True`
    (moved aside first, then removed), else the commit fails and nothing is lost.
    """
    target = Path(target)
    if staging is None:
        staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    staging = Path(staging)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        if not target.exists():
            os.replace(staging, target)
        elif replace:
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            raise ForgebenchError("the folder appeared while it was being written; nothing "
                                  "was written over it", path=target,
                                  hint="choose another folder and run the command again")
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_writer(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def append_jsonl(path: str | os.PathLike, obj: Any) -> None:
    """Append one JSON object as one line and flush it to disk before returning."""
    line = json.dumps(obj, sort_keys=True, default=str, allow_nan=True) + "\n"
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file another process may be appending to.

    A final line without its newline is an append in progress and is skipped; a missing file
    reads as empty.
    """
    try:
        data = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = data.split("\n")
    complete = lines[:-1]  # the text after the last newline is incomplete (or empty)
    out = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ForgebenchError(f"not valid JSON ({exc.msg})", path=path,
                                  where=f"line {number}") from exc
    return out


def read_json(path: str | os.PathLike) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ForgebenchError("file not found", path=path) from exc
    except json.JSONDecodeError as exc:
        raise ForgebenchError(f"not valid JSON ({exc.msg})", path=path,
                              where=f"line {exc.lineno}") from exc


def read_json_object(path: str | os.PathLike, what: str = "a JSON object") -> dict:
    """`read_json` of a file that must hold one JSON object (a manifest): a list or a number
    there is refused with the path, never met later as an AttributeError."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise ForgebenchError(f"must be {what}, not a JSON {type(value).__name__}", path=path,
                              hint="the file holds {\"key\": value, ...} at the top level")
    return value


def load_numeric_array(path: str | os.PathLike):
    """A .npy file of numbers (numpy's `load` with allow_pickle=False): an object array, which
    only unpickling could read, or a damaged file is refused with the path."""
    import numpy as np

    try:
        array = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ForgebenchError("file not found", path=path) from None
    except (ValueError, OSError, EOFError) as exc:
        raise ForgebenchError(f"not a numeric .npy array ({exc})", path=path,
                              hint="it holds pickled objects or is damaged: rebuild it "
                                   "(train the run again)") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "biuf":
        raise ForgebenchError(f"not a numeric array (dtype {getattr(array, 'dtype', '?')})",
                              path=path, hint="rebuild it (train the run again)")
    return array


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def require_free_space(directory: str | os.PathLike, needed_bytes: int,
                       margin: float = 1.2, hint: str = "free some space") -> None:
    """Refuse to start a write that the filesystem cannot hold (a full disk truncates files).
    `hint` says what the command at hand can do about it."""
    free = shutil.disk_usage(directory).free
    if free < needed_bytes * margin:
        raise ForgebenchError(
            f"not enough free disk space: this needs about {human_bytes(needed_bytes * margin)}, "
            f"{human_bytes(free)} are free", path=directory, hint=hint)


def human_bytes(count: float) -> str:
    if count < 1000:
        return f"{count:.0f} bytes"
    for unit in ("KB", "MB"):
        count /= 1000
        if count < 1000:
            return f"{count:.1f} {unit}"
    return f"{count / 1000:.1f} GB"


DISK_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file grew past the largest size allowed here (the file system's or "
                 "this process's file-size limit)",
    errno.EROFS: "the file system is read-only",
}
# Libraries written in Rust (safetensors) report an OS error inside their own message.
_RUST_OS_ERROR = re.compile(r"Os \{ code: (\d+)|\(os error (\d+)\)")


def disk_errno(exc: BaseException | None) -> int | None:
    """The ENOSPC/EDQUOT/EFBIG/EROFS behind `exc` (its causes and contexts included), else None."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return exc.errno
        match = _RUST_OS_ERROR.search(str(exc)) if not isinstance(exc, OSError) else None
        code = int(match.group(1) or match.group(2)) if match else None
        if code in DISK_ERRNOS:
            return code
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def free_space_text(path: str | os.PathLike | None) -> str:
    """"N MB free" on the file system holding `path` (its nearest existing folder)."""
    folder = Path(path or ".").absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f"{human_bytes(shutil.disk_usage(folder).free)} free"
    except OSError:
        return "free space unknown"


def disk_error(exc: BaseException, path: str | os.PathLike | None = None,
               fallback: str | os.PathLike | None = None) -> ForgebenchError | None:
    """`exc` as the one message a full or read-only disk gets (None if it is no such error):
    what happened, the path (`path`, else the file the error names, else `fallback`: the
    folder the command writes), the space free there, what to do."""
    code = disk_errno(exc)
    if code is None:
        return None
    found = exc
    while found is not None and not (isinstance(found, OSError) and found.filename):
        found = found.__cause__ or found.__context__
    where = path or (found.filename if found is not None else None) or fallback
    hint = ("make the folder writable, or work in a writable one" if code == errno.EROFS
            else "free some disk space (or raise the file-size limit) and run the command "
                 "again; a training run continues with forgebench resume RUN_DIR")
    return ForgebenchError(f"cannot write: {DISK_ERRNOS[code]} ({free_space_text(where)})",
                           path=where or "(a file of this command)", hint=hint)


def write_in_place(path: str | os.PathLike, data: bytes) -> None:
    """Overwrite an existing small file in its own blocks (no new file is created): how a job
    records its final status on a disk too full for `atomic_write_bytes`. Not atomic: a crash
    mid-write can leave it torn, so it is only the fallback."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)
