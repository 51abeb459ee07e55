"""Data cards: card.json (machine-readable) and card.md (for people), written beside the data.

The card states what the handbook asks of one: task, sources, collection dates, preprocessing,
split method, each right separately (train, publish data, publish weights, commercial use),
consent, counts, known gaps, intended and prohibited uses. Whatever the dataset's manifest does
not state is written as "not stated" and listed under `missing`, so a gap is visible instead of
silently assumed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from engine.config import Schema
from engine.data.dataset import Dataset, conversion_note
from engine.data.stats import dataset_stats
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, atomic_write_text, read_json

NOT_STATED = "not stated"
RIGHTS = ("train", "publish_data", "publish_weights", "commercial")
Answer = Literal["not stated", "yes", "no", "with conditions"]


class RightsStatement(Schema):
    """Each right answered on its own: they can have different answers."""

    train: Answer = Field(NOT_STATED, description="may a model be trained on this data?")
    publish_data: Answer = Field(NOT_STATED, description="may the data be redistributed?")
    publish_weights: Answer = Field(NOT_STATED, description="may trained weights be published?")
    commercial: Answer = Field(NOT_STATED, description="may it back a commercial service?")
    basis: str = Field("", validate_default=True,
                       description="the licence, permission or terms behind the answers")

    @field_validator("basis")
    @classmethod
    def _conditions_are_written(cls, basis: str, info: ValidationInfo) -> str:
        conditional = [r for r in RIGHTS if info.data.get(r) == "with conditions"]
        if conditional and not basis.strip():
            raise ValueError(f"state the conditions for {', '.join(conditional)}")
        return basis


class CardStatement(Schema):
    """What people state about a dataset; counts, lengths and hashes are measured instead.
    The app's data-card form is generated from this schema."""

    task: str = Field("", description="the job the data teaches")
    sources: list[str] = Field([], description="source types and where each came from")
    collection_dates: str = Field("", description="when the data was collected")
    preprocessing: str = Field("", description="cleaning and transformations applied")
    split_method: str = Field("", description="how splits were made (default: the manifest's "
                                              "split policy)")
    rights: RightsStatement = RightsStatement()
    consent: str = Field("", description="consent basis for recorded or depicted people")
    known_gaps: list[str] = Field([], description="what the data does not cover")
    intended_uses: list[str] = Field([], description="what it is for")
    prohibited_uses: list[str] = Field([], description="what it must not be used for")
    reviewed_by: str = Field("", description="who reviewed the labels")

    @field_validator("prohibited_uses")
    @classmethod
    def _uses_do_not_contradict(cls, prohibited: list[str], info: ValidationInfo) -> list[str]:
        both = set(info.data.get("intended_uses") or []) & set(prohibited)
        if both:
            raise ValueError(f"{sorted(both)[0]!r} is also listed as an intended use")
        return prohibited

    def given(self) -> dict:
        """Only what is stated: empty texts and 'not stated' answers are left out, so the
        card lists them as missing."""
        out = {k: v for k, v in self.model_dump(exclude={"rights"}).items() if v}
        rights = {k: v for k, v in self.rights.model_dump().items() if v and v != NOT_STATED}
        if rights:
            out["rights"] = rights
        return out


def statement_of(card: dict) -> dict:
    """The stated part of a written card.json, in `CardStatement` form (for re-editing and
    for keeping those statements when the card is written again)."""
    out = {}
    for name in CardStatement.model_fields:
        value = card.get(name)
        if name == "rights" and isinstance(value, dict):
            out["rights"] = {k: v for k, v in value.items()
                             if k in RightsStatement.model_fields and v != NOT_STATED}
        elif value not in (None, NOT_STATED, [NOT_STATED]) and name != "rights":
            out[name] = value
    return out


