"""The one checker for paths a user gives: config fields, dataset manifests, flags.

Contract (every function raises `ForgebenchError` naming the field, or returns a reason):
- `safe_relpath(rel)`: why a manifest entry may not name a file inside its dataset folder
  (absolute, '..', backslashes, NUL), or None.
- `inside(root, rel)`: the resolved path when it stays inside `root` after following symlinks,
  else None.
- `dataset_file(root, rel, source, field)`: a file a dataset manifest names, confined to the
  dataset folder (symlinks resolved, loops refused).
- `user_file(value, field, base=...)` / `user_dir(...)`: a file or folder the user names
  (config field, --model ...), resolved against `base`, which must exist and be of that kind.
- `require_writable_dir(path, field)`: an output folder (or where it will be created) that is
  really writable, probed with a temp file before any work starts (read-only mounts included).
- `require_writable_file(path, field)`: an output file that does not exist yet, in such a folder.
- `sweep_dead_staging(out)`: removes `.NAME.partial-PID` / `.NAME.scratch-PID` folders beside
  `out` that a killed export (PID no longer alive) left behind.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path, PurePosixPath, PureWindowsPath

from engine.errors import ForgebenchError, excerpt
from engine.runlock import pid_alive


def safe_relpath(rel: object) -> str | None:
    """Why `rel` may not name a file inside a dataset folder, or None when it may."""
    if not isinstance(rel, str) or not rel.strip():
        return "must be a non-empty relative path"
    if "\\" in rel or PureWindowsPath(rel).drive or PurePosixPath(rel).is_absolute():
        return "must be a relative path with '/' separators (absolute paths are refused)"
    if any(part in ("..", "") for part in rel.split("/")) or "\x00" in rel:
        return "must stay inside the dataset folder (no '..' or empty parts)"
    return None


def resolve(path: Path, field: str) -> Path:
    """Follow every symlink; a loop is an error, not an endless walk."""
    try:
        return path.resolve(strict=path.exists() or path.is_symlink())
    except RuntimeError:  # Python < 3.13 reports a symlink loop this way
        raise ForgebenchError("the path is a symlink loop", path=path, where=field) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ForgebenchError("the path is a symlink loop", path=path,
                                  where=field) from None
        if exc.errno == errno.ENOENT:  # a dangling symlink
            raise ForgebenchError("the path is a link to nothing", path=path,
                                  where=field) from None
        raise ForgebenchError(f"cannot read the path ({exc.strerror})", path=path,
                              where=field) from None


def inside(root: Path, rel: str) -> Path | None:
    """The resolved path, or None when it (through symlinks) leads outside `root`."""
    try:
        path = (root / rel).resolve()
    except (RuntimeError, OSError):
        return None
    return path if path.is_relative_to(root.resolve()) else None


def dataset_file(root: Path, rel: object, source: str | os.PathLike, field: str) -> Path:
    """A file named by a dataset manifest (`source`), confined to the dataset folder `root`."""
    reason = safe_relpath(rel)
    if reason:
        raise ForgebenchError(f"{excerpt(rel)} {reason}", path=source, where=f"field '{field}'",
                              hint="name a file inside the dataset folder")
    path = resolve(root / str(rel), f"field '{field}'")
    if not path.is_relative_to(resolve(root, "dataset folder")):
        raise ForgebenchError(f"{excerpt(rel)} is a link that leads outside the dataset "
                              "folder", path=source, where=f"field '{field}'",
                              hint="copy the file into the dataset folder")
    return path


def user_file(value: str | os.PathLike, field: str, *, base: Path | None = None,
              what: str = "file") -> Path:
    path = Path(value).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    resolved = resolve(path, field)
    if not resolved.exists():
        raise ForgebenchError(f"{what} not found", path=path, where=field)
    if not resolved.is_file():
        raise ForgebenchError(f"expected a {what}, got a directory", path=path, where=field)
    return resolved


def require_writable_dir(path: str | os.PathLike, field: str) -> None:
    """Refuse an output folder that is a file, sits under a file, or cannot be written."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ForgebenchError("exists and is not a folder", path=path, where=field,
                              hint=f"choose another {field}")
    probe_dir = path
    while not probe_dir.exists():
        if probe_dir.parent == probe_dir:
            break
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ForgebenchError(f"cannot create a folder under the file {probe_dir}", path=path,
                              where=field, hint=f"choose another {field}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".forgebench-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ForgebenchError(f"the folder is not writable ({exc.strerror})", path=probe_dir,
                              where=field, hint=f"choose a writable {field}") from None


def require_writable_file(path: str | os.PathLike, field: str) -> None:
    path = Path(path).expanduser()
    if path.is_dir():
        raise ForgebenchError("is a folder; give a file name", path=path, where=field)
    require_writable_dir(path.parent, field)


def sweep_dead_staging(out: str | os.PathLike) -> list[str]:
    """Remove the staging folders of `out` whose writer process is gone; return their names."""
    out = Path(out).expanduser()
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(partial|scratch)-(\d+)$")
    swept = []
    if out.parent.is_dir():
        for child in out.parent.iterdir():
            match = pattern.match(child.name)
            if match and child.is_dir() and not pid_alive(int(match.group(2))):
                shutil.rmtree(child, ignore_errors=True)
                swept.append(child.name)
    return swept

