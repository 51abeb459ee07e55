"""A small CTC speech recogniser: log-Mel features -> a convolution that halves the frame rate
to 50 a second -> residual dilated convolution blocks -> per-frame log-probabilities over a
blank plus the transcript alphabet. All-convolutional on purpose: on a CPU a recurrent layer's
frame-by-frame steps cost far more than the same arithmetic as one convolution. Greedy and
prefix-beam CTC decoding of those log-probabilities.

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
    channels: int = 128
    layers: int = 6             # residual convolution blocks after the input convolution
    kernel: int = 5
    dropout: float = 0.1


class Block(nn.Module):
    """Pre-norm residual block: LayerNorm over channels, GELU, a dilated convolution."""

    def __init__(self, channels: int, kernel: int, dilation: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.conv = nn.Conv1d(channels, channels, kernel, dilation=dilation,
                              padding=dilation * (kernel // 2))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] -> [B, C, T]; the padding stays zero."""
        h = F.gelu(self.norm(x.transpose(1, 2))).transpose(1, 2) * mask
        return x + self.drop(self.conv(h)) * mask


class SpeechCTC(nn.Module):
    def __init__(self, config: SpeechConfig):
        super().__init__()
        self.config = config
        self.register_buffer("filterbank", torch.tensor(mel_filterbank(config.n_mels),
                                                        dtype=torch.float32))
        self.register_buffer("feature_mean", torch.zeros(config.n_mels))
        self.register_buffer("feature_std", torch.ones(config.n_mels))
        c = config.channels
        self.conv_in = nn.Conv1d(config.n_mels, c, 5, stride=2, padding=2)
        # dilations 1, 2, 4, 1, 2, 4, ...: each block sees frames further away, so the last
        # sees about a second of context on either side
        self.blocks = nn.ModuleList(Block(c, config.kernel, 2 ** (i % 3), config.dropout)
                                    for i in range(config.layers))
        self.norm = nn.LayerNorm(c)
        self.head = nn.Linear(c, config.vocab)

    def scale(self, log_mel_features: torch.Tensor) -> torch.Tensor:
        """Log-Mel features scaled by the saved per-band training statistics."""
        return (log_mel_features - self.feature_mean) / self.feature_std

    def features(self, waves: torch.Tensor) -> torch.Tensor:
        """Scaled log-Mel features [B, frames, n_mels] (what `forward` takes)."""
        return self.scale(log_mel(waves, self.filterbank))

    @staticmethod
    def output_lengths(frames: torch.Tensor) -> torch.Tensor:
        return (frames - 1) // 2 + 1                       # conv_in: kernel 5, stride 2, pad 2

    def forward(self, features: torch.Tensor, frames: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities [B, T, vocab], valid lengths [B]) of padded features; frames past
        a clip's own length are zeroed before each convolution, so a clip scores the same
        alone as in any padded batch."""
        lengths = self.output_lengths(frames)
        mask = _mask(lengths, -(-features.shape[1] // 2))
        x = self.conv_in(features.transpose(1, 2) * _mask(frames, features.shape[1])) * mask
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.norm(x.transpose(1, 2)))
        return F.log_softmax(logits.float(), dim=-1), lengths


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
