"""Evaluation reports of a run, Qt-free: each evals/<name>.json the engine wrote, read as

1. its headline: split, checkpoint and step;
2. a before/after table where the report holds a pair of the same measurements (a classifier's
   `uncalibrated`/`calibrated` figures, `val_before`/`val_after`, `before`/`after`), with a
   note where an ECE is below the ECE a perfectly calibrated model would show on as many rows
   (`ece_noise_floor`): that split cannot tell the two apart;
3. the alert's confusion matrix in counts (`tn`, `fp`, `fn`, `tp`, at the top or in
   `threshold`);
4. every scalar figure by its dotted path, nested dicts included (lists are left to the
   pictures and the engine's own files);
5. the pictures it names (`plots`, run-relative PNG paths; else evals/<name>-*.png).

An lm-cartridge run's held-out comparison (evals/cartridge-<checkpoint>.json, the record its
.md report is written from) reads as a `CartridgeComparison`: the three conditions side by
side, each figure taken from the record as the engine wrote it (`cartridge_comparison`).

Written by the recipes (tabular-classify's selection and `forgebench eval` reports with their
PR curve and reliability plot, lm-decision's calibration report, every recipe's eval records,
lm-cartridge's comparison); this module only reads them.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ForgebenchError
from engine.rundir import RunDir

PAIRS = (("uncalibrated", "calibrated"), ("val_before", "val_after"), ("before", "after"))
CONFUSION = ("tn", "fp", "fn", "tp")
MAX_DEPTH = 4       # dotted paths deeper than this are the engine files' business


@dataclass
class Report:
    name: str
    path: Path
    record: dict

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent

    def headline(self) -> str:
        parts = [f"{key} {self.record[key]}" for key in ("split", "checkpoint", "step")
                 if key in self.record]
        return f"{self.name}: " + ", ".join(parts) if parts else self.name

    def pair(self) -> tuple[str, str, list[tuple[str, float, float]]] | None:
        """(before key, after key, [(measurement, before, after)]) of the first pair of dicts
        the report holds with numbers in both."""
        for before, after in PAIRS:
            old, new = self.record.get(before), self.record.get(after)
            if isinstance(old, dict) and isinstance(new, dict):
                rows = [(key, old[key], new[key]) for key in old
                        if key in new and _number(old[key]) and _number(new[key])]
                if rows:
                    return before, after, rows
        return None

    def noise_notes(self) -> list[str]:
        """Where a pair's ECE lies below its noise floor: what that split can and cannot say."""
        pair = self.pair()
        if pair is None:
            return []
        before, after, rows = pair
        values = {key: (old, new) for key, old, new in rows}
        if "ece" not in values or "ece_noise_floor" not in values:
            return []
        floor = max(values["ece_noise_floor"])
        below = [label for label, value in zip((before, after), values["ece"]) if value < floor]
        if not below:
            return []
        rows_text = f" on its {values['rows'][0]:g} rows" if "rows" in values else ""
        return [f"A perfectly calibrated model would show an ECE of about {floor:.3f}"
                f"{rows_text} from chance alone, and the {' and '.join(below)} ECE lies below "
                f"that: this split cannot tell the two apart. Log loss and Brier score weigh "
                f"every row; compare those, or evaluate on more rows."]

    def confusion(self) -> dict | None:
        """tn/fp/fn/tp counts (with the threshold when known), from the top level or the
        report's chosen `threshold`."""
        for source in (self.record, self.record.get("threshold")):
            if isinstance(source, dict) and all(isinstance(source.get(k), int)
                                                for k in CONFUSION):
                return {k: source[k] for k in (*CONFUSION, "threshold") if k in source}
        return None

    def figures(self) -> list[tuple[str, str]]:
        """(dotted path, value as text) of every scalar in the report: each level's own
        scalars before its nested dicts, so a report's headline figures (wer, iou, loss) come
        first."""
        out: list[tuple[str, str]] = []

        def walk(record: dict, prefix: str, depth: int) -> None:
            nested = []
            for key, value in record.items():
                if isinstance(value, dict):
                    nested.append((key, value))
                elif not isinstance(value, list):
                    out.append((prefix + str(key), format_value(value)))
            if depth < MAX_DEPTH:
                for key, value in nested:
                    walk(value, f"{prefix}{key}.", depth + 1)
        walk(self.record, "", 1)
        return out

    def pictures(self) -> list[Path]:
        named = self.record.get("plots")
        if isinstance(named, list) and named:
            paths = [self.run_dir / p for p in named if isinstance(p, str)]
        else:
            paths = sorted(self.path.parent.glob(f"{self.name}-*.png"))
        return [p for p in paths if p.is_file()]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def report_files(run_dir: str | Path) -> list[Path]:
    """The run's evaluation reports (evals/*.json), by name: a listing, no file read."""
    folder = Path(run_dir) / "evals"
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def read_report(path: str | Path) -> Report:
    """One report; a file that is not a JSON object is refused with its path."""
    path = Path(path)
    hint = "run `forgebench eval RUN --split val` again to rewrite it"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ForgebenchError(f"cannot read the report: {exc}", path=path, hint=hint) from None
    if not isinstance(record, dict):
        raise ForgebenchError(f"a report is a JSON object; this file holds a "
                              f"{type(record).__name__}", path=path, hint=hint)
    return Report(path.stem, path, record)


