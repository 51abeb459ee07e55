"""`forgebench models add|list|show|remove`: the workspace's model library
(engine/model_library.py). `add` copies or links a GGUF file (or an installed package's
model) or converts a Hugging Face checkpoint folder, with `--progress-json` lines for the
app's Models pane; outside a workspace, `models show FILE` describes a plain GGUF file from its
own header. `find_workspace` (the workspace around the current folder) serves chat and serve
too."""

from __future__ import annotations

import json
from pathlib import Path

from engine import model_library
from engine.errors import ForgebenchError
from engine.fsutil import human_bytes


def find_workspace(given: str | None, start: Path | None = None) -> Path | None:
    """--workspace, else the nearest folder holding workspace.json from `start` (the current
    folder) upwards."""
    if given:
        root = Path(given).expanduser()
        if not (root / model_library.WORKSPACE_FILE).is_file():
            raise ForgebenchError(f"not a workspace: {model_library.WORKSPACE_FILE} is missing",
                                  path=root, where="--workspace")
        return root.resolve()
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / model_library.WORKSPACE_FILE).is_file():
            return folder
    return None


def _require_workspace(args) -> Path:
    root = find_workspace(args.workspace)
    if root is None:
        raise ForgebenchError("no workspace here", where="--workspace",
                              hint="run inside a workspace folder or pass --workspace DIR")
    return root


def file_row(path: Path) -> dict:
    """A GGUF file outside any library as a `library()` row: `models show FILE` describes it
    the same way, from the file's own header."""
    from engine.fsutil import sha256_file

    return {"name": path.name, "mode": "file", "bytes": path.stat().st_size,
            "sha256": sha256_file(path), "source": str(path.resolve()),
            "facts": model_library.model_facts(path)}


def json_progress(delay: float = 0.0):
    """A conversion's progress as one JSON line per finished tensor on stdout, flushed:
    {"progress": {"tensor", "index", "tensors", "bytes", "total", "eta_s"}} (the app's Models
    pane reads them: app/viewmodels/models.py). The ETA is the bytes rate since the first
    finished tensor of this invocation (a resumed conversion counts only its own bytes)."""
    import time

    first: list[tuple[float, int]] = []

    def progress(tensor, index: int, tensors: int, written: int, total: int) -> None:
        now = time.monotonic()
        if not first:
            first.append((now, written))
        start, start_bytes = first[0]
        eta = (now - start) / (written - start_bytes) * (total - written) \
            if written > start_bytes else None
        print(json.dumps({"progress": {"tensor": tensor.name, "index": index,
                                       "tensors": tensors, "bytes": written, "total": total,
                                       "eta_s": eta}}), flush=True)
        if delay:
            time.sleep(delay)
    return progress


def cmd_models(args) -> int:
    if args.models_command == "show":
        root = find_workspace(args.workspace)
        known = root is not None and any(e["name"] == args.name
                                         for e in model_library.entries(root))
        if not known:
            return _show_file(args, root)
    root = _require_workspace(args)
    if args.models_command == "add":
        return _add(args, root)
    if args.models_command == "remove":
        model_library.remove_model(root, args.name)
        print(f"removed {args.name}")
        return 0
    rows = model_library.library(root)
    if args.models_command == "show":
        row = next((r for r in rows if r["name"] == args.name), None)
        if row is None:
            model_library.get_entry(root, args.name)      # raises with the known names
        print(json.dumps(row, ensure_ascii=False, indent=1) if args.json
              else model_library.describe(row))
        return 0
    return _list(args, rows)


def _show_file(args, root: Path | None) -> int:
    """`models show NAME` where NAME is no library model: a GGUF file's own facts."""
    path = Path(args.name).expanduser()
    if path.is_file():
        row = file_row(path)
        print(json.dumps(row, ensure_ascii=False, indent=1) if args.json
              else model_library.describe(row))
        return 0
    if root is None:
        raise ForgebenchError("not a GGUF file, and no workspace here to look the name up "
                              "in", path=args.name, where="NAME",
                              hint="give a GGUF file's path, or run inside a workspace "
                                   "(or pass --workspace DIR)")
    model_library.get_entry(root, args.name)      # raises with the known names
    return 0


def _add(args, root: Path) -> int:
    progress = json_progress(getattr(args, "tensor_delay", 0.0)) \
        if getattr(args, "progress_json", False) else None
    entry = model_library.add_model(root, args.file, package=args.package, name=args.name,
                                    mode="link" if args.link else "copy", progress=progress)
    facts = model_library.model_facts(model_library.entry_path(root, entry))
    if args.json:
        print(json.dumps({**entry, "facts": facts}, ensure_ascii=False))
    else:
        state = "usable" if facts["usable"] else f"NOT USABLE: {facts['reason']}"
        print(f"added {entry['name']} ({entry['mode']}, sha256 {entry['sha256'][:16]}…): "
              f"{state}")
    return 0


def _list(args, rows: list[dict]) -> int:
    if args.json:
        print(json.dumps(rows, ensure_ascii=False))
        return 0
    if not rows:
        print("the library is empty: forgebench models add FILE.gguf  (or --package "
              f"{model_library.GEMMA_PACKAGE})")
    for row in rows:
        facts = row["facts"]
        state = (f"{facts['family']}, {facts['params'] / 1e6:.0f}M params, "
                 + "/".join(facts["tensor_types"]) if facts["usable"]
                 else f"NOT USABLE: {facts['reason']}")
        print(f"{row['name']:<28} {human_bytes(row['bytes']):>10}  {state}")
    return 0
