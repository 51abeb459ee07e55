"""A spoken-command corpus for `speech-recognize`: workshop commands from a small grammar
("replace the m eight bolt on pump three"), spoken by espeak-ng and recorded through sox.

Speakers: each is one espeak-ng accent voice with one voice variant (m1..m7, f1..f5), its own
speed (words a minute) and pitch; no two speakers share an accent+variant pair. Sessions: every
speaker records two, a quiet booth (faint brown-noise room tone, SNR 28-35 dB) and the
workshop floor (a small sox reverb, pink-noise hum at SNR 16-24 dB), each at its own level.
About one clip in sixteen of a session holds its room tone alone, transcribed empty: the
recogniser must learn that no speech means no words.

Splits are by speaker (`block_split` over speaker numbers: every 20 speakers hold exactly 16
train, 2 val and 2 test), so both sessions of a speaker share a split and val/test voices are
voices the model never heard. Transcripts follow one recorded policy (cleaned, lower case,
numbers spelled, no punctuation; engine.data.speech checks it), and the dataset lists the
grammar's domain, negation and quantity words for the scorer.

Deterministic for a seed: espeak-ng and sox are deterministic, the noise beds come from
`sox -R` (repeatable mode) and every choice from numpy generators seeded per speaker and clip.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, RECORD_RIGHTS, staged_dataset_dir
from engine.data.speech import DEFAULT_POLICY
from engine.data.splits import DEFAULT_RATIOS, block_split
from engine.errors import ForgebenchError
from engine.fsutil import sha256_bytes

SAMPLE_RATE = 16_000
PEAK_LIMIT = 0.9
ACCENTS = ("en-gb", "en-us", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp",
           "en-gb-x-gbcwmd", "en-029", "en-us-nyc")
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5")
EMPTY_EVERY = 16          # one clip in this many is room tone alone (an empty transcript)
NOISE_BED_S = 20          # seconds of each noise bed; clips take seeded slices of it

NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve")
TENS = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
PARTS = ("m eight bolt", "m six bolt", "m ten nut", "seal", "filter", "gasket", "bearing",
         "drive belt", "hose clamp", "pressure valve")
MACHINES = ("pump", "motor", "compressor", "fan", "conveyor", "mixer")
VERBS = ("replace", "check", "tighten", "inspect", "clean", "remove", "install")
ACTIONS = ("restart", "open", "start", "stop", "service")
UNITS = ("bar", "percent", "degrees", "volts")
STATES = ("running", "leaking", "too hot", "offline", "not running")
TERMS = {
    "domain": sorted({w for phrase in PARTS + MACHINES + UNITS for w in phrase.split()}
                     - {"m"}),
    "negation": ["not", "never", "no"],
    "quantity": sorted(set(NUMBERS + TENS)),
}
SESSIONS = {  # room: (reverb args or None, noise kind, SNR range dB, peak range)
    "booth": (None, "brownnoise", (28.0, 35.0), (0.35, 0.8)),
    "floor": (["reverb", "25", "50", "40"], "pinknoise", (16.0, 24.0), (0.25, 0.7)),
}


def command(rng: np.random.Generator) -> str:
    """One transcript from the grammar, already in the policy's form."""
    pick = lambda options: options[rng.integers(len(options))]  # noqa: E731
    machine = f"{pick(MACHINES)} {pick(NUMBERS)}"
    template = rng.integers(6)
    if template == 0:
        return f"{pick(VERBS)} the {pick(PARTS)} on {machine}"
    if template == 1:
        return f"do not {pick(ACTIONS)} {machine}"
    if template == 2:
        return f"set {machine} to {pick(TENS)} {pick(UNITS)}"
    if template == 3:
        return f"{machine} is {pick(STATES)}"
    if template == 4:
        return f"never {pick(ACTIONS)} {machine} without a permit"
    return f"{pick(VERBS)} {pick(NUMBERS)} {pick(PARTS)}s on {machine}"


def speakers(n: int, seed: int) -> list[dict]:
    """n speakers with distinct accent+variant pairs and their own speed and pitch."""
    pairs = [(a, v) for a in ACCENTS for v in VARIANTS]
    if n > len(pairs):
        raise ForgebenchError(f"at most {len(pairs)} distinct speakers", where="--n")
    order = np.random.default_rng([seed, 0x5BEA]).permutation(len(pairs))
    out = []
    for index in range(n):
        accent, variant = pairs[order[index]]
        rng = np.random.default_rng([seed, index, 1])
        out.append({"id": f"spk{index:03d}", "voice": f"{accent}+{variant}",
                    "speed": int(rng.integers(135, 186)), "pitch": int(rng.integers(25, 76))})
    return out


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ForgebenchError(f"{name} is not installed", where="speech generator",
                              hint="install the system packages: make system-deps (as root), "
                                   "or apt-get install espeak-ng sox")
    return path


def _sox(args: list[str], data: bytes | None = None) -> np.ndarray:
    """Run sox writing a 16 kHz mono float WAV to stdout; the samples as float64."""
    import soundfile

    out = subprocess.run([_tool("sox"), *args], input=data, capture_output=True, check=True)
    wave, rate = soundfile.read(io.BytesIO(out.stdout), dtype="float64")
    assert rate == SAMPLE_RATE
    return wave


OUT = ["-t", "wav", "-e", "floating-point", "-b", "32", "-r", str(SAMPLE_RATE), "-c", "1", "-"]


def speak(text: str, speaker: dict, reverb: list[str] | None) -> np.ndarray:
    """espeak-ng's 22.05 kHz voice resampled by sox (its anti-aliased `rate` effect)."""
    voice = subprocess.run([_tool("espeak-ng"), "-v", speaker["voice"], "-s",
                            str(speaker["speed"]), "-p", str(speaker["pitch"]), "--stdout",
                            text], capture_output=True, check=True).stdout
    return _sox(["-t", "wav", "-", *OUT, "rate", "-v", str(SAMPLE_RATE), *(reverb or [])],
                voice)