def report_runs(run_dirs: list[Path]) -> list[tuple[str, str]]:
    """(label, path) of every run with at least one evaluation report."""
    out = []
    for path in run_dirs:
        try:
            RunDir(path).manifest()
        except ForgebenchError:          # an unreadable run.json: the Runs pane reports it
            continue
        if report_files(path):
            out.append((path.name, str(path)))
    return out


def summary_html(report: Report) -> str:
    """The headline, the before/after table with its notes, and the confusion matrix."""
    parts = [f"<b>{html.escape(report.headline())}</b>"]
    pair = report.pair()
    if pair is not None:
        before, after, rows = pair
        body = "".join(f"<tr><td>{html.escape(key)}</td><td align='right'>{format_value(old)}"
                       f"</td><td align='right'>{format_value(new)}</td></tr>"
                       for key, old, new in rows)
        parts.append("<table cellspacing='0' cellpadding='3' border='1'>"
                     f"<tr><th></th><th>{html.escape(before)}</th>"
                     f"<th>{html.escape(after)}</th></tr>{body}</table>")
        parts += [f"<i>{html.escape(note)}</i>" for note in report.noise_notes()]
    confusion = report.confusion()
    if confusion is not None:
        at = (f" at threshold {format_value(confusion['threshold'])}"
              if "threshold" in confusion else "")
        parts.append(f"Alerts{at}, in counts:"
                     "<table cellspacing='0' cellpadding='3' border='1'>"
                     "<tr><th></th><th>alert</th><th>no alert</th></tr>"
                     f"<tr><th>fault</th><td align='right'>{confusion['tp']} (TP)</td>"
                     f"<td align='right'>{confusion['fn']} (FN)</td></tr>"
                     f"<tr><th>no fault</th><td align='right'>{confusion['fp']} (FP)</td>"
                     f"<td align='right'>{confusion['tn']} (TN)</td></tr></table>")
    return "<br>".join(parts)


# -- an lm-cartridge run's held-out comparison ----------------------------------------------
CONDITIONS = ("no document", "whole document", "cartridge")    # engine/cartridge/self_study.py
EVAL_HINT = "run `forgebench eval RUN` to write the comparison again"
MEANING = ("Log-likelihood: how likely each condition finds the reference answers, per token "
           "(closer to 0 is better). Answer F1: the greedy answer's word overlap with the "
           "reference. KV memory: the f16 key/value rows the document part takes. TTFT: mean "
           "time to the first token. Bars: each figure as a share of its column's largest "
           "(log-likelihood as per-token probability); the best of each column in bold.")


@dataclass(frozen=True)
class Measure:
    key: str              # the figure's name in the record's `systems`
    label: str
    higher_is_better: bool


MEASURES = (Measure("logprob_per_token", "log-likelihood / token", True),
            Measure("answer_f1", "answer F1", True),
            Measure("kv_prefix_bytes_f16", "KV memory (MB)", False),
            Measure("mean_ttft_s", "TTFT (s)", False))


def _figure_text(key: str, value: float | None) -> str:
    if value is None:
        return "not scored"
    if key == "kv_prefix_bytes_f16":
        return f"{value / 1e6:.1f}"
    return {"logprob_per_token": f"{value:.3f}", "answer_f1": f"{value:.2f}"}.get(
        key, f"{value:.3f}")


@dataclass
class QuestionRow:
    question: str
    reference: str
    source: str
    figures: dict          # condition -> {"logprob_per_token", "answer_f1" (or None), "answer"}


@dataclass
class CartridgeComparison:
    """The held-out comparison: `values[condition][measure key]` as the record holds them
    (None: a figure this record predates, answer F1 before it was scored)."""

    checkpoint: str
    questions: list[QuestionRow]
    reference_tokens: int
    values: dict
    kv_prefix_tokens: dict

    def text(self, condition: str, key: str) -> str:
        return _figure_text(key, self.values[condition][key])

    def winner(self, key: str) -> str | None:
        """The condition with the best figure of `key` (None when it was not scored)."""
        measure = next(m for m in MEASURES if m.key == key)
        scored = [(v[key], c) for c, v in self.values.items() if v[key] is not None]
        if not scored:
            return None
        best = max if measure.higher_is_better else min
        return best(scored)[1]

    def bar(self, condition: str, key: str) -> float:
        """The bar's length in [0, 1]: the figure as a share of its column's largest, a
        log-likelihood taken as its per-token probability (exp) first."""
        return _share(self.values[condition][key],
                      [v[key] for v in self.values.values()], key == "logprob_per_token")

    def headline(self) -> str:
        """The cartridge against the two other conditions, in one sentence."""
        none, whole, cart = (self.values[c] for c in CONDITIONS)
        key = "logprob_per_token"
        gap = whole[key] - none[key]
        parts = [f"{len(self.questions)} held-out questions ({self.reference_tokens} "
                 f"reference tokens), checkpoint {self.checkpoint}. The cartridge "
                 f"({self.kv_prefix_tokens['cartridge']} rows) scores "
                 f"{cart[key]:.3f} per token, against {none[key]:.3f} without the document "
                 f"and {whole[key]:.3f} with the whole document"]
        if gap > 0:
            parts.append(f" ({(cart[key] - none[key]) / gap:.0%} of the way)")
        parts.append(".")
        if cart["kv_prefix_bytes_f16"] > 0:
            parts.append(f" Its KV memory is "
                         f"{whole['kv_prefix_bytes_f16'] / cart['kv_prefix_bytes_f16']:.1f}x "
                         f"smaller than the whole document's")
            if cart["mean_ttft_s"] > 0:
                parts.append(f", its first token "
                             f"{whole['mean_ttft_s'] / cart['mean_ttft_s']:.1f}x sooner")
            parts.append(".")
        return "".join(parts)


