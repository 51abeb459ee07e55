"""A small CTC speech recogniser: log-Mel features -> two convolutions (the first halves the
frame rate to 50 a second) -> a bidirectional GRU -> per-frame log-probabilities over a blank
plus the transcript alphabet. Greedy and prefix-beam CTC decoding of those log-probabilities.

Features (no torchaudio): 25 ms Hann frames every 10 ms (n_fft 400, hop 160 at 16 kHz, no
centre padding), the power spectrum pooled by a triangular HTK-Mel filterbank (peak 1, built in
numpy by `mel_filterbank`), then natural log with a floor of 1e-10. The features are scaled by
fixed per-band mean and deviation buffers measured once on the training split and saved with
the weights, so a quiet clip stays quiet: nothing is normalized per utterance.

Index 0 of the output is the CTC blank; index i > 0 is `alphabet[i - 1]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
LOG_FLOOR = 1e-10
BLANK = 0


def hz_to_mel(hz):
    """HTK Mel: 2595 log10(1 + f / 700); 1000 Hz is 999.986 mel."""
    return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


def mel_to_hz(mel):
    return 700.0 * (10.0 ** (np.asarray(mel, dtype=np.float64) / 2595.0) - 1.0)


def mel_filterbank(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                   fmin: float = 20.0, fmax: float | None = None) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangles with corners equally spaced in Mel, peak 1 at each
    centre, evaluated at the FFT bin frequencies k * sample_rate / n_fft."""
    fmax = sample_rate / 2 if fmax is None else fmax
    corners = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    bins = np.arange(n_fft // 2 + 1) * sample_rate / n_fft
    lower, centre, upper = corners[:-2, None], corners[1:-1, None], corners[2:, None]
    rising = (bins[None, :] - lower) / (centre - lower)
    falling = (upper - bins[None, :]) / (upper - centre)
    return np.clip(np.minimum(rising, falling), 0.0, None)


def frame_count(samples: int | torch.Tensor):
    """Feature frames of a clip of `samples` samples (a clip shorter than a frame has one)."""
    if isinstance(samples, torch.Tensor):
        return torch.clamp((samples - N_FFT) // HOP + 1, min=1)
    return max((samples - N_FFT) // HOP + 1, 1)


def log_mel(waves: torch.Tensor, filterbank: torch.Tensor) -> torch.Tensor:
    """Log-Mel features [B, frames, n_mels] of float waveforms [B, samples] (frames of a
    padded batch beyond a clip's own `frame_count` hold padding)."""
    if waves.shape[-1] < N_FFT:
        waves = F.pad(waves, (0, N_FFT - waves.shape[-1]))
    spectrum = torch.stft(waves, N_FFT, HOP, window=torch.hann_window(N_FFT, periodic=True,
                                                                      dtype=waves.dtype),
                          center=False, return_complex=True)           # [B, bins, frames]
    power = spectrum.real ** 2 + spectrum.imag ** 2
    return torch.log(torch.clamp(filterbank @ power, min=LOG_FLOOR)).transpose(1, 2)


@dataclass
class SpeechConfig:
    vocab: int                  # blank + alphabet
    n_mels: int = 40
    channels: int = 192
    hidden: int = 160
    layers: int = 2
    dropout: float = 0.1


class SpeechCTC(nn.Module):
    def __init__(self, config: SpeechConfig):
        super().__init__()
        self.config = config
        self.register_buffer("filterbank", torch.tensor(mel_filterbank(config.n_mels),
                                                        dtype=torch.float32))
        self.register_buffer("feature_mean", torch.zeros(config.n_mels))
        self.register_buffer("feature_std", torch.ones(config.n_mels))
        c = config.channels
        self.conv1 = nn.Conv1d(config.n_mels, c, 5, stride=2, padding=2)
        self.conv2 = nn.Conv1d(c, c, 5, padding=2)
        self.rnn = nn.GRU(c, config.hidden, num_layers=config.layers, batch_first=True,
                          bidirectional=True, dropout=config.dropout if config.layers > 1 else 0)
        self.drop = nn.Dropout(config.dropout)
        self.head = nn.Linear(2 * config.hidden, config.vocab)

    def features(self, waves: torch.Tensor) -> torch.Tensor:
        """Scaled log-Mel features [B, frames, n_mels] (what `forward` takes)."""
        return (log_mel(waves, self.filterbank) - self.feature_mean) / self.feature_std

    @staticmethod
    def output_lengths(frames: torch.Tensor) -> torch.Tensor:
        return (frames - 1) // 2 + 1                       # conv1: kernel 5, stride 2, pad 2

    def forward(self, features: torch.Tensor, frames: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities [B, T, vocab], valid lengths [B]) of padded features; frames past
        a clip's own length are zeroed before each convolution, so a clip scores the same
        alone as in any padded batch."""
        lengths = self.output_lengths(frames)
        x = features.transpose(1, 2) * _mask(frames, features.shape[1])
        x = F.gelu(self.conv1(x)) * _mask(lengths, -(-features.shape[1] // 2))
        x = F.gelu(self.conv2(x)).transpose(1, 2)          # [B, T, channels]
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        x, _ = self.rnn(packed)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True,
                                                total_length=int(lengths.max()))
        return F.log_softmax(self.head(self.drop(x)).float(), dim=-1), lengths


def _mask(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """[B, 1, total]: 1 inside each sequence, 0 in its padding."""
    return (torch.arange(total, device=lengths.device)[None, :] < lengths[:, None])[:, None]


# -- decoding -----------------------------------------------------------------------------
def greedy_decode(log_probs: np.ndarray) -> list[int]:
    """Best label per frame, repeats merged, blanks dropped: `a a _ b b` -> `ab`, `a _ a` ->
    `aa`."""
    best = np.asarray(log_probs).argmax(-1)
    out, previous = [], BLANK
    for label in best.tolist():
        if label != previous and label != BLANK:
            out.append(label)
        previous = label
    return out


def _logadd(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    high, low = (a, b) if a > b else (b, a)
    return high + math.log1p(math.exp(low - high))


def beam_decode(log_probs: np.ndarray, beam: int = 8,
                min_log_prob: float = -math.inf) -> list[int]:
    """CTC prefix beam search: each prefix keeps the probability of the paths that reach it
    ending in a blank and ending in its last label (so `a _ a` and `a a` stay apart), summed
    over every path, and the `beam` most probable prefixes survive each frame. With a beam
    as wide as the prefixes it returns the labelling of highest total probability. Labels
    below `min_log_prob` in a frame are not tried there (a speed-up; -inf tries all)."""
    log_probs = np.asarray(log_probs, dtype=np.float64)
    beams: dict[tuple[int, ...], tuple[float, float]] = {(): (0.0, -math.inf)}
    for frame in log_probs:
        candidates = [k for k in range(1, len(frame)) if frame[k] >= min_log_prob]
        nxt: dict[tuple[int, ...], list[float]] = {}

        def add(prefix, blank=-math.inf, label=-math.inf, nxt=nxt):
            entry = nxt.setdefault(prefix, [-math.inf, -math.inf])
            entry[0] = _logadd(entry[0], blank)
            entry[1] = _logadd(entry[1], label)

        for prefix, (p_blank, p_label) in beams.items():
            total = _logadd(p_blank, p_label)
            add(prefix, blank=total + frame[BLANK])
            if prefix:
                add(prefix, label=p_label + frame[prefix[-1]])   # a repeat merges
            for label in candidates:
                if prefix and label == prefix[-1]:
                    add(prefix + (label,), label=p_blank + frame[label])  # needs a blank
                else:
                    add(prefix + (label,), label=total + frame[label])
        ranked = sorted(nxt.items(), key=lambda kv: _logadd(*kv[1]), reverse=True)
        beams = {prefix: (b, lab) for prefix, (b, lab) in ranked[:beam]}
    return list(max(beams.items(), key=lambda kv: _logadd(*kv[1]))[0])
