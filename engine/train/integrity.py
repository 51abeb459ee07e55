"""Which checkpoint a resume may trust. No torch: the checks read bytes and JSON only.

Contract:
- At save, `file_records(folder, names)` gives each file's size and SHA-256; the checkpoint
  writer stores them under `files` in trainer_state.json (the sentinel, written last).
- `checkpoint_problems(checkpoint)` lists what is wrong with a committed checkpoint: an
  unreadable sentinel, a missing file, a size or hash that differs from the record, a
  safetensors file whose header does not parse or whose tensors run past its end.
  Checkpoints written before the records existed get the header and presence checks.
  A sentinel whose `files` is empty records nothing to verify and is refused, as is a file in
  the folder that the records do not name.
- `verified_checkpoint(run, name_or_step)` is how every reader of a run's weights (eval,
  export, generate, chat, decide, sample, serve-local, the recipes loading a base run) picks
  its checkpoint; `RunDir.checkpoint` calls it. "latest" is the newest committed checkpoint
  that verifies: a damaged one (a flipped byte, a stray `step-999999/` whose sentinel is `{}`)
  is passed over with a warning on stderr. A checkpoint named exactly ("step-000010", 10,
  "best") is returned only if it verifies, else refused with its problems. Verdicts are cached
  per process against each file's size, mtime and inode, so a reader that resolves the same
  checkpoint twice hashes it once.
- `choose_resume_checkpoint(run, from_step)` picks the newest intact checkpoint (or exactly
  step N), records an event and prints a line on stderr for every damaged one it passes over,
  and refuses with a reason when the run progressed but no intact checkpoint is left: a resume
  never restarts from step 0 silently.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

from engine.errors import ForgebenchError
from engine.rundir import SENTINEL, Checkpoint, RunDir

_MAX_HEADER = 100 * 1024 * 1024
_VERDICTS: dict[str, tuple[tuple, tuple[str, ...]]] = {}
_VERDICTS_KEPT = 256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def file_records(folder: Path, names: list[str]) -> dict[str, dict]:
    return {name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
            for name in names}


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be loaded whole, or None: the header must parse and every
    tensor's byte range must lie inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return "shorter than a safetensors header"
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_MAX_HEADER, size - 8):
                return "header length runs past the end of the file"
            header = json.loads(handle.read(length))
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "header is not valid JSON"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    data_size = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            return f"tensor '{name[:60]}' lies outside the file (truncated?)"
    return None


def _record_problems(folder: Path, records: dict) -> list[str]:
    """Each file of `folder` against the per-file records of its sentinel: files it does not
    record, malformed records, and missing files or ones whose size or SHA-256 differs."""
    problems = []
    for name in sorted(p.name for p in folder.iterdir() if p.is_file()
                       and p.name != SENTINEL and not p.name.startswith(".")):
        if name not in records:
            problems.append(f"{name} is not among the files {SENTINEL} records")
    for name, record in sorted(records.items()):
        if not isinstance(record, dict) or "/" in name or name.startswith("."):
            problems.append(f"{SENTINEL} has a malformed record for {name[:60]!r}")
            continue
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != record.get("size"):
            problems.append(f"{name} has {path.stat().st_size} bytes, "
                            f"{record.get('size')} were written")
        elif _sha256(path) != record.get("sha256"):
            problems.append(f"{name} has a different SHA-256 than was written")
    return problems


def _presence_problems(folder: Path) -> list[str]:
    """A checkpoint written before per-file records: only which files must be there."""
    problems = []
    if not (folder / "model.safetensors").is_file():
        problems.append("model.safetensors is missing")
    if (folder / "optimizer.json").is_file() and not (
            folder / "optimizer.safetensors").is_file():
        problems.append("optimizer.safetensors is missing")
    return problems


def checkpoint_problems(checkpoint: Checkpoint) -> list[str]:
    folder = checkpoint.path
    try:
        state = json.loads((folder / SENTINEL).read_text("utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{SENTINEL} is unreadable ({type(exc).__name__})"]
    if not isinstance(state, dict) or state.get("step") != checkpoint.step:
        return [f"{SENTINEL} does not describe step {checkpoint.step}"]
    records = state.get("files")
    if "files" in state and not isinstance(records, dict):
        return [f"{SENTINEL}'s 'files' is not a table of file records"]
    if isinstance(records, dict) and not records:
        return [f"{SENTINEL} records no files, so nothing in the checkpoint can be verified"]
    if isinstance(records, dict):
        problems = _record_problems(folder, records)
    else:  # written before per-file records: check presence and headers
        problems = _presence_problems(folder)
    for path in sorted(folder.glob("*.safetensors")):
        if not problems or all(path.name not in p for p in problems):
            reason = safetensors_problem(path)
            if reason:
                problems.append(f"{path.name}: {reason}")
    return problems


def _fingerprint(folder: Path) -> tuple:
    """What a cached verdict is valid for: every file's name, size, mtime and inode."""
    try:
        return tuple(sorted((p.name, st.st_size, st.st_mtime_ns, st.st_ino)
                            for p in folder.iterdir() for st in [p.stat()]))
    except OSError:
        return ()