def _share(value: float | None, column: list, exponentiate: bool) -> float:
    scored = [math.exp(v) if exponentiate else v for v in column if v is not None]
    if value is None or not scored or max(scored) <= 0:
        return 0.0
    return (math.exp(value) if exponentiate else value) / max(scored)


def _damaged(report: Report, what: str) -> ForgebenchError:
    return ForgebenchError(f"this cartridge comparison is damaged: {what}", path=report.path,
                           hint=EVAL_HINT)


def _figures_of(report: Report, where: str, record, keys: tuple[str, ...],
                optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(record, dict):
        raise _damaged(report, f"{where} is not an object")
    out = {}
    for key in keys:
        value = record.get(key)
        if value is None and key in optional:
            out[key] = None
        elif not _number(value) or not math.isfinite(value):
            raise _damaged(report, f"{where} has no number {key!r} (it holds {value!r})")
        else:
            out[key] = float(value)
    return out


def cartridge_comparison(report: Report) -> CartridgeComparison | None:
    """The report as a cartridge comparison, or None when it is another kind of report (it has
    no `systems`). A comparison missing a condition or a figure is refused with its path."""
    systems = report.record.get("systems")
    if systems is None:
        return None
    if not isinstance(systems, dict) or any(c not in systems for c in CONDITIONS):
        raise _damaged(report, "it does not hold the three conditions "
                               f"({', '.join(CONDITIONS)})")
    keys = tuple(m.key for m in MEASURES) + ("kv_prefix_tokens",)
    values = {c: _figures_of(report, f"systems[{c!r}]", systems[c], keys, ("answer_f1",))
              for c in CONDITIONS}
    tokens = {c: int(values[c].pop("kv_prefix_tokens")) for c in CONDITIONS}
    rows = report.record.get("questions")
    if not isinstance(rows, list):
        raise _damaged(report, "it has no list of questions")
    questions = []
    for number, row in enumerate(rows, 1):
        where = f"question {number}"
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise _damaged(report, f"{where} has no question text")
        figures = {}
        for c in CONDITIONS:
            figures[c] = _figures_of(report, f"{where}[{c!r}]", row.get(c),
                                     ("logprob_per_token", "answer_f1"), ("answer_f1",))
            figures[c]["answer"] = str(row[c].get("answer", ""))
        questions.append(QuestionRow(row["question"], str(row.get("reference", "")),
                                     str(row.get("source", "")), figures))
    reference_tokens = report.record.get("reference_tokens")
    return CartridgeComparison(str(report.record.get("checkpoint", report.name)), questions,
                               reference_tokens if isinstance(reference_tokens, int) else 0,
                               values, tokens)


def question_cell(row: QuestionRow, condition: str) -> str:
    """A per-question cell: the reference answer's log-likelihood per token and the answer's
    F1."""
    figures = row.figures[condition]
    return (f"{_figure_text('logprob_per_token', figures['logprob_per_token'])} · "
            f"F1 {_figure_text('answer_f1', figures['answer_f1'])}")


def question_bar(row: QuestionRow, condition: str) -> float:
    """A per-question cell's bar: the reference answer's per-token probability, as a share of
    the question's best condition's."""
    key = "logprob_per_token"
    return _share(row.figures[condition][key], [f[key] for f in row.figures.values()], True)


def comparison_summary(run_dir: str | Path) -> str | None:
    """The headline of a run's latest cartridge comparison (evals/cartridge-*.json, by
    checkpoint name) for the Runs pane's details, or what is wrong with it; None for a run
    without one."""
    paths = sorted((Path(run_dir) / "evals").glob("cartridge-*.json"))
    if not paths:
        return None
    try:
        comparison = cartridge_comparison(read_report(paths[-1]))
    except ForgebenchError as exc:
        return exc.render()
    if comparison is None:
        return None
    return comparison.headline() + " The figures side by side: the Reports pane."


QUESTION_CHARS = 120   # a question cell holds about four lines of its column at 1024 pixels


def short_question(text: str, limit: int = QUESTION_CHARS) -> str:
    """A question as its table cell shows it: one line of words (a generated question may
    hold newlines and code), cut at a word with an ellipsis past `limit` characters; the
    whole text is the cell's tooltip."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    return flat[:limit].rsplit(" ", 1)[0] + "…"
