"""The run directory: the contract between a training job and everything that watches it.

Layout and rules (docs/design.md §2)::

    run.json            immutable manifest
    run.seal.json       a SHA-256 of each of run.json's fields, written with it: a resume that
                        finds run.json edited refuses, naming the field (`manifest_drift`)
    invocations.jsonl   one line per start/resume
    status.json         replaced atomically
    metrics.jsonl       append-only, one object per optimizer step or eval
    events.jsonl        append-only: checkpoint_saved, sample_written, eval_done, warning, error
    checkpoints/step-NNNNNN/   trainer_state.json written last as the commit sentinel
    samples/<checkpoint>/
    evals/<name>.json
    job.lock            flock held by the one job writing the run (engine/runlock.py)
    example.json        only in a shipped example run: what made it (`RunDir.example`)

An example run is recorded with its workspace's folder written as `{workspace}` in its JSON
files (`make_portable`) and gets the folder it is installed in back (`relocate`): run.json
records absolute paths (the config's `base_dir`, the dataset folder), which resume and export
compare and read. Checkpoint files never hold them (their SHA-256 is in trainer_state.json).

No torch here: the app reads run directories while jobs write them. A run whose status says
queued/running/stopping while no process holds its lock has died: `live_status` reports it as
failed, and it can be resumed. The logs are read with `engine.jsonl.read_log`, which skips a
line a crash damaged instead of failing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from engine.errors import ForgebenchError
from engine.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    disk_errno,
    read_json,
    sha256_bytes,
    staged_dir,
    write_in_place,
)
from engine.jsonl import append_line, read_log
from engine.runlock import LOCK_NAME, lock_holder, pid_alive  # noqa: F401 (app uses pid_alive)

STATES = ("queued", "running", "stopping", "stopped", "completed", "failed")
ACTIVE_STATES = ("queued", "running", "stopping")
SENTINEL = "trainer_state.json"
SEAL_FILE = "run.seal.json"
EXAMPLE_FILE = "example.json"
WORKSPACE_TOKEN = "{workspace}"
_CHECKPOINT_RE = re.compile(r"^step-(\d{6,})$")


def field_digests(value: Any, prefix: str = "") -> dict[str, str]:
    """{dotted field name: SHA-256 of its JSON} for every leaf of a JSON document (a list or
    an empty table is one leaf)."""
    if isinstance(value, dict) and value:
        digests: dict[str, str] = {}
        for key, item in value.items():
            digests.update(field_digests(item, f"{prefix}{key}."))
        return digests
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return {prefix[:-1] or "(run.json)": sha256_bytes(text.encode("utf-8"))}


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: a directory holding the sentinel file."""

    path: Path
    step: int

    @property
    def name(self) -> str:
        return self.path.name

    def trainer_state(self) -> dict:
        return read_json(self.path / SENTINEL)


