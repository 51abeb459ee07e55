"""speech-recognize: a small CTC recogniser trained from scratch (handbook chapter 27).

Reads top to bottom: a speech dataset (WAV + transcript + speaker + session, split by speaker)
-> the transcript policy's alphabet as the output labels (blank first) -> log-Mel features of
every train clip, once, and per-band mean/deviation from them (saved with the weights; nothing
is normalized per utterance) -> a residual-convolution CTC model (`engine.models.speech`)
trained with AdamW in the shared step loop, train clips randomly louder or quieter and
SpecAugment-masked -> validation loss and greedy WER each evaluation, the lowest loss kept as
"best".

`forgebench eval` decodes a split greedily and with a prefix beam, scores both with the
handbook's scorer (`engine.eval.speech`), writes every clip's reference and hypotheses with
its review flags to evals/<split>-<checkpoint>-transcripts.jsonl (the app's aligned view
reads it), and runs the probes: digital silence, room tone, music-like noise, clipped and very
quiet copies of the split's speech. A probe's output is never trusted; the report counts how
many came out empty or flagged. The test split is read only by `forgebench eval --split test`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.data import media
from engine.data.speech import policy_of
from engine.errors import ForgebenchError
from engine.eval.speech import normalize_lexical, review_flags, score
from engine.fsutil import atomic_write_bytes
from engine.jobs import Job, run_config
from engine.models.speech import (
    SAMPLE_RATE,
    SpeechConfig,
    SpeechCTC,
    beam_decode,
    frame_count,
    greedy_decode,
    log_mel,
)
from engine.recipes.speech_recognize_config import SpeechRecognizeConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.devices import module_device, to_device
from engine.train.loop import (
    Loop,
    load_weights,
    meta_for,
    record_eval,
    require_same_classes,
    train_loop,
)
from engine.train.media_data import dataset_manifest, open_dataset, split_records
from engine.train.optim import adamw_for
from engine.train.precision import autocast

KINDS = ("speech",)
HEADLINE = ("loss", "wer", "cer", "beam_wer", "probes_empty_or_flagged")
NON_SPEECH = ("silence", "room_tone", "music_noise")
BEAM_FLOOR = -12.0   # beam search skips labels below e^-12 in a frame (never the best ones)


def data_manifest(config: SpeechRecognizeConfig) -> dict:
    return dataset_manifest(config, KINDS)


def alphabet_of(dataset) -> list[str]:
    """The output labels after the blank: the transcript policy's alphabet, in its order."""
    policy, problem = policy_of(dataset.manifest)
    if problem:
        raise ForgebenchError(problem, path=dataset.root / "dataset.json", where="transcripts")
    return list(policy["alphabet"])


@dataclass
class Clips:
    ids: list[str]
    speakers: list[str]
    texts: list[str]
    paths: list[str]
    waves: list[np.ndarray]


def load_clips(dataset, split: str) -> Clips:
    records = split_records(dataset, split)
    waves = []
    for record in records:
        audio, _, reason = media.check_audio(record["path"], {"channels": 1,
                                                              "sample_rate": SAMPLE_RATE})
        if reason:
            raise ForgebenchError(reason, path=record["path"],
                                  hint="prepare clips offline as 16 kHz mono WAV")
        waves.append(audio[0])
    return Clips([r["id"] for r in records], [r["speaker"] for r in records],
                 [r["text"] for r in records], [str(r["path"]) for r in records], waves)


def encode(text: str, alphabet: list[str]) -> list[int]:
    return [alphabet.index(c) + 1 for c in text]


def decode_text(labels: list[int], alphabet: list[str]) -> str:
    return " ".join("".join(alphabet[i - 1] for i in labels).split())


def build_model(config: SpeechRecognizeConfig, alphabet: list[str]) -> SpeechCTC:
    m = config.model
    return SpeechCTC(SpeechConfig(vocab=len(alphabet) + 1, n_mels=config.audio.n_mels,
                                  channels=m.channels, layers=m.layers, kernel=m.kernel,
                                  dropout=m.dropout))


def pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded [B, T, ...] and the lengths [B]."""
    lengths = torch.tensor([len(r) for r in rows])
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths


@torch.no_grad()
def log_probs_of(model: SpeechCTC, waves: list[np.ndarray], precision: str,
                 batch: int = 32) -> list[np.ndarray]:
    """Each clip's frame log-probabilities [T_i, vocab] (float32, on the CPU)."""
    device = module_device(model)
    out = []
    for start in range(0, len(waves), batch):
        chunk = [torch.from_numpy(np.asarray(w, dtype=np.float32)) for w in
                 waves[start:start + batch]]
        padded, samples = pad(chunk)
        padded = to_device(padded, device)
        with autocast(precision, device.type):
            log_probs, lengths = model(model.features(padded), to_device(frame_count(samples),
                                                                          device))
        out += [lp[:n].float().cpu().numpy() for lp, n in zip(log_probs, lengths.tolist())]
    return out


def greedy_confidence(log_probs: np.ndarray) -> float | None:
    """Mean peak posterior of the frames whose best label is a character (None if none)."""
    best = log_probs.max(-1)
    emitting = log_probs.argmax(-1) != 0
    return float(np.exp(best[emitting]).mean()) if emitting.any() else None


def transcribe(model: SpeechCTC, waves: list[np.ndarray], alphabet: list[str], precision: str,
               beam: int, vocabulary: set[str]) -> list[dict]:
    """Greedy and beam hypotheses of each clip, with the review flags of the greedy one."""
    out = []
    for wave, lp in zip(waves, log_probs_of(model, waves, precision)):
        greedy, confidence = decode_text(greedy_decode(lp), alphabet), greedy_confidence(lp)
        out.append({"greedy": greedy,
                    "beam": decode_text(beam_decode(lp, beam, BEAM_FLOOR), alphabet),
                    "confidence": confidence,
                    "flags": review_flags(wave, greedy, confidence, len(wave) / SAMPLE_RATE,
                                          vocabulary)})
    return out


def ctc_loss(model: SpeechCTC, features: list[torch.Tensor], texts: list[str],
             alphabet: list[str], precision: str) -> torch.Tensor:
    """Mean CTC loss per target character of scaled features [T_i, n_mels]."""
    device = module_device(model)
    padded, frames = pad(features)
    with autocast(precision, device.type):
        log_probs, lengths = model(to_device(padded, device), to_device(frames, device))
    targets = [torch.tensor(encode(t, alphabet), dtype=torch.long) for t in texts]
    return F.ctc_loss(log_probs.float().transpose(0, 1),
                      to_device(torch.cat(targets), device), lengths,
                      torch.tensor([len(t) for t in targets]), blank=0, reduction="mean",
                      zero_infinity=True)


# -- probes -------------------------------------------------------------------------------
def probe_clips(clips: Clips, n: int, seed: int) -> list[dict]:
    """n clips of each probe kind: digital silence, room tone (low-passed noise at -50..-35
    dBFS), music-like noise (chords of harmonic tones on a beat), clipped speech (a spoken
    clip driven 8-16x into full scale) and very quiet speech (-45..-35 dB)."""
    rng = np.random.default_rng([seed, 0x9B0BE])
    spoken = [w for w, t in zip(clips.waves, clips.texts) if t]
    probes = []
    for index in range(n):
        seconds = rng.uniform(1.0, 2.5)
        length = int(seconds * SAMPLE_RATE)
        t = np.arange(length) / SAMPLE_RATE
        probes.append({"kind": "silence", "wave": np.zeros(length)})
        white = rng.normal(size=length + 64)
        hum = np.convolve(white, np.ones(64) / 64, mode="valid")[:length]
        probes.append({"kind": "room_tone", "wave": hum / np.abs(hum).max()
                       * 10 ** (rng.uniform(-50, -35) / 20)})
        music = np.zeros(length)
        beat = rng.uniform(0.2, 0.5)
        for start in np.arange(0, seconds, beat):
            root = 110 * 2 ** (rng.integers(0, 24) / 12)
            notes = (t >= start) & (t < start + beat)
            envelope = np.exp(-(t - start) / (beat / 3)) * notes
            for ratio in (1.0, 1.25, 1.5):
                for harmonic in (1, 2, 3):
                    music += envelope * np.sin(2 * np.pi * root * ratio * harmonic * t) / harmonic
        probes.append({"kind": "music_noise", "wave": music / np.abs(music).max() * 0.5})
        if spoken:
            speech = spoken[index % len(spoken)].astype(np.float64)
            probes.append({"kind": "clipped", "wave": np.clip(speech * rng.uniform(8, 16),
                                                              -1, 1)})
            probes.append({"kind": "quiet", "wave": speech * 10 ** (rng.uniform(-45, -35)
                                                                    / 20)})
    return probes


