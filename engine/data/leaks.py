"""Leak and duplicate report: every finding is a pair of records with its evidence.

A pair in two different splits is a leak (severity "error": evaluation would be contaminated);
a pair inside one split is a duplicate (severity "warning": it over-weights one example).
Records of one group are meant to stay together, so near-duplicates inside a group are not
findings; a group seen in two splits is.

Near-duplicate text ignores template text: character shingles found in more than 5% of the
records (a prompt template, "Question: Where is") say that two records share a format, not
that one copies the other. The report's `settings` state each check's thresholds and that cut,
and every finding's evidence repeats what it was measured with.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from engine.data import formats as F
from engine.data import similarity as sim
from engine.data.dataset import Dataset, group_of

TEXT_JACCARD = 0.7       # near-duplicate text: Jaccard of normalized 5-gram shingles ...
TEXT_COMMON_SHARE = 0.05  # ... after dropping template shingles, those in more than 5% of
TEXT_COMMON_MIN = 20      # the texts (and more than 20). Measured at default sizes: the
                          # clean records corpus peaks at 0.48 (0.88 with the template kept),
                          # the style pairs at 0.48; planted near-copies score 0.79-1.0
IMAGE_HAMMING = 12       # near-duplicate image: perceptual-hash bits that may differ (of 64)
IMAGE_THUMB = 0.15       # ... and RMS difference of normalized colour thumbnails (0 = same)
AUDIO_DB = 2.0           # near-duplicate audio: mean |difference| of audible log-STFT bins, dB


@dataclass
class Item:
    """What the detector compares: one record's identity, split and content."""

    id: str                         # shown in findings ("dataset:id" across datasets)
    split: str | None
    group: str
    record_id: str = ""             # the id as stored, compared by the same-id check
    text: str | None = None
    media: str | None = None        # relative path of the main image/clip
    media_sha256: str | None = None
    media_path: object = None       # absolute path, for decoding


@dataclass
class LeakFinding:
    kind: str       # same-id | same-group | identical-bytes | identical-text | near-text | ...
    a: str          # record ids (prefixed "dataset:" when several datasets are compared)
    b: str
    split_a: str | None
    split_b: str | None
    evidence: dict
    severity: str = field(init=False)

    def __post_init__(self):
        self.severity = "error" if self.split_a != self.split_b else "warning"

    def render(self) -> str:
        label = "LEAK" if self.severity == "error" else "dup "
        detail = ", ".join(f"{k} {v}" for k, v in self.evidence.items())
        return f"{label} {self.kind:15s} {self.split_a}:{self.a} <-> {self.split_b}:{self.b}  " \
               f"({detail})"


@dataclass
class LeakReport:
    findings: list[LeakFinding]
    n_items: int
    checks: list[str]
    settings: dict = field(default_factory=dict)  # per check: thresholds, what was ignored

    @property
    def leaks(self) -> list[LeakFinding]:
        return [f for f in self.findings if f.severity == "error"]

    def to_json(self) -> dict:
        counts: dict[str, int] = defaultdict(int)
        for finding in self.findings:
            counts[finding.kind] += 1
        return {"records": self.n_items, "checks": self.checks, "leaks": len(self.leaks),
                "duplicates": len(self.findings) - len(self.leaks), "by_kind": dict(counts),
                "settings": self.settings,
                "findings": [asdict(f) for f in self.findings]}


def items_of(dataset: Dataset, prefix: str = "") -> list[Item]:
    kind = F.KINDS[dataset.kind]
    media_field = {"audio": "path", "image": "image"}.get(kind.media)
    if dataset.kind == "captioned-images":
        media_field = "file_name"
    files = dataset.files_manifest()
    items = []
    for raw, resolved in zip(dataset.raw_records(), dataset.records()):
        rel = raw.get(media_field) if media_field else None
        items.append(Item(
            id=prefix + raw["id"], split=resolved.get("split"), group=prefix + group_of(raw),
            record_id=raw["id"], text=dataset.text_of(raw) if kind.media is None else None,
            media=rel, media_sha256=files.get(rel) if rel else None,
            media_path=resolved.get(media_field) if rel else None))
    return items


