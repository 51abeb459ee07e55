"""Tabular datasets (kind "tabular"): a CSV of rows whose columns dataset.json declares.

The schema is the manifest's `table` section::

    "table": {"target": "fault", "group": "machine",
              "features": {"temperature": "number", "vibration": "number",
                           "serviced": "boolean"},
              "units": {"temperature": "degC", ...},          # optional, descriptive
              "id": "row_id",               # optional: the id column (else `id`, else line-N)
              "positive": "M",              # optional: the target value read as 1
              "ignored": {"city": "..."}}   # optional, descriptive: columns not read, and why

`target` is a binary column and may never be empty: 0/1, or two values of which `positive`
is read as 1 (compared case-insensitively: yes/YES). A feature is a number or a yes/no column
(true/false, yes/no, t/f, y/n, 1/0), and an empty cell (or `nan`) is a missing value the recipe
must handle, never a zero. `group` names the split unit (e.g. the machine): its value becomes
the record's group, so `forgebench data split` keeps all rows of one machine in one split.
`check_table` adds one finding per bad cell, naming the line and the column; `table_split`
turns one split's rows into float arrays in the declared feature order (the order a fitted
model is bound to), reading each cell with the same `feature_value` / `target_of` the
validator uses.

`infer_table` writes that section for a CSV that has only a header (`forgebench data init
--kind tabular`, the import wizard's table source): each column's type (number, boolean,
categorical, text) and missing cells from its values, the target guessed with its reason.
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
BOOLEAN = "boolean"      # a feature of two values (true/false, yes/no, t/f, y/n): read as 1/0
COLUMN_TYPES = (NUMBER, BOOLEAN)
MISSING_TEXT = ("nan", "NaN", "NAN")   # read as missing, like an empty cell
TARGET_VALUES = {"0": 0, "1": 1}
BOOLEAN_VALUES = {"true": 1, "false": 0, "yes": 1, "no": 0, "t": 1, "f": 0, "y": 1, "n": 0,
                  "1": 1, "0": 0}


def table_schema(manifest: dict) -> dict:
    """The manifest's `table` section, checked; a ForgebenchError names what is wrong."""
    table = manifest.get("table")
    hint = ('add e.g. "table": {"target": "fault", "group": "machine", "features": '
            '{"temperature": "number"}} to dataset.json')
    if not isinstance(table, dict):
        raise ForgebenchError("a tabular dataset needs a 'table' section", where="field 'table'",
                              hint=hint)
    unknown = sorted(set(table) - {"target", "group", "features", "units", "id", "positive",
                                   "ignored"})
    if unknown:
        raise ForgebenchError(f"unknown keys {unknown}", where="field 'table'", hint=hint)
    if not isinstance(table.get("target"), str) or not table["target"]:
        raise ForgebenchError("must name the target column", where="field 'table.target'",
                              hint=hint)
    if table.get("group") is not None and not isinstance(table["group"], str):
        raise ForgebenchError("must be a column name or null", where="field 'table.group'")
    _check_table_columns(table, hint)
    return table


def _check_table_columns(table: dict, hint: str) -> None:
    """The features' types, and the optional id, positive and ignored keys."""
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
    for key in ("id", "positive"):
        if table.get(key) is not None and not isinstance(table[key], str):
            raise ForgebenchError("must be a string or null", where=f"field 'table.{key}'")
    if table.get("ignored") is not None and not isinstance(table["ignored"], dict):
        raise ForgebenchError("must map column names to the reason they are not read",
                              where="field 'table.ignored'")


def target_of(table: dict, value: str) -> int | None:
    """A target cell as 0/1, or None when it is not one."""
    value = value.strip()
    if table.get("positive"):       # "M", or "yes" (matching YES and Yes too)
        return 1 if value.casefold() == table["positive"].casefold() else 0
    return TARGET_VALUES.get(value)


