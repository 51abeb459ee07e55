"""Log-Mel features against an independent reference (an explicit DFT and a filterbank built
by a loop from the HTK formula), the CTC model's shapes and lengths, and greedy and beam
decoding against brute-force path enumeration."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from engine.models.speech import (
    HOP,
    N_FFT,
    SpeechConfig,
    SpeechCTC,
    beam_decode,
    frame_count,
    greedy_decode,
    hz_to_mel,
    log_mel,
    mel_filterbank,
    mel_to_hz,
)


def test_mel_scale_worked_values():
    assert hz_to_mel(1000.0) == pytest.approx(999.986, abs=1e-3)   # the scale's anchor
    assert hz_to_mel(0.0) == 0.0
    assert mel_to_hz(hz_to_mel(3456.0)) == pytest.approx(3456.0)


def reference_features(wave: np.ndarray, n_mels: int) -> np.ndarray:
    """Frames, Hann window, explicit DFT sum, triangles from the formula, log: no FFT and no
    shared code with the module under test."""
    n = np.arange(N_FFT)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * n / N_FFT)           # periodic Hann
    frames = [wave[s:s + N_FFT] * window for s in range(0, len(wave) - N_FFT + 1, HOP)]
    k = np.arange(N_FFT // 2 + 1)
    dft = np.exp(-2j * np.pi * np.outer(k, n) / N_FFT)
    power = np.abs(np.array(frames) @ dft.T) ** 2                 # [frames, bins]
    lo, hi = 2595 * math.log10(1 + 20 / 700), 2595 * math.log10(1 + 8000 / 700)
    corners = [700 * (10 ** ((lo + (hi - lo) * i / (n_mels + 1)) / 2595) - 1)
               for i in range(n_mels + 2)]
    bank = np.zeros((n_mels, len(k)))
    for m in range(n_mels):
        left, centre, right = corners[m:m + 3]
        for b in k:
            f = b * 16000 / N_FFT
            if left < f <= centre:
                bank[m, b] = (f - left) / (centre - left)
            elif centre < f < right:
                bank[m, b] = (right - f) / (right - centre)
    return np.log(np.maximum(power @ bank.T, 1e-10))


def test_log_mel_matches_an_independent_reference():
    rng = np.random.default_rng(0)
    t = np.arange(4000) / 16000
    wave = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.normal(size=t.size)
    ours = log_mel(torch.tensor(wave[None]), torch.tensor(mel_filterbank(24)))[0].numpy()
    expected = reference_features(wave, 24)
    assert ours.shape == expected.shape == (frame_count(4000), 24)
    np.testing.assert_allclose(ours, expected, atol=1e-6)
    # twin: a filterbank with one band too many is a different feature, visibly
    other = log_mel(torch.tensor(wave[None]), torch.tensor(mel_filterbank(25)))[0].numpy()
    assert np.abs(other[:, :24] - expected).max() > 0.1


def test_a_tone_lights_the_band_centred_on_it():
    bank = mel_filterbank(40)
    centres = mel_to_hz(np.linspace(hz_to_mel(20), hz_to_mel(8000), 42))[1:-1]
    for hz in (300.0, 1000.0, 3000.0):
        t = np.arange(8000) / 16000
        features = log_mel(torch.tensor(np.sin(2 * np.pi * hz * t)[None]),
                           torch.tensor(bank))[0].numpy()
        assert abs(centres[features.mean(0).argmax()] - hz) < 0.5 * hz * 0.2


def test_model_shapes_and_padding_do_not_leak():
    torch.manual_seed(0)
    model = SpeechCTC(SpeechConfig(vocab=29, channels=16, layers=3)).eval()
    waves = torch.randn(2, 8000) * 0.1
    features = model.features(waves)
    frames = torch.tensor([frame_count(8000), frame_count(5000)])
    log_probs, lengths = model(features, frames)
    assert log_probs.shape == (2, int(lengths.max()), 29)
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, log_probs.shape[1]))
    alone, _ = model(model.features(waves[1:, :5000]), frames[1:])
    assert torch.allclose(alone[0], log_probs[1, :lengths[1]], atol=1e-5)


def collapse(path):
    out, previous = [], 0
    for label in path:
        if label != previous and label != 0:
            out.append(label)
        previous = label
    return tuple(out)


def best_labelling(log_probs: np.ndarray) -> tuple:
    """Sum every frame path into its collapsed labelling; the most probable labelling."""
    totals = {}
    for path in itertools.product(range(log_probs.shape[1]), repeat=log_probs.shape[0]):
        p = math.exp(sum(log_probs[t, s] for t, s in enumerate(path)))
        totals[collapse(path)] = totals.get(collapse(path), 0.0) + p
    return max(totals, key=totals.get)


def test_greedy_collapses_repeats_and_blanks():
    onehot = lambda labels: np.log(np.eye(3)[labels] * 0.98 + 0.01)  # noqa: E731
    assert greedy_decode(onehot([1, 1, 0, 2, 2])) == [1, 2]
    assert greedy_decode(onehot([1, 0, 1])) == [1, 1]
    assert greedy_decode(onehot([1, 1, 1])) == [1]


@pytest.mark.parametrize("seed", range(6))
def test_beam_search_finds_the_most_probable_labelling(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(5, 3)) * 1.5
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert tuple(beam_decode(log_probs, beam=64)) == best_labelling(log_probs)


def test_beam_beats_greedy_where_paths_add_up():
    # frame-wise the blank wins both frames, but "a" collects more probability over paths
    log_probs = np.log(np.array([[0.45, 0.35, 0.2], [0.45, 0.35, 0.2]]))
    assert greedy_decode(log_probs) == []
    assert best_labelling(log_probs) == (1,)          # 0.35*0.45*2 + 0.35^2 = 0.4375 > 0.2025
    assert beam_decode(log_probs, beam=8) == [1]
