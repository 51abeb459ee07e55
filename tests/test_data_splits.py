"""Group-aware splits: deterministic, ratios respected, and stable when records are added."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data.dataset import load_dataset, save_new_version, write_manifest
from engine.data.splits import DEFAULT_RATIOS, assign_splits, block_split, hash_split, parse_ratios


def _records(start: int, n: int, groups: int, rng: random.Random) -> list[dict]:
    return [{"id": f"r{i:05d}", "group": f"g{rng.randrange(groups):04d}",
             "instruction": f"question number {i} about topic {rng.random():.6f}",
             "response": f"answer {i}"} for i in range(start, start + n)]


def _write(root: Path, records: list[dict]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_manifest(root, "text-sft", "qa")


def _assignment(root: Path) -> dict[str, str]:
    return {r["id"]: r["split"] for r in load_dataset(root).records()}


def test_adding_ten_percent_keeps_every_existing_assignment(tmp_path):
    rng = random.Random(1)
    base = _records(0, 1000, 400, rng)
    _write(tmp_path / "v1", base)
    ratios = parse_ratios("0.7,0.1,0.1,0.1")
    first = assign_splits(tmp_path / "v1", ratios, seed=11)
    assert first["assigned"] == len({r["group"] for r in base})
    split_v1 = Path(first["path"])
    before = _assignment(split_v1)
    # groups never straddle splits
    by_group = {}
    for record in load_dataset(split_v1).records():
        by_group.setdefault(record["group"], set()).add(record["split"])
    assert all(len(s) == 1 for s in by_group.values())
    counts = Counter(before.values())
    assert abs(counts["train"] / 1000 - 0.7) < 0.08 and counts["calibration"] > 50

    # 10% more records: half join existing groups, half bring new groups; saved as a version
    added = _records(1000, 50, 400, rng) + _records(1050, 50, 10_000, rng)
    old = load_dataset(split_v1)
    lines = (split_v1 / "records.jsonl").read_text() + \
        "".join(json.dumps(r) + "\n" for r in added)
    new = save_new_version(old, {"records.jsonl": lines.encode()}, note="more records",
                           out_dir=tmp_path / "v2")
    after = _assignment(Path(assign_splits(new.root, ratios, seed=11)["path"]))
    assert {k: after[k] for k in before} == before
    group_split = {g: s.pop() for g, s in by_group.items()}
    for record in added:
        if record["group"] in group_split:
            assert after[record["id"]] == group_split[record["group"]]


def test_changed_ratios_do_not_move_assigned_groups(tmp_path):
    rng = random.Random(2)
    _write(tmp_path / "d", _records(0, 200, 100, rng))
    split = Path(assign_splits(tmp_path / "d", parse_ratios("0.8,0.1,0,0.1"), seed=0)["path"])
    before = _assignment(split)
    result = assign_splits(split, parse_ratios("0.1,0.1,0,0.8"), seed=5)
    assert result["assigned"] == 0 and result["path"] == str(split)  # nothing new written
    assert _assignment(split) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "d-v2"]


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_split_writes_a_new_version_and_leaves_the_old_one_byte_identical(tmp_path):
    _write(tmp_path / "d", _records(0, 20, 10, random.Random(3)))
    before = _tree(tmp_path / "d")
    old = load_dataset(tmp_path / "d").version
    result = assign_splits(tmp_path / "d", DEFAULT_RATIOS, seed=0)
    assert _tree(tmp_path / "d") == before  # not one byte of the old version changed
    assert result["path"] == str(tmp_path / "d-v2")
    dataset = load_dataset(result["path"])
    assert dataset.manifest["parent"] == old != dataset.version == result["version"]
    assert dataset.manifest["split_policy"]["seed"] == 0
    assert dataset.manifest["history"][-1]["changed"] == ["splits.json"]
    assert "splits.json" in dataset.files_manifest()
    assert (Path(result["path"]) / "records.jsonl").read_bytes() == before["records.jsonl"]
    assert all(r["split"] in ("train", "val", "test") for r in dataset.records())
    assert not any("split" in r for r in load_dataset(tmp_path / "d").records())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=60, unique=True),
       st.integers(0, 2 ** 31), st.lists(st.floats(0, 1), min_size=4, max_size=4)
       .filter(lambda v: sum(v) > 0.01))
def test_hash_split_is_a_pure_function_of_seed_and_group(groups, seed, values):
    ratios = parse_ratios(dict(zip(("train", "val", "calibration", "test"), values)))
    first = {g: hash_split(g, seed, ratios) for g in groups}
    shuffled = list(reversed(groups)) + ["another-new-group"]
    second = {g: hash_split(g, seed, ratios) for g in shuffled}
    assert all(first[g] == second[g] for g in groups)
    assert all(ratios[s] > 0 for s in first.values())


def test_block_split_is_exact_per_block_and_stable():
    splits = [block_split(i, seed=4) for i in range(200)]
    assert Counter(splits) == {"train": 160, "val": 20, "test": 20}
    assert [block_split(i, seed=4) for i in range(37)] == splits[:37]
    assert Counter(block_split(i, 0, parse_ratios("0.7,0.1,0.1,0.1")) for i in range(20)) == \
        {"train": 14, "val": 2, "calibration": 2, "test": 2}