def feature_value(ftype: str, value: str | None) -> float | str:
    """A feature cell as a float (NaN when missing), or the reason it is not one."""
    if value is None or value in MISSING_TEXT or not value.strip():
        return math.nan
    if ftype == BOOLEAN:
        number = BOOLEAN_VALUES.get(value.strip().lower())
        return float(number) if number is not None else \
            f"not a yes/no value: {excerpt(value)} (true/false, yes/no, t/f, y/n, 1/0)"
    try:
        number = float(value)
    except ValueError:
        return f"not a number: {excerpt(value)} (leave the cell empty for a missing value)"
    return number if math.isfinite(number) else f"not a finite number: {excerpt(value)}"


def assign_ids(rows: list[tuple[str, dict]], manifest: dict) -> None:
    """Give each row its id: the `table.id` column's value, else an `id` column's, else
    `line-N` from its line in the CSV (stable: the file is hashed)."""
    table = manifest.get("table") if isinstance(manifest.get("table"), dict) else {}
    column = table.get("id") if isinstance(table.get("id"), str) else None
    for where, record in rows:
        if column and record.get(column):
            record["id"] = record[column]
        elif "id" not in record:
            record["id"] = where.replace(" ", "-")


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
    others: set[str] = set()
    for where, record in rows:
        other = _check_row(table, rel, f"{where} (id {record['id']!r})", record, report)
        if other is not None:
            others.add(other)
    if len(others) > 1:
        report.add("dataset.json", None, "table", f"table.positive is {table['positive']!r} but "
                   f"the target column holds {len(others)} other values "
                   f"({', '.join(sorted(others)[:5])}); tabular-classify predicts two classes")


def _check_row(table: dict, rel: str, at: str, record: dict, report) -> str | None:
    """Report the row's bad target, feature and group cells and set its group; the row's
    target value (folded) when it is a value other than `table.positive`."""
    rid, other = record["id"], None
    target = record.get(table["target"])
    if target is None or target in MISSING_TEXT:
        report.add(rel, at, table["target"], "the target is missing (NaN); every row needs "
                   "a label", record_id=rid)
    elif target_of(table, target) is None:
        report.add(rel, at, table["target"], f"the target must be 0 or 1, got "
                   f"{excerpt(target)}", record_id=rid)
    elif table.get("positive") and not target_of(table, target):
        other = target.strip().casefold()
    for name, ftype in table["features"].items():
        value = feature_value(ftype, record.get(name))
        if isinstance(value, str):
            report.add(rel, at, name, value, record_id=rid)
    group = table.get("group")
    if group:
        if not record.get(group):
            report.add(rel, at, group, "the group column is empty", record_id=rid)
        else:
            record["group"] = record[group]
    return other


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
    features = np.array([[feature_value(table["features"][n], r.get(n)) for n in names]
                         for r in rows], dtype=np.float64)
    target = np.array([target_of(table, r[table["target"]]) for r in rows], dtype=np.int64)
    return TableSplit(features, target, [r["id"] for r in rows],
                      [r.get("group") or r["id"] for r in rows], names)


# -- schema inference ---------------------------------------------------------------------
CATEGORICAL = "categorical"
TEXT = "text"
TARGET_NAMES = ("target", "label", "labels", "class", "y", "outcome", "diagnosis", "fault",
                "churn", "default", "survived", "response", "result")
ID_NAMES = ("id", "uid", "key", "record_id", "row_id", "index")
MAX_CATEGORIES = 50      # more distinct non-numeric values than this (and half the rows): text


@dataclass
class ColumnGuess:
    """One CSV column as read: its type, how many cells are missing, how many distinct values,
    a few examples, and the role the schema gives it (with why)."""

    name: str
    type: str                 # number | boolean | categorical | text
    missing: int
    distinct: int
    examples: list[str]
    role: str = ""            # feature | target | group | id | ignored
    reason: str = ""