def build_card(dataset: Dataset, stats: dict | None = None, stated: dict | None = None) -> dict:
    """The card: `stated` (a `CardStatement.given()`) wins over the manifest's card and
    rights sections; everything measured comes from the data itself."""
    manifest = dataset.manifest
    given = dict(manifest.get("card") or {}, **{k: v for k, v in (stated or {}).items()
                                                 if k != "rights"})
    rights_given = manifest.get("rights")
    rights_given = rights_given if isinstance(rights_given, dict) else \
        {"statement": rights_given} if rights_given else {}
    rights_given = dict(rights_given, **(stated or {}).get("rights", {}))
    stats = stats or dataset_stats(dataset)
    policy = manifest.get("split_policy") or {}
    card = {
        "name": dataset.name, "version": dataset.version, "parent": manifest.get("parent"),
        "kind": dataset.kind,
        "task": given.get("task", NOT_STATED),
        "sources": given.get("sources") or [manifest.get("provenance") or NOT_STATED],
        "collection_dates": given.get("collection_dates")
        or (f"generated {manifest['created']}" if manifest.get("created") and
            manifest.get("provenance", {}).get("generator") else NOT_STATED),
        "preprocessing": given.get("preprocessing", NOT_STATED),
        "split_method": given.get("split_method") or _split_method(policy),
        "rights": {right: rights_given.get(right, NOT_STATED) for right in RIGHTS}
        | {"basis": rights_given.get("basis") or rights_given.get("statement", NOT_STATED)},
        "consent": given.get("consent") or rights_given.get("consent", NOT_STATED),
        "counts": stats["counts"],
        "known_gaps": given.get("known_gaps") or [NOT_STATED],
        "intended_uses": given.get("intended_uses") or [NOT_STATED],
        "prohibited_uses": given.get("prohibited_uses") or [NOT_STATED],
        "reviewed_by": given.get("reviewed_by", NOT_STATED),
        "files_sha256": dataset.files_manifest(),
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for key in ("text_lengths", "images", "audio"):
        if key in stats:
            card[key] = stats[key]
    if "images" in stats:   # measured, so it is stated even when the preprocessing is not
        card["conversions"] = conversion_note(stats["images"].get("converted_to_rgb", {})) \
            or "none: every image is 8-bit RGB"
    card["missing"] = sorted(_missing(card))
    return card


def _split_method(policy: dict) -> str:
    if not policy:
        return NOT_STATED
    parts = [str(policy.get("method", "unspecified"))]
    if policy.get("ratios"):
        parts.append("ratios " + ", ".join(f"{k} {v:g}" for k, v in policy["ratios"].items()
                                           if isinstance(v, (int, float))))
    if "seed" in policy:
        parts.append(f"seed {policy['seed']}")
    if policy.get("group_field"):
        parts.append(f"grouped by '{policy['group_field']}'")
    if policy.get("note"):
        parts.append(str(policy["note"]))
    return "; ".join(parts)


def _missing(card: dict) -> list[str]:
    out = []
    for key, value in card.items():
        if value == NOT_STATED or value == [NOT_STATED]:
            out.append(key)
        elif isinstance(value, dict):
            out += [f"{key}.{k}" for k, v in value.items() if v == NOT_STATED]
    return out


def render_markdown(card: dict) -> str:
    def bullet(items) -> str:
        return "\n".join(f"- {item}" for item in items)

    lines = [f"# Data card: {card['name']}", "",
             f"Version `{card['version']}`" + (f" (parent `{card['parent']}`)"
                                               if card.get("parent") else "")
             + f", kind `{card['kind']}`.", "",
             "## Task", "", str(card["task"]), "",
             "## Sources and collection", "", bullet(card["sources"]), "",
             f"Collection dates: {card['collection_dates']}", "",
             f"Preprocessing: {card['preprocessing']}", "",
             f"Split method: {card['split_method']}", "",
             "## Rights and consent", "",
             "| right | answer |", "|---|---|"]
    labels = {"train": "Train on it", "publish_data": "Publish the data",
              "publish_weights": "Publish trained weights", "commercial": "Commercial use",
              "basis": "Basis"}
    lines += [f"| {labels[k]} | {v} |" for k, v in card["rights"].items()]
    lines += ["", f"Consent: {card['consent']}", "", "## Counts", ""]
    counts = card["counts"]
    lines += ["| split | records |", "|---|---|"] + \
        [f"| {s} | {n} |" for s, n in counts["by_split"].items()]
    if "by_class" in counts:
        classes = sorted({c for per in counts["by_class"].values() for c in per})
        lines += ["", "| split | " + " | ".join(classes) + " |",
                  "|---|" + "---|" * len(classes)]
        lines += [f"| {s} | " + " | ".join(str(per.get(c, 0)) for c in classes) + " |"
                  for s, per in counts["by_class"].items()]
    if "text_lengths" in card:
        lengths = card["text_lengths"]
        lines += ["", f"Lengths in {lengths['unit']}:", "",
                  "| split | n | min | p50 | p90 | max |", "|---|---|---|---|---|---|"]
        lines += [f"| {s} | {v['n']} | {v.get('min', 0):g} | {v.get('p50', 0):g} | "
                  f"{v.get('p90', 0):g} | {v.get('max', 0):g} |"
                  for s, v in lengths["by_split"].items()]
    if "images" in card:
        lines += ["", "Image sizes: " + ", ".join(f"{k} ({v})" for k, v in
                                                  card["images"]["sizes"].items()),
                  "Image modes: " + ", ".join(f"{k} ({v})" for k, v in
                                              card["images"]["modes"].items()),
                  f"Conversions on load: {card['conversions']}"]
    if "audio" in card:
        audio = card["audio"]
        lines += ["", f"Audio: {audio['clips']} clips, duration "
                      f"{audio['duration_s'].get('min', 0):.3f}-"
                      f"{audio['duration_s'].get('max', 0):.3f} s, peak up to "
                      f"{audio['peak_dbfs'].get('max', 0):.1f} dBFS, "
                      f"{audio['clipped_clips']} clipped."]
    lines += ["", "## Known gaps", "", bullet(card["known_gaps"]), "",
              "## Intended uses", "", bullet(card["intended_uses"]), "",
              "## Prohibited or unsupported uses", "", bullet(card["prohibited_uses"]), "",
              f"Labels reviewed by: {card['reviewed_by']}", ""]
    if card["missing"]:
        lines += ["## Not stated", "", "The dataset does not state: " +
                  ", ".join(card["missing"]) + ".", ""]
    return "\n".join(lines)


def write_card(dataset: Dataset, stats: dict | None = None,
               stated: dict | None = None) -> tuple[Path, Path]:
    """Write card.json and card.md into the dataset folder (descriptions, not data: they are
    not part of the hashed file list). Without `stated`, what an earlier card.json stated is
    kept: rewriting a card never loses what someone wrote into it."""
    if stated is None and (dataset.root / "card.json").is_file():
        try:
            previous = read_json(dataset.root / "card.json")
        except ForgebenchError:
            previous = {}
        stated = statement_of(previous) if isinstance(previous, dict) else None
    card = build_card(dataset, stats, stated)
    json_path, md_path = dataset.root / "card.json", dataset.root / "card.md"
    atomic_write_json(json_path, card)
    atomic_write_text(md_path, render_markdown(card))
    return json_path, md_path
