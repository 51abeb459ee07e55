"""One verdict for an export, from its report's figures: the words and the colour every surface
shows (report.txt, `forgebench export`'s summary and exit code, the wizard's final page, the
desktop notification, the model card, the Models library entry and the Runs ledger).

An export report answers two questions (engine/export/equivalence.py, engine/export/quality.py):

1. *Is the file right?* (`report["question1"]`) Its weights, read back with gguf-py's reference
   dequantizer (independent of the engine), are each within the rounding their type allows of
   the unquantized merged weights they were made from; and llama.cpp opened on the file
   computes what the engine computes on it: bit for bit where `forgebench doctor`
   (engine.kernels.cpu.plan) claims the engine follows llama.cpp's kernels for every weight type
   in the file, otherwise same top-1 on >= 99.5 % of the positions and mean KL <= 1e-3 nats.
   Without llama-cpp-python the second half is *not answered*: never "verified".
2. *What did quantization cost your fine-tune?* (`report["question2"]`) On the run's own
   validation data: the validation loss of the base, of the merged (unquantized) fine-tune and
   of the exported file, and the share of the fine-tune's gain (base loss - fine-tune loss) the
   exported file keeps.

Verdicts (`KEYS`), in order of precedence:

- `defect`    question 1 failed: the file is not right; it is kept only for diagnosis, under a
              name no runtime or picker takes for a model (`DEFECT_SUFFIX`), and never listed
              as usable;
- `lost`      keeps less than `LOST_BELOW` (50 %) of the fine-tune's gain: names a larger type;
- `reduced`   keeps at least 50 % but less than `KEPT_MIN` (90 %);
- `kept`      keeps at least 90 % ("keeps 96% of the fine-tune's gain");
- `no-gain`   the fine-tune did not lower the validation loss: there is no gain to keep;
- `checked`   question 1 passed, question 2 not measured (the reason is given);
- `unchecked` no report (`--no-report`), or nothing could be measured.

Question 1 unanswered (no llama.cpp) never makes a verdict "verified": the words say so.

No torch, no Qt: the app imports this module.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Question 1: llama.cpp against the engine on the same file, where bit-exact is not claimed.
Q1_MIN_TOP1 = 0.995
Q1_MAX_KL = 1e-3
# Question 1: a tensor's relative RMS error (||dequantized - merged|| / ||merged||) allowed per
# stored type: about 1.5x the largest the type's rounding gave on the test models (whose blocks
# hold outliers that widen every step), so rounding passes; a damaged scale gives errors of
# order 1 and more.
WEIGHT_REL_ERROR = {"F32": 0.0, "F16": 2e-3, "BF16": 1.5e-2, "Q8_0": 3e-2, "Q6_K": 6e-2,
                    "Q5_K": 0.12, "Q5_0": 0.12, "Q5_1": 0.12, "Q4_K": 0.25, "Q4_0": 0.3,
                    "Q4_1": 0.3, "Q3_K": 0.45, "Q2_K": 0.7,
                    # ternary planes (engine/gguf/layouts.py rows): one plane as loose as Q2_K,
                    # PTQTP's two as Q3_K (gemma-3-270m: 0.45 / 0.19 mean, docs/ptqtp.md)
                    "TQ2_0": 0.7, "TQ1_0": 0.7, "PTQTP_2_TQ2_0": 0.45, "PTQTP_2_TQ1_0": 0.45}
# Question 2: shares of the fine-tune's gain.
KEPT_MIN = 0.90          # the picker recommends the smallest type keeping at least this
LOST_BELOW = 0.50        # "loses most of the fine-tune's gain"
# A fine-tune whose validation loss is not this much (nats) below the base's has no gain to keep.
MIN_GAIN = 1e-3
# The file types from small to large: where a type loses the gain, the next ones may keep it.
SIZE_ORDER = ("ptqtp", "q4_0", "q4_k_s", "q4_k_m", "q5_k_m", "q6_k", "q8_0", "bf16", "f16", "f32")
DEFECT_SUFFIX = ".defective"     # model.gguf -> model.gguf.defective
EXPORTS_LEDGER = "exports.jsonl"  # in a run folder: one line per export of the run

KEYS = ("defect", "lost", "reduced", "kept", "no-gain", "checked", "unchecked")
# (background, text) colours per verdict: the wizard's banner and table cells use the first,
# lists and ledgers the second.
COLOURS = {"defect": ("#ffcdd2", "#b71c1c"), "lost": ("#ffcdd2", "#c62828"),
           "reduced": ("#ffe0b2", "#e65100"), "kept": ("#c8e6c9", "#2e7d32"),
           "no-gain": ("#e0e0e0", "#616161"), "checked": ("#c8e6c9", "#2e7d32"),
           "unchecked": ("#e0e0e0", "#616161")}
TITLES = {"defect": "DEFECT", "lost": "Lost", "reduced": "Reduced", "kept": "Kept",
          "no-gain": "No gain", "checked": "Verified", "unchecked": "Not checked"}


@dataclass(frozen=True)
class Verdict:
    key: str                 # one of KEYS
    words: str               # one line for people: "keeps 96% of the fine-tune's gain"
    gain_kept: float | None  # share of the fine-tune's gain the file keeps
    q1: str                  # "passed", "failed" or "not answered"
    suggestion: str | None = None     # a type that keeps the gain, when this one lost it

    @property
    def usable(self) -> bool:
        """Whether the file may be offered as a model (a defect never is)."""
        return self.key != "defect"

    @property
    def title(self) -> str:
        return TITLES[self.key]

    @property
    def background(self) -> str:
        return COLOURS[self.key][0]

    @property
    def colour(self) -> str:
        return COLOURS[self.key][1]

    @property
    def line(self) -> str:
        """"Kept: keeps 96% of the fine-tune's gain": the title and the words."""
        return f"{self.title}: {self.words}"

    def as_dict(self) -> dict:
        return {"key": self.key, "title": self.title, "words": self.words,
                "gain_kept": self.gain_kept, "question1": self.q1,
                "suggestion": self.suggestion, "usable": self.usable,
                "colour": self.colour, "background": self.background}


# ----------------------------------------------------------------------- question 1

def claimed_exact(weight_types: list[str], kernels) -> bool:
    """Whether `forgebench doctor` (engine.kernels.cpu.plan().kernels: rows with a name and a
    status) claims the engine bit-exact with llama.cpp for every matrix weight type in a file.

    A type is claimed when a bit-exact row about weights names it (its ggml name, or "f16",
    first word of one of the row name's comma-separated parts; the activation quantizers' row
    is not about weights). The plan lists Q4_K twice, exact for rows % 8 == 0
    and rounding otherwise: the exact row is taken, as every matrix of the models the engine
    exports has a multiple of 8 rows. An "all kernels" rounding row claims nothing."""
    rows = [(k.name, k.status) for k in kernels]
    if any(name.startswith("all kernels") and status != "bit-exact" for name, status in rows):
        return False
    def named(name: str) -> set[str]:
        return {p.strip().split(" ")[0].upper() for p in name.split(",")}

    exact = set().union(*(named(name) for name, status in rows
                          if status == "bit-exact" and "weights" in name))
    return bool(weight_types) and all(w.upper() in exact for w in weight_types)


ADAPTER_KERNEL = "LoRA adapter products"


def adapter_claimed_exact(kernels) -> bool:
    """Whether the doctor's plan claims the engine bit-exact with llama.cpp for a GGUF LoRA
    adapter's products (llama.cpp's build_lora_mm over F32 A and B): its row of that name is
    bit-exact. The base's own matrices are claimed by `file_claimed_exact`."""
    return any(k.name.startswith(ADAPTER_KERNEL) and k.status == "bit-exact" for k in kernels)