def infer_table(path: str | Path, *, target: str | None = None, group: str | None = None,
                leave_out: tuple[str, ...] | list[str] = ()) -> tuple[dict, list[ColumnGuess]]:
    """The `table` section for a CSV with a header, inferred from its values, and every
    column's guess. The target is `target`, else a two-valued column named like a label
    (`TARGET_NAMES`), else the last two-valued column; each choice carries its reason.
    `leave_out` names columns the user keeps from the features (a leak, an identifier). A
    ForgebenchError names the file and what to pass when no target can be chosen."""
    path = Path(path)
    names, rows = _read_table_csv(path)
    guesses = [_guess_column(name, [row[i] if i < len(row) else "" for row in rows])
               for i, name in enumerate(names)]
    by_name = {g.name: g for g in guesses}
    for option, value in [("--target", target), ("--group", group),
                          *(("--leave-out", name) for name in leave_out)]:
        if value is not None and value not in by_name:
            raise ForgebenchError(f"no column {value!r} in the header", path=path,
                                  where=option, hint="columns: " + ", ".join(names))
    chosen = _choose_target(guesses, target, path)
    chosen.role = "target"
    table: dict = {"target": chosen.name, "group": group, "features": {}}
    positive = _positive_value(chosen, [row[names.index(chosen.name)] for row in rows
                                        if names.index(chosen.name) < len(row)])
    if positive is not None:
        table["positive"] = positive
        chosen.reason += f"; {positive!r} is read as 1"
    if group:
        by_name[group].role, by_name[group].reason = "group", "chosen with --group"
    id_guess = next((g for g in guesses if _named_like_an_id(g.name) and not g.role
                     and g.missing == 0 and g.distinct == len(rows)), None)
    if id_guess:
        id_guess.role = "id"
        id_guess.reason = "named like an id, a unique value in every row"
        if id_guess.name != "id":
            table["id"] = id_guess.name
    _assign_feature_roles(table, guesses, leave_out, len(rows))
    if not table["features"]:
        raise ForgebenchError("no numeric or yes/no column to learn from", path=path,
                              hint="tabular-classify reads numeric features; columns: "
                                   + ", ".join(f"{g.name} ({g.type})" for g in guesses))
    return table, guesses


