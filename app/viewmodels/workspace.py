"""Workspaces (docs/design.md §1) and the app's own settings (recent workspaces, chart choices).

A workspace is a plain folder holding `workspace.json`; the app never keeps anything about a
workspace outside it except the list of recent workspaces.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from engine import model_library
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, read_json
from engine.rundir import LOCK_NAME, relocate

WORKSPACE_FILE = "workspace.json"
WORKSPACE_FORMAT = 1
SUBFOLDERS = ("datasets", "runs", "exports", "ratings", "configs")
MAX_RECENT = 10
REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_SAMPLE = REPO_ROOT / "resources" / "sample-workspace"


def config_dir() -> Path:
    """Where the app keeps settings: $FORGEBENCH_CONFIG_DIR, else ~/.config/forgebench."""
    override = os.environ.get("FORGEBENCH_CONFIG_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "forgebench"


def data_dir() -> Path:
    """Where the sample workspace is copied so runs never write into the installed sources."""
    override = os.environ.get("FORGEBENCH_DATA_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "forgebench"


@dataclass(frozen=True)
class Workspace:
    root: Path
    manifest: dict

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Workspace":
        root = Path(path).expanduser()
        if not root.exists():
            raise ForgebenchError("the workspace folder is missing (moved, renamed or deleted)",
                                  path=root, hint="open another workspace, or create a new one")
        if not (root / WORKSPACE_FILE).is_file():
            raise ForgebenchError(f"not a workspace: {WORKSPACE_FILE} is missing", path=root,
                                  hint="choose the folder that holds workspace.json, "
                                       "or create a new workspace here")
        manifest = read_json(root / WORKSPACE_FILE)
        if not isinstance(manifest, dict):
            raise ForgebenchError("expected a JSON object", path=root / WORKSPACE_FILE)
        return cls(root.resolve(), manifest)

    @classmethod
    def create(cls, path: str | os.PathLike, name: str | None = None) -> "Workspace":
        """Make a new workspace; refuses a folder that already holds other files."""
        root = Path(path).expanduser()
        if (root / WORKSPACE_FILE).is_file():
            raise ForgebenchError("a workspace already exists here", path=root,
                                  hint="open it instead")
        if root.exists() and any(root.iterdir()):
            raise ForgebenchError("the folder is not empty", path=root,
                                  hint="choose an empty or new folder for the workspace")
        root.mkdir(parents=True, exist_ok=True)
        for sub in SUBFOLDERS:
            (root / sub).mkdir(exist_ok=True)
        manifest = {"format": WORKSPACE_FORMAT, "name": name or root.name, "created": time.time()}
        atomic_write_json(root / WORKSPACE_FILE, manifest)
        return cls(root.resolve(), manifest)

    @property
    def name(self) -> str:
        return str(self.manifest.get("name") or self.root.name)

    @property
    def datasets_dir(self) -> Path:
        return self.root / "datasets"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def configs_dir(self) -> Path:
        return self.root / "configs"

    @property
    def launch_dir(self) -> Path:
        """Configs and logs of runs the app started (a run directory must start empty)."""
        return self.runs_dir / ".launch"

    def dataset_dirs(self) -> list[Path]:
        if not self.datasets_dir.is_dir():
            return []
        return sorted(p for p in self.datasets_dir.iterdir() if (p / "dataset.json").is_file())

    def run_dirs(self) -> list[Path]:
        if not self.runs_dir.is_dir():
            return []
        return sorted(p for p in self.runs_dir.iterdir() if (p / "run.json").is_file())

    def config_files(self) -> list[Path]:
        if not self.configs_dir.is_dir():
            return []
        return sorted(self.configs_dir.glob("*.toml"))

    def new_run_dir(self, stem: str) -> Path:
        """A fresh, unused run folder name: runs/<stem>-<date>-<time>[-n]."""
        base = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        candidate, n = self.runs_dir / base, 1
        while candidate.exists() or (self.launch_dir / f"{candidate.name}.toml").exists():
            n += 1
            candidate = self.runs_dir / f"{base}-{n}"
        return candidate


def dialog_folder(workspace: "Workspace | None", *sub: str) -> str:
    """Where a file dialog opens: the open workspace (its `sub` folder when that exists), else
    the user's home; never the folder the app was started from (a checkout, say)."""
    if workspace is None:
        return str(Path.home())
    inner = Path(workspace.root, *sub)
    return str(inner if inner.is_dir() else workspace.root)


