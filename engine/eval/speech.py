"""The handbook's ASR scorer (ch. 27): raw and lexical WER/CER aggregated over a corpus,
empty-reference false positives, inserted words, per-speaker slices, and domain-term, negation
and quantity error counts.

- raw: NFC Unicode, whitespace runs collapsed; case and punctuation kept.
- lexical: raw, casefolded, every Unicode punctuation character replaced by a space (so an
  apostrophe splits a word); no number expansion.
- WER = (substitutions + deletions + insertions) / reference words, each summed over every
  clip with a non-empty reference (a one-word clip weighs one word, not one clip); CER the
  same over code points with whitespace removed. WER can exceed 1.
- A clip whose reference is empty has no denominator: it counts as a false positive when the
  hypothesis holds any word, and its words are reported as inserted words, apart from WER.
- Term errors use the lexical word alignment: a reference term that is substituted or deleted
  is `missed`; a hypothesis term that is inserted or stands in for another word is
  `invented`. Terms come from the dataset (its `terms` section), not from this module.

`align` is the one word/character alignment: the app marks errors with it too.
"""

from __future__ import annotations

import unicodedata
from collections import defaultdict

OK, SUB, DEL, INS = "ok", "sub", "del", "ins"


def normalize_raw(text: str) -> str:
    return " ".join(unicodedata.normalize("NFC", text).split())


def normalize_lexical(text: str) -> str:
    folded = normalize_raw(text).casefold()
    return " ".join("".join(" " if unicodedata.category(c).startswith("P") else c
                            for c in folded).split())


