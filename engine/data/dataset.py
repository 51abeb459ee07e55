"""Datasets on disk: load, validate, version.

`validate_dataset(dir)` returns every problem as a `Finding` naming the file, the line or record,
the field and the reason, so the app can mark the right record. `load_dataset(dir)` raises the
first error as a ForgebenchError and otherwise returns a `Dataset` whose records have their file
paths resolved. Raw files are never rewritten: `save_new_version` writes a new folder whose
manifest names its parent.

A dataset's version (`dataset_version`) is computed from its manifest: every file's SHA-256 and
every field a run reads, so editing dataset.json by hand gives a new version; `data_change`
is how resume compares a run's recorded data with the data now.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from engine.data import decisions, tool_records
from engine.data import formats as F
from engine.errors import ForgebenchError
from engine.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    sha256_bytes,
    sha256_file,
    staged_dir,
)
from engine.paths import inside, safe_relpath

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class Finding:
    """One problem: `file` relative to the dataset, `where` a line or record, `field` or None."""

    file: str
    where: str | None
    field: str | None
    reason: str
    severity: str = "error"  # "error" blocks loading; "warning" is reported only
    record_id: str | None = None

    def render(self) -> str:
        parts = [self.file] + [p for p in (self.where, self.field and f"field {self.field!r}") if p]
        return f"{self.severity}: {': '.join(parts)}: {self.reason}"


@dataclass
class Report:
    root: Path
    kind: str | None
    n_records: int = 0
    findings: list[Finding] = field(default_factory=list)
    # images a run converts to RGB on load, by source mode (media.rgb_conversion decides)
    conversions: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, file: str, where: str | None, field_name: str | None, reason: str,
            severity: str = "error", record_id: str | None = None) -> None:
        self.findings.append(Finding(file, where, field_name, reason, severity, record_id))

    def to_json(self) -> dict:
        return {"root": str(self.root), "kind": self.kind, "records": self.n_records,
                "ok": self.ok, "errors": len(self.errors),
                "warnings": len(self.findings) - len(self.errors),
                "conversions": dict(self.conversions),
                "findings": [asdict(f) for f in self.findings]}

    def conversion_note(self) -> str | None:
        """"40 images converted from L to RGB on load", or None when none is."""
        return conversion_note(self.conversions)

    def raise_first(self) -> None:
        if self.errors:
            first = self.errors[0]
            where = ", ".join(p for p in (first.where, first.field and f"field {first.field!r}")
                              if p) or None
            more = len(self.errors) - 1
            raise ForgebenchError(
                first.reason + (f" (and {more} more error{'s' * (more > 1)})" if more else ""),
                path=self.root / first.file, where=where,
                hint=f"run `forgebench data validate {self.root}` to list every problem")


def conversion_note(conversions: dict[str, int]) -> str | None:
    """What a data card and `data validate` say about images converted on load."""
    if not conversions:
        return None
    parts = [f"{n} image{'s' * (n != 1)} converted from {mode} to RGB"
             for mode, n in sorted(conversions.items())]
    return "; ".join(parts) + " on load (the image recipes read 8-bit RGB)"


# ----------------------------------------------------------------------------- files


def progress_bar(items, **bar):
    """tqdm's progress bar over `items` on stderr. tqdm is imported on first use: the app reads
    this module while its window starts, and importing tqdm costs a noticeable part of that."""
    from tqdm import tqdm

    return tqdm(items, **bar)


def _hash_files(root: Path, progress: bool = False) -> dict[str, str]:
    """sha256 of every data file under root (not the manifest, cards or hidden files)."""
    skip = {F.MANIFEST, *F.CARD_FILES}
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".")
                                              for part in p.relative_to(root).parts))
    names = [n for n in names if n not in skip]
    return {n: sha256_file(root / n)
            for n in progress_bar(names, desc="hashing", unit="file", disable=not progress)}


def version_id(files: dict[str, str]) -> str:
    """A content address for a set of files: it changes whenever any byte changes (the
    version of a manifest written before `VERSION_SCHEME` 2)."""
    return sha256_bytes(json.dumps(sorted(files.items())).encode())[:16]


# 1: a version covered the data files only; 2: the files and the manifest fields a run reads
VERSION_SCHEME = 2
# Manifest fields that describe a dataset without changing what a run reads from it. Every
# other field (kind, records, layout, classes, image, audio, table, splits, options, ...),
# including one this build does not know yet, is part of the version.
DESCRIPTIVE_FIELDS = frozenset({"name", "version", "version_scheme", "parent", "created",
                                "history", "provenance", "rights", "card", "description"})


def dataset_version(manifest: dict) -> str:
    """The dataset's version: a content address over every file's SHA-256 and every manifest
    field a run reads, so editing dataset.json's classes, table or records file gives a new
    version while a new name or rights statement does not. Computed from the manifest (never
    taken from its `version` field, which an edit leaves stale)."""
    read = {k: v for k, v in manifest.items() if k not in DESCRIPTIVE_FIELDS and k != "files"}
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    blob = json.dumps({"files": sorted(files.items()), "manifest": read}, sort_keys=True,
                      ensure_ascii=False, default=str)
    return sha256_bytes(blob.encode())[:16]


def data_change(recorded: dict, current: dict) -> str | None:
    """How a run's recorded data (`data_manifest`, in run.json) differs from the data now, or
    None when resuming reads the same data.

    A record made before datasets were versioned by scheme 2 has no `version_scheme`: its
    version covered the files only, so it is compared on what it can vouch for (the folder
    and every file's SHA-256) rather than refused because the version's definition changed."""
    if recorded == current:
        return None
    if "version_scheme" in current and "version_scheme" not in recorded:
        kept = set(recorded) - {"version"}      # what the old record can vouch for
        if {k: recorded[k] for k in kept} == {k: current.get(k) for k in kept}:
            return None
    parts = _file_changes(recorded.get("files", {}), current.get("files", {}))
    if not parts and recorded.get("version") != current.get("version"):
        parts.append(f"dataset.json changed (version {recorded.get('version')} is now "
                     f"{current.get('version')}): a field the run reads was edited")
    old_versions, new_versions = recorded.get("versions") or {}, current.get("versions") or {}
    if not parts and old_versions != new_versions:
        parts += [f"{name}/dataset.json changed (version {old_versions.get(name)} is now "
                  f"{new_versions.get(name)}): a field the run reads was edited"
                  for name in sorted(set(old_versions) | set(new_versions))
                  if old_versions.get(name) != new_versions.get(name)]
    if not parts and recorded.get("dataset") != current.get("dataset"):
        parts.append(f"the dataset folder is now {current.get('dataset')} "
                     f"(was {recorded.get('dataset')})")
    return "; ".join(parts) or "the data manifest differs"


def _file_changes(old_files: dict, new_files: dict) -> list[str]:
    """Each file missing, new or with a different SHA-256, by name."""
    parts = []
    for name in sorted(set(old_files) | set(new_files)):
        if name not in new_files:
            parts.append(f"{name} is missing")
        elif name not in old_files:
            parts.append(f"{name} is new")
        elif old_files[name] != new_files[name]:
            parts.append(f"{name} has a different SHA-256")
    return parts


def write_manifest(root: str | os.PathLike, kind: str, name: str, *, parent: str | None = None,
                   progress: bool = False, **fields: Any) -> dict:
    """Hash every file in `root` and write its dataset.json (used by generators and `init`)."""
    if kind not in F.KINDS:
        raise ForgebenchError(f"unknown dataset kind {kind!r}", where="kind",
                              hint="use one of " + ", ".join(F.kind_names()))
    root = Path(root)
    files = _hash_files(root, progress)
    manifest = {"kind": kind, "schema_version": F.SCHEMA_VERSION, "name": name,
                "version": None, "parent": parent, "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}
    manifest.update(version=dataset_version(manifest), version_scheme=VERSION_SCHEME)
    atomic_write_json(root / F.MANIFEST, manifest)
    return manifest


# ----------------------------------------------------------------------------- records


def records_file_of(manifest: dict, kind: F.Kind, root: Path) -> str:
    """The records file a manifest names, or the kind's default when it names none."""
    if isinstance(manifest.get("records"), str):
        return manifest["records"]
    for candidate in (kind.records, *kind.alt_records):
        if candidate in manifest.get("files", {}) or (root / candidate).exists():
            return candidate
    return kind.records


def read_raw_records(root: Path, rel: str, manifest: dict, kind: F.Kind,
                     report: Report) -> list[tuple[str, dict]]:
    """(where, record) pairs from a JSONL or CSV file, a class-per-folder layout, or
    one-document-per-line text files."""
    layout = _layout(manifest, kind)
    if layout == "folders":
        return _folder_records(manifest)
    if layout == "text-lines":
        return _text_line_records(root, manifest, report)
    path = root / rel
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        report.add(rel, None, None, "records file not found")
        return []
    except OSError as exc:
        report.add(rel, None, None, f"cannot read records file ({exc.strerror})")
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        report.add(rel, f"line {line}", None, "not valid UTF-8 text")
        return []
    if rel.endswith(".csv"):
        rows = _csv_records(rel, text, report)
        if kind.name == "tabular":
            from engine.data.tabular import assign_ids

            assign_ids(rows, manifest)
        return rows
    out = []
    for number, record, problem in jsonl_objects(text):
        if problem:
            report.add(rel, f"line {number}", None, problem)
        else:
            out.append((f"line {number}", record))
    return out


def jsonl_objects(text: str) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, object, None) for each non-blank line holding a JSON object, or
    (line number, None, problem) for one that does not."""
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            yield number, None, f"not valid JSON ({reason})"
            continue
        if not isinstance(value, dict):
            yield number, None, f"each line must be a JSON object, found {type(value).__name__}"
            continue
        yield number, value, None


def _csv_records(rel: str, text: str, report: Report) -> list[tuple[str, dict]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    out = []
    try:
        for row in reader:
            where = f"line {reader.line_num}"
            if None in row:
                report.add(rel, where, None, "more values than header columns")
                continue
            out.append((where, {k: v for k, v in row.items() if k and v not in (None, "")}))
    except csv.Error as exc:
        report.add(rel, f"line {reader.line_num}", None, f"not valid CSV ({exc})")
    return out


def _layout(manifest: dict, kind: F.Kind) -> str:
    """"records" (a JSONL/CSV file), "folders" (image-classify: a folder per class) or
    "text-lines" (text-corpus: `splits: {name: {"file": "train.txt"}}`, a document a line)."""
    if kind.name == "image-classify" and manifest.get("layout") == "folders":
        return "folders"
    splits = manifest.get("splits")
    if kind.name == "text-corpus" and isinstance(splits, dict) and splits and all(
            isinstance(v, dict) and isinstance(v.get("file"), str) for v in splits.values()):
        return "text-lines"
    return "records"


def read_listed_text(root: Path, rel: str, report: Report) -> str | None:
    """The UTF-8 text of a file the manifest lists, or None with the reason reported."""
    try:
        return (root / rel).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        report.add(rel, None, None, f"unreadable as UTF-8 text ({exc})")
        return None


def _text_line_records(root: Path, manifest: dict,
                       report: Report) -> list[tuple[str, dict]]:
    out = []
    for split, spec in manifest["splits"].items():
        rel = spec["file"]
        if split not in F.SPLITS:
            report.add(F.MANIFEST, None, "splits", f"{split!r} is not one of "
                       f"{', '.join(F.SPLITS)}")
            continue
        reason = safe_relpath(rel)
        if reason or rel not in manifest["files"]:
            report.add(F.MANIFEST, None, "splits", f"{rel!r} {reason or 'is not listed in files'}")
            continue
        text = read_listed_text(root, rel, report)
        if text is None:
            continue
        for number, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                rid = f"{rel}:{number}"
                out.append((f"{rel} line {number}",
                            {"id": rid, "text": line, "split": split, "group": rid}))
    return out


def _folder_records(manifest: dict) -> list[tuple[str, dict]]:
    """`<class>/<file>` or `<split>/<class>/<file>` image folders as records."""
    out = []
    for rel in sorted(manifest.get("files", {})):
        parts = rel.split("/")
        if not rel.lower().endswith(F.IMAGE_SUFFIXES) or len(parts) < 2:
            continue
        record = {"id": rel.rsplit(".", 1)[0], "image": rel}
        if parts[0] in F.SPLITS and len(parts) >= 3:
            record.update(split=parts[0], label=parts[1])
        else:
            record["label"] = parts[0]
        out.append((rel, record))
    return out


def _nonempty_string(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"must be a string, found {type(value).__name__}"
    return None if value.strip() else "must not be empty"


def _check_label(value: Any, manifest: dict, kind: F.Kind) -> str | None:
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    classes = manifest.get("classes")
    allowed = list(classes or []) + ([F.EMPTY_LABEL] if kind.name in
                                     ("image-masks", "image-boxes") else [])
    if classes and value not in allowed:
        return f"unknown label {value!r}; the dataset's classes are {', '.join(allowed)}"
    return None


# field type -> (value, manifest, kind) -> why the value is not valid, or None
_FIELD_CHECKS: dict[str, Callable[[Any, dict, F.Kind], str | None]] = {
    F.TEXT: lambda v, m, k: _nonempty_string(v),
    F.ID: lambda v, m, k: _nonempty_string(v),
    F.STR: lambda v, m, k: None if isinstance(v, str)
    else f"must be a string, found {type(v).__name__}",
    F.RIGHTS: lambda v, m, k: None if isinstance(v, (str, dict))
    else "must be a string or an object",
    F.SPLIT: lambda v, m, k: None if v in F.SPLITS else f"must be one of {', '.join(F.SPLITS)}",
    F.PATH: lambda v, m, k: safe_relpath(v),
    F.LABEL: _check_label,
    F.SHA256: lambda v, m, k: None if isinstance(v, str) and _HEX64.match(v)
    else "must be 64 lowercase hex digits",
    F.BOX: lambda v, m, k: _check_box(v),
    F.MESSAGES: lambda v, m, k: _check_messages(v),
    F.OUTCOME: lambda v, m, k: None if v in F.OUTCOMES
    else f"must be one of {', '.join(F.OUTCOMES)}",
    F.OPTIONS: lambda v, m, k: decisions.options_problem(v, decisions.schema_of(m)),
    F.TOOLS: lambda v, m, k: None,     # checked with the record's messages in check_record
}


def _check_field(ftype: str, value: Any, manifest: dict, kind: F.Kind) -> str | None:
    """Why `value` is not a valid `ftype`, or None."""
    if ftype not in _FIELD_CHECKS:
        raise AssertionError(f"unknown field type {ftype}")
    return _FIELD_CHECKS[ftype](value, manifest, kind)


def _check_box(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 4 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in value):
        return "must be null or [x0, y0, x1, y1] with four finite numbers"
    x0, y0, x1, y1 = value
    if not (0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1):
        return "must be normalized with 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1"
    return None


def _check_messages(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return "must be a non-empty list of {role, content} objects"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} must be an object"
        if message.get("role") not in F.MESSAGE_ROLES:
            return f"message {i} role must be one of {', '.join(F.MESSAGE_ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {i} content must be a string"
    if not any(m["role"] == "assistant" for m in value):
        return "has no assistant message to learn from"
    return None


_NAMED_FIELD = re.compile(r"field '([^']+)' (.*)", re.DOTALL)


def _tool_conversation_problems(record: dict) -> list[tuple[str | None, str]]:
    """A tool-call record's problem, at the exact field its message names
    (`messages[2].tool_calls[0].function.arguments`), or none."""
    try:
        tool_records.tool_conversation(record, "messages", None, "")
    except ForgebenchError as exc:
        named = _NAMED_FIELD.match(exc.message)
        return [named.groups() if named else ("messages", exc.message)]
    return []


def check_record(record: dict, kind: F.Kind, manifest: dict) -> list[tuple[str | None, str]]:
    """(field, reason) problems of one record; the app calls it for inline validation."""
    if kind.id_from and "id" not in record and isinstance(record.get(kind.id_from), str):
        record["id"] = record[kind.id_from]
    problems = _missing_fields(record, kind)
    types = {**F.COMMON_FIELDS, **kind.fields}
    for name, value in record.items():
        if name in types and not (name == "box" and value is None):
            if (value is None and name not in kind.required) or any(p[0] == name for p in problems):
                continue
            reason = _check_field(types[name], value, manifest, kind)
            if reason:
                problems.append((name, reason))
    if not problems:
        problems = _cross_field_problems(record, kind)
    return problems


def _missing_fields(record: dict, kind: F.Kind) -> list[tuple[str | None, str]]:
    """The kind's required fields the record lacks (one group of `one_of` included)."""
    problems: list[tuple[str | None, str]] = []
    for name in kind.required:
        if name not in record or record[name] is None and name != "box":
            problems.append((name, "required field is missing"))
    if kind.one_of:
        present = [group for group in kind.one_of if any(f in record for f in group)]
        if len(present) != 1:
            options = " or ".join("/".join(g) for g in kind.one_of)
            problems.append((None, f"give exactly one of {options}"))
        else:
            problems += [(f, "required field is missing") for f in present[0] if f not in record]
    return problems


