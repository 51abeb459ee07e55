"""The Models pane's state: the workspace's model library (engine/model_library.py is the
contract; this module shapes it for the pane, the new-run form and the export wizard). No Qt.

Reading the facts parses every header (a 262k-token vocabulary takes a moment), so the pane
calls `ModelsView.load` off the GUI thread and shows `rows` when it returns.

Adding a Hugging Face folder converts every tensor (minutes for a large model), so it runs as an
engine job, `forgebench models add DIR --progress-json --json` (`AddFolderJob`: its command line,
and its progress read from the JSON lines it prints); a cancelled job leaves no library entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from app.viewmodels.jobs import duration_text, forgebench_argv, job_error
from engine import model_library
from engine.errors import ForgebenchError
from engine.export.verdict import exported_file_verdict
from engine.fsutil import human_bytes


@dataclass
class ModelsView:
    root: Path
    rows: list[dict] = field(default_factory=list)

    def load(self) -> list[dict]:
        self.rows = [with_export_verdict(self.root, row)
                     for row in model_library.library(self.root)]
        return self.rows

    def add_file(self, path: str | Path, link: bool = False, name: str | None = None) -> dict:
        return model_library.add_model(self.root, path, name=name,
                                       mode="link" if link else "copy")

    def add_package(self, package: str = model_library.GEMMA_PACKAGE) -> dict:
        return model_library.add_model(self.root, package=package)

    def remove(self, name: str) -> None:
        model_library.remove_model(self.root, name)

    def row(self, name: str) -> dict | None:
        return next((r for r in self.rows if r["name"] == name), None)

    def package_line(self) -> str:
        """What the pane says about the bundled-by-package model."""
        package = model_library.GEMMA_PACKAGE
        title = model_library.KNOWN_PACKAGES[package]
        if any(e.get("package") == package for e in model_library.entries(self.root)):
            return f"{title} is in the library."
        if model_library.package_installed(package):
            return f"{title} is installed as a package: add it with “Add Gemma package”."
        return f"{title} is not installed: pip install {package}, then “Add Gemma package”."


def with_export_verdict(root: Path, row: dict) -> dict:
    """A library row with the verdict of the export that made its file, if one did
    (engine.export.verdict): a file that failed question 1 is listed as not usable."""
    found = exported_file_verdict(root, row.get("sha256"), row.get("source"))
    if found is None:
        return row
    row = {**row, "export_verdict": found.as_dict()}
    if not found.usable:
        row["facts"] = {**row["facts"], "usable": False, "reason": found.line}
    return row


def list_label(row: dict) -> str:
    """One line per model in the pane's list: usable ones with family and size (and the
    export's verdict when an export made the file), the others with the reason."""
    facts = row["facts"]
    if not facts["usable"]:
        return f"⚠ {row['name']} — {facts['reason']}"
    verdict = row.get("export_verdict")
    return f"{row['name']} — {facts['family']}, {facts['params'] / 1e6:.0f}M, " \
           f"{human_bytes(row['bytes'])}" + (f" — {verdict['title']}: {verdict['words']}"
                                              if verdict else "")


def tensor_rows(facts: dict) -> list[tuple[str, str, str, str]]:
    """(type, tensors, parameters, size) for the pane's table."""
    return [(name, str(t["tensors"]), f"{t['params']:,}", human_bytes(t["bytes"]))
            for name, t in facts.get("tensor_types", {}).items()]


def memory_rows(facts: dict) -> list[tuple[str, str, str]]:
    """(mode, memory, fits here?) for the pane's table."""
    memory = facts.get("memory")
    if not memory:
        return []
    available = memory["available"]
    rows = []
    for label, key in (("chat / generate (llama.cpp numerics)", "generate"),
                       ("LoRA, packed weights", "lora_packed"),
                       ("LoRA, dense cache", "lora_dense_cache"),
                       ("full fine-tune", "full")):
        value = memory[key]
        if value is None:
            rows.append((label, "n/a", facts["support"]["full_finetune_reason"] or ""))
        else:
            rows.append((label, human_bytes(value),
                         "fits" if value <= available else
                         f"more than the {human_bytes(available)} available"))
    return rows


