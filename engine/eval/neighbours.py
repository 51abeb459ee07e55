"""Nearest training neighbours of generated samples: a screen for memorisation.

Images are compared by pixels (RMS difference in [0, 1]) and by gradient-orientation features
(cosine distance), which see shape rather than colour; sounds by log-STFT distance. A small
distance is a reason to look, not proof of copying; a large one is not proof of originality.
"""

from __future__ import annotations

import numpy as np

from engine.eval.audio import log_stft

ORIENTATIONS = 8
CELLS = 4


def gradient_features(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] floats -> unit vector of orientation histograms on a CELLS × CELLS grid."""
    gray = np.asarray(image, dtype=np.float64).mean(axis=2)
    gy, gx = np.gradient(gray)
    magnitude = np.hypot(gx, gy)
    angle = np.mod(np.arctan2(gy, gx), np.pi)  # unsigned: a light-on-dark edge = dark-on-light
    bins = np.minimum((angle / np.pi * ORIENTATIONS).astype(int), ORIENTATIONS - 1)
    h, w = gray.shape
    rows = np.minimum(np.arange(h) * CELLS // h, CELLS - 1)
    cols = np.minimum(np.arange(w) * CELLS // w, CELLS - 1)
    cell = rows[:, None] * CELLS + cols[None, :]
    hist = np.zeros(CELLS * CELLS * ORIENTATIONS)
    np.add.at(hist, (cell * ORIENTATIONS + bins).ravel(), magnitude.ravel())
    return hist / (np.linalg.norm(hist) + 1e-12)


def nearest_images(samples: np.ndarray, train: np.ndarray, ids: list[str]) -> list[dict]:
    """For each sample [N, H, W, 3] the nearest of `train` [M, H, W, 3] by pixels and features."""
    flat_train = train.reshape(len(train), -1)
    train_features = np.stack([gradient_features(t) for t in train])
    out = []
    for sample in samples:
        pixel = np.sqrt(np.mean((flat_train - sample.reshape(1, -1)) ** 2, axis=1))
        feature = 1.0 - train_features @ gradient_features(sample)
        i, j = int(pixel.argmin()), int(feature.argmin())
        out.append({"pixel": {"id": ids[i], "rms_distance": float(pixel[i])},
                    "feature": {"id": ids[j], "cosine_distance": float(feature[j])}})
    return out


def nearest_clips(samples: list[np.ndarray], train: list[np.ndarray], ids: list[str]) -> list[dict]:
    """For each waveform the training clip with the smallest log-STFT RMS distance."""
    train_specs = np.stack([log_stft(t) for t in train]).reshape(len(train), -1)
    out = []
    for sample in samples:
        dist = np.sqrt(np.mean((train_specs - log_stft(sample).reshape(1, -1)) ** 2, axis=1))
        i = int(dist.argmin())
        out.append({"log_stft": {"id": ids[i], "rms_distance": float(dist[i])}})
    return out