def _read_table_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    """The header's column names and the non-blank rows; a ForgebenchError names the line
    of an unreadable file, a header without unique names, no rows or a row too long."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise ForgebenchError(f"cannot read the file ({exc.strerror})", path=path) from None
    except UnicodeDecodeError as exc:
        raise ForgebenchError("not valid UTF-8 text", path=path,
                              where=f"byte {exc.start}") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, [])
        rows = [row for row in reader if any(cell.strip() for cell in row)]
    except csv.Error as exc:
        raise ForgebenchError(f"not valid CSV ({exc})", path=path,
                              where=f"line {reader.line_num}") from None
    names = [h.strip() for h in header]
    if not names or not any(names):
        raise ForgebenchError("no header row", path=path, where="line 1",
                              hint="the first line names the columns: age,income,...,label")
    blank = [i + 1 for i, name in enumerate(names) if not name]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if blank or duplicated:
        raise ForgebenchError("every column needs a unique name in the header", path=path,
                              where="line 1", hint=(f"column(s) {blank} have no name; "
                                                    if blank else "")
                              + (f"{duplicated} appear twice" if duplicated else ""))
    if not rows:
        raise ForgebenchError("holds a header but no rows", path=path, where="line 2")
    for number, row in enumerate(rows, start=2):
        if len(row) > len(names):
            raise ForgebenchError("more values than header columns", path=path,
                                  where=f"line {number}")
    return names, rows


def _assign_feature_roles(table: dict, guesses: list[ColumnGuess], leave_out, n_rows: int) -> None:
    """Every column without a role yet: a numeric or yes/no column with a value is a feature;
    the rest (left out by choice, empty, text or categorical) are ignored, with the reason."""
    ignored = {}
    for guess in guesses:
        if guess.role:
            continue
        if guess.name in leave_out:
            guess.role, guess.reason = "ignored", "left out by choice"
            ignored[guess.name] = guess.reason
        elif guess.type in (NUMBER, BOOLEAN) and guess.missing < n_rows:
            guess.role = "feature"
            table["features"][guess.name] = guess.type
        else:
            guess.role = "ignored"
            guess.reason = ("every cell is empty" if guess.missing == n_rows else
                            f"{guess.type} values: tabular-classify reads numbers and yes/no "
                            "columns")
            ignored[guess.name] = guess.reason
    if ignored:
        table["ignored"] = ignored


def _named_like_an_id(name: str) -> bool:
    folded = name.strip().casefold()
    return folded in ID_NAMES or folded.endswith(("_id", " id", "-id"))


def _guess_column(name: str, cells: list[str]) -> ColumnGuess:
    present = [c.strip() for c in cells if c.strip() and c.strip() not in MISSING_TEXT]
    distinct = sorted(set(present))
    examples = distinct[:3]
    guess = ColumnGuess(name, TEXT, len(cells) - len(present), len(distinct), examples)
    folded = {c.casefold() for c in distinct}
    if not present:
        guess.type = NUMBER
    elif all(isinstance(feature_value(NUMBER, c), float) for c in distinct):
        guess.type = BOOLEAN if set(distinct) == {"0", "1"} else NUMBER
    elif folded <= set(BOOLEAN_VALUES) and len({BOOLEAN_VALUES[c] for c in folded}) == \
            len(folded) == 2:
        guess.type, guess.distinct = BOOLEAN, 2      # YES and yes are one value
    elif len(distinct) <= MAX_CATEGORIES and len(distinct) <= max(2, len(present) // 2):
        guess.type = CATEGORICAL
    return guess


def _choose_target(guesses: list[ColumnGuess], target: str | None, path: Path) -> ColumnGuess:
    if target is not None:
        chosen = next(g for g in guesses if g.name == target)
        chosen.reason = "chosen with --target"
    else:
        named = [g for g in guesses if g.name.strip().lower() in TARGET_NAMES]
        two_valued = [g for g in guesses if g.distinct == 2]
        if named and named[0].distinct == 2:
            chosen = named[0]
            chosen.reason = "named like a label, two values"
        elif named:
            raise ForgebenchError(
                f"column {named[0].name!r} looks like the label but holds {named[0].distinct} "
                "values; tabular-classify predicts two", path=path, where="--target",
                hint="pass --target COLUMN naming a column with two values")
        elif two_valued:
            chosen = two_valued[-1]
            chosen.reason = "the last column with exactly two values (none is named like a " \
                            "label: target, label, class, y, ...)"
        else:
            raise ForgebenchError("no column with two values to predict", path=path,
                                  where="--target",
                                  hint="pass --target COLUMN; tabular-classify predicts a "
                                       "two-valued column (0/1, yes/no, M/B, ...)")
    if chosen.distinct != 2 or chosen.missing:
        raise ForgebenchError(
            f"the target column {chosen.name!r} holds {chosen.distinct} distinct values and "
            f"{chosen.missing} missing cells; it needs two values and none missing",
            path=path, where="--target", hint="choose another column with --target")
    return chosen


def _positive_value(chosen: ColumnGuess, cells: list[str]) -> str | None:
    """None for a 0/1 target; otherwise the value read as 1: yes/true/t/y for a yes/no
    column, else the rarer value (the event a classifier is usually asked to flag; the
    alphabetically first on a tie)."""
    values = sorted({c.strip() for c in cells if c.strip()})
    if set(values) == {"0", "1"}:
        return None
    if chosen.type == BOOLEAN:
        return next(v.casefold() for v in values if BOOLEAN_VALUES[v.casefold()] == 1)
    counts = {v: sum(c.strip() == v for c in cells) for v in values}
    return min(values, key=lambda v: (counts[v], v))


def schema_lines(table: dict, guesses: list[ColumnGuess]) -> list[str]:
    """The inferred schema as the lines `data init` prints for confirmation."""
    width = max(len(g.name) for g in guesses)
    lines = [f"  {'column':<{width}}  {'type':<11}  {'missing':>7}  {'distinct':>8}  role"]
    for g in guesses:
        lines.append(f"  {g.name:<{width}}  {g.type:<11}  {g.missing:>7}  {g.distinct:>8}  "
                     f"{g.role}" + (f" ({g.reason})" if g.reason else ""))
    lines.append(f"target: {table['target']}" + (f" ({table['positive']!r} = 1)"
                                                  if table.get("positive") else " (0/1)")
                 + f"; {len(table['features'])} features; "
                 + (f"group: {table['group']}" if table.get("group") else
                    "no group column (each row is its own split unit; --group COLUMN keeps "
                    "rows of one source together)"))
    return lines