def _entries(folder: Path) -> tuple:
    """(name, mtime_ns) of a folder's entries; () when it is missing."""
    try:
        return tuple(sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(folder)))
    except OSError:
        return ()


def file_stamp(path: str | os.PathLike | None) -> tuple | None:
    """(path, mtime_ns): what tells a file written again from the one a pane shows."""
    try:
        return (str(path), os.stat(path).st_mtime_ns) if path else None
    except OSError:
        return None


class WorkspaceWatch:
    """What changed in a workspace since the last look, from directory listings alone (a few
    `scandir` calls per run, no file reads), so panes refresh when a job or another window
    adds a run, a checkpoint, samples, a config or a dataset.

    `changes()` returns a subset of {"runs", "configs", "datasets", "ratings"}: "runs" covers
    new or removed run folders, new checkpoints, new samples and evaluations written (an eval
    lands without a checkpoint: `forgebench eval` of an existing one)."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self.last = self.signature()

    def signature(self) -> dict[str, tuple]:
        ws = self.workspace
        runs = []
        for run in ws.run_dirs():
            samples = _entries(run / "samples")
            runs.append((run.name, _entries(run / "checkpoints"), _entries(run / "evals"),
                         samples,
                         tuple(_entries(run / "samples" / name) for name, _ in samples)))
        return {"runs": tuple(runs), "configs": _entries(ws.configs_dir),
                "datasets": tuple((p.name, _entries(p)) for p in ws.dataset_dirs()),
                "ratings": _entries(ws.root / "ratings")}

    def changes(self) -> set[str]:
        now = self.signature()
        changed = {key for key, value in now.items() if self.last.get(key) != value}
        self.last = now
        return changed


def install_sample_workspace(target: Path | None = None) -> Path:
    """Copy the bundled sample workspace to the user's data folder (once) and return it, with
    its finished example runs (packaging/make_examples.py) relocated to the copy. Its
    model library gets the Gemma package model whenever that package is installed (the Models
    pane says how to install it when it is not)."""
    target = target or data_dir() / "sample-workspace"
    if (target / WORKSPACE_FILE).is_file():
        _register_sample_model(target)
        return target
    if not BUNDLED_SAMPLE.is_dir():
        raise ForgebenchError("the bundled sample workspace is missing", path=BUNDLED_SAMPLE,
                              hint="reinstall Forgebench or create a new workspace")
    shutil.copytree(BUNDLED_SAMPLE, target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(LOCK_NAME, "__pycache__"))
    for sub in SUBFOLDERS:
        (target / sub).mkdir(exist_ok=True)
    for run in Workspace(target.resolve(), {}).run_dirs():
        relocate(run, target)   # the example runs name the folder they now live in
    if not (target / WORKSPACE_FILE).is_file():
        atomic_write_json(target / WORKSPACE_FILE, {"format": WORKSPACE_FORMAT,
                                                    "name": "Sample workspace",
                                                    "created": time.time()})
    _register_sample_model(target)
    return target


def _register_sample_model(target: Path) -> None:
    try:
        model_library.register_package_if_installed(target)
    except ForgebenchError:
        pass    # a broken package install: the Models pane shows why when it is added


class Settings:
    """The app's settings file (JSON): recent workspaces and view preferences."""

    def __init__(self, path: Path | None = None):
        self.path = path or config_dir() / "settings.json"
        try:
            data = read_json(self.path)
        except ForgebenchError:
            data = {}  # first launch, or an unreadable file: start over rather than refuse
        self.data: dict = data if isinstance(data, dict) else {}

    @property
    def first_launch(self) -> bool:
        return not self.data.get("recent")

    @property
    def recent(self) -> list[str]:
        return list(self.data.get("recent", []))

    def add_recent(self, path: str | os.PathLike) -> None:
        path = str(Path(path).resolve())
        self.data["recent"] = [path] + [p for p in self.recent if p != path][:MAX_RECENT - 1]
        self.save()

    def forget(self, path: str | os.PathLike) -> None:
        self.data["recent"] = [p for p in self.recent if p != str(path)]
        self.save()

    def get(self, key: str, default=None):
        return self.data.get(key, default)

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, self.data)
