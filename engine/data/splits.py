"""Group-aware, seed-deterministic split assignment that never moves an existing group.

Two assigners share one ratio table:

* `hash_split(group)` places a group by a hash of (seed, group) alone, so adding records can
  never move a group that already exists; `assign_splits` additionally keeps every assignment
  recorded in splits.json, so even a change of ratios moves nothing already assigned. Its
  output is a new dataset version: the raw data and the version it came from are not touched.
* `block_split(index)` is for generators that number their entities: every block of 20
  consecutive entities is split exactly by the ratios, so a generated set of any size has its
  exact proportions and growing it leaves earlier entities where they were.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from engine.data import formats as F
from engine.errors import ForgebenchError
from engine.fsutil import read_json

DEFAULT_RATIOS = {"train": 0.8, "val": 0.1, "calibration": 0.0, "test": 0.1}
BLOCK = 20


def parse_ratios(text: str | dict | None) -> dict[str, float]:
    """'0.8,0.1,0,0.1' (train,val,calibration,test) or a dict -> normalized ratios."""
    if text is None:
        return dict(DEFAULT_RATIOS)
    if isinstance(text, dict):
        values = [text.get(s, 0.0) for s in F.SPLITS]
    else:
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) != len(F.SPLITS):
            raise ForgebenchError(f"ratios {text!r} must be four numbers",
                                  where="--ratios", hint="e.g. 0.8,0.1,0,0.1 for "
                                  "train,val,calibration,test")
    if any(not isinstance(v, (int, float)) or v < 0 for v in values) or sum(values) <= 0:
        raise ForgebenchError("ratios must be non-negative and not all zero", where="ratios")
    total = float(sum(values))
    return {s: v / total for s, v in zip(F.SPLITS, values)}


def hash_split(group: str, seed: int, ratios: dict[str, float]) -> str:
    """The split of `group`, a pure function of (seed, group, ratios)."""
    digest = hashlib.sha256(f"{seed}\x00{group}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0 ** 64
    edge = 0.0
    for split in F.SPLITS:
        edge += ratios.get(split, 0.0)
        if u < edge:
            return split
    return max(ratios, key=ratios.get)  # u within rounding of 1.0


def block_split(index: int, seed: int, ratios: dict[str, float] | None = None) -> str:
    """The split of the index-th generated entity: exact ratios within each block of 20."""
    ratios = ratios or DEFAULT_RATIOS
    exact = {s: ratios.get(s, 0.0) * BLOCK for s in F.SPLITS}
    counts = {s: int(v) for s, v in exact.items()}
    for s in sorted(F.SPLITS, key=lambda s: counts[s] - exact[s])[:BLOCK - sum(counts.values())]:
        counts[s] += 1  # largest remainders first
    pattern = [s for s in F.SPLITS for _ in range(counts[s])]
    block, offset = divmod(index, BLOCK)
    order = np.random.default_rng([seed, block, 0x5B17]).permutation(BLOCK)
    return pattern[order[offset]]


def assign_splits(root: str | os.PathLike, ratios: dict[str, float], seed: int,
                  out_dir: str | os.PathLike | None = None, progress: bool = False) -> dict:
    """Give every unassigned group a split, saved as a new version of the dataset.

    Records that carry their own `split` keep it; groups already in splits.json keep theirs.
    The assignments go to splits.json in a new version folder (`save_new_version`: the old
    folder stays byte-identical and the new manifest names it as parent); when every group
    already has a split, nothing is written. Returns {"assigned": n_new, "counts":
    {split: n}, "path", "version", "parent"} of the version that holds the assignments.
    """
    from engine.data.dataset import group_of, load_dataset, save_new_version

    dataset = load_dataset(root, check_media=False, progress=progress)
    existing = read_json(dataset.root / F.SPLITS_FILE).get("groups", {}) \
        if F.SPLITS_FILE in dataset.manifest["files"] else {}
    groups = dict(existing)
    new = 0
    for record in dataset.raw_records():
        group = group_of(record)
        if group in groups:
            continue
        groups[group] = record.get("split") or hash_split(group, seed, ratios)
        new += record.get("split") is None
    if new:
        policy = {"method": "group-hash", "ratios": ratios, "seed": seed,
                  "group_field": "group"}
        data = json.dumps({"policy": policy, "groups": dict(sorted(groups.items()))},
                          indent=2).encode("utf-8")
        dataset = save_new_version(dataset, {F.SPLITS_FILE: data},
                                   f"assigned {new} new groups to splits (seed {seed})",
                                   out_dir, manifest_updates={"split_policy": policy},
                                   progress=progress)
    return {"assigned": new, "counts": split_counts(dataset), "path": str(dataset.root),
            "version": dataset.version, "parent": dataset.manifest.get("parent")}


def split_counts(dataset) -> dict[str, int]:
    counts = {s: 0 for s in F.SPLITS}
    for record in dataset.records():
        key = record.get("split") or "unassigned"
        counts[key] = counts.get(key, 0) + 1
    return counts

