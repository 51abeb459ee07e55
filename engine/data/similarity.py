"""Near-duplicate fingerprints written with numpy alone.

* text: normalized character 5-gram shingles, 64 MinHash values per text, LSH with 16 bands of
  4 rows (pairs above Jaccard ~0.5 become candidates), confirmed with the exact Jaccard;
* images: a 64-bit DCT perceptual hash of the 32x32 grey thumbnail proposes pairs (Hamming
  distance), a normalized 16x16 colour thumbnail confirms them (small, flat images fool a
  grey low-frequency hash alone: two different circles at one place share most bits);
* audio: log-power STFT frames in dB below the clip's peak (gain-invariant), compared by mean
  absolute difference over audible bins after aligning the two clips by cross-correlation;
  a loudness-envelope correlation picks the pairs worth aligning.
"""

from __future__ import annotations

import re
import unicodedata
import zlib

import numpy as np

SHINGLE = 5
NUM_PERM = 64
BANDS = 16
ROWS = NUM_PERM // BANDS
# h -> a * h + b mod 2**32 with odd a is a permutation of the 32-bit hashes: applied in place
# in 32-bit arithmetic, one permutation of millions of shingles is two vector operations
_rng = np.random.default_rng(20240611)
_PERM_A = (_rng.integers(0, 2 ** 31, NUM_PERM, dtype=np.uint64) * 2 + 1).astype(np.uint32)
_PERM_B = _rng.integers(0, 2 ** 32, NUM_PERM, dtype=np.uint64).astype(np.uint32)
_NON_WORD = re.compile(r"[^\w]+")


def normalize_text(text: str) -> str:
    """Case, accents, punctuation and spacing folded: what a near-duplicate may differ in."""
    text = text.casefold()
    if not text.isascii():  # fold accents only where there can be any (the slow part)
        text = "".join(ch for ch in unicodedata.normalize("NFKD", text)
                       if not unicodedata.combining(ch))
    return _NON_WORD.sub(" ", text).strip()


def shingle_sets(normalized: list[str]) -> list[np.ndarray]:
    """Per text (already passed through normalize_text), the sorted unique 32-bit hashes of
    its character 5-grams.

    All texts are hashed in one vectorized pass over their concatenated bytes; n-grams that
    straddle two texts are dropped. A text shorter than 5 bytes is one shingle.
    """
    encoded = [t.encode("utf-8") for t in normalized]
    lengths = np.array([len(b) for b in encoded], dtype=np.int64)
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.uint32)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    n_grams = np.maximum(lengths - SHINGLE + 1, 0)
    count = max(data.size - SHINGLE + 1, 0)
    h = np.zeros(count, dtype=np.uint32)
    for k in range(SHINGLE):  # polynomial hash mod 2**32, in place (this is memory-bound)
        h *= np.uint32(1_000_003)
        h += data[k:k + count]
    h *= np.uint32(0x9E3779B1)  # mix the low bits up
    h ^= h >> np.uint32(15)
    # one global sort of (text, shingle) keys dedupes every text's shingles at once
    owner = np.repeat(np.arange(len(encoded), dtype=np.uint64), n_grams)
    position = np.concatenate([np.arange(s, s + g) for s, g in zip(starts[:-1], n_grams)]) \
        if n_grams.sum() else np.zeros(0, dtype=np.int64)
    keys = np.sort((owner << np.uint64(32)) | h[position].astype(np.uint64))
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if keys.size else keys
    counts = np.bincount((keys >> np.uint64(32)).astype(np.int64), minlength=len(encoded))
    sets = np.split(keys & np.uint64(0xFFFFFFFF), np.cumsum(counts)[:-1])
    for i in np.flatnonzero(counts == 0):  # too short for a 5-gram: the whole text is one
        sets[i] = np.array([zlib.crc32(encoded[i])], dtype=np.uint64)
    return sets


def minhash(sets: list[np.ndarray]) -> np.ndarray:
    """[n, NUM_PERM] MinHash signatures (32-bit values; one vectorized pass per permutation)."""
    if not sets:
        return np.zeros((0, NUM_PERM), dtype=np.uint32)
    flat = np.concatenate(sets).astype(np.uint32)
    offsets = np.concatenate([[0], np.cumsum([s.size for s in sets])[:-1]])
    signatures = np.empty((len(sets), NUM_PERM), dtype=np.uint32)
    permuted = np.empty_like(flat)
    for p in range(NUM_PERM):  # in place: the shingle array is the memory traffic
        np.multiply(flat, _PERM_A[p], out=permuted)
        permuted += _PERM_B[p]
        signatures[:, p] = np.minimum.reduceat(permuted, offsets)
    return signatures


def lsh_candidates(signatures: np.ndarray, max_bucket: int = 64) -> set[tuple[int, int]]:
    """Index pairs that share at least one band. A bucket larger than `max_bucket` pairs each
    member with its first few members only (a cluster that large is one finding anyway)."""
    pairs: set[tuple[int, int]] = set()
    n = signatures.shape[0]
    for band in range(BANDS):
        rows = signatures[:, band * ROWS:(band + 1) * ROWS]
        keys = np.zeros(n, dtype=np.uint64)
        for r in range(ROWS):
            keys = keys * np.uint64(0x100000001B3) ^ rows[:, r].astype(np.uint64)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]]))
        sizes = np.diff(np.concatenate([starts, [n]]))
        for start, size in zip(starts[sizes > 1], sizes[sizes > 1]):  # shared buckets only
            members = sorted(order[start:start + size].tolist())
            anchors = members if len(members) <= max_bucket else members[:4]
            for i, a in enumerate(anchors):
                for b in members[i + 1:]:
                    pairs.add((a, b))
    return pairs


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    inter = np.intersect1d(a, b, assume_unique=True).size
    union = a.size + b.size - inter
    return inter / union if union else 1.0


