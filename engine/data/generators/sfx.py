"""Tiny sound effects: thumps, pings and hisses, mono 16 kHz PCM16, 8192 samples (0.512 s).

Each class varies in pitch, onset, decay and level. Pitch, onset and decay are dealt from
jittered grids in independent orders (one cell per clip, a Latin hypercube) so that no two
clips of a class are near-copies of each other, and a clip the leak detector would still
call a near-copy of another is drawn again; every clip comes from its own seed
(seed, class, index[, attempt]).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, RECORD_RIGHTS, staged_dataset_dir
from engine.data.splits import DEFAULT_RATIOS, block_split
from engine.fsutil import sha256_bytes

CLASSES = ("thump", "ping", "hiss")
SAMPLE_RATE = 16_000
SAMPLES = 8192
PEAK_LIMIT = 0.9  # stays clear of full scale: generated data must not clip


def _grid_value(rng: np.random.Generator, index: int, lo: float, hi: float, cells: int,
                dim: int) -> float:
    """A log-uniform value in one of `cells` cells: each parameter (`dim`) deals the cells out
    in its own fixed order (a Latin hypercube), so two clips close in pitch are far apart in
    decay and onset."""
    cell = np.random.default_rng([cells, dim, 7]).permutation(cells)[index % cells]
    return float(np.exp(np.log(lo) + (cell + rng.uniform(0.1, 0.9)) / cells *
                        (np.log(hi) - np.log(lo))))


def synthesize(label: str, rng: np.random.Generator, index: int, cells: int) -> np.ndarray:
    """One clip as float64 [SAMPLES] in [-PEAK_LIMIT, PEAK_LIMIT]."""
    t = np.arange(SAMPLES) / SAMPLE_RATE
    onset = _grid_value(rng, index, 0.002, 0.08, cells, dim=1)
    local = np.clip(t - onset, 0.0, None)
    started = t >= onset
    if label == "thump":
        f0 = _grid_value(rng, index, 45.0, 140.0, cells, dim=0)
        drop = rng.uniform(0.45, 0.8)
        freq = f0 * (drop + (1 - drop) * np.exp(-local / 0.03))
        click = rng.normal(0, 1, SAMPLES) * np.exp(-local / 0.003) * 0.15
        carrier = np.sin(2 * np.pi * np.cumsum(freq) / SAMPLE_RATE) + click
        envelope = np.exp(-local / _grid_value(rng, index, 0.05, 0.18, cells, dim=2))
    elif label == "ping":
        f = _grid_value(rng, index, 600.0, 3600.0, cells, dim=0)
        partial = rng.uniform(0.1, 0.4)
        carrier = np.sin(2 * np.pi * f * local) + partial * np.sin(2 * np.pi * 2.76 * f * local)
        envelope = np.minimum(local / 0.002, 1.0) * np.exp(
            -local / _grid_value(rng, index, 0.05, 0.25, cells, dim=2))
    elif label == "hiss":
        cutoff = _grid_value(rng, index, 800.0, 7000.0, cells, dim=0)
        alpha = np.exp(-2 * np.pi * cutoff / SAMPLE_RATE)  # one-pole low-pass, applied
        omega = 2 * np.pi * np.fft.rfftfreq(SAMPLES)         # in the frequency domain
        response = (1 - alpha) / (1 - alpha * np.exp(-1j * omega))
        shaped = np.fft.irfft(np.fft.rfft(rng.normal(0, 1, SAMPLES)) * response, SAMPLES)
        carrier = shaped / (np.std(shaped) + 1e-12)
        attack, release = rng.uniform(0.01, 0.08), rng.uniform(0.05, 0.2)
        length = rng.uniform(0.15, 0.4)
        envelope = np.minimum(local / attack, 1.0) * np.where(
            local < length, 1.0, np.exp(-(local - length) / release))
    else:
        raise ValueError(f"unknown sound class {label!r}")
    envelope = np.where(started, envelope, 0.0)
    envelope *= np.minimum(1.0, (SAMPLES - 1 - np.arange(SAMPLES)) / 80)  # no click at the end
    wave = carrier * envelope
    wave -= envelope * (wave.sum() / envelope.sum())  # no DC offset; silence stays silent
    level = rng.uniform(0.25, PEAK_LIMIT)
    return wave / (np.max(np.abs(wave)) + 1e-12) * level


def wav_bytes(wave: np.ndarray) -> bytes:
    """Mono PCM16 WAV bytes at SAMPLE_RATE."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, wave, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return buffer.getvalue()


def distinct_clips(label: str, n: int, seed: int, class_index: int) -> list[np.ndarray]:
    """n clips of one class, none a near-duplicate of another by the leak detector's own
    measure (with a margin for PCM16 rounding): a clip too close to an earlier one is drawn
    again from the next seed (seed, class, index, attempt). The grid keeps this rare."""
    from engine.data.leaks import AUDIO_DB
    from engine.data.similarity import audio_pairs

    cells = max(n, 1)
    attempts = [0] * n
    waves = [synthesize(label, np.random.default_rng([seed, class_index, index]), index, cells)
             for index in range(n)]
    while True:
        again = sorted({j for _, j, _ in audio_pairs(waves, AUDIO_DB + 0.25)})
        if not again:
            return waves
        for index in again:
            attempts[index] += 1
            if attempts[index] > 20:
                raise RuntimeError(f"no distinct {label} clip for index {index}")
            rng = np.random.default_rng([seed, class_index, index, attempts[index]])
            waves[index] = synthesize(label, rng, index, cells)


def generate_sfx(out_dir: str | os.PathLike, n_per_class: int = 60, seed: int = 0) -> Path:
    """Write an `audio-clips` dataset of 3 x n_per_class clips to a new folder."""
    with staged_dataset_dir(out_dir) as root:
        (root / "clips").mkdir()
        lines = []
        for class_index, label in enumerate(CLASSES):
            for index, wave in enumerate(distinct_clips(label, n_per_class, seed, class_index)):
                data = wav_bytes(wave)
                rid = f"{label}-{index:04d}"
                (root / "clips" / f"{rid}.wav").write_bytes(data)
                lines.append(json.dumps({
                    "id": rid, "path": f"clips/{rid}.wav", "label": label,
                    "split": block_split(index, seed + class_index), "group": rid,
                    "source": "forgebench sfx generator",
                    "rights": RECORD_RIGHTS, "sha256": sha256_bytes(data)}))
        (root / "clips.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        write_manifest(
            root, "audio-clips", "tiny-sfx", records="clips.jsonl", classes=list(CLASSES),
            audio={"sample_rate": SAMPLE_RATE, "channels": 1, "subtype": "PCM_16",
                   "samples": SAMPLES},
            split_policy={"method": "block", "ratios": DEFAULT_RATIOS, "seed": seed,
                          "group_field": "group", "stratified_by": "label"},
            provenance={"generator": "engine.data.generators.sfx", "seed": seed,
                        "n_per_class": n_per_class},
            rights=GENERATED_RIGHTS,
            card={"task": "generate (or classify) short thump, ping and hiss sounds",
                  "sources": ["procedural synthesis by engine.data.generators.sfx"],
                  "preprocessing": "none: synthesized directly at 16 kHz, peak-normalized "
                                   "below 0.9",
                  "known_gaps": ["half-second mono clips only", "no room acoustics, speech "
                                 "or music"],
                  "intended_uses": ["teaching a tiny class-conditioned sound generator"],
                  "prohibited_uses": ["text-to-speech or voice imitation"]})
    return Path(out_dir).expanduser().absolute()
