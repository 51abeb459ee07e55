"""Sample playback through sounddevice, at a level the listener controls.

Playback starts quiet (START_GAIN_DB) because generated audio can be loud or broken, applies only
the user's gain (never peak-normalizes: a quiet sample must sound quiet, a clipped one clipped),
and degrades to a clear message when PortAudio or an output device is missing — importing
sounddevice raises OSError without PortAudio — so the rest of the app keeps working.
"""

from __future__ import annotations

import numpy as np

START_GAIN_DB = -18.0
MIN_GAIN_DB, MAX_GAIN_DB = -60.0, 0.0


def gain_factor(gain_db: float) -> float:
    return float(10.0 ** (gain_db / 20.0))


def apply_gain(wave: np.ndarray, gain_db: float) -> np.ndarray:
    """The samples scaled by the level control only, then held inside [-1, 1]: the gain is at
    most 0 dB, so the clip only ever touches samples that were already out of range."""
    gain_db = min(max(gain_db, MIN_GAIN_DB), MAX_GAIN_DB)
    return np.clip(np.asarray(wave, dtype=np.float32) * gain_factor(gain_db), -1.0, 1.0)


class Player:
    """Plays one waveform at a time; `problem` says why playback is unavailable (or None)."""

    def __init__(self, gain_db: float = START_GAIN_DB):
        self.gain_db = gain_db
        self.problem: str | None = None
        self._sd = None
        try:
            import sounddevice
        except OSError as exc:          # no PortAudio library on this system
            self.problem = f"audio playback is unavailable: PortAudio is missing ({exc})"
            return
        try:
            sounddevice.query_devices(kind="output")
        except Exception as exc:        # PortAudioError / ValueError: no default output device
            self.problem = f"audio playback is unavailable: no output device ({exc})"
            return
        self._sd = sounddevice

    @property
    def available(self) -> bool:
        return self._sd is not None

    def play(self, wave: np.ndarray, sample_rate: int, *, blocking: bool = False) -> bool:
        """Start playback; False (and `problem` set) when there is no way to play."""
        if self._sd is None:
            return False
        try:
            self._sd.play(apply_gain(wave, self.gain_db), sample_rate, blocking=blocking)
        except Exception as exc:        # a device unplugged since start
            self.problem = f"audio playback failed: {exc}"
            return False
        return True

    def play_sequence(self, waves: list[tuple[np.ndarray, int]], gap_s: float = 0.4) -> bool:
        """A then B: the clips one after another with a short silence between (one rate)."""
        if not waves:
            return False
        rate = waves[0][1]
        gap = np.zeros(int(gap_s * rate), dtype=np.float32)
        joined = np.concatenate([part for wave, _ in waves for part in (wave, gap)])
        return self.play(joined, rate)

    def stop(self) -> None:
        if self._sd is not None:
            self._sd.stop()
