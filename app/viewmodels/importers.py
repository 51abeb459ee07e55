"""Import wizards' view-model: turn a folder of images, a JSONL file, an audio CSV or a table
CSV (its schema inferred by the engine, for the user to confirm) into a new workspace dataset.

Each source becomes an `ImportPlan` first: the records as they will be written, the files to
copy, and every problem found on the way as an engine `Finding` (file, line or record, field,
reason), so a preview can mark the right row before anything is written. Per-record checks
are the engine's (`check_record`, `media.open_image`, `media.check_audio`). `import_dataset`
then copies into a staging folder, writes `dataset.json` with the engine's `write_manifest`,
validates the result with the engine's validator and only then renames it into place: a cancel
or a failure leaves nothing behind.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.data import formats as F
from engine.data import media
from engine.data.dataset import (
    Finding,
    check_record,
    jsonl_objects,
    safe_relpath,
    validate_dataset,
    write_manifest,
)
from engine.data.generators import staged_dataset_dir
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_text, require_free_space, sha256_file

PREVIEW_ROWS = 50       # records shown (and media decoded) before import; all are checked after
JSONL_KINDS = ("text-sft", "text-corpus", "preferences", "captioned-images")
AUDIO_COLUMNS = ("path", "label", "split", "group", "source", "rights", "sha256")
AUDIO_SPEC = {"sample_rate": 16000, "channels": 1, "subtype": "PCM_16"}
MASK_SUFFIX = "_mask.png"  # masks beside images: cat/a.jpg + cat/a_mask.png
RIGHT_ANSWERS = ("not stated", "yes", "no", "with conditions")
# Source keys commonly used for a canonical field, tried when the names differ.
SYNONYMS = {
    "instruction": ("prompt", "input", "question", "query"),
    "response": ("output", "answer", "completion", "target"),
    "text": ("content", "document", "caption", "body"),
    "prompt": ("instruction", "question", "input"),
    "chosen": ("preferred", "winner", "good"),
    "rejected": ("dispreferred", "loser", "bad"),
    "file_name": ("image", "file", "path", "filename"),
    "id": ("uid", "key", "record_id"),
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")


class ImportCancelled(Exception):
    """The user cancelled: the staging folder has been removed."""


@dataclass
class PlannedRecord:
    where: str                           # "line 3", "cat/a.png": as the source names it
    record: dict                         # as it will be written (paths inside the dataset)
    copies: list[tuple[Path, str]] = field(default_factory=list)  # (source file, dest rel)
    findings: list[Finding] = field(default_factory=list)
    info: str = ""                       # e.g. the audio format, shown in the preview


@dataclass
class ImportPlan:
    kind: str
    source: Path
    records_file: str
    records: list[PlannedRecord] = field(default_factory=list)
    general: list[Finding] = field(default_factory=list)   # not tied to one record
    manifest_fields: dict = field(default_factory=dict)    # classes, audio spec, table ...
    skipped: list[str] = field(default_factory=list)        # where left-out records were
    schema: list = field(default_factory=list)              # a table's ColumnGuess rows
    files: list[tuple[Path, str]] = field(default_factory=list)  # copied whole (a table's CSV)

    @property
    def records_copied(self) -> bool:
        """The records file is one of `files`, copied as is instead of written."""
        return any(rel == self.records_file for _, rel in self.files)

    @property
    def findings(self) -> list[Finding]:
        return self.general + [f for r in self.records for f in r.findings]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return bool(self.records) and not self.errors

    def copies(self) -> list[tuple[Path, str]]:
        return list(self.files) + [c for r in self.records for c in r.copies]

    def bytes_to_copy(self) -> int:
        return sum(src.stat().st_size for src, _ in self.copies() if src.is_file())

    def columns(self) -> list[str]:
        seen: dict[str, None] = {}
        for planned in self.records[:PREVIEW_ROWS]:
            for key in planned.record:
                seen.setdefault(key, None)
        return list(seen)

    def summary(self) -> str:
        errors = len(self.errors)
        skipped = f"{len(self.skipped)} skipped ({', '.join(self.skipped[:5])}" \
            f"{', …' if len(self.skipped) > 5 else ''}); " if self.skipped else ""
        return (f"{len(self.records)} records, {len(self.copies())} files to copy; {skipped}"
                + (f"{errors} problem(s) to fix (or skip) before importing" if errors
                   else "no problems"))

    def skipping_errors(self) -> "ImportPlan":
        """This plan without the records (and unparseable lines) that have an error; what was
        left out is listed in `skipped`, and the import records it in the provenance. A
        problem of the whole source (an unreadable file) is never skipped."""
        bad = [r for r in self.records if any(f.severity == "error" for f in r.findings)]
        lines = [f for f in self.general if f.severity == "error" and _line_of(f.where or "")]
        if self.records_copied and bad:     # a copied CSV cannot leave rows out
            return self
        return ImportPlan(self.kind, self.source, self.records_file,
                          [r for r in self.records if r not in bad],
                          [f for f in self.general if f not in lines],
                          dict(self.manifest_fields),
                          sorted([r.where for r in bad] + [f.where for f in lines],
                                 key=_line_of), self.schema, list(self.files))


def unreadable_plan(path: Path, message: str) -> ImportPlan:
    """A plan whose source could not be read at all: one general finding, no records."""
    return ImportPlan("unknown", path, "", general=[Finding(str(path), None, None, message)])


def _check(planned: PlannedRecord, kind: F.Kind, manifest: dict, file: str) -> None:
    """The engine's per-record checks, as findings on this record."""
    rid = planned.record.get("id") if isinstance(planned.record.get("id"), str) else None
    for name, reason in check_record(planned.record, kind, manifest):
        planned.findings.append(Finding(file, planned.where, name, reason, record_id=rid))