def run_probes(model, clips: Clips, alphabet, config, vocabulary) -> dict:
    probes = probe_clips(clips, config.decode.probes, config.seed)
    results = transcribe(model, [p["wave"] for p in probes], alphabet, config.precision,
                         config.decode.beam, vocabulary)
    kinds: dict[str, dict] = {}
    for probe, result in zip(probes, results):
        entry = kinds.setdefault(probe["kind"], {"clips": 0, "empty": 0, "flagged": 0,
                                                 "empty_or_flagged": 0, "examples": []})
        empty = not result["greedy"]
        entry["clips"] += 1
        entry["empty"] += empty
        entry["flagged"] += bool(result["flags"])
        entry["empty_or_flagged"] += empty or bool(result["flags"])
        if not empty and len(entry["examples"]) < 3:
            entry["examples"].append({"hypothesis": result["greedy"], "flags": result["flags"]})
    non_speech = [kinds[k] for k in NON_SPEECH if k in kinds]
    total = sum(k["clips"] for k in non_speech)
    return {"kinds": kinds, "non_speech_clips": total,
            "non_speech_empty_or_flagged": sum(k["empty_or_flagged"] for k in non_speech),
            "share": sum(k["empty_or_flagged"] for k in non_speech) / total if total else None,
            "trust": "never: probe outputs are flagged triage signals, not transcripts"}


# -- evaluation ---------------------------------------------------------------------------
def vocabulary_of(dataset) -> set[str]:
    return {w for r in dataset.records("train") for w in normalize_lexical(r["text"]).split()}


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """Greedy and beam WER/CER (raw and lexical), empty-reference false positives, speaker
    slices, term errors, every clip's transcripts, and the probe counts of one split."""
    config: SpeechRecognizeConfig = run_config(run)
    dataset = open_dataset(config, KINDS)
    alphabet = alphabet_of(dataset)
    meta = require_same_classes(checkpoint, alphabet)
    model = build_model(config, alphabet)
    load_weights(checkpoint, model)
    clips = load_clips(dataset, split)
    vocabulary = vocabulary_of(dataset)
    results = transcribe(model, clips.waves, alphabet, config.precision, config.decode.beam,
                         vocabulary)
    terms = dataset.manifest.get("terms") or {}
    reports = {decoder: score([{"id": i, "speaker": s, "reference": t, "hypothesis": r[decoder]}
                               for i, s, t, r in zip(clips.ids, clips.speakers, clips.texts,
                                                     results)], terms)
               for decoder in ("greedy", "beam")}
    features = [model.scale(log_mel(torch.from_numpy(w)[None], model.filterbank)[0])
                for w in clips.waves]
    with torch.no_grad():
        loss = float(ctc_loss(model, features, clips.texts, alphabet, config.precision))
    probes = run_probes(model, clips, alphabet, config, vocabulary)
    name = f"{split}-{checkpoint.name}"
    lines = [json.dumps({"id": i, "path": p, "speaker": s, "reference": t, **r})
             for i, p, s, t, r in zip(clips.ids, clips.paths, clips.speakers, clips.texts,
                                      results)]
    atomic_write_bytes(run.evals_dir / f"{name}-transcripts.jsonl",
                       ("\n".join(lines) + "\n").encode("utf-8"))
    greedy = reports["greedy"]
    report = {"split": split, "checkpoint": checkpoint.name, "step": checkpoint.step,
              "loss": loss, "wer": greedy["lexical"]["wer"], "cer": greedy["lexical"]["cer"],
              "beam_wer": reports["beam"]["lexical"]["wer"],
              "flagged_clips": sum(bool(r["flags"]) for r in results),
              "probes_empty_or_flagged": probes["share"], "greedy": greedy,
              "beam": reports["beam"], "probes": probes, "beam_width": config.decode.beam,
              "transcripts": f"evals/{name}-transcripts.jsonl",
              "preprocessing": meta["preprocessing"]}
    return record_eval(run, checkpoint, split, report, HEADLINE)