def file_claimed_exact(plan, matrices: list[tuple[str, int]]) -> bool:
    """Whether the doctor's plan (engine.kernels.cpu.plan()) claims the engine bit-exact with
    llama.cpp for every matrix of a file, given as (ggml type name, rows): the plan's own
    `exact_weight(type, rows)` where it has one, else its rows read by `claimed_exact`."""
    exact_weight = getattr(plan, "exact_weight", None)
    if exact_weight is not None:
        return bool(matrices) and all(exact_weight(kind, rows) for kind, rows in matrices)
    return claimed_exact(sorted({kind for kind, _ in matrices}), plan.kernels)


def question1(weights: dict | None, llamacpp: dict | None) -> dict:
    """The answer to question 1 from the weights check and the llama.cpp comparison.

    `weights`: {"checked": n, "failed": [{"name", "type", "rel_error", "bound"}...],
    "worst": {...}} or None where no reference existed; `llamacpp`: {"available": bool,
    "reason", "claimed_exact", "top1", "kl_mean", "max_abs", "greedy_matched",
    "greedy_total"}."""
    reasons, passed = [], True
    if weights is not None and weights.get("failed"):
        passed = False
        bad = weights["failed"][0]
        reasons.append(f"{len(weights['failed'])} tensor(s) differ from the merged weights by "
                       f"more than their type's rounding ({bad['name']} {bad['type']}: "
                       f"{_ratio(bad['rel_error'])} relative error, allowed "
                       f"{_ratio(bad['bound'])})")
    answered = bool(llamacpp and llamacpp.get("available"))
    if answered:
        if llamacpp["claimed_exact"]:
            ok = llamacpp["max_abs"] == 0.0 and \
                llamacpp.get("greedy_matched") == llamacpp.get("greedy_total")
            if not ok:
                reasons.append(f"llama.cpp computes differently from the engine on this file "
                               f"where the doctor claims bit-exact (max |Δlogit| "
                               f"{llamacpp['max_abs']:.3g})")
        else:
            ok = llamacpp["top1"] >= Q1_MIN_TOP1 and llamacpp["kl_mean"] <= Q1_MAX_KL \
                and llamacpp["top1"] == llamacpp["top1"]        # NaN fails
            if not ok:
                reasons.append(f"llama.cpp and the engine disagree on this file (same top-1 "
                               f"{llamacpp['top1']:.2%}, needs ≥ {Q1_MIN_TOP1:.1%}; mean KL "
                               f"{llamacpp['kl_mean']:.3g}, needs ≤ {Q1_MAX_KL:g})")
        passed = passed and ok
    status = "failed" if not passed else "passed" if answered else "not answered"
    return {"status": status, "reasons": reasons, "weights": weights, "llamacpp": llamacpp,
            "not_answered_because": None if answered else
            (llamacpp or {}).get("reason") or "llama.cpp did not run"}