class RunDir:
    """Reader and writer of one run directory. Safe to read while another process writes."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = None

    # -- paths ---------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.path / "run.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def samples_dir(self) -> Path:
        return self.path / "samples"

    @property
    def evals_dir(self) -> Path:
        return self.path / "evals"

    def exists(self) -> bool:
        return self.manifest_path.is_file()

    @property
    def example(self) -> dict | None:
        """What made a shipped example run (its `example.json`), or None for the user's own."""
        path = self.path / EXAMPLE_FILE
        if not path.is_file():
            return None
        try:
            info = read_json(path)
        except ForgebenchError:
            return {}   # a damaged marker still marks the run as an example
        return info if isinstance(info, dict) else {}

    # -- the writer's lock ---------------------------------------------------------------
    def acquire_lock(self, purpose: str) -> None:
        """Become the run's one writer until `release_lock()` or process exit (refuses with
        the holder's identity when another job holds it)."""
        if self._lock is None:
            from engine.runlock import RunLock

            self._lock = RunLock(self.path).acquire(purpose)

    def release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def holds_lock(self) -> bool:
        return self._lock is not None

    # -- creation ------------------------------------------------------------------------
    def create(self, manifest: dict) -> None:
        """Start a fresh run, holding its lock. Refuses a directory that already holds anything."""
        if self.path.exists():
            if not self.path.is_dir():
                raise ForgebenchError("output path exists and is not a directory",
                                      path=self.path, hint="choose another --out")
            if any(p.name != LOCK_NAME for p in self.path.iterdir()):
                raise ForgebenchError(
                    "output directory is not empty; a fresh run never writes over another",
                    path=self.path,
                    hint="choose a new --out, or use 'forgebench resume' to continue that run")
        self.path.mkdir(parents=True, exist_ok=True)
        self.acquire_lock("run")  # before run.json: a queued run without a live writer is dead
        self.checkpoints_dir.mkdir()
        atomic_write_json(self.manifest_path, manifest)
        self.seal_manifest()
        self.set_status("queued", step=0)

    # -- the manifest's seal ---------------------------------------------------------------
    def seal_manifest(self) -> None:
        """Record each run.json field's SHA-256 beside it (at creation, and after `relocate`
        rewrote the workspace folder in it)."""
        atomic_write_json(self.path / SEAL_FILE, {
            "about": "SHA-256 of each run.json field when the run was created; resume refuses "
                     "a run.json that no longer matches",
            "fields": field_digests(self.manifest())})

    def amend_manifest(self, fields: dict) -> None:
        """Rewrite run.json with `fields` replaced, by the engine itself before the first step
        (the precision "auto" settled by timing the run's own step), and seal it anew, but only
        if the seal matched before: an edit made by hand stays detectable."""
        matched = self.manifest_drift() == []
        atomic_write_json(self.manifest_path, {**self.manifest(), **fields})
        if matched:
            self.seal_manifest()

    def manifest_drift(self) -> list[str] | None:
        """The run.json fields that differ from the seal (added, removed or changed), [] when
        none, None for a run without a seal (made before seals existed)."""
        path = self.path / SEAL_FILE
        if not path.is_file():
            return None
        try:
            sealed = read_json(path)["fields"]
        except (ForgebenchError, KeyError, TypeError):
            return ["run.seal.json (unreadable)"]
        now = field_digests(self.manifest())
        return sorted(name for name in set(sealed) | set(now) if sealed.get(name) != now.get(name))

    def require_unedited_manifest(self) -> None:
        """Refuse a run whose run.json was edited after it was created (the manifest is
        immutable: the checkpoints were trained under what it says); seal an older run that
        has no seal yet, so later edits are caught."""
        drift = self.manifest_drift()
        if drift is None:
            with contextlib.suppress(OSError):
                self.seal_manifest()
            return
        if drift:
            shown = ", ".join(drift[:8]) + (f" and {len(drift) - 8} more" if len(drift) > 8
                                            else "")
            raise ForgebenchError(
                "run.json was edited after the run was created (the manifest is immutable; "
                f"the checkpoints were trained under what it said): {shown}",
                path=self.manifest_path, where="field " + drift[0],
                hint="restore run.json as it was; to train with other settings start a new "
                     "run (forgebench run), or pass --steps/--save-every... to resume")

    # -- reading -------------------------------------------------------------------------
    def require(self) -> "RunDir":
        if not self.exists():
            raise ForgebenchError("not a run directory (run.json is missing)", path=self.path,
                                  hint="pass the folder that 'forgebench run' created")
        return self

    def manifest(self) -> dict:
        return read_json(self.require().manifest_path)

    def status(self) -> dict:
        try:
            status = read_json(self.path / "status.json")
        except ForgebenchError:
            return {"state": "unknown"}
        return status

    def lock_holder(self) -> dict | None:
        """Who holds the run's lock (pid, process_start, host, purpose, command, since), or
        None when no job is alive in it. The app shows "running elsewhere" for a holder it did
        not start itself."""
        return lock_holder(self.path)

    def live_status(self) -> dict:
        """The status, with a job that died (no process holds the run lock) reported as failed,
        never as forever queued or running."""
        status = self.status()
        if status.get("state") in ACTIVE_STATES and self.lock_holder() is None:
            status = dict(status, state="failed", stale=True,
                          error=status.get("error") or "the job's process is gone without "
                          "writing a final status; resume the run to continue it")
        return status

    def is_active(self) -> bool:
        return self.lock_holder() is not None

    def metrics(self) -> list[dict]:
        return read_log(self.path / "metrics.jsonl")

    def current_metrics(self) -> list[dict]:
        """The metrics, without the lines a later invocation superseded: a job killed after
        its last checkpoint logged steps that the resume trains (and logs) again."""
        starts = {i.get("id"): i.get("start_step") for i in self.invocations()}
        metrics = self.metrics()
        kept = []
        for m in metrics:
            later = [s for inv, s in starts.items() if isinstance(inv, int) and isinstance(s, int)
                     and inv > (m.get("invocation") or 0)]
            if m.get("split", "train") == "train" and later and m.get("step", 0) > min(later):
                continue
            kept.append(m)
        return kept

    def events(self) -> list[dict]:
        return read_log(self.path / "events.jsonl")

    def invocations(self) -> list[dict]:
        return read_log(self.path / "invocations.jsonl")

    def checkpoints(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first. Directories without the sentinel are skipped."""
        found = []
        if self.checkpoints_dir.is_dir():
            for child in self.checkpoints_dir.iterdir():
                match = _CHECKPOINT_RE.match(child.name)
                if match and (child / SENTINEL).is_file():
                    found.append(Checkpoint(child, int(match.group(1))))
        return sorted(found, key=lambda c: c.step)

    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint that verifies (damaged ones are passed over with a
        warning), or None."""
        from engine.train.integrity import verified_checkpoint

        return verified_checkpoint(self, "latest", required=False)

    def checkpoint(self, name_or_step: str | int | None) -> Checkpoint:
        """The checkpoint a reader loads: 'latest' (the newest that verifies), 'best',
        'step-000010', 10 or a path, its files checked against the hashes its sentinel
        records (engine/train/integrity.py `verified_checkpoint`, the one way readers pick)."""
        from engine.train.integrity import verified_checkpoint

        return verified_checkpoint(self, name_or_step)

    def committed_checkpoint(self, name_or_step: str | int | None) -> Checkpoint:
        """Resolve 'latest', 'best', 'step-000010', 10 or a path to a committed checkpoint,
        without verifying it (`checkpoint` verifies)."""
        checkpoints = self.checkpoints()
        if not checkpoints:
            raise ForgebenchError("the run has no committed checkpoint yet", path=self.path)
        if name_or_step in (None, "latest", "last"):
            return checkpoints[-1]
        if name_or_step == "best":
            best = self.status().get("best_checkpoint")
            for ckpt in checkpoints:
                if ckpt.name == best:
                    return ckpt
            raise ForgebenchError("the run has recorded no best checkpoint", path=self.path,
                                  hint="use 'latest' or a step number")
        text = str(name_or_step)
        text = Path(text).name if ("/" in text) else text
        step = int(text) if text.isdigit() else None
        for ckpt in checkpoints:
            if ckpt.name == text or ckpt.step == step:
                return ckpt
        names = ", ".join(c.name for c in checkpoints)
        raise ForgebenchError(f"no committed checkpoint '{name_or_step}'", path=self.path,
                              hint=f"available: {names}")

    # -- writing -------------------------------------------------------------------------
    def set_status(self, state: str, **fields: Any) -> dict:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        previous = self.status()
        previous.pop("stale", None)
        status = {k: v for k, v in previous.items() if k not in ("state", "updated")}
        status.update(fields)
        status.update(state=state, updated=time.time())
        path = self.path / "status.json"
        try:
            atomic_write_json(path, status)
        except OSError as exc:
            # A full disk has no room for the new file; the old one's blocks still hold the
            # few bytes of a final status, so a dead job never reads as `running`.
            if disk_errno(exc) is None or not path.is_file():
                raise
            write_in_place(path, (json.dumps(status, indent=2, sort_keys=True, default=str)
                                  + "\n").encode("utf-8"))
        return status

    def log_metric(self, record: dict) -> None:
        append_line(self.path / "metrics.jsonl",
                    dict(record, time=record.get("time", time.time())))

    def log_event(self, kind: str, **fields: Any) -> None:
        append_line(self.path / "events.jsonl", dict(fields, kind=kind, time=time.time()))

    def log_invocation(self, record: dict) -> None:
        append_line(self.path / "invocations.jsonl", dict(record, time=time.time()))

    @contextlib.contextmanager
    def staging_checkpoint(self, step: int) -> Iterator[Path]:
        """Yield a hidden temp directory to fill; the caller writes the sentinel last.

        On exit the directory is renamed to `checkpoints/step-NNNNNN`. A crash leaves only a
        hidden `.tmp-*` directory, which is never taken for a checkpoint and is swept later.
        """
        final = self.checkpoints_dir / checkpoint_name(step)
        tmp = self.checkpoints_dir / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
        # replace=True: a checkpoint of the same step from an earlier invocation gives way
        with staged_dir(final, staging=tmp, replace=True) as staging:
            yield staging
            if not (staging / SENTINEL).is_file():
                raise RuntimeError(f"checkpoint staged without {SENTINEL}")

    def sweep_staging(self) -> list[str]:
        """Remove what a crash left in checkpoints/: half-written `.tmp-*`/`.old-*` folders, and
        `step-N` folders without the sentinel (a kill during keep-last cleanup, which unlinks
        the sentinel first). Only the job holding the run lock calls this. Returns the names."""
        swept = []
        if self.checkpoints_dir.is_dir():
            for child in sorted(self.checkpoints_dir.iterdir()):
                orphan = (_CHECKPOINT_RE.match(child.name) and child.is_dir()
                          and not (child / SENTINEL).is_file())
                if child.name.startswith(".tmp-") or ".old-" in child.name or orphan:
                    shutil.rmtree(child, ignore_errors=True)
                    swept.append(child.name)
        return swept

    def apply_retention(self, keep_last: int, protect: tuple[str, ...] = ()) -> list[str]:
        """Delete all but the newest `keep_last` checkpoints, sparing `protect` (e.g. best).

        The newest committed checkpoint is never deleted, so a run always keeps one good one.
        """
        checkpoints = self.checkpoints()
        if keep_last <= 0 or len(checkpoints) <= 1:
            return []
        keep = {c.name for c in checkpoints[-max(keep_last, 1):]} | set(protect)
        removed = []
        for ckpt in checkpoints[:-1]:
            if ckpt.name not in keep:
                # Remove the sentinel first: a half-deleted directory is then not a checkpoint.
                (ckpt.path / SENTINEL).unlink()
                shutil.rmtree(ckpt.path, ignore_errors=True)
                removed.append(ckpt.name)
        return removed

    # -- control -------------------------------------------------------------------------
    def request_stop(self) -> bool:
        """Ask the job holding the run lock to finish its step, checkpoint and exit (SIGTERM).
        False when no job holds the run or it cannot be identified for sure (see
        `engine.runlock.signal_holder`, which says why): the pid comes from the lock and is
        checked against the process start time, never a pid alone."""
        import signal

        from engine.runlock import signal_holder

        try:
            return signal_holder(self.path, signal.SIGTERM) is not None
        except ForgebenchError:
            return False

    def write_eval(self, name: str, result: dict) -> Path:
        path = self.evals_dir / f"{name}.json"
        atomic_write_json(path, result)
        self.log_event("eval_done", name=name, path=str(path.relative_to(self.path)))
        return path

    def write_eval_pngs(self, name: str, pngs: dict[str, bytes]) -> list[str]:
        """evals/<name>-<suffix>.png for each (suffix, PNG bytes); their run-relative paths."""
        written = []
        for suffix, data in pngs.items():
            path = self.evals_dir / f"{name}-{suffix}.png"
            atomic_write_bytes(path, data)
            written.append(str(path.relative_to(self.path)))
        return written


def _json_files(run_dir: Path) -> list[Path]:
    """The run's JSON and JSONL files outside checkpoints/ (which no rewrite may touch)."""
    return sorted(p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")
                  and "checkpoints" not in p.relative_to(run_dir).parts)


def _replace_in_json_files(run_dir: Path, old: str, new: str) -> list[str]:
    """Replace `old` by `new` in the run's JSON files; return the ones changed."""
    changed = []
    for path in _json_files(run_dir):
        text = path.read_text(encoding="utf-8")
        if old in text:
            atomic_write_bytes(path, text.replace(old, new).encode("utf-8"))
            changed.append(str(path.relative_to(run_dir)))
    return changed


def make_portable(run_dir: str | os.PathLike, workspace: str | os.PathLike) -> list[str]:
    """Write the workspace folder as `{workspace}` in the run's JSON files; return the files
    changed. Refuses a run any of whose files still names the folder after that (a checkpoint,
    a PNG), so a shipped run never points at the machine that made it."""
    run_dir, root = Path(run_dir), str(Path(workspace).resolve())
    changed = _reseal_after(run_dir, lambda: _replace_in_json_files(
        run_dir, json.dumps(root)[1:-1], WORKSPACE_TOKEN))
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        if root.encode("utf-8") in path.read_bytes():
            raise ForgebenchError("the file still names the workspace folder it was made in",
                                  path=path, hint="this file cannot be shipped as an example")
    return changed


def relocate(run_dir: str | os.PathLike, workspace: str | os.PathLike) -> list[str]:
    """Give a portable run (`make_portable`) the workspace folder it now lives in; return the
    files changed."""
    escaped = json.dumps(str(Path(workspace).resolve()))[1:-1]
    return _reseal_after(Path(run_dir), lambda: _replace_in_json_files(
        Path(run_dir), WORKSPACE_TOKEN, escaped))


def _reseal_after(run_dir: Path, rewrite) -> list[str]:
    """Run `rewrite` (which rewrites the workspace folder in the run's JSON files) and seal the
    new run.json, if the seal matched before: an edit made by hand stays detectable."""
    run = RunDir(run_dir)
    intact = run.exists() and run.manifest_drift() == []
    changed = rewrite()
    if intact and "run.json" in changed:
        run.seal_manifest()
    return changed


def awaits_relocation(run: RunDir) -> bool:
    """True for a run whose run.json still writes its workspace as `{workspace}`: a shipped
    example copied by hand instead of installed, whose recorded paths name no folder yet.
    (Its config's folder is in the workspace, so the token starts the recorded `base_dir`.)"""
    return str(run.manifest().get("config", {}).get("base_dir", "")).startswith(WORKSPACE_TOKEN)


def home_workspace(run_dir: Path) -> Path | None:
    """The workspace a run folder sits in (the folder above its `runs/`), or None."""
    runs = Path(run_dir).resolve().parent
    return runs.parent if runs.name == "runs" else None


def require_relocated(run: RunDir) -> None:
    """Refuse a run that awaits relocation, with the command that relocates it."""
    if not awaits_relocation(run):
        return
    home = home_workspace(run.path)
    raise ForgebenchError(
        f"a shipped example run whose paths are still written {WORKSPACE_TOKEN}",
        path=run.manifest_path,
        hint="install it with the sample workspace (the app's Workspace > Open sample "
             "workspace writes in the folder it lives in), or relocate this copy into the "
             "workspace whose datasets it trains on: forgebench relocate "
             f"{shlex.quote(str(run.path.resolve()))}"
             + ("" if home else " WORKSPACE"))


def describe(run: RunDir) -> dict:
    """A compact summary for `forgebench status` and the app's run list."""
    manifest = run.manifest()
    status = run.live_status()
    metrics = run.current_metrics()
    train = [m for m in metrics if m.get("split", "train") == "train" and "loss" in m]
    evals = [m for m in metrics if m.get("split") in ("val", "test")]
    return {
        "run": str(run.path),
        "recipe": manifest.get("recipe"),
        "state": status.get("state"),
        "step": status.get("step"),
        "target_steps": status.get("target_steps"),
        "last_loss": train[-1]["loss"] if train else None,
        "last_eval": evals[-1] if evals else None,
        "checkpoints": [c.name for c in run.checkpoints()],
        "error": status.get("error"),
        "updated": status.get("updated"),
        "held_by": run.lock_holder(),
    }


def format_status(summary: dict) -> str:
    return json.dumps(summary, indent=2, default=str)