# -- training -----------------------------------------------------------------------------
def train(job: Job) -> None:
    config: SpeechRecognizeConfig = job.config
    torch.manual_seed(config.seed)
    job.announce("load", "reading and featurizing the train and val clips")
    dataset = open_dataset(config, KINDS)
    alphabet = alphabet_of(dataset)
    train_clips, val_clips = load_clips(dataset, "train"), load_clips(dataset, "val")

    device = job.device
    model = build_model(config, alphabet)
    raw, val_raw = ([log_mel(torch.from_numpy(w)[None], model.filterbank)[0] for w in
                     clips.waves] for clips in (train_clips, val_clips))
    frames = torch.cat(raw)
    model.feature_mean.copy_(frames.mean(0))
    model.feature_std.copy_(frames.std(0).clamp(min=1e-3))
    model.to(device)
    val_features = [model.scale(f.to(device)) for f in val_raw]
    opt, aug = config.optim, config.augment
    optimizer = adamw_for(model.named_parameters(), opt)

    def augmented(index: int, generator: torch.Generator) -> torch.Tensor:
        """A train clip's features, louder or quieter (a gain is a constant in log power)
        and SpecAugment-masked (masked cells hold the band mean, i.e. 0 once scaled)."""
        features = raw[index].clone()
        gain_db = (torch.rand((), generator=generator) * 2 - 1) * aug.gain_db
        features += gain_db / 10 * np.log(10)
        features = model.scale(features.to(device)).cpu()
        length, bands = features.shape
        for _ in range(aug.time_masks):
            width = int(torch.randint(0, aug.time_mask_frames + 1, (), generator=generator))
            start = int(torch.randint(0, max(length - width, 0) + 1, (), generator=generator))
            features[start:start + width] = 0
        for _ in range(aug.freq_masks):
            width = int(torch.randint(0, aug.freq_mask_bands + 1, (), generator=generator))
            start = int(torch.randint(0, bands - width + 1, (), generator=generator))
            features[:, start:start + width] = 0
        return features

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        features = [augmented(i, generator) for i in indices]
        return ctc_loss(model, features, [train_clips.texts[i] for i in indices], alphabet,
                        config.precision)

    def validate() -> dict:
        loss = float(ctc_loss(model, val_features, val_clips.texts, alphabet, config.precision))
        hypotheses = [decode_text(greedy_decode(lp), alphabet)
                      for lp in log_probs_of(model, val_clips.waves, config.precision)]
        report = score([{"id": i, "speaker": s, "reference": t, "hypothesis": h} for i, s, t, h
                        in zip(val_clips.ids, val_clips.speakers, val_clips.texts, hypotheses)])
        return {"loss": loss, "wer": report["lexical"]["wer"], "cer": report["lexical"]["cer"],
                "empty_false_positives": report["empty_reference"]["false_positives"]}

    m = config.model
    train_loop(job, Loop(model, optimizer, len(train_clips.ids), batch_loss, validate,
                         meta=meta_for(config, alphabet, family="SpeechCTC", channels=m.channels,
                                       layers=m.layers, kernel=m.kernel,
                                       n_mels=config.audio.n_mels)))