def find_leaks(datasets: list[Dataset], *, text_jaccard: float = TEXT_JACCARD,
               text_common_share: float = TEXT_COMMON_SHARE,
               image_hamming: int = IMAGE_HAMMING, image_thumb: float = IMAGE_THUMB,
               audio_db: float = AUDIO_DB, progress: bool = False) -> LeakReport:
    """Check one dataset, or several against each other (e.g. a training set and an
    evaluation set kept in separate folders)."""
    several = len(datasets) > 1
    items = [item for d in datasets for item in items_of(d, f"{d.name}:" if several else "")]
    kinds = {F.KINDS[d.kind].media for d in datasets}
    return find_leaks_in_items(items, media=kinds.pop() if len(kinds) == 1 else None,
                               text_jaccard=text_jaccard,
                               text_common_share=text_common_share,
                               image_hamming=image_hamming,
                               image_thumb=image_thumb, audio_db=audio_db, progress=progress)


def find_leaks_in_items(items: list[Item], *, media: str | None,
                        text_jaccard: float = TEXT_JACCARD,
                        text_common_share: float = TEXT_COMMON_SHARE,
                        image_hamming: int = IMAGE_HAMMING,
                        image_thumb: float = IMAGE_THUMB, audio_db: float = AUDIO_DB,
                        progress: bool = False) -> LeakReport:
    found: dict[tuple[int, int], LeakFinding] = {}

    def add(kind: str, i: int, j: int, evidence: dict) -> None:
        key = (min(i, j), max(i, j))
        if key not in found:  # one finding per pair: the strongest check reports first
            found[key] = LeakFinding(kind, items[key[0]].id, items[key[1]].id,
                                     items[key[0]].split, items[key[1]].split, evidence)

    checks = ["same-id", "same-group"]
    settings: dict = {}
    _chain_equal([it.record_id or it.id for it in items],
                 lambda i, j: add("same-id", i, j, {"id": items[i].record_id or items[i].id}))
    _group_across_splits(items, add)
    if media is None:
        checks += ["identical-text", "near-text"]
        normalized = [sim.normalize_text(it.text or "") for it in items]
        _chain_equal(normalized,
                     lambda i, j: add("identical-text", i, j,
                                      {"text": _excerpt(items[i].text)}))
        settings["near-text"] = _near_text(items, normalized, text_jaccard, text_common_share,
                                           add, progress)
    else:
        checks += ["identical-bytes"] + ([f"near-{media}"] if media in ("image", "audio") else [])
        _chain_equal([it.media_sha256 for it in items],
                     lambda i, j: add("identical-bytes", i, j,
                                      {"sha256": items[i].media_sha256[:16],
                                       "files": [items[i].media, items[j].media]}))
        if media == "image":
            settings["near-image"] = {"phash_bits_differ_max": image_hamming, "of_bits": 64,
                                      "thumbnail_rms_max": image_thumb}
            _near_images(items, image_hamming, image_thumb, add, progress)
        elif media == "audio":
            settings["near-audio"] = {"log_stft_db_max": audio_db}
            _near_audio(items, audio_db, add, progress)
    findings = sorted(found.values(), key=lambda f: (f.severity != "error", f.kind, f.a, f.b))
    return LeakReport(findings, len(items), checks, settings)


def _excerpt(text: str | None, width: int = 60) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _chain_equal(keys: list, report) -> None:
    """Positions with equal (non-empty) keys: each one is paired with the first of its
    cluster, so k copies give k - 1 findings rather than k^2 / 2."""
    first: dict[object, int] = {}
    for i, value in enumerate(keys):
        if value in (None, ""):
            continue
        if value in first:
            report(first[value], i)
        else:
            first[value] = i