def align(reference: list[str], hypothesis: list[str]) -> list[tuple[str, str | None,
                                                                     str | None]]:
    """A minimum-edit alignment as (op, reference token, hypothesis token) in reading order.
    Among equal-cost alignments it keeps the most matches ("turn the pump off" / "turn pump
    on" deletes "the" rather than shifting every word), then prefers a substitution, then a
    deletion."""
    n, m = len(reference), len(hypothesis)
    # cost[i][j] = (edits, -matches) of the best alignment of the first i and j tokens
    cost = [[(0, 0)] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        cost[i][0] = (i, 0)
    for j in range(1, m + 1):
        cost[0][j] = (j, 0)

    def diagonal(i: int, j: int) -> tuple[int, int]:
        edits, negative_hits = cost[i - 1][j - 1]
        same = reference[i - 1] == hypothesis[j - 1]
        return edits + (not same), negative_hits - same

    for i in range(1, n + 1):
        for j in range(1, m + 1):
            up, left = cost[i - 1][j], cost[i][j - 1]
            cost[i][j] = min(diagonal(i, j), (up[0] + 1, up[1]), (left[0] + 1, left[1]))
    ops = []
    i, j = n, m
    while i or j:
        if i and j and cost[i][j] == diagonal(i, j):
            ops.append((OK if reference[i - 1] == hypothesis[j - 1] else SUB,
                        reference[i - 1], hypothesis[j - 1]))
            i, j = i - 1, j - 1
        elif i and cost[i][j] == (cost[i - 1][j][0] + 1, cost[i - 1][j][1]):
            ops.append((DEL, reference[i - 1], None))
            i -= 1
        else:
            ops.append((INS, None, hypothesis[j - 1]))
            j -= 1
    return ops[::-1]


def edit_counts(reference: list[str], hypothesis: list[str]) -> dict[str, int]:
    counts = {OK: 0, SUB: 0, DEL: 0, INS: 0}
    for op, _, _ in align(reference, hypothesis):
        counts[op] += 1
    return counts


def _chars(text: str) -> list[str]:
    return [c for c in text if not c.isspace()]


def _rate(totals: dict[str, int]) -> float | None:
    words = totals[OK] + totals[SUB] + totals[DEL]
    return (totals[SUB] + totals[DEL] + totals[INS]) / words if words else None


def _empty() -> dict[str, int]:
    return {OK: 0, SUB: 0, DEL: 0, INS: 0}


def term_errors(pairs: list[tuple[str, str]], terms: dict[str, list[str]]) -> dict:
    """Per term category: reference occurrences, missed ones and invented ones (lexical)."""
    out = {name: {"reference": 0, "missed": 0, "invented": 0} for name in terms}
    for reference, hypothesis in pairs:
        for op, ref, hyp in align(normalize_lexical(reference).split(),
                                  normalize_lexical(hypothesis).split()):
            for name, words in terms.items():
                if ref in words:
                    out[name]["reference"] += 1
                    out[name]["missed"] += op in (SUB, DEL)
                if hyp in words and op in (SUB, INS):
                    out[name]["invented"] += 1
    return out


def score(clips: list[dict], terms: dict[str, list[str]] | None = None) -> dict:
    """The corpus report of clips {"id", "speaker", "reference", "hypothesis"}."""
    totals = {mode: {"words": _empty(), "chars": _empty()} for mode in ("raw", "lexical")}
    speakers: dict[str, dict] = defaultdict(lambda: {"clips": 0, "words": _empty(),
                                                     "raw_words": _empty()})
    empty = {"clips": 0, "false_positives": 0, "inserted_words": 0, "ids": []}
    for clip in clips:
        raw_ref, raw_hyp = normalize_raw(clip["reference"]), normalize_raw(clip["hypothesis"])
        if not raw_ref:
            words = normalize_lexical(raw_hyp).split()
            empty["clips"] += 1
            empty["false_positives"] += bool(words)
            empty["inserted_words"] += len(words)
            if words:
                empty["ids"].append(clip["id"])
            continue
        slice_ = speakers[clip.get("speaker") or "unknown"]
        slice_["clips"] += 1
        for mode, normalize in (("raw", normalize_raw), ("lexical", normalize_lexical)):
            ref, hyp = normalize(raw_ref), normalize(raw_hyp)
            words, chars = edit_counts(ref.split(), hyp.split()), edit_counts(_chars(ref),
                                                                               _chars(hyp))
            for op in words:
                totals[mode]["words"][op] += words[op]
                totals[mode]["chars"][op] += chars[op]
                slice_["words" if mode == "lexical" else "raw_words"][op] += words[op]
    report = {"clips": len(clips), "scored_clips": len(clips) - empty["clips"]}
    for mode, counts in totals.items():
        report[mode] = {"wer": _rate(counts["words"]), "cer": _rate(counts["chars"]),
                        "reference_words": counts["words"][OK] + counts["words"][SUB]
                        + counts["words"][DEL],
                        "substitutions": counts["words"][SUB], "deletions": counts["words"][DEL],
                        "insertions": counts["words"][INS]}
    report["empty_reference"] = empty
    report["inserted_words"] = totals["lexical"]["words"][INS] + empty["inserted_words"]
    report["speakers"] = {name: {"clips": s["clips"], "wer": _rate(s["words"]),
                                 "raw_wer": _rate(s["raw_words"])}
                          for name, s in sorted(speakers.items())}
    report["terms"] = term_errors([(c["reference"], c["hypothesis"]) for c in clips
                                   if normalize_raw(c["reference"])], terms or {})
    return report


# -- triage: signals that a transcript must not be trusted ---------------------------------
QUIET_PEAK = 0.03          # peak below -30 dBFS: too quiet to trust (no gain is applied)
LOW_CONFIDENCE = 0.6       # mean peak posterior of the frames that emitted a character
MAX_CHARS_PER_S = 25.0     # faster than any speech the grammar holds: a runaway decode


def review_flags(wave, hypothesis: str, confidence: float | None, seconds: float,
                 vocabulary: set[str]) -> list[str]:
    """Why a transcript needs review (empty when nothing looks wrong). Input flags: digital
    silence, clipping, a very quiet signal; output flags: low confidence, words the training
    transcripts never held, more characters a second than speech has. Triage signals, not a
    certificate: an unflagged transcript can still be wrong."""
    from engine.eval.audio import integrity_flags

    measured = integrity_flags(wave)
    flags = [f for f in measured["flags"] if f in ("silence", "clipping")]
    if measured["peak"] < QUIET_PEAK and "silence" not in flags:
        flags.append("very_quiet")
    words = normalize_lexical(hypothesis).split()
    if words and confidence is not None and confidence < LOW_CONFIDENCE:
        flags.append("low_confidence")
    if any(w not in vocabulary for w in words):
        flags.append("unknown_words")
    if seconds > 0 and len(hypothesis) / seconds > MAX_CHARS_PER_S:
        flags.append("too_fast")
    return flags
