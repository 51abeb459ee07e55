"""Tabular datasets (kind "tabular"): a CSV of rows whose columns dataset.json declares.

The schema is the manifest's `table` section::

    "table": {"target": "fault", "group": "machine",
              "features": {"temperature": "number", "vibration": "number", ...},
              "units": {"temperature": "degC", ...}}          # units optional, descriptive

`target` is a binary 0/1 column and may never be empty; every feature is a number, and an
empty cell (or `nan`) is a missing value the recipe must handle, never a zero. `group` names the
split unit (e.g. the machine): its value becomes the record's group, so `forgebench data split`
keeps all rows of one machine in one split. `check_table` adds one finding per bad cell, naming
the line and the column; `table_split` turns one split's rows into float arrays in the declared
feature order (the order a fitted model is bound to).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ForgebenchError, excerpt

NUMBER = "number"
COLUMN_TYPES = (NUMBER,)
MISSING_TEXT = ("nan", "NaN", "NAN")   # read as missing, like an empty cell
TARGET_VALUES = {"0": 0, "1": 1}


def table_schema(manifest: dict) -> dict:
    """The manifest's `table` section, checked; a ForgebenchError names what is wrong."""
    table = manifest.get("table")
    hint = ('add e.g. "table": {"target": "fault", "group": "machine", "features": '
            '{"temperature": "number"}} to dataset.json')
    if not isinstance(table, dict):
        raise ForgebenchError("a tabular dataset needs a 'table' section", where="field 'table'",
                              hint=hint)
    unknown = sorted(set(table) - {"target", "group", "features", "units"})
    if unknown:
        raise ForgebenchError(f"unknown keys {unknown}", where="field 'table'", hint=hint)
    if not isinstance(table.get("target"), str) or not table["target"]:
        raise ForgebenchError("must name the target column", where="field 'table.target'",
                              hint=hint)
    if table.get("group") is not None and not isinstance(table["group"], str):
        raise ForgebenchError("must be a column name or null", where="field 'table.group'")
    features = table.get("features")
    if not isinstance(features, dict) or not features:
        raise ForgebenchError("must map at least one column to a type",
                              where="field 'table.features'", hint=hint)
    for name, ftype in features.items():
        if ftype not in COLUMN_TYPES:
            raise ForgebenchError(f"column {name!r} has type {excerpt(ftype)}",
                                  where="field 'table.features'",
                                  hint="supported types: " + ", ".join(COLUMN_TYPES))
    if table["target"] in features or table.get("group") in features:
        raise ForgebenchError("the target and group columns cannot also be features",
                              where="field 'table.features'")
    return table


def _header(root: Path, rel: str) -> list[str]:
    text = (root / rel).read_text(encoding="utf-8")
    return next(csv.reader(io.StringIO(text, newline="")), [])


def check_table(root: Path, rel: str, manifest: dict, rows: list[tuple[str, dict]],
                report) -> None:
    """Add a finding for every schema problem, missing column and bad cell; set each row's
    group from the group column."""
    try:
        table = table_schema(manifest)
    except ForgebenchError as exc:
        report.add("dataset.json", None, "table", f"{exc.where}: {exc.message}")
        return
    if not rel.endswith(".csv"):
        report.add("dataset.json", None, "records", f"a tabular dataset is a CSV file, got {rel!r}")
        return
    if not (root / rel).is_file():
        return  # already reported by the records reader
    header = _header(root, rel)
    group = table.get("group")
    needed = [table["target"], *table["features"], *([group] if group else [])]
    missing = [name for name in needed if name not in header]
    for name in missing:
        report.add(rel, "line 1 (header)", name,
                   "column declared in dataset.json's table is missing from the header")
    if missing:
        return
    for where, record in rows:
        at = f"{where} (id {record['id']!r})"
        target = record.get(table["target"])
        if target is None or target in MISSING_TEXT:
            report.add(rel, at, table["target"], "the target is missing (NaN); every row needs "
                       "a 0/1 label", record_id=record["id"])
        elif target.strip() not in TARGET_VALUES:
            report.add(rel, at, table["target"], f"the target must be 0 or 1, got "
                       f"{excerpt(target)}", record_id=record["id"])
        for name in table["features"]:
            value = record.get(name)
            if value is None or value in MISSING_TEXT:
                continue
            try:
                number = float(value)
            except ValueError:
                report.add(rel, at, name, f"not a number: {excerpt(value)} (leave the cell "
                           "empty for a missing value)", record_id=record["id"])
                continue
            if not math.isfinite(number):
                report.add(rel, at, name, f"not a finite number: {excerpt(value)}",
                           record_id=record["id"])
        if group:
            if not record.get(group):
                report.add(rel, at, group, "the group column is empty", record_id=record["id"])
            else:
                record["group"] = record[group]


@dataclass(frozen=True)
class TableSplit:
    """One split as arrays: features [n, f] float64 with NaN for missing, target [n] int."""

    features: np.ndarray
    target: np.ndarray
    ids: list[str]
    groups: list[str]
    feature_names: list[str]

    def subset(self, index: np.ndarray) -> "TableSplit":
        """The rows at `index` (e.g. the fitting part of a cross-validation fold)."""
        return TableSplit(self.features[index], self.target[index],
                          [self.ids[i] for i in index], [self.groups[i] for i in index],
                          self.feature_names)


def table_split(dataset, split: str) -> TableSplit:
    """The rows of `split` (a validated tabular dataset) as arrays in declared column order."""
    table = table_schema(dataset.manifest)
    names = list(table["features"])
    rows = dataset.records(split)
    if not rows:
        raise ForgebenchError(f"the dataset has no {split!r} rows", path=dataset.root,
                              where="field 'split'",
                              hint="assign splits by group: forgebench data split DIR "
                                   "--ratios 0.6,0.1,0.15,0.15")
    features = np.array([[float(r[n]) if r.get(n) not in (None, *MISSING_TEXT) else np.nan
                          for n in names] for r in rows], dtype=np.float64)
    target = np.array([TARGET_VALUES[r[table["target"]].strip()] for r in rows], dtype=np.int64)
    return TableSplit(features, target, [r["id"] for r in rows],
                      [r.get("group") or r["id"] for r in rows], names)