# ----------------------------------------------------------------------------- images

_DCT32 = np.array([[np.cos(np.pi * (2 * x + 1) * u / 64) for x in range(32)]
                   for u in range(32)]) * np.sqrt(2 / 32)


def phash(image) -> int:
    """64-bit DCT perceptual hash of a PIL image (robust to re-encoding, small resizes,
    brightness and contrast changes)."""
    from PIL import Image

    grey = np.asarray(image.convert("L").resize((32, 32), Image.Resampling.BILINEAR),
                      dtype=np.float64)
    low = (_DCT32 @ grey @ _DCT32.T)[:8, :8].ravel()
    bits = low > np.median(low[1:])
    return int(np.packbits(bits).view(">u8")[0])


def thumbnail(image, size: int = 16) -> np.ndarray:
    """Colour thumbnail [size * size * 3], zero mean and unit variance: brightness and
    contrast changes cancel, colours and layout remain."""
    from PIL import Image

    pixels = np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BOX),
                        dtype=np.float64)
    pixels -= pixels.mean()
    return (pixels / (pixels.std() + 1e-6)).ravel()


def thumbnail_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Root-mean-square difference of two normalized thumbnails (0 = same picture)."""
    return float(np.sqrt(np.mean((a - b) ** 2)))


def hamming_pairs(hashes: np.ndarray, max_distance: int,
                  chunk: int = 2048) -> list[tuple[int, int, int]]:
    """(i, j, distance) for i < j with Hamming distance <= max_distance."""
    hashes = hashes.astype(np.uint64)
    out = []
    for start in range(0, hashes.size, chunk):
        block = hashes[start:start + chunk]
        distances = np.bitwise_count(block[:, None] ^ hashes[None, :])
        for i, j in zip(*np.nonzero(distances <= max_distance)):
            a = start + int(i)
            if a < j:
                out.append((a, int(j), int(distances[i, j])))
    return out


# ----------------------------------------------------------------------------- audio

N_FFT = 512
HOP = 128
FLOOR_DB = -60.0
ACTIVE_DB = -50.0
MAX_SHIFT = 512     # samples a near-copy may be shifted by
ENVELOPE_PREFILTER = 0.9  # envelope similarity of near-copies (measured >= 0.94)


def log_stft(wave: np.ndarray) -> np.ndarray:
    """[frames, N_FFT // 2 + 1] log power of a mono wave [samples] in dB relative to the
    clip's loudest bin, floored at -60 dB (so a gain change leaves it unchanged and
    near-silence does not dominate)."""
    if wave.size < N_FFT:
        wave = np.pad(wave, (0, N_FFT - wave.size))
    frames = np.lib.stride_tricks.sliding_window_view(wave, N_FFT)[::HOP] * np.hanning(N_FFT)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    peak = power.max()
    if peak <= 0:
        return np.full(power.shape, FLOOR_DB)
    return np.maximum(10 * np.log10(np.maximum(power / peak, 1e-30)), FLOOR_DB)


def stft_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute dB difference of two aligned log-STFTs over the bins where either clip is
    audible (within 50 dB of its peak)."""
    n = min(len(a), len(b))
    x, y = a[:n], b[:n]
    active = (x > ACTIVE_DB) | (y > ACTIVE_DB)
    return float(np.mean(np.abs(x[active] - y[active]))) if active.any() else 0.0


def _envelope(wave: np.ndarray, block: int = 32) -> np.ndarray:
    """Unit-norm RMS envelope over blocks of 32 samples (the prefilter's view of a clip)."""
    usable = wave[:wave.size // block * block].reshape(-1, block)
    envelope = np.sqrt((usable ** 2).mean(axis=1))
    return envelope / (np.linalg.norm(envelope) + 1e-12)


def audio_pairs(waves: list[np.ndarray], max_distance: float) -> list[tuple[int, int, float]]:
    """(i, j, distance) for mono clips within `max_distance` dB of each other.

    Prefilter: the best cross-correlation of two clips' loudness envelopes (shift-invariant;
    near-copies score above 0.9). Survivors are aligned to the sample by cross-correlating the
    waves and their log-STFTs compared over audible bins.
    """
    if len(waves) < 2:
        return []
    longest = max(w.size for w in waves)
    env_size = 1 << int(np.ceil(np.log2(2 * (longest // 32 + 1))))
    envelopes = np.stack([np.fft.rfft(_envelope(w), env_size) for w in waves])
    wave_size = 1 << int(np.ceil(np.log2(2 * longest)))
    spectra = [np.fft.rfft(w, wave_size) for w in waves]
    features = [log_stft(w) for w in waves]
    lags = np.concatenate([np.arange(0, MAX_SHIFT + 1), np.arange(-MAX_SHIFT, 0)])
    out = []
    for i in range(len(waves) - 1):
        similarity = np.fft.irfft(np.conj(envelopes[i]) * envelopes[i + 1:], env_size).max(1)
        for j in np.flatnonzero(similarity >= ENVELOPE_PREFILTER) + i + 1:
            xc = np.fft.irfft(np.conj(spectra[i]) * spectra[j], wave_size)
            k = int(lags[np.argmax(np.abs(xc[lags]))])  # waves[j][t + k] ~ waves[i][t]
            if k >= 0:
                x = features[i][:_frames(waves[i].size - k)]
                y = log_stft(waves[j][k:])
            else:
                x = log_stft(waves[i][-k:])
                y = features[j][:_frames(waves[j].size + k)]
            distance = stft_distance(x, y)
            if distance <= max_distance:
                out.append((i, int(j), distance))
    return out


def _frames(samples: int) -> int:
    return max(1, (max(samples, N_FFT) - N_FFT) // HOP + 1)
