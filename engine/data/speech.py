"""Speech datasets (kind "speech"): WAV clips with transcripts, speakers and sessions.

dataset.json carries the transcript policy every label was written under (handbook ch. 27:
"choose verbatim versus cleaned transcription before labeling")::

    "transcripts": {"style": "cleaned", "case": "lower", "numbers": "spelled",
                    "punctuation": "none", "alphabet": "abcdefghijklmnopqrstuvwxyz' ",
                    "empty": "the clip holds no speech"}

A transcript outside its policy (a digit when numbers are spelled, a capital in a lower-case
set, a character outside the alphabet, doubled or edge spaces) is a finding on its line and
field `text`; so is a WAV in the folder that no record transcribes, and a speaker or session
that appears in more than one split (the split unit is the speaker: every session of one
speaker lands in one split, so a score on val or test is a score on unseen voices).
An empty transcript is allowed only as the policy's "no speech" marker.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import excerpt

POLICY_KEYS = ("style", "case", "numbers", "punctuation", "alphabet", "empty")
STYLES = ("cleaned", "verbatim")
DEFAULT_POLICY = {"style": "cleaned", "case": "lower", "numbers": "spelled",
                  "punctuation": "none", "alphabet": "abcdefghijklmnopqrstuvwxyz' ",
                  "empty": "the clip holds no speech"}


def policy_of(manifest: dict) -> tuple[dict | None, str | None]:
    """(policy, None) or (None, why the manifest's `transcripts` section is unusable)."""
    policy = manifest.get("transcripts")
    if not isinstance(policy, dict):
        return None, ("a speech dataset records its transcript policy in a 'transcripts' "
                      "section, e.g. " + str(DEFAULT_POLICY))
    unknown = sorted(set(policy) - set(POLICY_KEYS))
    if unknown:
        return None, f"unknown keys {unknown}; known: {', '.join(POLICY_KEYS)}"
    if policy.get("style") not in STYLES:
        return None, f"'style' must be one of {', '.join(STYLES)}"
    if not isinstance(policy.get("alphabet"), str) or not policy["alphabet"]:
        return None, "'alphabet' must list every character a transcript may use"
    return policy, None


def transcript_problem(text: str, policy: dict) -> str | None:
    """Why `text` breaks the policy, or None. The first problem only: one finding a field."""
    if text == "":
        return None
    if text != text.strip() or "  " in text:
        return "words must be separated by single spaces, with none at either end"
    if policy.get("numbers") == "spelled":
        digits = [c for c in text if c.isdigit()]
        if digits:
            return (f"holds the digit {digits[0]!r}; the policy spells numbers out (write "
                    "'m eight', not 'm8')")
    if policy.get("case") == "lower" and text != text.lower():
        return "holds capital letters; the policy is lower case"
    outside = sorted({c for c in text if c not in policy["alphabet"]})
    if outside:
        what = "punctuation " if policy.get("punctuation") == "none" and all(
            not c.isalnum() for c in outside) else ""
        return (f"holds {what}characters outside the policy's alphabet: "
                f"{excerpt(''.join(outside))}")
    return None


def _frames(root: Path, rel: object) -> int | None:
    """The frame count a clip's header gives, or None when it cannot be read (the media
    check reports unreadable files)."""
    import soundfile

    try:
        return soundfile.info(str(root / str(rel))).frames
    except Exception:  # libsndfile raises RuntimeError subclasses for any malformed file
        return None


def check_speech(root: Path, rel: str, manifest: dict, rows: list[tuple[str, dict]],
                 report) -> None:
    """Add a finding for a missing or bad policy, each transcript outside it, each WAV no
    record transcribes, and each speaker or session found in two splits."""
    policy, problem = policy_of(manifest)
    if problem:
        report.add("dataset.json", None, "transcripts", problem)
    transcribed = set()
    homes: dict[tuple[str, str], tuple[str, str]] = {}
    for where, record in rows:
        at = f"{where} (id {record['id']!r})"
        transcribed.add(record.get("path"))
        if str(record.get("text") or "").strip() and _frames(root, record.get("path")) == 0:
            report.add(rel, at, "path", "the WAV holds no audio (0 frames) but its transcript "
                       "is not empty: there is nothing to learn the text from",
                       record_id=record["id"])
        if policy is not None:
            reason = transcript_problem(record["text"], policy)
            if reason:
                report.add(rel, at, "text", reason, record_id=record["id"])
        _check_split_homes(record, where, at, rel, homes, report)
    _check_untranscribed(root, rel, manifest, transcribed, report)


def _check_split_homes(record: dict, where: str, at: str, rel: str,
                       homes: dict[tuple[str, str], tuple[str, str]], report) -> None:
    """A speaker or session seen in another split before (`homes`: its first split and
    line) is reported here."""
    split = record.get("split")
    if split is None:
        return
    for field in ("speaker", "session"):
        first = homes.setdefault((field, record[field]), (split, where))
        if first[0] != split:
            report.add(rel, at, field, f"{field} {record[field]!r} is in {split} here and "
                       f"in {first[0]} at {first[1]}; split whole speakers and sessions",
                       record_id=record["id"])


def _check_untranscribed(root: Path, rel: str, manifest: dict, transcribed: set,
                         report) -> None:
    """Each WAV no record transcribes, listed in dataset.json or only in the folder."""
    listed = manifest.get("files", {})
    for name in sorted(listed):
        if name.lower().endswith(".wav") and name not in transcribed:
            report.add(name, None, None, "a WAV without a transcript: no record names it "
                       f"(add a line to {rel} with its text, or an empty text if it holds "
                       "no speech)")
    # A clip dropped into the folder by hand is in no list at all: training would leave it
    # out without a word, so it is named here too.
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.suffix.lower() == ".wav" and path.is_file() and name not in listed:
            report.add(name, None, None, "a WAV without a transcript: it is in the dataset "
                       f"folder, but neither dataset.json nor {rel} names it, so training "
                       f"would leave it out (give it a line in {rel} and import the folder "
                       "as a new version, or move the file out)")
