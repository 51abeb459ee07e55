"""SFT token view: the samples `forgebench inspect-sft --json` renders, split into supervised
and masked spans (the engine marks supervised tokens between ⟦ and ⟧)."""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "⟦", "⟧"


@dataclass(frozen=True)
class SftSample:
    line: int | str
    input_tokens: int
    supervised_tokens: int
    truncated: bool
    spans: list[tuple[str, bool]]  # (text, supervised)


def marked_spans(marked: str) -> list[tuple[str, bool]]:
    """'a⟦b⟧c' -> [('a', False), ('b', True), ('c', False)] (empty spans dropped)."""
    spans, supervised, current = [], False, []
    for char in marked:
        if char in (OPEN, CLOSE):
            if current:
                spans.append(("".join(current), supervised))
            current, supervised = [], char == OPEN
        else:
            current.append(char)
    if current:
        spans.append(("".join(current), supervised))
    return spans


def parse_inspect_report(text: str) -> tuple[list[SftSample], dict]:
    """Samples and the summary from `forgebench inspect-sft CONFIG --json` output."""
    report = json.loads(text)
    samples = [SftSample(s.get("line", "?"), int(s.get("input_tokens", 0)),
                         int(s.get("supervised_tokens", 0)), bool(s.get("truncated")),
                         marked_spans(s.get("marked", "")))
               for s in report.get("samples", [])]
    return samples, report.get("summary", {})
