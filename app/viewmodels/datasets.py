"""Datasets: the table of a dataset's records with the validator's findings attached to the
right rows, filters, per-split stats, the split/group editor and single-record edits.

Validation is the engine's (`engine.data.dataset.validate_dataset`); this module only places
its findings. A dataset that does not parse still shows its rows and every finding.

A table is immutable once built (edits save new versions), so everything the views ask for
repeatedly - columns, each row's search text, groups, per-split counts - is computed once,
on the loading thread, and filtering or sorting 50,000 rows is one pass over plain strings.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from engine.data import formats as F
from engine.data.dataset import (
    Dataset,
    Finding,
    Report,
    check_record,
    dataset_version,
    group_of,
    load_dataset,
    read_raw_records,
    records_file_of,
    save_new_version,
    validate_dataset,
)
from engine.errors import ForgebenchError
from engine.fsutil import read_json

_LINE = re.compile(r"^(line \d+)")
LEADING_COLUMNS = ("id", "split", "group", "label")
SPLITS = F.SPLITS   # the split names a record or group may be moved to (train, val, test)


@dataclass
class Row:
    where: str                      # "line 7" (as the validator names it)
    record: dict | None             # None: the line is not a JSON object
    raw: str = ""
    findings: list[Finding] = field(default_factory=list)
    search: str = ""                # lower-cased cell texts, for word filters

    @property
    def line(self) -> int:
        """The line number in the records file (0 for records that are not lines)."""
        return int(self.where.split()[1]) if self.where.startswith("line ") else 0

    @property
    def has_error(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    def value(self, column: str) -> str:
        if self.record is None:
            return self.raw if column == "id" else ""
        value = self.record.get(column)
        if value is None:
            return "" if column not in self.record else "null"
        return value if isinstance(value, str) else json.dumps(value)


class DatasetTable:
    """One dataset as rows and columns, with findings placed on rows."""

    def __init__(self, root: str | Path, check_media: bool = True,
                 report: Report | None = None):
        """`report`: the validator's findings when they were computed elsewhere (a
        `forgebench data validate --json` subprocess, see `report_from_json`)."""
        self.root = Path(root)
        self.report = report or validate_dataset(self.root, check_media=check_media)
        self.manifest: dict = {}
        self.rows: list[Row] = []
        self.general: list[Finding] = []  # findings not tied to one record
        try:
            self.manifest = read_json(self.root / F.MANIFEST)
        except ForgebenchError:
            pass
        kind = F.KINDS.get(self.manifest.get("kind")) if isinstance(self.manifest, dict) else None
        self.kind = kind.name if kind else None
        self.records_file = records_file_of(self.manifest, kind, self.root) if kind else None
        if kind:
            scratch = Report(self.root, self.kind)  # the real findings come from report
            self.rows = [Row(where, record) for where, record in
                         read_raw_records(self.root, self.records_file, self.manifest, kind,
                                           scratch)]
        self._place_findings()
        self.columns = self._columns()
        for row in self.rows:
            row.search = "\t".join([row.where] + [row.value(c) for c in self.columns]).lower()
        self._groups = self._count_groups()
        self._split_counts = self._count_splits()
        self.images = self._images()
        self.clips = self._clips()

    def _place_findings(self) -> None:
        by_where = {row.where: row for row in self.rows}
        raw_lines = None
        for finding in self.report.findings:
            match = _LINE.match(finding.where or "") if finding.file == self.records_file else None
            if not match:
                self.general.append(finding)
                continue
            row = by_where.get(match.group(1))
            if row is None:  # a line that is not a record at all: show its text
                if raw_lines is None:
                    raw_lines = (self.root / self.records_file).read_text(
                        encoding="utf-8", errors="replace").split("\n")
                number = int(match.group(1).split()[1])
                row = Row(match.group(1), None, raw_lines[number - 1][:200]
                          if number <= len(raw_lines) else "")
                by_where[row.where] = row
                self.rows.append(row)
            row.findings.append(finding)
        self.rows.sort(key=lambda r: r.line)

    def _images(self) -> list[tuple[str, str, int]]:
        """(caption, absolute image path, row index) of every record that names an image."""
        out = []
        for i, row in enumerate(self.rows):
            record = row.record or {}
            rel = record.get("image") or record.get("file_name")
            if isinstance(rel, str):
                out.append((f"{record.get('id', rel)}\n{record.get('label', '')}",
                            str(self.root / rel), i))
        return out

    def _clips(self) -> list[tuple[str, str, int]]:
        """(caption, absolute clip path, row index) of every record of an audio dataset; the
        caption's second line is the label, or a speech clip's transcript."""
        if self.kind not in ("audio-clips", "speech"):
            return []
        return [(f"{row.record.get('id', row.record['path'])}\n"
                 f"{row.record.get('label', row.record.get('text', ''))}",
                 str(self.root / row.record["path"]), i) for i, row in enumerate(self.rows)
                if isinstance((row.record or {}).get("path"), str)]

    @property
    def ok(self) -> bool:
        return self.report.ok

    @property
    def name(self) -> str:
        return str(self.manifest.get("name") or self.root.name)

    @property
    def version(self) -> str:
        """The dataset's version as runs record it (engine.data.dataset.dataset_version)."""
        return dataset_version(self.manifest) if isinstance(self.manifest, dict) else "?"

    def _columns(self) -> list[str]:
        seen: dict[str, None] = {}
        for row in self.rows:
            for key in row.record or {}:
                seen.setdefault(key, None)
        lead = [c for c in LEADING_COLUMNS if c in seen]
        return lead + [c for c in seen if c not in lead]

    def error_rows(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row.has_error]

    def row_of(self, record_id: str) -> int | None:
        for i, row in enumerate(self.rows):
            if row.record is not None and row.record.get("id") == record_id:
                return i
        return None

    def matches(self, row: Row, text: str) -> bool:
        """Filter: words must all occur; `field=value` compares one field exactly;
        `has:error` keeps rows with findings."""
        return _row_filter(text)(row)

    def filter_rows(self, text: str, order: list[int] | None = None) -> list[int]:
        """Indexes of the rows that match `text`, in `order` (file order by default)."""
        order = range(len(self.rows)) if order is None else order
        if not text.strip():
            return list(order)
        keep, rows = _row_filter(text), self.rows
        return [i for i in order if keep(rows[i])]

    def sort_order(self, column: str, descending: bool = False) -> list[int]:
        """Row indexes sorted by one column: numbers numerically, then text; the file order
        breaks ties (Python's sort is stable)."""
        if column == "where":
            keys = [(0, row.line, "") for row in self.rows]
        else:
            keys = []
            for row in self.rows:
                value = row.record.get(column) if row.record else None
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    keys.append((0, value, ""))
                else:
                    keys.append((1, 0, row.value(column)))
        return sorted(range(len(self.rows)), key=keys.__getitem__, reverse=descending)

    def load(self) -> Dataset:
        """The validated dataset (raises the first error when it does not validate)."""
        return load_dataset(self.root)

    # -- stats ---------------------------------------------------------------------------
    def split_counts(self) -> dict[str, Counter]:
        """label counts per split (records without a label count under '—')."""
        return self._split_counts

    def _count_splits(self) -> dict[str, Counter]:
        out: dict[str, Counter] = defaultdict(Counter)
        splits = self._assignments()
        for row in self.rows:
            if row.record is None:
                continue
            split = row.record.get("split") or splits.get(self._group(row.record), "unassigned")
            out[str(split)][str(row.record.get("label", "—"))] += 1
        return dict(out)

    def _group(self, record: dict) -> str:
        """The split unit: a tabular dataset names its group column (e.g. the machine) in
        its table section; every other kind uses the record's `group` field."""
        table = self.manifest.get("table") if self.kind == "tabular" else None
        column = table.get("group") if isinstance(table, dict) else None
        value = record.get(column) if isinstance(column, str) else None
        return value if isinstance(value, str) and value else group_of(record)

    def _assignments(self) -> dict[str, str]:
        try:
            data = read_json(self.root / F.SPLITS_FILE)
        except ForgebenchError:
            return {}
        groups = data.get("groups") if isinstance(data, dict) else None   # the engine's format
        return groups if isinstance(groups, dict) else {}

    @property
    def unassigned_groups(self) -> int:
        """Groups with no split yet (what `forgebench data split` assigns)."""
        return sum(1 for _, split, _ in self._groups if split == "unassigned")

    # -- groups and splits ---------------------------------------------------------------
    def groups(self) -> list[tuple[str, str, int]]:
        """(group, split, records) — a group's records always share a split."""
        return self._groups

    def _count_groups(self) -> list[tuple[str, str, int]]:
        splits = self._assignments()
        counts: Counter = Counter()
        split_of: dict[str, set] = defaultdict(set)
        for row in self.rows:
            if row.record is None:
                continue
            group = self._group(row.record)
            counts[group] += 1
            split_of[group].add(row.record.get("split") or splits.get(group, "unassigned"))
        return [(g, "/".join(sorted(split_of[g])), counts[g]) for g in sorted(counts)]

    def check_record(self, record: dict) -> list[tuple[str | None, str]]:
        """The validator's per-record checks for an edited record (fields and types)."""
        kind = F.KINDS[self.kind]
        return check_record(dict(record), kind, self.manifest)

    def _records_bytes(self, replace: dict[int, dict]) -> bytes:
        lines = (self.root / self.records_file).read_text(encoding="utf-8").split("\n")
        for index, record in replace.items():
            number = int(self.rows[index].where.split()[1])
            lines[number - 1] = json.dumps(record)
        return "\n".join(lines).encode("utf-8")

    def save_record(self, index: int, record: dict) -> Dataset:
        """Save one edited record as a new dataset version."""
        if self.records_file.endswith(".csv"):
            raise ForgebenchError("editing CSV records is not supported; convert to JSONL",
                                  path=self.root / self.records_file)
        problems = self.check_record(record)
        if problems:
            name, reason = problems[0]
            raise ForgebenchError(reason, path=self.root / self.records_file,
                                  where=f"{self.rows[index].where}, field {name!r}")
        data = self._records_bytes({index: record})
        return save_new_version(self.load(), {self.records_file: data},
                                f"edited record {record.get('id')} ({self.rows[index].where})")

    def save_group_splits(self, new_splits: dict[str, str]) -> Dataset:
        """Move whole groups to other splits; saved as a new dataset version."""
        bad = [s for s in new_splits.values() if s not in F.SPLITS]
        if bad:
            raise ForgebenchError(f"unknown split {bad[0]!r}", hint="use one of "
                                  + ", ".join(F.SPLITS))
        replace = {}
        for i, row in enumerate(self.rows):
            if row.record is not None and group_of(row.record) in new_splits:
                replace[i] = dict(row.record, split=new_splits[group_of(row.record)])
        changed = ", ".join(f"{g}→{s}" for g, s in sorted(new_splits.items()))
        return save_new_version(self.load(), {self.records_file: self._records_bytes(replace)},
                                f"moved groups between splits: {changed}")


