"""Rule rewards on generated text (seed 000 §15.8, the R1-style `rule` reward): unigram F1
against the reference plus a bonus for the response envelope. Pure Python: the app and tests
can score a string without the training stack.

Words are lower-cased runs of letters, digits and apostrophes (`\\w` plus "'"), so
"Paris," and "paris" are the same word; F1 counts a word as often as it appears in both
(multiset overlap), as SQuAD's F1 does.
"""

from __future__ import annotations

import re
from collections import Counter

WORD = re.compile(r"[\w']+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def unigram_f1(candidate: str, reference: str) -> float:
    """Harmonic mean of word precision and recall (0 when either side has no words)."""
    a, b = Counter(words(candidate)), Counter(words(reference))
    overlap = sum((a & b).values())
    if not overlap:
        return 0.0
    precision, recall = overlap / sum(a.values()), overlap / sum(b.values())
    return 2 * precision * recall / (precision + recall)


def in_envelope(text: str, prefix: str, suffix: str) -> bool:
    """The answer starts with `prefix` and ends with `suffix` (surrounding whitespace aside)."""
    text = text.strip()
    return text.startswith(prefix) and text.endswith(suffix)


def rule_reward(candidate: str, reference: str, *, prefix: str, suffix: str,
                envelope_bonus: float = 0.1) -> float:
    """unigram_f1 + envelope_bonus when the candidate sits in the envelope."""
    bonus = envelope_bonus if in_envelope(candidate, prefix, suffix) else 0.0
    return unigram_f1(candidate, reference) + bonus
