"""Near-duplicate fingerprints written with numpy alone.

* text: normalized character 5-gram shingles; shingles shared by a large share of the texts
  are template boilerplate and are dropped (what is left is what tells texts apart); 64 MinHash
  values per text, LSH with 16 bands of 4 rows (pairs above Jaccard ~0.5 become candidates),
  confirmed with the exact Jaccard of the remaining shingles;
* images: a 64-bit DCT perceptual hash of the 32x32 grey thumbnail proposes pairs (Hamming
  distance), a normalized 16x16 colour thumbnail confirms them (small, flat images fool a
  grey low-frequency hash alone: two different circles at one place share most bits);
* audio: log-power STFT frames in dB below the clip's peak (gain-invariant), compared by mean
  absolute difference over audible bins after aligning the two clips by cross-correlation;
  only pairs whose normalized cross-correlation reaches 0.5 are compared (batched FFTs).
"""

from __future__ import annotations

import re
import unicodedata
import zlib

import numpy as np
from tqdm import tqdm

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
    count = max(data.size - SHINGLE + 1, 0)
    h = np.zeros(count, dtype=np.uint32)
    for k in range(SHINGLE):  # polynomial hash mod 2**32, in place (this is memory-bound)
        h *= np.uint32(1_000_003)
        h += data[k:k + count]
    h *= np.uint32(0x9E3779B1)  # mix the low bits up
    h ^= h >> np.uint32(15)
    # an n-gram belongs to a text when its first and last bytes do
    byte_owner = np.repeat(np.arange(len(encoded), dtype=np.uint32), lengths)
    whole = byte_owner[:count] == byte_owner[SHINGLE - 1:]
    # one global sort of (text, shingle) keys dedupes every text's shingles at once
    keys = byte_owner[:count][whole].astype(np.uint64)
    keys <<= np.uint64(32)
    keys |= h[whole]
    del byte_owner, whole, h, data
    keys.sort()
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if keys.size else keys
    counts = np.bincount((keys >> np.uint64(32)).astype(np.int64), minlength=len(encoded))
    sets = np.split(keys & np.uint64(0xFFFFFFFF), np.cumsum(counts)[:-1])
    for i in np.flatnonzero(counts == 0):  # too short for a 5-gram: the whole text is one
        sets[i] = np.array([zlib.crc32(encoded[i])], dtype=np.uint64)
    return sets


def drop_common_shingles(sets: list[np.ndarray], max_share: float,
                         min_texts: int) -> tuple[list[np.ndarray], int, int]:
    """(sets without their common shingles, the document-frequency cut, how many shingles were
    dropped).

    A shingle found in more than cut = max(min_texts, max_share * len(sets)) texts is template
    text ("Question: Where is", "Rewrite this in a formal tone"): two records that share it
    share a template, not content, so it is no evidence that one copies the other. Below
    `min_texts` a shared phrase may as well be a copied passage, so small sets keep all.
    """
    cut = max(int(min_texts), int(max_share * len(sets)))
    if not sets:
        return [], cut, 0
    flat = np.concatenate(sets)  # each set is unique, so a value's count is its text count
    ordered = np.sort(flat)
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    counts = np.diff(np.concatenate([starts, [ordered.size]]))
    common = ordered[starts[counts > cut]]  # sorted; few in natural text
    if not common.size:
        return sets, cut, 0
    position = np.minimum(np.searchsorted(common, flat), common.size - 1)
    keep = common[position] != flat
    owner = np.repeat(np.arange(len(sets)), [s.size for s in sets])
    kept_per_text = np.bincount(owner[keep], minlength=len(sets))
    return np.split(flat[keep], np.cumsum(kept_per_text)[:-1]), cut, int(common.size)


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
MAX_SHIFT = 512           # samples a near-copy may be shifted by
MIN_CORRELATION = 0.5     # normalized cross-correlation worth a log-STFT comparison
BATCH_SAMPLES = 1 << 21   # padded samples per batched STFT (bounds its memory)


def log_stfts(waves: list[np.ndarray]) -> list[np.ndarray]:
    """log_stft of every clip; clips of similar length are padded to one length and
    transformed together (one FFT call per batch instead of one per clip)."""
    out: list[np.ndarray | None] = [None] * len(waves)
    order = sorted(range(len(waves)), key=lambda i: waves[i].size)
    batch: list[int] = []
    for i in order:  # ascending length: the last clip of a batch is its longest
        if batch and (len(batch) + 1) * max(waves[i].size, N_FFT) > BATCH_SAMPLES:
            _log_stft_batch(waves, batch, out)
            batch = []
        batch.append(i)
    if batch:
        _log_stft_batch(waves, batch, out)
    return out