def report_from_json(data: dict) -> Report:
    """The Report that `forgebench data validate --json` printed."""
    report = Report(Path(data["root"]), data.get("kind"), int(data.get("records", 0)))
    report.findings = [Finding(**finding) for finding in data.get("findings", [])]
    return report


def _row_filter(text: str):
    """The filter text parsed once into a predicate over rows."""
    words = [w.lower() for w in text.split() if w != "has:error" and "=" not in w]
    fields = [w.partition("=")[::2] for w in text.split() if "=" in w]
    need_findings = "has:error" in text.split()

    def keep(row: Row) -> bool:
        return (not need_findings or bool(row.findings)) and \
            all(w in row.search for w in words) and \
            all(row.value(key) == value for key, value in fields)
    return keep


def records_bytes(root: str | Path) -> int:
    """Size of a dataset's records file (0 when unknown): big ones load off the GUI thread."""
    try:
        manifest = read_json(Path(root) / F.MANIFEST)
        kind = F.KINDS[manifest["kind"]]
        return (Path(root) / records_file_of(manifest, kind, Path(root))).stat().st_size
    except (ForgebenchError, OSError, KeyError, TypeError):
        return 0


@dataclass
class DatasetEntry:
    path: Path
    name: str
    kind: str
    version: str
    parent: str | None
    files: int


