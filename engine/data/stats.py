"""Dataset statistics: counts per split, class and slice; text lengths with truncation counts;
image sizes and modes; audio duration, level, clipping, silence and DC offset."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Protocol

import numpy as np
from tqdm import tqdm

from engine.data import formats as F
from engine.data.dataset import Dataset

CLIP_LEVEL = 0.999          # |sample| at or above this counts as clipped (PCM16 full scale)
SILENCE_DBFS = -60.0        # a 20 ms frame quieter than this is silence
DC_WARN = 0.01              # |mean sample| above this is a DC offset worth fixing


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


def _split_order(item: tuple[str, object]) -> tuple[int, str]:
    """train, val, calibration, test first, then anything else (e.g. unassigned)."""
    name = item[0]
    return (F.SPLITS.index(name) if name in F.SPLITS else len(F.SPLITS), name)


def _summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    array = np.asarray(values, dtype=np.float64)
    return {"n": int(array.size), "min": float(array.min()), "mean": float(array.mean()),
            "p50": float(np.percentile(array, 50)), "p90": float(np.percentile(array, 90)),
            "p99": float(np.percentile(array, 99)), "max": float(array.max())}


def dataset_stats(dataset: Dataset, *, tokenizer: Tokenizer | None = None,
                  tokenizer_name: str | None = None, max_length: int | None = None,
                  slices: list[str] | None = None, progress: bool = False) -> dict:
    """Everything a data card and the curation pane show, as one JSON-ready dict."""
    kind = F.KINDS[dataset.kind]
    records = dataset.records()
    slices = slices if slices is not None else list(dataset.manifest.get("slices", []))
    out: dict = {"name": dataset.name, "version": dataset.version, "kind": dataset.kind,
                 "records": len(records), "counts": _counts(records, kind, slices)}
    if kind.media is None:
        out["text_lengths"] = _text_lengths(dataset, records, tokenizer, tokenizer_name,
                                            max_length, progress)
    elif kind.media == "image":
        out["images"] = _image_stats(records, kind, progress)
    elif kind.media == "audio":
        out["audio"] = _audio_stats(records, progress)
    return out


def _counts(records: list[dict], kind: F.Kind, slices: list[str]) -> dict:
    by_split = Counter(r.get("split") or "unassigned" for r in records)
    counts: dict = {"by_split": dict(sorted(by_split.items(), key=_split_order))}
    if kind.labelled:
        by_class: dict[str, Counter] = defaultdict(Counter)
        for r in records:
            by_class[r.get("split") or "unassigned"][r.get("label")] += 1
        counts["by_class"] = {s: dict(sorted(c.items()))
                              for s, c in sorted(by_class.items(), key=_split_order)}
    for field in slices:
        per: dict[str, Counter] = defaultdict(Counter)
        for r in records:
            value = r.get(field)
            per[r.get("split") or "unassigned"][value if isinstance(value, str) else
                                                 "(none)" if value is None else str(value)] += 1
        counts.setdefault("by_slice", {})[field] = {s: dict(sorted(c.items()))
                                                    for s, c in sorted(per.items(),
                                                                       key=_split_order)}
    return counts


def _text_lengths(dataset: Dataset, records: list[dict], tokenizer, tokenizer_name,
                  max_length, progress) -> dict:
    if tokenizer is None:
        unit, measure = "whitespace words (no tokenizer chosen)", lambda text: len(text.split())
    else:
        unit, measure = f"tokens ({tokenizer_name or type(tokenizer).__name__})", \
            lambda text: len(tokenizer.encode(text))
    per_split: dict[str, list[int]] = defaultdict(list)
    for record in tqdm(records, desc="measuring text", unit="record", disable=not progress):
        per_split[record.get("split") or "unassigned"].append(measure(dataset.text_of(record)))
    ordered = sorted(per_split.items(), key=_split_order)
    result = {"unit": unit, "by_split": {s: _summary(v) for s, v in ordered}}
    if max_length is not None:
        result["max_length"] = max_length
        result["over_max_length"] = {s: sum(n > max_length for n in v) for s, v in ordered}
    return result


def _image_stats(records: list[dict], kind: F.Kind, progress: bool) -> dict:
    from engine.data.media import open_image, rgb_conversion

    field = "file_name" if kind.name == "captioned-images" else "image"
    sizes, modes, converted, unreadable = Counter(), Counter(), Counter(), 0
    for record in tqdm(records, desc="reading images", unit="image", disable=not progress):
        image, reason = open_image(record[field])
        if image is None:
            unreadable += 1
            continue
        sizes[f"{image.size[0]}x{image.size[1]}"] += 1
        modes[image.mode] += 1
        if rgb_conversion(image)[0]:
            converted[image.mode] += 1
    return {"sizes": dict(sizes.most_common()), "modes": dict(modes.most_common()),
            "converted_to_rgb": dict(sorted(converted.items())), "unreadable": unreadable}


def clip_levels(wave: np.ndarray, rate: int) -> dict:
    """Level figures for one clip [channels, samples] of floats in [-1, 1]."""
    mono = wave.mean(axis=0)
    frame = max(1, int(0.02 * rate))
    usable = mono[:mono.size // frame * frame].reshape(-1, frame) if mono.size >= frame else \
        mono.reshape(1, -1)
    frame_rms = np.sqrt(np.mean(usable ** 2, axis=1))
    rms = float(np.sqrt(np.mean(mono ** 2))) if mono.size else 0.0
    peak = float(np.abs(wave).max()) if wave.size else 0.0
    return {"duration_s": wave.shape[1] / rate if rate else 0.0,
            "rms_dbfs": 20 * np.log10(max(rms, 1e-10)),
            "peak_dbfs": 20 * np.log10(max(peak, 1e-10)),
            "clipped_samples": int(np.sum(np.abs(wave) >= CLIP_LEVEL)),
            "silent_fraction": float(np.mean(20 * np.log10(np.maximum(frame_rms, 1e-10))
                                             < SILENCE_DBFS)),
            "dc_offset": float(mono.mean()) if mono.size else 0.0}


def _audio_stats(records: list[dict], progress: bool) -> dict:
    from engine.data.media import read_audio

    levels, flagged, unreadable = [], defaultdict(list), 0
    for record in tqdm(records, desc="reading audio", unit="clip", disable=not progress):
        wave, rate, _ = read_audio(record["path"])
        if wave is None:
            unreadable += 1
            continue
        figures = clip_levels(wave, rate)
        levels.append(figures)
        if figures["clipped_samples"]:
            flagged["clipping"].append(record["id"])
        if figures["silent_fraction"] > 0.5:
            flagged["mostly_silent"].append(record["id"])
        if abs(figures["dc_offset"]) > DC_WARN:
            flagged["dc_offset"].append(record["id"])
    keys = ("duration_s", "rms_dbfs", "peak_dbfs", "silent_fraction", "dc_offset")
    return {"clips": len(levels), "unreadable": unreadable,
            **{k: _summary([lv[k] for lv in levels]) for k in keys},
            "clipped_clips": len(flagged.get("clipping", [])), "flagged": dict(flagged)}