def _duplicate_ids(plan: ImportPlan, file: str) -> None:
    seen: dict[str, str] = {}
    for planned in plan.records:
        rid = planned.record.get("id")
        if not isinstance(rid, str):
            continue
        if rid in seen:
            planned.findings.append(Finding(file, planned.where, "id",
                                            f"duplicate id (first used at {seen[rid]})",
                                            record_id=rid))
        else:
            seen[rid] = planned.where


def preview_rows(plan: ImportPlan) -> list[PlannedRecord]:
    """The first records in source order, with a row for each line that is not a record at
    all (it does not parse), so its problem shows where it is."""
    rows = list(plan.records[:PREVIEW_ROWS])
    last = _line_of(rows[-1].where) if len(plan.records) > PREVIEW_ROWS else None
    for finding in plan.general:
        line = _line_of(finding.where or "")
        if line and (last is None or line < last):
            rows.append(PlannedRecord(finding.where, {}, findings=[finding]))
    return sorted(rows, key=lambda r: _line_of(r.where))


def preview_column_widths(wanted: list[int], least: list[int], available: int) -> list[int]:
    """Widths for the preview's columns: each as wide as its text on one line (`wanted`) when
    they all fit in `available` pixels; otherwise the widest are capped at one common width
    (the largest that fits), none below `least` (its longest unbreakable word), so long paths
    wrap at their "/" while short columns stay on one line, and nothing ends in "…". When
    even the least widths do not fit, those are kept: the table scrolls sideways, nothing is
    cut."""
    def capped(cap: int) -> list[int]:
        return [min(w, max(lo, cap)) for w, lo in zip(wanted, least)]

    low, high = 0, max(wanted, default=0)
    while low < high:                   # the largest cap whose columns fit
        middle = (low + high + 1) // 2
        low, high = (middle, high) if sum(capped(middle)) <= available else (low, middle - 1)
    return capped(low)


def _line_of(where: str) -> int:
    match = re.match(r"line (\d+)", where)
    return int(match.group(1)) if match else 0


# ----------------------------------------------------------------------------- images


