"""Audio review aids: signal-integrity flags, log-STFT features and a small spectrogram
classifier used as an independent judge of generated sounds.

Waveforms are float arrays in [-1, 1] (PCM16 / 32768). Every flag reports its measured value and
threshold, so a reviewer sees how close a clip came, not just a yes/no.
"""

from __future__ import annotations

import numpy as np

CLIP_LEVEL = 32767 / 32768        # a PCM16 sample at full scale
CLIP_FRACTION = 0.001             # more than 0.1 % of samples at full scale = clipping
DC_LIMIT = 0.02                   # |mean| above 2 % of full scale = DC offset
SILENCE_RMS = 1e-3                # RMS below -60 dBFS = silence
EDGE_SAMPLES = 4                  # the first and last few samples ...
EDGE_LIMIT = 0.05                 # ... should start and end near zero, or playback clicks
FADE_S = 0.005                    # a generated clip's raised-cosine fade in and out (5 ms: the
                                  # sfx training clips end in an 80-sample fade at 16 kHz)

N_FFT = 512
HOP = 256
# The judge looks at the top 50 dB of each clip, like a listener: below that, a faint noise
# floor (-60 dBFS white noise turned every real val clip into "hiss" when bins were floored
# only at 1e-5) would decide the class instead of the sound itself.
JUDGE_RANGE_DB = 50.0


def integrity_flags(wave: np.ndarray) -> dict:
    """Clipping, DC offset, silence and edge clicks of one mono waveform."""
    wave = np.asarray(wave, dtype=np.float64).reshape(-1)
    clipped = int(np.count_nonzero(np.abs(wave) >= CLIP_LEVEL))
    dc = float(wave.mean())
    rms = float(np.sqrt(np.mean(wave ** 2)))
    edges = float(max(np.abs(wave[:EDGE_SAMPLES]).max(), np.abs(wave[-EDGE_SAMPLES:]).max()))
    flags = {
        "clipping": clipped / wave.size > CLIP_FRACTION,
        "dc_offset": abs(dc) > DC_LIMIT,
        "silence": rms < SILENCE_RMS,
        "edge_click": edges > EDGE_LIMIT,
    }
    return {
        "flags": [name for name, raised in flags.items() if raised],
        "clipped_samples": clipped, "dc_offset": dc, "rms": rms,
        "peak": float(np.abs(wave).max()), "edge_peak": edges,
        "thresholds": {"clip_fraction": CLIP_FRACTION, "dc": DC_LIMIT, "silence_rms": SILENCE_RMS,
                       "edge_samples": EDGE_SAMPLES, "edge_peak": EDGE_LIMIT},
    }


def finished_clip(wave: np.ndarray, sample_rate: int) -> np.ndarray:
    """A generated clip as it is written for listening: its mean removed (a waveform DDPM
    drifts by a constant that a speaker cannot play; it is the `dc_offset` flag) and both ends
    faded over FADE_S with a raised cosine (an abrupt start or end is the click of the
    `edge_click` flag). Nothing else changes: no filtering, no peak normalization, so level and
    clipping stay as the model made them."""
    wave = np.asarray(wave, dtype=np.float64).reshape(-1)
    wave = wave - wave.mean()
    n = min(int(round(FADE_S * sample_rate)), wave.size // 2)
    if n > 0:
        ramp = 0.5 - 0.5 * np.cos(np.pi * np.arange(n) / n)    # 0 at the very edge .. ~1
        wave[:n] *= ramp
        wave[-n:] *= ramp[::-1]
    return wave


def log_stft(wave: np.ndarray, n_fft: int = N_FFT, hop: int = HOP) -> np.ndarray:
    """log(1e-5 + |STFT|) with a Hann window, frames without padding: [frames, n_fft/2 + 1]."""
    wave = np.asarray(wave, dtype=np.float64).reshape(-1)
    frames = 1 + (wave.size - n_fft) // hop
    index = np.arange(n_fft)[None, :] + hop * np.arange(frames)[:, None]
    spectrum = np.fft.rfft(wave[index] * np.hanning(n_fft)[None, :], axis=1)
    return np.log(1e-5 + np.abs(spectrum))


def log_stft_distance(a: np.ndarray, b: np.ndarray) -> float:
    """RMS difference of two log-STFTs (same length clips)."""
    return float(np.sqrt(np.mean((log_stft(a) - log_stft(b)) ** 2)))


def spectrogram_features(wave: np.ndarray) -> np.ndarray:
    """Time-averaged log spectrum plus the per-frame log energy envelope, both limited to
    JUDGE_RANGE_DB below the clip's loudest bin."""
    spec = log_stft(wave)
    spec = np.maximum(spec, spec.max() - JUDGE_RANGE_DB / 20 * np.log(10))
    envelope = np.log(np.mean(np.exp(2 * spec), axis=1))
    return np.concatenate([spec.mean(axis=0), envelope])


class SpectrogramClassifier:
    """Softmax regression on standardized spectrogram features, fitted by gradient descent.

    Deliberately unlike the generator (no convolutions, no diffusion), so its verdict on
    generated clips is an independent check.
    """

    def __init__(self, classes: list[str]):
        self.classes = list(classes)

    def fit(self, waves: list[np.ndarray], labels: list[str], steps: int = 500,
            lr: float = 0.5, l2: float = 1e-3) -> "SpectrogramClassifier":
        x = np.stack([spectrogram_features(w) for w in waves])
        self.mean, self.std = x.mean(axis=0), x.std(axis=0) + 1e-6
        x = (x - self.mean) / self.std
        y = np.array([self.classes.index(label) for label in labels])
        onehot = np.eye(len(self.classes))[y]
        self.weight = np.zeros((x.shape[1], len(self.classes)))
        self.bias = np.zeros(len(self.classes))
        for _ in range(steps):
            grad = (self._softmax(x) - onehot) / len(x)
            self.weight -= lr * (x.T @ grad + l2 * self.weight)
            self.bias -= lr * grad.sum(axis=0)
        return self

    def _softmax(self, x: np.ndarray) -> np.ndarray:
        logits = x @ self.weight + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)

    def predict(self, waves: list[np.ndarray]) -> list[str]:
        x = (np.stack([spectrogram_features(w) for w in waves]) - self.mean) / self.std
        return [self.classes[k] for k in self._softmax(x).argmax(axis=1)]