def _group_across_splits(items: list[Item], add) -> None:
    by_group: dict[str, dict[str | None, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, item in enumerate(items):
        by_group[item.group][item.split].append(i)
    for group, splits in by_group.items():
        if len(splits) < 2:
            continue
        evidence = {"group": group, "records_per_split": {str(s): len(v) for s, v in
                                                          splits.items()}}
        for a, b in itertools.combinations(sorted(splits, key=str), 2):
            add("same-group", splits[a][0], splits[b][0], evidence)


def _same_group(items: list[Item], i: int, j: int) -> bool:
    return items[i].group == items[j].group


def _near_text(items: list[Item], normalized: list[str], threshold: float,
               common_share: float, add, progress: bool) -> dict:
    """Near-duplicate texts by the Jaccard of their distinctive shingles; returns the
    settings that explain the findings (threshold and the template cut)."""
    texts = [it.text or "" for it in items]
    sets, cut, n_common = sim.drop_common_shingles(sim.shingle_sets(normalized),
                                                   common_share, TEXT_COMMON_MIN)
    index = [i for i, s in enumerate(sets) if s.size]  # all-template texts have no evidence
    signatures = sim.minhash([sets[i] for i in index])
    candidates = sim.lsh_candidates(signatures)
    for a, b in tqdm(sorted(candidates), desc="near-duplicate text", unit="pair",
                     disable=not progress):
        i, j = index[a], index[b]
        if _same_group(items, i, j):
            continue
        if float(np.mean(signatures[a] == signatures[b])) < threshold - 0.15:
            continue
        score = sim.jaccard(sets[i], sets[j])
        if score >= threshold:
            add("near-text", i, j, {"jaccard": round(score, 3),
                                    "distinctive_shingles": [int(sets[i].size),
                                                             int(sets[j].size)],
                                    "ignored_shingles_in_more_than":
                                        f"{cut} of {len(items)} texts",
                                    "a": _excerpt(texts[i]), "b": _excerpt(texts[j])})
    return {"jaccard_min": threshold, "shingle_chars": sim.SHINGLE,
            "template_cut": cut, "template_shingles_ignored": n_common,
            "texts_only_template": len(items) - len(index),
            "explain": f"pairs at Jaccard >= {threshold} of normalized {sim.SHINGLE}-character "
                       f"shingles, ignoring "
                       f"the {n_common} shingles found in more than {cut} of the "
                       f"{len(items)} texts (template text shared by many records is no "
                       "evidence of copying)"}


def _near_images(items: list[Item], max_bits: int, max_thumb: float, add,
                 progress: bool) -> None:
    from engine.data.media import open_image

    index, hashes, thumbs = [], [], []
    for i, item in enumerate(tqdm(items, desc="perceptual hashes", unit="image",
                                  disable=not progress)):
        if item.media_path is None:
            continue
        image, reason = open_image(item.media_path)
        if image is not None:
            index.append(i)
            hashes.append(sim.phash(image))
            thumbs.append(sim.thumbnail(image))
    for a, b, bits in sim.hamming_pairs(np.array(hashes, dtype=np.uint64), max_bits):
        i, j = index[a], index[b]
        distance = sim.thumbnail_distance(thumbs[a], thumbs[b])
        if distance <= max_thumb and not _same_group(items, i, j):
            add("near-image", i, j, {"phash_bits_differ": bits, "of_bits": 64,
                                     "thumbnail_rms": round(distance, 3),
                                     "files": [items[i].media, items[j].media]})


def _near_audio(items: list[Item], max_db: float, add, progress: bool) -> None:
    from engine.data.media import read_audio

    index, waves = [], []
    for i, item in enumerate(tqdm(items, desc="reading clips", unit="clip",
                                  disable=not progress)):
        if item.media_path is None:
            continue
        wave, _, reason = read_audio(item.media_path)
        if wave is not None:
            index.append(i)
            waves.append(wave.mean(axis=0))
    for a, b, distance in sim.audio_pairs(waves, max_db, progress):
        i, j = index[a], index[b]
        if not _same_group(items, i, j):
            add("near-audio", i, j, {"log_stft_db": round(distance, 2),
                                     "files": [items[i].media, items[j].media]})