def plan_image_folder(folder: str | Path, masks: bool = False) -> ImportPlan:
    """`<class>/<image>` folders become an image-classify dataset; with `masks`, each image's
    `<stem>_mask.png` beside it makes an image-masks dataset."""
    folder = Path(folder)
    kind = "image-masks" if masks else "image-classify"
    plan = ImportPlan(kind, folder, "records.jsonl")
    if not folder.is_dir():
        plan.general.append(Finding(str(folder), None, None, "folder not found"))
        return plan
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir()
                     and not p.name.startswith("."))
    for label in classes:
        for image in sorted((folder / label).iterdir()):
            name = image.name
            if not name.lower().endswith(F.IMAGE_SUFFIXES) or name.endswith(MASK_SUFFIX) \
                    or name.startswith("."):
                continue
            rel = f"{label}/{name}"
            rid = f"{label}/{image.stem}"
            planned = PlannedRecord(rel, {"id": rid, "image": f"images/{rel}", "label": label,
                                          "group": rid},
                                    [(image, f"images/{rel}")])
            if masks:
                mask = image.with_name(image.stem + MASK_SUFFIX)
                planned.record["mask"] = f"masks/{label}/{image.stem}.png"
                if mask.is_file():
                    planned.copies.append((mask, planned.record["mask"]))
                else:
                    planned.findings.append(Finding(rel, None, "mask",
                                                    f"no mask beside the image (expected "
                                                    f"{label}/{mask.name})", record_id=rid))
            plan.records.append(planned)
    loose = [p.name for p in folder.iterdir() if p.is_file()
             and p.name.lower().endswith(F.IMAGE_SUFFIXES)]
    if loose:
        plan.general.append(Finding(loose[0], None, None,
                                    f"{len(loose)} image(s) outside a class folder are left "
                                    "out; put each image in a folder named after its class",
                                    severity="warning"))
    if not plan.records:
        plan.general.append(Finding(str(folder), None, None,
                                    "holds no images in class folders (expected "
                                    "<class>/<image>.png)"))
        return plan
    plan.manifest_fields["classes"] = [c for c in classes if c != F.EMPTY_LABEL]
    for planned in plan.records[:PREVIEW_ROWS]:
        _check_image_files(planned)
    return plan


def _check_image_files(planned: PlannedRecord) -> None:
    image, reason = media.open_image(planned.copies[0][0])
    how = None
    if not reason:
        how, reason = media.rgb_conversion(image)     # the rule validate and training use
    if reason:
        planned.findings.append(Finding(planned.where, None, "image", reason,
                                        record_id=planned.record["id"]))
        return
    planned.info = f"{image.size[0]}x{image.size[1]} {image.mode}" + \
        (" (read as RGB)" if how else "")
    if len(planned.copies) > 1:
        mask, reason = media.open_image(planned.copies[1][0])
        array = None
        if not reason:
            array, reason = media.mask_array(mask)
        if not reason and mask.size != image.size:
            reason = f"mask size {mask.size} differs from image size {image.size}"
        if not reason:
            reason = media.check_binary_mask(array)
        if reason:
            planned.findings.append(Finding(planned.where, None, "mask", reason,
                                            record_id=planned.record["id"]))


# ----------------------------------------------------------------------------- JSONL


def read_jsonl_source(path: str | Path, corrections: dict[int, str] | None = None
                      ) -> tuple[list[tuple[int, dict]], list[Finding]]:
    """(line number, object) for every line that parses; a finding for every one that does
    not. An unreadable file is one finding. `corrections` replaces lines (by number) with the
    text the user fixed them to in the wizard; the source file itself is never changed."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        return [], [Finding(path.name, None, None, f"cannot read the file ({exc.strerror})")]
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        return [], [Finding(path.name, f"line {line}", None, "not valid UTF-8 text")]
    if corrections:
        lines = text.split("\n")
        for number, fixed in corrections.items():
            if 1 <= number <= len(lines):
                lines[number - 1] = fixed.replace("\n", " ")
        text = "\n".join(lines)
    rows, findings = [], []
    for number, value, problem in jsonl_objects(text):
        if problem:
            findings.append(Finding(path.name, f"line {number}", None, problem))
        else:
            rows.append((number, value))
    return rows, findings


def canonical_fields(kind: str) -> list[str]:
    """The fields a mapping can fill for a kind: its own, then the common ones."""
    spec = F.KINDS[kind]
    names = ["id"] + [n for n in spec.fields if n != "id"]
    return names + [n for n in F.COMMON_FIELDS if n not in names]


def source_keys(path: str | Path, lines: int = 500) -> list[str]:
    """The keys used in the first `lines` lines (the mapping's choices; a big file is not
    parsed whole for them)."""
    seen: dict[str, None] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for _, line in zip(range(lines), handle):
                try:
                    value = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    continue
                for key in value if isinstance(value, dict) else ():
                    seen.setdefault(key, None)
    except OSError:
        return []
    return list(seen)


def source_bytes(path: str | Path) -> int:
    """Size of a source file (0 for folders or missing files): big ones plan off-thread."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else 0