def _ratio(value: float) -> str:
    return f"{value:.3g}" if value == value else "NaN"


# ----------------------------------------------------------------------- question 2

def gain_kept(base_loss: float, fine_tune_loss: float, export_loss: float) -> float | None:
    """(base - export) / (base - fine-tune): 1.0 keeps all of it; None when the fine-tune has
    no gain (its validation loss is not MIN_GAIN below the base's)."""
    gain = base_loss - fine_tune_loss
    if not gain > MIN_GAIN:
        return None
    return (base_loss - export_loss) / gain


def larger_types(dtype: str) -> list[str]:
    """The quantized types larger than `dtype`, small to large; f16 after q8_0."""
    if dtype not in SIZE_ORDER:
        return []
    larger = SIZE_ORDER[SIZE_ORDER.index(dtype) + 1:]
    quantized = [t for t in larger if t.startswith("q")]
    return quantized or [t for t in larger if t == "f16"]


def recommend(rows: list[dict]) -> str | None:
    """The smallest type keeping at least KEPT_MIN of the gain among picker rows
    ({"dtype", "bytes", "gain_kept"}), else None."""
    good = [r for r in rows if r.get("gain_kept") is not None and r["gain_kept"] >= KEPT_MIN
            and not r.get("defect")]
    return min(good, key=lambda r: r["bytes"])["dtype"] if good else None


# ----------------------------------------------------------------------- the verdict

def _generator_verdict(report: dict) -> Verdict:
    """A generator bundle's verdict: it redraws the checkpoint's samples, or it is a defect."""
    if report.get("passed"):
        return Verdict("checked", "the bundle redraws the checkpoint's samples "
                       f"({report.get('bar')})", None, "passed")
    return Verdict("defect", "the bundle does not redraw the checkpoint's samples "
                   f"({report.get('bar')}): not usable", None, "failed")


