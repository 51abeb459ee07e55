"""Audio integrity flags, log-STFT (against torch.stft) and nearest-neighbour search."""

import numpy as np
import pytest
import torch

from engine.eval.audio import SpectrogramClassifier, integrity_flags, log_stft, log_stft_distance
from engine.eval.neighbours import gradient_features, nearest_clips, nearest_images

SR, N = 16000, 8192
t = np.arange(N) / SR
fade = np.minimum(1, np.minimum(np.arange(N), N - 1 - np.arange(N)) / 200)


def test_clean_tone_raises_no_flag():
    report = integrity_flags(0.3 * np.sin(2 * np.pi * 440 * t) * fade)
    assert report["flags"] == []


@pytest.mark.parametrize("wave, flag", [
    (np.clip(2 * np.sin(2 * np.pi * 440 * t), -1, 1) * fade, "clipping"),
    (0.1 * np.sin(2 * np.pi * 440 * t) * fade + 0.05, "dc_offset"),
    (np.full(N, 1e-5), "silence"),
    (0.3 * np.cos(2 * np.pi * 440 * t), "edge_click"),   # starts at 0.3: an audible click
])
def test_each_defect_raises_its_flag(wave, flag):
    assert flag in integrity_flags(wave)["flags"]


def test_log_stft_matches_torch_stft():
    wave = np.random.default_rng(0).normal(size=N) * 0.1
    ours = log_stft(wave)
    ref = torch.stft(torch.from_numpy(wave), n_fft=512, hop_length=256, center=False,
                     window=torch.hann_window(512, periodic=False, dtype=torch.float64),
                     return_complex=True).abs().T.numpy()
    assert ours.shape == ref.shape == (31, 257)
    assert np.allclose(ours, np.log(1e-5 + ref), atol=1e-9)


def _clip(kind, rng):
    if kind == "ping":
        f = rng.uniform(800, 2000)
        return 0.4 * np.sin(2 * np.pi * f * t) * np.exp(-t * rng.uniform(5, 15)) * fade
    if kind == "thump":
        f = rng.uniform(50, 120)
        return 0.6 * np.sin(2 * np.pi * f * t) * np.exp(-t * rng.uniform(15, 30)) * fade
    return rng.normal(size=N) * 0.1 * fade


def test_spectrogram_classifier_separates_synthetic_classes():
    rng = np.random.default_rng(1)
    classes = ["thump", "ping", "hiss"]
    train = [(c, _clip(c, rng)) for c in classes for _ in range(10)]
    test = [(c, _clip(c, rng)) for c in classes for _ in range(5)]
    model = SpectrogramClassifier(classes).fit([w for _, w in train], [c for c, _ in train])
    assert model.predict([w for _, w in test]) == [c for c, _ in test]


def test_spectrogram_judge_hears_the_sound_not_a_faint_noise_floor():
    """A -60 dBFS white-noise floor does not change what a listener hears; with log bins
    floored only at 1e-5 it made every ping and thump a "hiss". Pure noise stays a hiss."""
    rng = np.random.default_rng(1)
    classes = ["thump", "ping", "hiss"]
    train = [(c, _clip(c, rng)) for c in classes for _ in range(10)]
    test = [(c, _clip(c, rng)) for c in classes for _ in range(5)]
    model = SpectrogramClassifier(classes).fit([w for _, w in train], [c for c, _ in train])
    noisy = [w + rng.normal(0, 1e-3, N) for _, w in test]
    assert model.predict(noisy) == [c for c, _ in test]
    assert set(model.predict([rng.normal(0, 0.1, N) for _ in range(5)])) == {"hiss"}


def test_nearest_clip_finds_the_copy():
    rng = np.random.default_rng(2)
    train = [_clip(c, rng) for c in ("thump", "ping", "hiss") * 3]
    ids = [f"c{i}" for i in range(len(train))]
    found = nearest_clips([train[4] + 1e-4 * rng.normal(size=N)], train, ids)[0]
    assert found["log_stft"]["id"] == "c4"
    assert log_stft_distance(train[4], train[4]) == 0.0


def test_nearest_image_by_pixels_and_by_shape():
    rng = np.random.default_rng(3)
    train = rng.random((6, 32, 32, 3))
    ids = [f"i{k}" for k in range(6)]
    found = nearest_images(train[2:3] + 0.001, train, ids)[0]
    assert found["pixel"]["id"] == "i2" and found["pixel"]["rms_distance"] == pytest.approx(0.001)
    # Gradient features ignore a global brightness shift and an inverted image.
    assert gradient_features(1 - train[1]) @ gradient_features(train[1]) == pytest.approx(1.0)