def list_datasets(paths: list[Path]) -> list[DatasetEntry]:
    """Summaries for the dataset list, from each dataset.json (no validation: it is instant)."""
    out = []
    for path in paths:
        try:
            manifest = read_json(path / F.MANIFEST)
        except ForgebenchError:
            manifest = {}
        if not isinstance(manifest, dict):
            manifest = {}
        out.append(DatasetEntry(path, str(manifest.get("name") or path.name),
                                str(manifest.get("kind", "?")),
                                dataset_version(manifest) if manifest else "?",
                                manifest.get("parent"),
                                len(manifest.get("files") or {})))
    return out


# -- what the pane's tabs show, as plain rows ----------------------------------------------
MAX_LISTED_FINDINGS = 2000  # beyond this the findings list says how many more there are


@dataclass(frozen=True)
class FindingRow:
    text: str
    where: str           # the record's place ("line 7", "records.jsonl line 7 field 'x'")
    severity: str        # error | warning | more (the "… and N more" line)


def finding_rows(report: Report, limit: int = MAX_LISTED_FINDINGS) -> list[FindingRow]:
    rows = [FindingRow(f.render(), f.where or "", f.severity) for f in report.findings[:limit]]
    if len(report.findings) > limit:
        rows.append(FindingRow(f"… and {len(report.findings) - limit} more (filter the "
                               "records with has:error to see them all)", "", "more"))
    return rows


