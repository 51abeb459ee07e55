"""Transcripts of a speech-recognize run's evaluations, Qt-free: every clip's reference and
hypothesis aligned word by word (the scorer's own alignment, lexical normalization) with each
error marked, and the review flags the engine raised.

The engine writes evals/<split>-<checkpoint>-transcripts.jsonl (engine/recipes/
speech_recognize.py); this module only reads it.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ForgebenchError
from engine.eval.speech import DEL, INS, OK, SUB, align, normalize_lexical
from engine.rundir import RunDir

RECIPE = "speech-recognize"
SUFFIX = "-transcripts.jsonl"
COLOURS = {SUB: "#e65100", DEL: "#b71c1c", INS: "#1565c0"}
LABELS = {SUB: "substituted", DEL: "deleted", INS: "inserted"}


@dataclass
class Clip:
    id: str
    path: Path
    speaker: str
    reference: str
    hypothesis: str
    beam: str = ""
    flags: list[str] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(op != OK for op, _, _ in aligned(self.reference, self.hypothesis))


def speech_runs(run_dirs: list[Path]) -> list[tuple[str, str]]:
    """(label, path) of every speech-recognize run among `run_dirs`."""
    out = []
    for path in run_dirs:
        try:
            recipe = RunDir(path).manifest().get("recipe")
        except ForgebenchError:          # an unreadable run.json: the Runs pane reports it
            continue
        if recipe == RECIPE:
            out.append((path.name, str(path)))
    return out


def transcript_files(run_dir: str | Path) -> list[Path]:
    """The run's transcript files, newest evaluation name last."""
    folder = Path(run_dir) / "evals"
    return sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []


def load_clips(path: str | Path) -> list[Clip]:
    clips = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            clips.append(Clip(row["id"], Path(row["path"]), row.get("speaker", ""),
                              row["reference"], row["greedy"], row.get("beam", ""),
                              list(row.get("flags", []))))
    return clips


def aligned(reference: str, hypothesis: str) -> list[tuple[str, str | None, str | None]]:
    return align(normalize_lexical(reference).split(), normalize_lexical(hypothesis).split())


def alignment_html(reference: str, hypothesis: str) -> str:
    """Two rows, reference over hypothesis, one column per aligned word; errors coloured and
    titled (substituted, deleted, inserted), a gap shown as '—'."""
    cells = aligned(reference, hypothesis)
    if not cells:
        return "<i>empty reference, empty hypothesis</i>"

    def cell(op: str, word: str | None) -> str:
        text = html.escape(word) if word is not None else "—"
        if op == OK:
            return f"<td>{text}</td>"
        return (f"<td title='{LABELS[op]}' style='color:{COLOURS[op]}'><b><u>{text}</u></b>"
                "</td>")
    ref = "".join(cell(op, r) for op, r, _ in cells)
    hyp = "".join(cell(op, h) for op, _, h in cells)
    return ("<table cellspacing='6'><tr><td><i>reference</i></td>" + ref + "</tr>"
            "<tr><td><i>hypothesis</i></td>" + hyp + "</tr></table>")


def clip_label(clip: Clip) -> str:
    marks = f"{clip.errors} error{'s' * (clip.errors != 1)}" if clip.errors else "exact"
    flags = f" · flagged: {', '.join(clip.flags)}" if clip.flags else ""
    return f"{clip.id} ({clip.speaker}) — {marks}{flags}"