def of_report(report: dict | None) -> Verdict:
    """The verdict of an export report (report.json as written), or of none (--no-report)."""
    if report is None:
        return Verdict("unchecked", "not checked: exported without the report (--no-report)",
                       None, "not answered")
    if report.get("kind") == "generator":
        return _generator_verdict(report)
    q1 = report.get("question1") or {"status": "not answered",
                                     "not_answered_because": "this report predates it"}
    q2 = report.get("question2") or {"available": False, "reason": "not measured"}
    dtype = (report.get("export") or {}).get("dtype", "")
    if q1["status"] == "failed":
        return Verdict("defect", "the file is not right: " + "; ".join(q1["reasons"])
                       + ". Do not use it; export again", None, "failed")
    unanswered = "" if q1["status"] == "passed" else \
        f" (llama.cpp check not answered: {q1.get('not_answered_because')})"
    if not q2.get("available"):
        if q1["status"] != "passed":
            return Verdict("unchecked", f"not checked: {q2.get('reason')}{unanswered}", None,
                           q1["status"])
        return Verdict("checked", "llama.cpp runs the file as the engine does; quantization "
                       f"cost not measured ({q2.get('reason')})", None, q1["status"])
    kept = q2.get("gain_kept")
    if kept is None:
        return Verdict("no-gain", f"the fine-tune did not lower the validation loss (base "
                       f"{q2['base_loss']:.3f}, fine-tune {q2['fine_tune_loss']:.3f}, this file "
                       f"{q2['export_loss']:.3f}): there is no gain to keep{unanswered}", None,
                       q1["status"])
    figure = f"{max(kept, 0.0):.0%}"
    if kept >= KEPT_MIN:
        return Verdict("kept", f"keeps {figure} of the fine-tune's gain{unanswered}", kept,
                       q1["status"])
    suggestion = (report.get("picker") or {}).get("recommended")
    if suggestion is None or suggestion == dtype:
        larger = larger_types(dtype)
        suggestion = larger[-1] if kept < LOST_BELOW and larger else \
            larger[0] if larger else None
    hint = f"; {suggestion} keeps more" if suggestion else ""
    if kept >= LOST_BELOW:
        return Verdict("reduced", f"keeps {figure} of the fine-tune's gain{hint}{unanswered}",
                       kept, q1["status"], suggestion)
    return Verdict("lost", f"loses most of the fine-tune's gain (keeps {figure}){hint}"
                   f"{unanswered}", kept, q1["status"], suggestion)


def of_bundle(folder: str | os.PathLike) -> Verdict:
    """The verdict of an export folder: its report.json, or none."""
    path = Path(folder) / "report.json"
    if not path.is_file():
        return of_report(None)
    try:
        return of_report(json.loads(path.read_text("utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return Verdict("unchecked", "the report cannot be read", None, "not answered")


def notification(folder: str | os.PathLike, ok: bool, error: str) -> tuple[bool, str]:
    """(ok, message) of an export job's desktop notification: a defect is a failure, never
    "done"; a finished export says its verdict."""
    folder = Path(folder)
    if not (folder / "report.json").is_file() and not (folder / "SHA256SUMS").is_file():
        return False, error or "failed: nothing was written"
    verdict = of_bundle(folder)
    return ok and verdict.usable, f"{verdict.line} — {folder.name}"


# ----------------------------------------------------------------------- where it is read

def record_in_run(run_dir: str | os.PathLike, out: str | os.PathLike, dtype: str,
                  verdict: Verdict, sha256: str | None) -> None:
    """Append the export to the run's exports.jsonl (what the Runs ledger shows). A run folder
    that cannot be written (a read-only example) keeps no record; the bundle has it all."""
    line = json.dumps({"out": str(out), "dtype": dtype, "sha256": sha256,
                       "verdict": verdict.as_dict()})
    try:
        with open(Path(run_dir) / EXPORTS_LEDGER, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    except OSError:
        pass


def run_exports(run_dir: str | os.PathLike) -> list[dict]:
    """The run's recorded exports whose folder still exists, oldest first."""
    path = Path(run_dir) / EXPORTS_LEDGER
    try:
        lines = path.read_text("utf-8").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and Path(entry.get("out", "")).is_dir():
            found.append(entry)
    return found


def latest_run_export(run_dir: str | os.PathLike) -> Verdict | None:
    """The verdict of the run's latest export that is still there (re-read from its report,
    so it is the bundle's own), or None."""
    entries = run_exports(run_dir)
    return of_bundle(entries[-1]["out"]) if entries else None


def exported_file_verdict(workspace: str | os.PathLike, sha256: str | None,
                          source: str | None = None) -> Verdict | None:
    """The verdict of a model file that came out of an export: found by its SHA-256 among the
    workspace's exports (exports/*/report.json) or beside its source path; None for a file
    no export made."""
    if not sha256:
        return None
    folders = []
    if source:
        folders.append(Path(source).parent)
    exports = Path(workspace) / "exports"
    if exports.is_dir():
        folders += sorted(p for p in exports.iterdir() if p.is_dir())
    for folder in folders:
        report = folder / "report.json"
        if not report.is_file():
            continue
        try:
            data = json.loads(report.read_text("utf-8"))
        except (OSError, ValueError):
            continue
        if (data.get("export") or {}).get("sha256") == sha256:
            return of_report(data)
    return None


def run_command(file_name: str, needs_no_repack: bool) -> list[str]:
    """The llama.cpp command lines that run an exported model, for the card."""
    flag = " --no-repack" if needs_no_repack else ""
    return [f"llama-cli -m {file_name}{flag} -cnv",
            f"llama-server -m {file_name}{flag} --port 8080"]