def default_mapping(kind: str, keys: list[str]) -> dict[str, str | None]:
    """canonical field -> source key: the same name, else a common synonym, else none."""
    mapping = {}
    for name in canonical_fields(kind):
        match = name if name in keys else next(
            (k for k in SYNONYMS.get(name, ()) if k in keys), None)
        mapping[name] = match
    used = Counter(v for v in mapping.values() if v)
    for name, key in mapping.items():  # one source key feeds one field: same name wins
        if key and used[key] > 1 and key != name:
            mapping[name] = None
    return mapping


def source_line(path: str | Path, number: int) -> str:
    """The text of one line of a source file (1-based), to fix it in the wizard."""
    lines = Path(path).read_bytes().decode("utf-8", "replace").split("\n")
    return lines[number - 1] if 1 <= number <= len(lines) else ""


def plan_jsonl(path: str | Path, kind: str, mapping: dict[str, str | None],
               corrections: dict[int, str] | None = None) -> ImportPlan:
    """Records of a JSONL file with keys renamed to the kind's fields. A record without an id
    gets `line-N`; captioned images are copied from beside the file. `corrections`: lines the
    user fixed in the wizard (see `read_jsonl_source`)."""
    path = Path(path)
    if kind not in JSONL_KINDS:
        raise ForgebenchError(f"{kind!r} cannot be imported from JSONL", where="kind",
                              hint="choose one of " + ", ".join(JSONL_KINDS))
    spec = F.KINDS[kind]
    plan = ImportPlan(kind, path, spec.records)
    rows, plan.general = read_jsonl_source(path, corrections)
    for number, value in rows:
        record = {name: value[key] for name, key in mapping.items()
                  if key is not None and key in value}
        if "id" not in record and not (spec.id_from and spec.id_from in record):
            record["id"] = f"line-{number}"
        planned = PlannedRecord(f"line {number}", record)
        if kind == "captioned-images":
            _plan_caption_image(planned, path.parent, path.name)
        _check(planned, spec, {}, path.name)
        plan.records.append(planned)
    _duplicate_ids(plan, path.name)
    if not rows and not plan.general:
        plan.general.append(Finding(path.name, None, None, "holds no records"))
    for planned in plan.records[:PREVIEW_ROWS]:
        if planned.copies and not planned.findings:
            image, reason = media.open_image(planned.copies[0][0])
            if reason:
                planned.findings.append(Finding(path.name, planned.where, "file_name", reason))
            else:
                planned.info = f"{image.size[0]}x{image.size[1]} {image.mode}"
    return plan


def _plan_caption_image(planned: PlannedRecord, base: Path, file: str) -> None:
    record = planned.record
    record.setdefault("group", record.get("id") or record.get("file_name"))
    rel = record.get("file_name")
    if not isinstance(rel, str) or safe_relpath(rel):
        return  # check_record reports it
    source = base / rel
    if not source.is_file():
        planned.findings.append(Finding(file, planned.where, "file_name",
                                        f"{rel!r} not found beside the JSONL file "
                                        f"(looked for {source})"))
        return
    planned.copies.append((source, rel))


# ----------------------------------------------------------------------------- audio CSV