def cached_problems(checkpoint: Checkpoint) -> list[str]:
    """`checkpoint_problems`, remembered while none of the checkpoint's files changes."""
    key, fingerprint = str(checkpoint.path.resolve()), _fingerprint(checkpoint.path)
    cached = _VERDICTS.get(key)
    if cached is not None and cached[0] == fingerprint and fingerprint:
        return list(cached[1])
    problems = checkpoint_problems(checkpoint)
    if len(_VERDICTS) >= _VERDICTS_KEPT:
        _VERDICTS.clear()
    _VERDICTS[key] = (fingerprint, tuple(problems))
    return problems


def verified_checkpoint(run: RunDir, name_or_step: str | int | None = "latest", *,
                        required: bool = True) -> Checkpoint | None:
    """The checkpoint a reader loads (see the module docstring). With `required=False` a run
    without an intact checkpoint gives None instead of an error."""
    checkpoints = run.checkpoints()
    if not checkpoints:
        if not required:
            return None
        raise ForgebenchError("the run has no committed checkpoint yet", path=run.path)
    if name_or_step in (None, "latest", "last"):
        for checkpoint in reversed(checkpoints):
            problems = cached_problems(checkpoint)
            if not problems:
                return checkpoint
            print(f"warning: {checkpoint.path}: checkpoint {checkpoint.name} is damaged "
                  f"({'; '.join(problems)}); using an older one", file=sys.stderr)
        if not required:
            return None
        raise ForgebenchError("every checkpoint of the run is damaged (warnings above say how)",
                              path=run.checkpoints_dir,
                              hint="restore the checkpoints folder from a backup, or resume "
                                   "the run from step 0 with forgebench resume")
    checkpoint = run.committed_checkpoint(name_or_step)
    problems = cached_problems(checkpoint)
    if problems:
        intact = [c.name for c in checkpoints if c != checkpoint and not cached_problems(c)]
        raise ForgebenchError(f"checkpoint {checkpoint.name} is damaged: " + "; ".join(problems),
                              path=checkpoint.path,
                              hint="intact checkpoints: " + (", ".join(intact) or "none"))
    return checkpoint


def _run_progressed(run: RunDir) -> bool:
    """Did the run ever commit a checkpoint (so restarting from step 0 would lose work)?"""
    if any(e.get("kind") == "checkpoint_saved" for e in run.events()):
        return True
    return not run.checkpoints_dir.is_dir() and (run.status().get("step") or 0) > 0


def choose_resume_checkpoint(run: RunDir, from_step: int | None = None) -> Checkpoint | None:
    """The checkpoint to resume from (None: the run never committed one; start at step 0)."""
    checkpoints = run.checkpoints()
    if from_step is not None:
        chosen = [c for c in checkpoints if c.step == from_step]
        if not chosen:
            names = ", ".join(str(c.step) for c in checkpoints) or "none"
            raise ForgebenchError(f"no committed checkpoint at step {from_step}",
                                  path=run.checkpoints_dir, where="--from-step",
                                  hint=f"committed steps: {names}")
        problems = checkpoint_problems(chosen[0])
        if problems:
            raise ForgebenchError(f"checkpoint {chosen[0].name} is damaged: "
                                  + "; ".join(problems), path=chosen[0].path,
                                  where="--from-step", hint="pick another step")
        return chosen[0]
    for checkpoint in reversed(checkpoints):
        problems = checkpoint_problems(checkpoint)
        if not problems:
            return checkpoint
        message = f"checkpoint {checkpoint.name} is damaged ({'; '.join(problems)})"
        print(f"warning: {checkpoint.path}: {message}; trying an older one", file=sys.stderr)
        run.log_event("warning", message=message + "; skipped by resume",
                      checkpoint=checkpoint.name, problems=problems)
    if _run_progressed(run):
        why = ("every checkpoint is damaged" if checkpoints
               else "checkpoints/ holds no committed checkpoint")
        raise ForgebenchError(
            f"cannot resume: {why}, and the run had saved some; restarting from step 0 would "
            "silently throw that training away", path=run.checkpoints_dir,
            hint="restore the checkpoints folder, or start a new run with forgebench run")
    if run.status().get("step") or any(m.get("split") == "train" for m in run.metrics()):
        message = "the run died before its first checkpoint; training restarts from step 0"
        print(f"warning: {run.path}: {message}", file=sys.stderr)
        run.log_event("warning", message=message)
    return None