def _cross_field_problems(record: dict, kind: F.Kind) -> list[tuple[str | None, str]]:
    """The checks between the fields of a record whose fields are each valid: a preference
    pair's two texts differ, a tool conversation's calls, a decision among its own options."""
    problems: list[tuple[str | None, str]] = []
    if kind.distinct and len({str(record.get(f)).strip()
                              for f in kind.distinct}) < len(kind.distinct):
        problems.append((kind.distinct[-1], f"{' and '.join(kind.distinct)} are the same text, "
                                            "so the pair prefers nothing"))
    tools_field = next((n for n, t in kind.fields.items() if t == F.TOOLS), None)
    if tools_field in record and not problems:
        problems += _tool_conversation_problems(record)
    if kind.chosen_from and not problems:
        answer, options = kind.chosen_from
        ids = [o["id"] for o in record[options]]
        if record[answer] not in ids:
            problems.append((answer, f"{record[answer]!r} is not one of this record's "
                                     f"{options} ({', '.join(ids)})"))
    return problems


# ----------------------------------------------------------------------------- validation


def _validate_manifest(root: Path, report: Report) -> dict | None:
    manifest = _read_manifest(root, report)
    if manifest is None:
        return None
    kind = manifest.get("kind")
    if kind not in F.KINDS:
        report.add(F.MANIFEST, None, "kind",
                   f"unknown dataset kind {kind!r}; use one of {', '.join(F.kind_names())}")
        return None
    report.kind = kind
    problem = _manifest_problem(manifest)
    if problem is not None:
        report.add(F.MANIFEST, None, *problem)
        return None
    version = dataset_version(manifest)
    if manifest.get("version_scheme") == VERSION_SCHEME and manifest.get("version") != version:
        report.add(F.MANIFEST, None, "version",
                   f"edited after it was written: the dataset's version is now {version} (the "
                   f"file records {manifest.get('version')}); a run started on the old version "
                   "will not resume on this one", severity="warning")
    return manifest