def noise_bed(kind: str) -> np.ndarray:
    """NOISE_BED_S seconds of sox's repeatable noise, shaped like a room (hum below 1 kHz)."""
    wave = _sox(["-R", "-n", *OUT, "synth", str(NOISE_BED_S), kind, "lowpass", "1000"])
    return wave / np.sqrt(np.mean(wave ** 2))


def record(speech: np.ndarray | None, bed: np.ndarray, rng: np.random.Generator,
           snr_db: float, peak: float) -> np.ndarray:
    """Speech padded with room tone at `snr_db` below its RMS, scaled to `peak`; a clip with
    no speech is the room tone alone at the level it has under speech of that peak."""
    lead, tail = rng.uniform(0.1, 0.3, size=2)
    body = speech if speech is not None else np.zeros(int(rng.uniform(1.0, 2.5) * SAMPLE_RATE))
    wave = np.concatenate([np.zeros(int(lead * SAMPLE_RATE)), body,
                           np.zeros(int(tail * SAMPLE_RATE))])
    start = rng.integers(len(bed) - len(wave))
    if speech is not None:
        scale = peak / np.abs(wave).max()
        speech_rms = np.sqrt(np.mean(speech ** 2)) * scale
    else:
        scale, speech_rms = 0.0, peak / 4  # a typical speech RMS is about a quarter of peak
    noise = bed[start:start + len(wave)] * speech_rms * 10 ** (-snr_db / 20)
    return np.clip(wave * scale + noise, -PEAK_LIMIT, PEAK_LIMIT)


def wav_bytes(wave: np.ndarray) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, wave, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return buffer.getvalue()


def generate_speech(out_dir: str | os.PathLike, n_speakers: int = 40, per_session: int = 16,
                    seed: int = 0, progress: bool = True) -> Path:
    """Write a `speech` dataset: n_speakers x 2 sessions x per_session clips."""
    cast = speakers(n_speakers, seed)
    beds = {room: noise_bed(kind) for room, (_, kind, _, _) in SESSIONS.items()}
    with staged_dataset_dir(out_dir) as root:
        (root / "clips").mkdir()
        lines = []
        bar = tqdm(total=n_speakers * len(SESSIONS) * per_session, desc="speaking",
                   unit="clip", disable=not progress)
        for index, speaker in enumerate(cast):
            split = block_split(index, seed)
            for room_index, (room, (reverb, _, snr, peak)) in enumerate(SESSIONS.items()):
                session = f"{speaker['id']}-{room}"
                level = np.random.default_rng([seed, index, room_index, 2]).uniform(*peak)
                for clip in range(per_session):
                    rng = np.random.default_rng([seed, index, room_index, clip, 3])
                    text = "" if clip % EMPTY_EVERY == EMPTY_EVERY - 1 else command(rng)
                    speech = speak(text, speaker, reverb) if text else None
                    snr_db = float(rng.uniform(*snr))
                    data = wav_bytes(record(speech, beds[room], rng, snr_db, level))
                    rid = f"{session}-{clip:03d}"
                    (root / "clips" / f"{rid}.wav").write_bytes(data)
                    lines.append(json.dumps({
                        "id": rid, "path": f"clips/{rid}.wav", "text": text,
                        "speaker": speaker["id"], "session": session, "group": speaker["id"],
                        "split": split, "voice": speaker["voice"], "speed": speaker["speed"],
                        "pitch": speaker["pitch"], "room": room, "snr_db": round(snr_db, 1),
                        "source": "forgebench speech generator (espeak-ng + sox)",
                        "rights": RECORD_RIGHTS, "sha256": sha256_bytes(data)}))
                    bar.update(1)
        bar.close()
        (root / "utterances.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        write_manifest(
            root, "speech", "workshop-commands", records="utterances.jsonl",
            audio={"sample_rate": SAMPLE_RATE, "channels": 1, "subtype": "PCM_16"},
            transcripts=dict(DEFAULT_POLICY), terms=TERMS,
            split_policy={"method": "block", "ratios": DEFAULT_RATIOS, "seed": seed,
                          "group_field": "group", "unit": "speaker (both sessions together)"},
            provenance={"generator": "engine.data.generators.speech", "seed": seed,
                        "n_speakers": n_speakers, "per_session": per_session,
                        "speakers": cast, "sessions": {r: {"reverb": s[0], "noise": s[1],
                                                           "snr_db": s[2], "peak": s[3]}
                                                       for r, s in SESSIONS.items()},
                        "tools": _versions()},
            rights=GENERATED_RIGHTS,
            card={"task": "transcribe short spoken workshop commands",
                  "sources": ["espeak-ng formant synthesis of a procedural grammar, mixed "
                              "with sox noise in engine.data.generators.speech"],
                  "preprocessing": "espeak-ng 22.05 kHz resampled to 16 kHz by sox; no "
                                   "loudness normalization beyond a per-session peak level",
                  "known_gaps": ["synthetic voices only: no human speech, accents are "
                                 "espeak-ng's", "a closed grammar of a few hundred words"],
                  "intended_uses": ["teaching a small CTC recogniser from scratch"],
                  "prohibited_uses": ["voice imitation", "claims about human-speech accuracy"]})
    return Path(out_dir).expanduser().absolute()


def _versions() -> dict:
    espeak = subprocess.run([_tool("espeak-ng"), "--version"], capture_output=True, text=True)
    sox = subprocess.run([_tool("sox"), "--version"], capture_output=True, text=True)
    return {"espeak-ng": espeak.stdout.strip(), "sox": sox.stdout.strip()}