def plan_audio_csv(path: str | Path) -> ImportPlan:
    """Rows of `path,label,split,group,source,rights,sha256` (paths relative to the CSV);
    each clip must exist, match its sha256 and be mono 16 kHz PCM16."""
    path = Path(path)
    plan = ImportPlan("audio-clips", path, "clips.jsonl", manifest_fields={"audio": AUDIO_SPEC})
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        plan.general.append(Finding(path.name, None, None,
                                    f"cannot read the file ({exc.strerror})"))
        return plan
    except UnicodeDecodeError:
        plan.general.append(Finding(path.name, None, None, "not valid UTF-8 text"))
        return plan
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = [c for c in AUDIO_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        plan.general.append(Finding(path.name, "line 1", None,
                                    f"the header lacks column(s) {', '.join(missing)}; "
                                    f"expected {','.join(AUDIO_COLUMNS)}"))
        return plan
    try:
        for row in reader:
            where = f"line {reader.line_num}"
            if None in row:
                plan.general.append(Finding(path.name, where, None,
                                            "more values than header columns"))
                continue
            plan.records.append(_plan_clip(path, where, row))
    except csv.Error as exc:
        plan.general.append(Finding(path.name, f"line {reader.line_num}", None,
                                    f"not valid CSV ({exc})"))
    _duplicate_ids(plan, path.name)
    if not plan.records and not plan.general:
        plan.general.append(Finding(path.name, None, None, "holds no rows"))
    for planned in plan.records[:PREVIEW_ROWS]:
        if planned.copies:
            check_clip_format(planned, path.name)
    return plan


def _plan_clip(csv_path: Path, where: str, row: dict) -> PlannedRecord:
    record = {k: v for k, v in row.items() if k in AUDIO_COLUMNS and v not in (None, "")}
    planned = PlannedRecord(where, record)
    rel = record.get("path")
    if isinstance(rel, str) and not safe_relpath(rel):
        source = csv_path.parent / rel
        record["id"] = rel
        if not source.is_file():
            planned.findings.append(Finding(csv_path.name, where, "path",
                                            f"{rel!r} not found (looked for {source})",
                                            record_id=rel))
        else:
            planned.copies.append((source, f"clips/{rel}"))
            record["path"] = f"clips/{rel}"
            record["id"] = record["path"]
            if record.get("sha256") and record["sha256"] != sha256_file(source):
                planned.findings.append(Finding(csv_path.name, where, "sha256",
                                                "does not match the file's sha256 (the file "
                                                "changed or the row names another file)",
                                                record_id=rel))
    _check(planned, F.KINDS["audio-clips"], {}, csv_path.name)
    return planned


def check_clip_format(planned: PlannedRecord, file: str) -> None:
    """Decode one clip: its format for the preview, and a finding unless mono 16 kHz PCM16."""
    import soundfile

    source = planned.copies[0][0]
    audio, rate, reason = media.check_audio(source, AUDIO_SPEC)
    if audio is not None:
        info = soundfile.info(str(source))
        planned.info = (f"{'mono' if info.channels == 1 else f'{info.channels} ch'}, "
                        f"{rate} Hz, {info.subtype}, {audio.shape[1] / rate:.2f} s")
    if reason:
        planned.findings.append(Finding(file, planned.where, "path", reason,
                                        record_id=planned.record.get("id")))


# ----------------------------------------------------------------------------- table CSV


def plan_table_csv(path: str | Path, target: str | None = None, group: str | None = None,
                   leave_out: tuple[str, ...] = ()) -> ImportPlan:
    """A CSV with a header as a tabular dataset: the schema inferred by the engine
    (`engine.data.tabular.infer_table`: column types, missing cells, the target guessed with
    its reason) is the plan's `schema` for the user to confirm or change (`target`, `group`,
    the features to `leave_out`), and every row is checked against it as the validator will.
    The CSV is copied as is."""
    from engine.data.dataset import Report, read_raw_records
    from engine.data.tabular import check_table, infer_table

    path = Path(path)
    plan = ImportPlan("tabular", path, "rows.csv", files=[(path, "rows.csv")])
    try:
        table, plan.schema = infer_table(path, target=target, group=group,
                                         leave_out=leave_out)
    except ForgebenchError as exc:
        plan.general.append(Finding(path.name, exc.where, None,
                                    exc.message + (f" ({exc.hint})" if exc.hint else "")))
        return plan
    manifest = {"table": table}
    kind = F.KINDS["tabular"]
    report = Report(path.parent, "tabular")
    rows = read_raw_records(path.parent, path.name, manifest, kind, report)
    for where, record in rows:
        planned = PlannedRecord(where, record)
        _check(planned, kind, manifest, path.name)
        plan.records.append(planned)
    check_table(path.parent, path.name, manifest, rows, report)
    by_id = {p.record.get("id"): p for p in plan.records}
    for finding in report.findings:
        target_row = by_id.get(finding.record_id)
        (target_row.findings if target_row else plan.general).append(finding)
    _duplicate_ids(plan, path.name)
    plan.manifest_fields["table"] = table
    return plan


# ----------------------------------------------------------------------------- import


def check_name(datasets_dir: Path, name: str) -> str | None:
    """Why `name` cannot name a new dataset folder, or None."""
    if not _NAME.match(name or ""):
        return "use letters, digits, '.', '_' or '-' (no spaces or slashes), up to 80"
    if (Path(datasets_dir) / name).exists():
        return f"a dataset named {name!r} already exists in this workspace"
    return None


def rights_statement(answers: dict[str, str], basis: str, consent: str) -> dict:
    """The manifest's rights object: each right answered separately (the card reads it)."""
    rights = {k: v for k, v in answers.items() if v and v != "not stated"}
    if basis.strip():
        rights["basis"] = basis.strip()
    if consent.strip():
        rights["consent"] = consent.strip()
    return rights


def import_dataset(plan: ImportPlan, datasets_dir: str | Path, name: str, *,
                   provenance: dict, rights: dict,
                   progress: Callable[[int, int, str], None] | None = None,
                   cancelled: Callable[[], bool] | None = None) -> Path:
    """Copy, write and validate the new dataset in a staging folder, then rename it to
    `datasets_dir/name`. Raises ImportCancelled or a ForgebenchError; either way nothing is
    left behind."""
    datasets_dir = Path(datasets_dir)
    reason = check_name(datasets_dir, name)
    if reason:
        raise ForgebenchError(reason, path=datasets_dir / name, where="name")
    if not plan.ok:
        first = plan.errors[0] if plan.errors else None
        raise ForgebenchError(first.reason if first else "nothing to import",
                              path=plan.source, where=first.where if first else None,
                              hint="fix the problems shown in the preview first")
    copies = plan.copies()
    datasets_dir.mkdir(parents=True, exist_ok=True)
    require_free_space(datasets_dir, plan.bytes_to_copy())
    total = len(copies) + 2  # + writing the records, + validating
    report = progress or (lambda done, total, what: None)
    with staged_dataset_dir(datasets_dir / name) as staging:
        for done, (source, rel) in enumerate(copies):
            if cancelled and cancelled():
                raise ImportCancelled()
            report(done, total, f"copying {rel}")
            destination = staging / rel
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
        report(len(copies), total, "writing records and dataset.json")
        if not plan.records_copied:
            atomic_write_text(staging / plan.records_file,
                              "".join(json.dumps(p.record) + "\n" for p in plan.records))
        write_manifest(staging, plan.kind, name, records=plan.records_file,
                       provenance=dict(provenance, imported_from=str(plan.source),
                                       imported=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime())),
                       rights=rights, **plan.manifest_fields)
        if cancelled and cancelled():
            raise ImportCancelled()
        report(len(copies) + 1, total, "validating every record and file")
        result = validate_dataset(staging)
        if not result.ok:
            first = result.errors[0]
            raise ForgebenchError(f"the imported dataset does not validate: {first.render()}"
                                  + (f" (and {len(result.errors) - 1} more)"
                                     if len(result.errors) > 1 else ""),
                                  path=plan.source, hint="nothing was imported; fix the "
                                                         "source and import again")
        report(total, total, "done")
    return datasets_dir / name