def _read_manifest(root: Path, report: Report) -> dict | None:
    """dataset.json as a JSON object, or None with the reason reported."""
    path = root / F.MANIFEST
    if not root.is_dir():
        report.add(".", None, None, "dataset folder not found")
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        report.add(F.MANIFEST, None, None,
                   "missing; a dataset folder holds a dataset.json (create one with "
                   "`forgebench data init DIR --kind KIND`)")
        return None
    except UnicodeDecodeError:
        report.add(F.MANIFEST, None, None, "not valid UTF-8 text")
        return None
    except json.JSONDecodeError as exc:
        report.add(F.MANIFEST, f"line {exc.lineno}", None, f"not valid JSON ({exc.msg})")
        return None
    if not isinstance(manifest, dict):
        report.add(F.MANIFEST, None, None, "must be a JSON object")
        return None
    return manifest


def _manifest_problem(manifest: dict) -> tuple[str, str] | None:
    """(field, reason) of the first malformed manifest field, or None."""
    if manifest.get("schema_version") != F.SCHEMA_VERSION:
        return ("schema_version", f"schema version {manifest.get('schema_version')!r} is not "
                f"supported (this build reads {F.SCHEMA_VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(v, str) and _HEX64.match(v) for v in files.values()):
        return "files", "must map relative paths to sha256 hex digests"
    classes = manifest.get("classes")
    if classes is not None and not (isinstance(classes, list) and classes and
                                    all(isinstance(c, str) and c for c in classes)):
        return "classes", "must be a non-empty list of strings"
    if "options" in manifest and (problem := decisions.schema_problem(manifest["options"])):
        return "options", f"the option schema {problem}"
    for section in ("image", "audio", "split_policy", "provenance", "card"):
        if section in manifest and not isinstance(manifest[section], dict):
            return section, "must be an object"
    return None


def _validate_files(root: Path, manifest: dict, report: Report, check_hashes: bool,
                    progress: bool) -> None:
    for rel, digest in progress_bar(sorted(manifest["files"].items()), desc="checking files",
                                    unit="file", disable=not progress):
        reason = safe_relpath(rel)
        if reason:
            report.add(F.MANIFEST, None, "files", f"{rel!r} {reason}")
            continue
        path = inside(root, rel)
        if path is None:
            report.add(rel, None, None, "is a link that leads outside the dataset folder")
        elif not path.is_file():
            report.add(rel, None, None, "listed in dataset.json but missing")
        elif check_hashes and sha256_file(path) != digest:
            report.add(rel, None, None,
                       "changed since dataset.json was written (sha256 differs); raw data is "
                       "never edited in place: save edits as a new version")


def _validate_splits_file(root: Path, manifest: dict, report: Report) -> dict[str, str]:
    if F.SPLITS_FILE not in manifest["files"]:
        return {}
    try:
        assignments = json.loads((root / F.SPLITS_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        report.add(F.SPLITS_FILE, None, None, f"unreadable ({exc})")
        return {}
    groups = assignments.get("groups") if isinstance(assignments, dict) else None
    if not isinstance(groups, dict) or not all(v in F.SPLITS for v in groups.values()):
        report.add(F.SPLITS_FILE, None, "groups", "must map group names to split names")
        return {}
    return groups


def _validate_media(root: Path, kind: F.Kind, manifest: dict, rel_records: str,
                    items: list[tuple[str, dict]], report: Report, progress: bool,
                    require: dict) -> None:
    for where, record in progress_bar(items, desc="checking media", unit="record",
                                      disable=not progress):
        rid = str(record.get("id"))
        at = f"{where} (id {rid!r})"
        paths = _media_paths(root, kind, manifest, record, rel_records, at, rid, report)
        if kind.media == "audio" and "path" in paths:
            _check_clip(paths["path"], record, manifest, require, rel_records, at, rid, report)
            continue
        image_field = "file_name" if kind.name == "captioned-images" else "image"
        if image_field in paths:
            _check_image(paths, image_field, record, manifest, kind, require, rel_records, at,
                         rid, report)


def _media_paths(root: Path, kind: F.Kind, manifest: dict, record: dict, rel_records: str,
                 at: str, rid: str, report: Report) -> dict[str, Path]:
    """The record's media files that are listed in the manifest and inside the folder."""
    paths = {}
    for name in kind.path_fields:
        rel = record.get(name)
        if not isinstance(rel, str) or safe_relpath(rel):
            continue
        if rel not in manifest["files"]:
            report.add(rel_records, at, name, f"{rel!r} is not listed in dataset.json files",
                       record_id=rid)
        elif inside(root, rel) is not None:
            paths[name] = root / rel
    return paths


def _check_clip(path: Path, record: dict, manifest: dict, require: dict, rel_records: str,
                at: str, rid: str, report: Report) -> None:
    from engine.data import media

    _, _, reason = media.check_audio(path, {**manifest.get("audio", {}),
                                            **require.get("audio", {})})
    if reason:
        report.add(rel_records, at, "path", f"{record['path']}: {reason}", record_id=rid)
    if record.get("sha256") and record["sha256"] != manifest["files"].get(record["path"]):
        report.add(rel_records, at, "sha256", "does not match the file's sha256",
                   record_id=rid)


def _check_image(paths: dict[str, Path], image_field: str, record: dict, manifest: dict,
                 kind: F.Kind, require: dict, rel_records: str, at: str, rid: str,
                 report: Report) -> None:
    from engine.data import media

    image, reason = media.open_image(paths[image_field])
    reason = reason or media.check_image(
        image, {**manifest.get("image", {}), **require.get("image", {})})
    if not reason:
        how, reason = media.rgb_conversion(image)
        if how:
            report.conversions[image.mode] = report.conversions.get(image.mode, 0) + 1
    if reason:
        report.add(rel_records, at, image_field, f"{record[image_field]}: {reason}",
                   record_id=rid)
        return
    if "mask" in paths:
        _check_mask(paths["mask"], image, record, manifest, kind, rel_records, at, rid,
                    report)


def _check_mask(path: Path, image, record: dict, manifest: dict, kind: F.Kind,
                rel_records: str, at: str, rid: str, report: Report) -> None:
    from engine.data import media

    mask, reason = media.open_image(path)
    array = None
    if not reason:
        array, reason = media.mask_array(mask)
    if not reason and mask.size != image.size:
        reason = f"mask size {mask.size} differs from image size {image.size}"
    if not reason and manifest.get("mask_values", "binary") == "binary":
        reason = media.check_binary_mask(array)
    if reason:
        report.add(rel_records, at, "mask", f"{record['mask']}: {reason}", record_id=rid)
        return
    derived = media.box_from_mask(array)
    if record.get("label") == F.EMPTY_LABEL and derived is not None:
        report.add(rel_records, at, "label", "label is 'empty' but the mask has foreground",
                   record_id=rid)
    if "box" in record and _check_box(record["box"]) is None:
        box = record["box"]
        if (box is None) != (derived is None) or (box is not None and any(
                abs(a - b) > 1e-6 for a, b in zip(box, derived))):
            report.add(rel_records, at, "box",
                       f"box {box} disagrees with the box derived from the mask {derived} "
                       "(normalized xyxy, exclusive max edge, null for an empty mask)",
                       record_id=rid)


def validate_dataset(root: str | os.PathLike, *, check_hashes: bool = True,
                     check_media: bool = True, progress: bool = False) -> Report:
    """Check a dataset folder completely; every problem becomes a Finding."""
    report, _ = _validate(Path(root), check_hashes, check_media, progress, {})
    return report


def _validate(root: Path, check_hashes: bool, check_media: bool, progress: bool,
              require: dict) -> tuple[Report, tuple | None]:
    report = Report(root, None)
    manifest = _validate_manifest(root, report)
    if manifest is None:
        return report, None
    kind = F.KINDS[manifest["kind"]]
    _validate_files(root, manifest, report, check_hashes, progress)
    rel = records_file_of(manifest, kind, root)
    if _layout(manifest, kind) == "records":
        reason = safe_relpath(rel)
        if reason:
            report.add(F.MANIFEST, None, "records", reason)
            return report, None
        if rel not in manifest["files"]:
            report.add(F.MANIFEST, None, "files", f"the records file {rel!r} is not listed")
    items = read_raw_records(root, rel, manifest, kind, report)
    good = _valid_records(items, kind, manifest, rel, report)
    report.n_records = len(items)
    if kind.name == "tabular":
        from engine.data.tabular import check_table

        check_table(root, rel, manifest, good, report)
    if kind.name == "speech":
        from engine.data.speech import check_speech

        check_speech(root, rel, manifest, good, report)
    if not items and not report.errors:
        report.add(rel, None, None, "holds no records")
    assignments = _validate_splits_file(root, manifest, report)
    if kind.name == "retrieval":
        from engine.data.retrieval import check_queries

        check_queries(root, manifest, good, assignments, report)
    if check_media and kind.media:
        _validate_media(root, kind, manifest, rel, good, report, progress, require)
    report.findings.sort(key=_reading_order(report.findings))
    return report, (manifest, kind, good, assignments)


def _valid_records(items: list[tuple[str, dict]], kind: F.Kind, manifest: dict, rel: str,
                   report: Report) -> list[tuple[str, dict]]:
    """The records with no problem and an id not used before; the others are reported."""
    good: list[tuple[str, dict]] = []
    seen: dict[str, str] = {}
    for where, record in items:
        problems = check_record(record, kind, manifest)
        rid = record.get("id") if isinstance(record.get("id"), str) else None
        at = f"{where} (id {rid!r})" if rid else where
        for name, reason in problems:
            report.add(rel, at, name, reason, record_id=rid)
        if problems:
            continue
        if rid in seen:
            report.add(rel, at, "id", f"duplicate id (first used at {seen[rid]})", record_id=rid)
            continue
        seen[rid] = where
        good.append((where, record))
    return good


def _reading_order(findings: list[Finding]):
    """Sort key: files in order of first mention, then by line, so the first error reported
    is the first one a reader meets in the file."""
    first_seen: dict[str, int] = {}
    for finding in findings:
        first_seen.setdefault(finding.file, len(first_seen))

    def key(finding: Finding) -> tuple[int, int]:
        match = re.match(r"line (\d+)", finding.where or "")
        return first_seen[finding.file], int(match.group(1)) if match else 0
    return key


# ----------------------------------------------------------------------------- Dataset


class Dataset:
    """A validated dataset: its manifest and its records with absolute file paths."""

    def __init__(self, root: Path, manifest: dict, records: list[dict],
                 assignments: dict[str, str]):
        self.root = root
        self.manifest = manifest
        self.kind = manifest["kind"]
        self._records = records
        self._assignments = assignments

    @property
    def name(self) -> str:
        return self.manifest.get("name") or self.root.name

    @property
    def version(self) -> str:
        return dataset_version(self.manifest)

    @property
    def classes(self) -> list[str]:
        """Declared classes, or the sorted labels in use ('empty' is not a class)."""
        declared = self.manifest.get("classes")
        if declared:
            return list(declared)
        return sorted({r["label"] for r in self._records
                       if "label" in r and r["label"] != F.EMPTY_LABEL})

    def split_of(self, record: dict) -> str | None:
        return record.get("split") or self._assignments.get(group_of(record))

    def records(self, split: str | None = None) -> list[dict]:
        """Records (copies) with path fields as absolute Paths, optionally of one split."""
        out = []
        for record in self._records:
            assigned = self.split_of(record)
            if split is not None and assigned != split:
                continue
            resolved = dict(record)
            if assigned and "split" not in resolved:
                resolved["split"] = assigned
            for name in F.KINDS[self.kind].path_fields:
                if isinstance(resolved.get(name), str):
                    resolved[name] = self.root / resolved[name]
            out.append(resolved)
        return out

    def raw_records(self) -> list[dict]:
        """Records as stored, relative paths kept (what leak and stats work compare)."""
        return [dict(r) for r in self._records]

    def files_manifest(self) -> dict[str, str]:
        """Relative path -> sha256 of every data file (what a run records and resume checks)."""
        return dict(self.manifest["files"])

    def text_of(self, record: dict) -> str:
        """The model-visible text of a record, fields joined in the kind's order."""
        parts = []
        for name in F.KINDS[self.kind].text_fields:
            value = record.get(name)
            if name == "messages" and isinstance(value, list):
                parts += [m["content"] for m in value]
            elif isinstance(value, str):
                parts.append(value)
        return "\n".join(parts)


def group_of(record: dict) -> str:
    """The split unit: records of one group always share a split."""
    group = record.get("group")
    return group if isinstance(group, str) and group else str(record.get("id"))


def load_dataset(root: str | os.PathLike, *, check_media: bool = True, progress: bool = False,
                 require: dict | None = None) -> Dataset:
    """Validate and load; the first error is raised as a ForgebenchError.

    `require` adds a recipe's own format needs to the manifest's, e.g.
    {"audio": {"sample_rate": 16000, "channels": 1, "subtype": "PCM_16", "samples": 8192}} or
    {"image": {"mode": "RGB"}}; every file is checked against them.
    """
    root = Path(root).expanduser().absolute()
    report, parts = _validate(root, True, check_media, progress, require or {})
    report.raise_first()
    manifest, _, good, assignments = parts
    return Dataset(root, manifest, [record for _, record in good], assignments)


# ----------------------------------------------------------------------------- versions


def save_new_version(dataset: Dataset, changes: dict[str, bytes], note: str,
                     out_dir: str | os.PathLike | None = None,
                     manifest_updates: dict | None = None, progress: bool = False) -> Dataset:
    """Write an edited copy as a new dataset folder; the original is left untouched.

    Unchanged files are hard-linked when the filesystem allows it (they are never written in
    place, so sharing them is safe) and copied otherwise. The new manifest names the old
    version as its parent, records the note, and takes `manifest_updates` (e.g. a new
    split_policy) over the inherited fields.
    """
    for rel in changes:
        reason = safe_relpath(rel)
        if reason or rel in (F.MANIFEST, *F.CARD_FILES):
            raise ForgebenchError(f"cannot save {rel!r}: {reason or 'reserved file name'}",
                                  path=dataset.root)
    target = Path(out_dir) if out_dir else _next_version_dir(dataset.root)
    if target.exists() and any(target.iterdir()):
        raise ForgebenchError("output folder is not empty", path=target,
                              hint="choose a new folder for the new version")
    with staged_dir(target) as staging:
        for rel in dataset.manifest["files"]:
            if rel in changes:
                continue
            destination = staging / rel
            destination.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(dataset.root / rel, destination)
            except OSError:
                shutil.copy2(dataset.root / rel, destination)
        for rel, data in changes.items():
            atomic_write_bytes(staging / rel, data)
        _rederive_boxes(staging, dataset, set(changes))
        inherited = {k: v for k, v in dataset.manifest.items()
                     if k not in ("files", "version", "parent", "created", "kind", "name")}
        inherited.update(manifest_updates or {})
        history = list(inherited.pop("history", [])) + [
            {"parent": dataset.version, "note": note, "changed": sorted(changes),
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
        write_manifest(staging, dataset.kind, dataset.name, parent=dataset.version,
                       history=history, progress=progress, **inherited)
    return load_dataset(target, progress=progress)


def _rederive_boxes(staging: Path, dataset: Dataset, changed: set[str]) -> None:
    """Boxes are derived data: when an edit replaces a mask, its record's box follows it."""
    from engine.data.media import box_from_mask, mask_array, open_image

    rel = records_file_of(dataset.manifest, F.KINDS[dataset.kind], dataset.root)
    if "mask" not in F.KINDS[dataset.kind].fields or rel in changed or rel.endswith(".csv"):
        return
    records = [json.loads(line) for line in
               (staging / rel).read_text(encoding="utf-8").splitlines() if line.strip()]
    touched = False
    for record in records:
        if record.get("mask") in changed and "box" in record:
            image, reason = open_image(staging / record["mask"])
            array, reason = (None, reason) if reason else mask_array(image)
            if array is not None:
                record["box"] = box_from_mask(array)
                touched = True
    if touched:
        # atomic_write_bytes renames a new file over the hard link: the original is untouched
        atomic_write_bytes(staging / rel, "".join(json.dumps(r) + "\n" for r in records)
                           .encode("utf-8"))


def _next_version_dir(root: Path) -> Path:
    stem = re.sub(r"-v\d+$", "", root.name)
    n = 2
    while (root.parent / f"{stem}-v{n}").exists():
        n += 1
    return root.parent / f"{stem}-v{n}"