def library_files(root: Path) -> list[tuple[str, Path]]:
    """(name, file) of every library model whose file is there: the pickers of the new-run
    form and the export wizard. Reads only workspace.json (no headers): a file the engine
    cannot use is refused with its reason by the form's or the wizard's own checks."""
    try:
        entries = model_library.entries(root)
    except ForgebenchError:      # a broken workspace.json leaves the pickers empty
        return []
    return [(e["name"], model_library.entry_path(root, e)) for e in entries
            if model_library.entry_path(root, e).is_file()
            and _not_defect(exported_file_verdict(root, e.get("sha256"), e.get("source")))]


def _not_defect(verdict) -> bool:
    return verdict is None or verdict.usable


@dataclass
class AddFolderJob:
    """Adding a Hugging Face checkpoint folder as an engine job: `argv` to start, `feed` each
    chunk of its output (the engine prints one JSON progress line per converted tensor, then
    the entry as JSON), `result` when it exits. The conversion is resumable and the library
    entry is written only at its end (engine.model_library), so a cancel leaves no entry."""

    root: Path
    folder: Path
    name: str | None = None
    tensor: str = ""
    index: int = 0
    tensors: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    eta_s: float | None = None
    entry: dict | None = None
    _pending: str = ""

    def argv(self) -> list[str]:
        argv = forgebench_argv() + ["models", "--workspace", str(self.root), "add",
                                    str(self.folder), "--progress-json", "--json"]
        return argv + (["--name", self.name] if self.name else [])

    @property
    def title(self) -> str:
        return f"adding {Path(self.folder).name} to the model library"

    def feed(self, chunk: str) -> tuple[int, int, str] | None:
        """Read a chunk of the job's output; (done, total, stage line) when it moved the
        progress (done/total: the bytes written, in per mille), else None. A line split
        across chunks is kept for the next."""
        self._pending += chunk
        *lines, self._pending = self._pending.split("\n")
        moved = False
        for line in lines:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "progress" in record:
                p = record["progress"]
                self.tensor, self.index, self.tensors = p["tensor"], p["index"], p["tensors"]
                self.bytes_done, self.bytes_total, self.eta_s = p["bytes"], p["total"], \
                    p.get("eta_s")
                moved = True
            elif "name" in record and "sha256" in record:
                self.entry = record
        if not moved:
            return None
        # per mille of the bytes: a progress bar holds a 32-bit int, a model's bytes may not
        return (self.bytes_done * 1000 // max(self.bytes_total, 1), 1000, self.stage())

    def stage(self) -> str:
        """"tensor 3/21 blk.0.attn_q.weight · 1.2 MB of 4.0 MB · ETA 5 s"."""
        if not self.tensors:
            return "reading the checkpoint…"
        text = (f"tensor {self.index}/{self.tensors} {self.tensor} · "
                f"{human_bytes(self.bytes_done)} of {human_bytes(self.bytes_total)}")
        return text + (f" · ETA {duration_text(self.eta_s)}" if self.eta_s is not None
                       and self.index < self.tensors else "")

    def result(self, ok: bool, output: str, cancelled: bool = False) -> tuple[bool, str]:
        """(ok, message) of the finished job: what was added, or the engine's error."""
        if cancelled:
            return False, ("cancelled: nothing was added to the library (the finished tensors "
                           "are kept, and adding the same folder again resumes)")
        if not ok or self.entry is None:
            return False, job_error(output) if output.strip() else "the job failed"
        facts = self.entry.get("facts") or {}
        state = "usable" if facts.get("usable", True) else f"not usable: {facts.get('reason')}"
        return True, (f"added {self.entry['name']} ({human_bytes(self.entry['bytes'])}, "
                      f"converted from {Path(self.folder).name}): {state}")