def _log_stft_batch(waves: list[np.ndarray], batch: list[int], out: list) -> None:
    length = max(N_FFT, max(waves[i].size for i in batch))
    padded = np.zeros((len(batch), length), dtype=np.float32)  # float32: half the memory
    for row, i in enumerate(batch):                             # traffic, 1e-4 dB apart
        padded[row, :waves[i].size] = waves[i]
    windows = np.lib.stride_tricks.sliding_window_view(padded, N_FFT, axis=1)[:, ::HOP]
    spectrum = np.fft.rfft(windows * np.hanning(N_FFT).astype(np.float32), axis=-1)
    power = spectrum.real ** 2 + spectrum.imag ** 2  # [clips, frames, bins]
    counts = np.array([_frames(waves[i].size) for i in batch])
    power[np.arange(power.shape[1])[None, :] >= counts[:, None]] = 0.0  # frames past a clip's end
    peak = power.max(axis=(1, 2), keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        db = 10 * np.log10(np.maximum(power / peak, 1e-30))
    db = np.where(peak > 0, np.maximum(db, FLOOR_DB), FLOOR_DB)
    for row, i in enumerate(batch):
        out[i] = db[row, :counts[row]]


def log_stft(wave: np.ndarray) -> np.ndarray:
    """[frames, N_FFT // 2 + 1] log power of a mono wave [samples] in dB relative to the
    clip's loudest bin, floored at -60 dB (so a gain change leaves it unchanged and
    near-silence does not dominate)."""
    return log_stfts([wave])[0]


def stft_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute dB difference of two aligned log-STFTs over the bins where either clip is
    audible (within 50 dB of its peak)."""
    n = min(len(a), len(b))
    x, y = a[:n], b[:n]
    active = (x > ACTIVE_DB) | (y > ACTIVE_DB)
    return float(np.mean(np.abs(x[active] - y[active]))) if active.any() else 0.0


def aligned_pairs(waves: list[np.ndarray], min_correlation: float,
                  block: int = 64) -> list[tuple[int, int, int, float]]:
    """(i, j, lag, correlation) for i < j whose normalized cross-correlation within
    +-MAX_SHIFT samples reaches `min_correlation`; waves[j][t + lag] ~ waves[i][t].

    One float32 FFT per clip, then one batched inverse FFT per block of clip pairs. The FFT
    length only has to cover the longest clip plus MAX_SHIFT for those lags not to wrap.
    """
    size = -(-(max(w.size for w in waves) + MAX_SHIFT) // 512) * 512
    spectra = np.fft.rfft(np.stack([np.pad(w, (0, size - w.size)) for w in waves])
                          .astype(np.float32), axis=1)
    norms = np.array([np.linalg.norm(w) for w in waves], dtype=np.float32)
    lags = np.concatenate([np.arange(0, MAX_SHIFT + 1), np.arange(-MAX_SHIFT, 0)])
    out = []
    for i in range(len(waves) - 1):
        for start in range(i + 1, len(waves), block):
            xc = np.fft.irfft(np.conj(spectra[i]) * spectra[start:start + block], size,
                              axis=1)[:, lags]
            best = np.argmax(np.abs(xc), axis=1)
            peak = np.abs(xc[np.arange(len(best)), best])
            correlation = peak / np.maximum(norms[i] * norms[start:start + block], 1e-12)
            out += [(i, start + int(k), int(lags[best[k]]), float(correlation[k]))
                    for k in np.flatnonzero(correlation >= min_correlation)]
    return out


def audio_pairs(waves: list[np.ndarray], max_distance: float, progress: bool = False,
                chunk: int = 256) -> list[tuple[int, int, float]]:
    """(i, j, distance) for mono clips within `max_distance` dB of each other.

    Every pair is aligned to the sample by cross-correlation (within MAX_SHIFT); pairs whose
    normalized correlation reaches MIN_CORRELATION (near-copies measured >= 0.72, even with
    500 samples trimmed off) get the log-STFTs of their aligned parts compared over audible
    bins, computed in batches.
    """
    if len(waves) < 2:
        return []
    features = log_stfts(waves)
    candidates = aligned_pairs(waves, MIN_CORRELATION)
    out = []
    for start in tqdm(range(0, len(candidates), chunk), desc="comparing similar clips",
                      unit="batch", disable=not progress):
        batch = candidates[start:start + chunk]
        moved = log_stfts([waves[j][k:] if k >= 0 else waves[i][-k:] for i, j, k, _ in batch])
        for (i, j, k, _), shifted in zip(batch, moved):
            if k >= 0:
                distance = stft_distance(features[i][:_frames(waves[i].size - k)], shifted)
            else:
                distance = stft_distance(shifted, features[j][:_frames(waves[j].size + k)])
            if distance <= max_distance:
                out.append((i, j, distance))
    return out


def _frames(samples: int) -> int:
    return max(1, (max(samples, N_FFT) - N_FFT) // HOP + 1)
