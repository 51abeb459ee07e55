"""Preference pairs for lm-dpo: a JSONL file or a `preferences` dataset folder, validated.

Each record is `{"prompt", "chosen", "rejected"}` (non-empty texts, chosen different from
rejected), with optional `system`, `rater`, `session`, `rationale`, `outcome` and the common
fields (`id`, `group`, `split`, `source`, `rights`); the field table is `formats.KINDS
["preferences"]`, so a plain file and a dataset folder are held to the same rules. A malformed
record is refused with its line number (or record id). Records whose `outcome` is "tie" or
"skip" state no preference: they are left out and counted, and a file of nothing else is an
error. Pairs keep who rated them and in which session, so several raters' pairs stay
distinguishable (and are counted per rater).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.data import formats as F
from engine.data.dataset import check_record, jsonl_objects, load_dataset
from engine.errors import ForgebenchError

KIND = F.KINDS["preferences"]


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    where: str                 # "line 7" or "record 'pref-00003'"
    source: str                # the file it came from
    system: str | None = None
    rater: str | None = None
    session: str | None = None
    rationale: str | None = None


@dataclass
class PreferenceCounts:
    records: int = 0
    pairs: int = 0
    ties: int = 0
    skips: int = 0
    raters: dict[str, int] = field(default_factory=dict)    # rater -> pairs ("" = unnamed)
    sessions: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def load_preferences(path: str | Path, split: str | None = None
                     ) -> tuple[list[PreferencePair], PreferenceCounts]:
    """The pairs of a JSONL file, or of one split of a `preferences` dataset folder."""
    path = Path(path)
    if path.is_dir():
        dataset = load_dataset(path, check_media=False)
        if dataset.kind != KIND.name:
            raise ForgebenchError(f"dataset kind is {dataset.kind!r}, DPO needs 'preferences'",
                                  path=path / F.MANIFEST, where="kind")
        source = path / dataset.manifest.get("records", KIND.records)
        items = [(f"record {r.get('id')!r}", r) for r in dataset.records(split)]
        if not items:
            raise ForgebenchError(f"the dataset has no records in split {split!r}", path=path,
                                  hint="run `forgebench data split` or choose another split")
    else:
        source, items = path, _file_records(path)
    pairs, counts = [], PreferenceCounts(records=len(items))
    for where, record in items:
        outcome = record.get("outcome", "preferred")
        if outcome in ("tie", "skip"):
            if outcome == "tie":
                counts.ties += 1
            else:
                counts.skips += 1
            continue
        pair = PreferencePair(record["prompt"], record["chosen"], record["rejected"], where,
                              str(source), *(record.get(k) for k in
                                             ("system", "rater", "session", "rationale")))
        pairs.append(pair)
        counts.pairs += 1
        counts.raters[pair.rater or ""] = counts.raters.get(pair.rater or "", 0) + 1
        if pair.session:
            counts.sessions[pair.session] = counts.sessions.get(pair.session, 0) + 1
    if not pairs:
        raise ForgebenchError(
            f"no preference to learn from: the {counts.records} record(s) are "
            f"{counts.ties} tie(s) and {counts.skips} skip(s)", path=source,
            hint="ties and skips say neither answer is better; rate more pairs with a winner")
    return pairs, counts


def _file_records(path: Path) -> list[tuple[str, dict]]:
    """(where, record) of every line of a JSONL file, each validated against the kind (an
    `id` is optional in a plain file: the line number identifies the record)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ForgebenchError("preference data file not found", path=path) from None
    except UnicodeDecodeError as exc:
        raise ForgebenchError(f"not UTF-8 text (byte {exc.start})", path=path) from None
    items = []
    for number, record, error in jsonl_objects(text):
        where = f"line {number}"
        if error:
            raise ForgebenchError(error, path=path, where=where,
                                  hint="each line must be one JSON object")
        record.setdefault("id", where)
        for name, reason in check_record(record, KIND, {}):
            raise ForgebenchError(f"field '{name}': {reason}" if name else reason, path=path,
                                  where=where, hint="records need non-empty 'prompt', 'chosen' "
                                                    "and 'rejected' texts that differ")
        items.append((where, record))
    if not items:
        raise ForgebenchError("the preference data file has no records", path=path,
                              hint="one JSON object per line")
    return items