def row_of_place(rows: list[Row], where: str) -> int | None:
    """The record a finding's place names: its `where` starts with the record's own."""
    for i, row in enumerate(rows):
        if where and where.startswith(row.where) and \
                where[len(row.where):len(row.where) + 1] in ("", " "):
            return i
    return None


@dataclass(frozen=True)
class LeakRow:
    leak: bool                   # across splits (an error); else a duplicate within a split
    kind: str
    a: str                       # "id (split)"
    b: str
    a_id: str
    b_id: str
    evidence: str

    @property
    def cells(self) -> tuple[str, str, str, str, str]:
        return ("LEAK" if self.leak else "duplicate", self.kind, self.a, self.b, self.evidence)


def leak_rows(report: dict) -> tuple[list[LeakRow], str]:
    """`forgebench data leaks --json` as table rows and a one-line summary."""
    rows = [LeakRow(f.get("severity") == "error", str(f.get("kind", "")),
                    f"{f.get('a')} ({f.get('split_a')})", f"{f.get('b')} ({f.get('split_b')})",
                    str(f.get("a")), str(f.get("b")),
                    ", ".join(f"{k} {v}" for k, v in (f.get("evidence") or {}).items()))
            for f in report.get("findings", [])]
    summary = (f"{report.get('records')} records checked "
               f"({', '.join(report.get('checks', []))}): {report.get('leaks')} leak(s) "
               f"across splits, {report.get('duplicates')} duplicate(s) within a split")
    return rows, summary


@dataclass(frozen=True)
class StatsBars:
    labels: list[str]
    splits: list[str]
    heights: dict[str, list[int]]     # split -> count per label, in `labels` order
    totals: dict[str, int]


def stats_bars(counts: dict[str, Counter]) -> StatsBars:
    """Records per label and split, as grouped bars (splits in their canonical order)."""
    labels = sorted({label for c in counts.values() for label in c})
    splits = [s for s in (*F.SPLITS, "unassigned") if s in counts]
    return StatsBars(labels, splits,
                     {s: [counts[s].get(label, 0) for label in labels] for s in splits},
                     {s: sum(c.values()) for s, c in counts.items()})


@dataclass
class ColumnStat:
    """One column of a tabular dataset: its role and, over the rows the file holds, how many
    cells are filled and what the numbers look like (None where a cell is not a number)."""

    column: str
    role: str                        # "feature", "target" or "group"
    filled: int
    missing: int
    mean: float | None = None
    std: float | None = None
    minimum: float | None = None
    maximum: float | None = None
    distinct: int | None = None      # group column: how many groups


def column_stats(table: DatasetTable) -> list[ColumnStat]:
    """Per-column statistics of a tabular dataset, read from the records as stored (a cell
    that is empty or `nan` is missing; a non-number counts as neither, the findings say why).
    Empty for every other kind or when the manifest has no valid table section."""
    from engine.data.tabular import MISSING_TEXT, feature_value, table_schema, target_of

    if table.kind != "tabular":
        return []
    try:
        schema = table_schema(table.manifest)
    except ForgebenchError:
        return []
    records = [row.record for row in table.rows if row.record is not None]
    roles = [(name, "feature") for name in schema["features"]] + [(schema["target"], "target")]
    out = []
    for name, role in roles:
        numbers, missing = [], 0
        for record in records:
            value = record.get(name)
            if value is None or value in MISSING_TEXT:
                missing += 1
                continue
            # read as the recipe reads it (yes/no features, a target's positive value)
            number = target_of(schema, value) if role == "target" else \
                feature_value(schema["features"][name], value)
            if isinstance(number, (int, float)) and number == number:     # not NaN
                numbers.append(float(number))
        if numbers:
            mean = sum(numbers) / len(numbers)
            std = (sum((x - mean) ** 2 for x in numbers) / len(numbers)) ** 0.5
            out.append(ColumnStat(name, role, len(numbers), missing, mean, std, min(numbers),
                                  max(numbers)))
        else:
            out.append(ColumnStat(name, role, 0, missing))
    if schema.get("group"):
        values = [r.get(schema["group"]) for r in records]
        out.append(ColumnStat(schema["group"], "group", sum(v is not None for v in values),
                              sum(v is None for v in values),
                              distinct=len({v for v in values if v is not None})))
    return out
