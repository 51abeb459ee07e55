"""The export wizard's steps over `forgebench export` / `forgebench convert`
(engine/export/bundle.py):
which runs can be exported, what the base is, how big each quantization will be, the
equivalence report as pass/fail rows, and the bundle's model card and rights checklist.

Language-model runs export as GGUF (or their LoRA adapter), or as a merged Hugging Face folder
(engine/export/hf_export.py: `hf_export_refusal` says up front why a run cannot);
image-generate and audio-generate runs as a generator bundle
(engine/export/generator_bundle.py: f32 or f16 weights, verified by redrawing fixed-seed
samples from the bundle alone). The verification table's columns follow the kind.

The export itself runs as a job; this module only prepares its command line and reads what it
wrote. No Qt, no torch (sizes come from the safetensors header or the GGUF tensor table).
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType as T

from app.viewmodels.jobs import forgebench_argv
from engine.errors import ForgebenchError
from engine.export.bundle import DTYPES, EXPORTABLE_RECIPES, GGUF_BASE_RECIPES, write_sha256sums
from engine.export.generator_bundle import GENERATOR_DTYPES, GENERATOR_RECIPES
from engine.export.quant_choices import PTQTP, estimated_sizes, tensor_bytes
from engine.export.verdict import of_report
from engine.fsutil import atomic_write_text, read_json
from engine.gguf.quant_policy import FLOAT_TYPES, ModelFacts
from engine.rundir import RunDir

EXPORTABLE = EXPORTABLE_RECIPES + GENERATOR_RECIPES
LLM_COLUMNS = ("stage", "stage check", "top-1 agreement", "max |Δlogit|", "mean |Δlogit|", "KL",
               "greedy match", "tokenizer", "file")
GENERATOR_COLUMNS = ("stage", "verdict", "weights", "max |Δ| output", "mean |Δ| output",
                     "PSNR", "file")
RIGHTS_LABELS = {"train": "training on this data is allowed",
                 "publish_data": "the data may be published",
                 "publish_weights": "weights trained on it may be published",
                 "commercial": "commercial use is allowed",
                 "consent": "the people in the data consented"}
SAFETENSORS_DTYPES = {"F32": T.F32, "F16": T.F16, "BF16": T.BF16}


@dataclass(frozen=True)
class ExportableRun:
    path: Path
    recipe: str
    checkpoints: list[str]


def exportable_runs(run_dirs: list[Path]) -> list[ExportableRun]:
    """Runs whose recipe has an export (GGUF or generator bundle) and that hold at least one
    checkpoint."""
    found = []
    for path in run_dirs:
        run = RunDir(path)
        try:
            recipe = run.manifest()["recipe"]
        except (ForgebenchError, KeyError):
            continue
        names = [c.name for c in run.checkpoints()]
        if recipe in EXPORTABLE and names:
            found.append(ExportableRun(path, recipe, names))
    return found


# -- step 2: the base ----------------------------------------------------------------------
@dataclass(frozen=True)
class BaseInfo:
    path: Path | None
    quantized_tensors: int          # matrices stored quantized (a merge needs a dense copy)
    types: dict[str, int]           # ggml type name -> tensor count

    @property
    def quantized(self) -> bool:
        return self.quantized_tensors > 0

    def explanation(self) -> str:
        if self.path is None:
            return "This run was trained from scratch: it has no base model."
        if not self.quantized:
            return f"The base {self.path.name} is dense: the adapters merge straight into it."
        return (f"The base {self.path.name} is quantized ({self.quantized_tensors} tensors: "
                + ", ".join(f"{k} ×{v}" for k, v in sorted(self.types.items())) + "). "
                "Merging into quantized weights would dequantize, add the adapter and "
                "quantize again, compounding the rounding, so the engine refuses it. The way out "
                "is one explicit step: write a dense f16 copy of the base (it records the "
                "SHA-256 of the file it came from, so it is accepted as the adapter's base), "
                "merge into that copy, then quantize once. Or export the adapter alone.")


def gguf_tensor_table(path: Path) -> list[tuple[str, tuple[int, ...], T]]:
    """(name, torch-order shape, type) of every tensor in a GGUF file, from its header."""
    return _header(path)[0]


def _header(path: Path) -> tuple[list[tuple[str, tuple[int, ...], T]], dict]:
    """The tensor table and the scalar metadata of a GGUF file, read by the engine's header
    parser (engine.gguf.parser: the tensor bytes stay mapped, never read; the 262k-token
    vocabulary arrays are not turned into Python values). gguf-py's GGUFReader builds Python
    objects for every array element: about a minute of CPU on gemma-3-270m, which held the
    wizard's size step before."""
    stat = Path(path).stat()
    return _read_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header(path: str, _size: int, _mtime_ns: int):
    """_header's read, kept while the file is unchanged (steps 2 and 3 read the same base)."""
    from gguf import GGUFValueType

    from engine.gguf.parser import parse_gguf

    parsed = parse_gguf(path)
    table = [(slot.name, tuple(slot.shape), T(slot.ggml_type)) for slot in parsed.tensors]
    metadata = {k: v.python() for k, v in parsed.metadata.items()
                if v.type != GGUFValueType.ARRAY}
    return table, metadata


def base_info(run_dir: Path, base: Path | None = None) -> BaseInfo:
    """The GGUF an export merges into: `base`, else the one the run trained on."""
    if base is None:
        recorded = (RunDir(run_dir).manifest().get("base_model") or {}).get("path")
        base = Path(recorded) if recorded and str(recorded).endswith(".gguf") else None
    if base is None:
        return BaseInfo(None, 0, {})
    if not base.is_file():
        raise ForgebenchError("the base model file is missing", path=base,
                              hint="choose the GGUF file the run was trained on")
    types: dict[str, int] = {}
    quantized = 0
    for _, shape, kind in gguf_tensor_table(base):
        types[kind.name] = types.get(kind.name, 0) + 1
        quantized += kind not in FLOAT_TYPES and len(shape) >= 2
    return BaseInfo(base, quantized, types)


def convert_argv(base: Path, out: Path, dtype: str = "f16") -> list[str]:
    return forgebench_argv() + ["convert", str(base), "--dtype", dtype, "--out", str(out)]


# -- step 3: quantization type and size ----------------------------------------------------
def safetensors_table(path: Path) -> list[tuple[str, tuple[int, ...], T]]:
    """(name, shape, type) of a safetensors file, read from its JSON header alone."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return [(name, tuple(v["shape"]), SAFETENSORS_DTYPES.get(v["dtype"], T.F32))
            for name, v in header.items() if name != "__metadata__"]


def size_estimates(run: ExportableRun, checkpoint: str, base: Path | None = None) -> dict[str, int]:
    """Bytes of tensor data per export type (metadata and tokenizer not counted).

    The engine's own per-tensor quantization plan (llama.cpp's) is applied. For an lm-pretrain
    checkpoint the tensors carry torch names, so the plan's special cases for the embedding and
    output matrices are not applied to them: an estimate, exact for the dense types.
    """
    if run.recipe in GENERATOR_RECIPES:     # the EMA copy of the U-Net is what is exported
        weights = RunDir(run.path).checkpoint(checkpoint).path / "model.safetensors"
        ema = [s for name, s, _ in safetensors_table(weights) if name.startswith("ema.")]
        kinds = {"f32": T.F32, "f16": T.F16}
        return {dtype: sum(tensor_bytes(shape, kinds[dtype]) for shape in ema)
                for dtype in GENERATOR_DTYPES}
    if run.recipe in GGUF_BASE_RECIPES:
        info = base_info(run.path, base)
        table, metadata = _header(info.path)       # one header read for the table and facts
        facts = ModelFacts.from_metadata(metadata)
        sizes = estimated_sizes(table, facts)     # every export type the engine offers
        adapter = RunDir(run.path).checkpoint(checkpoint).path / "adapters.safetensors"
        if adapter.is_file():
            sizes["adapter"] = sum(tensor_bytes(s, T.F32) for _, s, _ in safetensors_table(adapter))
        return sizes
    weights = RunDir(run.path).checkpoint(checkpoint).path / "model.safetensors"
    table = safetensors_table(weights)
    facts = ModelFacts("llama", len({n.split(".")[1] for n, _, _ in table
                                     if n.startswith("layers.")}))
    return estimated_sizes(table, facts)       # torch names: every matrix is "other"


def _gguf_metadata(path: Path) -> dict:
    """The scalar metadata (block count, architecture, ...) the quantization plan reads."""
    return _header(path)[1]


def export_argv(run_dir: Path, checkpoint: str, dtype: str, out: Path,
                base: Path | None = None) -> list[str]:
    if dtype not in DTYPES:
        raise ForgebenchError(f"unknown export type {dtype!r}", where="quantization",
                              hint="one of " + ", ".join(DTYPES))
    argv = forgebench_argv() + ["export", str(run_dir), "--checkpoint", checkpoint,
                                "--dtype", dtype, "--out", str(out)]
    return argv + (["--base", str(base)] if base else [])


# -- step 4: the format: GGUF / adapter, or a merged Hugging Face folder ---------------------
FORMATS = {"gguf": "GGUF or adapter (the type chosen in step 3)",
           "hf": "Hugging Face folder (merged safetensors)"}


def hf_export_refusal(run: ExportableRun, hf_source: Path | None = None) -> str | None:
    """Why the run cannot be exported as a merged Hugging Face folder (None: it can): the
    engine's own refusal (engine.export.hf_export.run_hf_source: the base never came from an
    HF folder and none was chosen, or the chosen folder is no checkpoint)."""
    from engine.export.hf_export import run_hf_source

    if run.recipe not in EXPORTABLE_RECIPES:
        return (f"{run.recipe} runs export as a verified bundle; a Hugging Face folder holds a "
                "language model")
    try:
        run_hf_source(run.path, hf_source)
    except ForgebenchError as exc:
        return exc.render()
    return None


def hf_export_argv(run_dir: Path, checkpoint: str, out: Path, base: Path | None = None,
                   hf_source: Path | None = None) -> list[str]:
    argv = forgebench_argv() + ["export", str(run_dir), "--format", "hf", "--checkpoint",
                                checkpoint, "--out", str(out)]
    return argv + (["--base", str(base)] if base else []) + \
        (["--hf-source", str(hf_source)] if hf_source else [])


def hf_export_written(out: Path) -> list[tuple[str, int]]:
    """(file, bytes) of a finished merged Hugging Face export, for the wizard to list."""
    return sorted((p.name, p.stat().st_size) for p in Path(out).iterdir() if p.is_file())


def hf_notification(out: Path | None, ok: bool, message: str) -> tuple[bool, str]:
    """(ok, text) of a merged HF export job's notification: the folder and its size, or the
    engine's error."""
    if not ok or out is None or not (Path(out) / "config.json").is_file():
        return False, message or "failed: nothing was written"
    written = hf_export_written(out)
    return True, (f"merged Hugging Face folder — {Path(out).name}: {len(written)} files, "
                  f"{sum(size for _, size in written) / 1e6:.1f} MB")


# -- step 3: the quantization picker ---------------------------------------------------------
# what the wizard's Measure button compares: llama.cpp's usual 4- to 8-bit types and PTQTP's two
# ternary planes, names from the one list of export types (engine/export/quant_choices.py), as
# the CLI's `--compare` takes them
PICKER_TYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", PTQTP)


def picker_folder(root: Path, run_dir: Path) -> Path:
    """A new scratch folder for one picker job's picker.json (under exports/, hidden)."""
    import time

    return root / "exports" / f".picker-{run_dir.name}-{time.time_ns()}"


def picker_argv(run_dir: Path, checkpoint: str, out: Path, base: Path | None = None,
                types: tuple[str, ...] = PICKER_TYPES) -> list[str]:
    argv = forgebench_argv() + ["export", str(run_dir), "--checkpoint", checkpoint,
                                "--compare", ",".join(types), "--compare-only",
                                "--out", str(out)]
    return argv + (["--base", str(base)] if base else [])


def finished_bundle(out: Path | None) -> tuple[dict, str] | None:
    """A finished export's report and model card; None when the bundle is not complete (the
    export writes SHA256SUMS last, so a folder without it is a failed or partial export)."""
    if out is None or not (out / "SHA256SUMS").is_file():
        return None
    return read_json(out / "report.json"), (out / "model_card.md").read_text("utf-8")


def read_picker(out: Path) -> dict:
    """The picker job's result; its scratch folder is removed."""
    import shutil

    try:
        return read_json(out / "picker.json")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def kept_text(row: dict) -> str:
    """"keeps 96%" (or "no gain") for the picker column."""
    kept = row.get("gain_kept")
    return "no gain to keep" if kept is None else f"keeps {max(kept, 0.0):.0%}"


def picker_summary(picker: dict) -> str:
    from engine.export.verdict import KEPT_MIN

    best = picker.get("recommended")
    return ((f"Recommended: {best}, the smallest file keeping ≥ {KEPT_MIN:.0%} of the "
             f"fine-tune's gain" if best else
             f"No measured type keeps ≥ {KEPT_MIN:.0%} of the fine-tune's gain: choose f16")
            + f" (measured on the run's {picker.get('split')}; base loss "
            f"{picker['base_loss']:.3f}, fine-tune {picker['fine_tune_loss']:.3f}).")


# -- step 4: verification ------------------------------------------------------------------
@dataclass(frozen=True)
class StageRow:
    name: str
    description: str
    file: str
    top1: float | None
    max_abs: float | None
    mean_abs: float | None
    kl: float | None
    greedy: str
    tokenizer: bool | None
    passed: bool | None          # None: the reference row
    min_top1: float | None       # the engine's bar for this stage
    greedy_matched: int = 0
    greedy_total: int = 0
    identical: bool | None = None   # generator bundles: outputs bit for bit the checkpoint's
    psnr: float | None = None
    weights: str = ""

    @property
    def exact(self) -> bool:
        """Nothing the user could notice changed: every top-1 token and greedy answer (for a
        generator: every output value)."""
        if self.identical is not None:
            return self.identical
        return self.top1 == 1.0 and self.greedy_matched == self.greedy_total and \
            self.tokenizer is not False

    @property
    def verdict(self) -> str:
        """reference; FAIL below the engine's bar; "match" when nothing changed; "changed"
        when the stage passes the bar but quantization changed tokens or answers (amber: the
        loss is real and shown, not hidden behind a green pass)."""
        if self.passed is None:
            return "reference"
        if not self.passed:
            return "FAIL"
        return "match" if self.exact else "changed"


def _row(stage: dict) -> StageRow:
    if "vs_checkpoint" not in stage:
        return StageRow(stage["name"], stage.get("description", ""), stage.get("file") or "",
                        None, None, None, None, "", None, None, None)
    m, g = stage["vs_checkpoint"], stage["greedy_vs_checkpoint"]
    matched, total = sum(g["matches"]), len(g["matches"])
    return StageRow(stage["name"], stage.get("description", ""), stage.get("file") or "",
                    m["top1_agreement"], m["max_abs_logit_diff"], m["mean_abs_logit_diff"],
                    m["kl_mean"], f"{matched}/{total}", bool(stage["tokenizer_matches"]),
                    stage["passed"], stage["min_top1"], matched, total)


def _generator_row(stage: dict) -> StageRow:
    if "identical" not in stage:
        return StageRow(stage["name"], stage.get("description", ""), "", None, None, None,
                        None, "", None, None, None)
    return StageRow(stage["name"], stage.get("description", ""), stage.get("file") or "",
                    None, stage["max_abs_diff"], stage["mean_abs_diff"], None, "", None,
                    stage["passed"], None, identical=stage["identical"],
                    psnr=stage["psnr_db"],
                    weights="identical" if stage["weights_identical"] else "rounded")


def _number(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def cells(row: StageRow, kind: str) -> tuple[str, ...]:
    """A row's table cells under the columns of its report kind."""
    if kind == "generator":
        psnr = "" if row.passed is None else "∞ (identical)" if row.psnr is None \
            else f"{row.psnr:.1f} dB"
        return (row.name, row.verdict, row.weights, _number(row.max_abs, ".4g"),
                _number(row.mean_abs, ".3g"), psnr, row.file)
    bar = f" (≥ {row.min_top1:.0%})" if row.min_top1 is not None else ""
    return (row.name, row.verdict + bar, _number(row.top1, ".2%"), _number(row.max_abs, ".4g"),
            _number(row.mean_abs, ".3g"), _number(row.kl, ".3g"), row.greedy,
            "" if row.tokenizer is None else ("same" if row.tokenizer else "DIFFERS"), row.file)


def verification(report: dict) -> dict:
    """Rows per stage with the engine's verdicts, the llama.cpp row and its answers when it
    ran; for a generator bundle, the bundle's row and its reference outputs."""
    if report.get("kind") == "generator":
        rows = [_generator_row(stage) for stage in report["stages"]]
        return {"kind": "generator", "columns": GENERATOR_COLUMNS, "rows": rows,
                "passed": bool(report["passed"]), "bar": report["bar"],
                "changed": [r.name for r in rows if r.verdict == "changed"], "numerics": None,
                "references": [f for f in report["export"]["files"]
                               if f.startswith("reference/")],
                "llamacpp": {"available": False, "reason": "not a language model",
                             "answers": []},
                "verdict": of_report(report), "questions": [], "side_by_side": [],
                "picker": None}
    rows = [_row(stage) for stage in report["stages"]]
    cpp = report.get("llamacpp", {})
    q2 = report.get("question2") or {}
    answers = []
    if cpp.get("available"):
        rows.append(_row({"name": "llama.cpp", **cpp}))
        answers = [(p["prompt"], p.get("answer"), a)
                   for p, a in zip(report["prompt_suite"], cpp.get("answers", []))]
    return {"kind": "llm", "columns": LLM_COLUMNS, "rows": rows,
            "passed": bool(report["passed"]),
            "changed": [r.name for r in rows if r.verdict == "changed"],
            # which llama.cpp kernels the engine matched on the machine that wrote the report
            "numerics": report.get("numerics"),
            "llamacpp": {"available": bool(cpp.get("available")), "reason": cpp.get("reason"),
                         "note": cpp.get("note"), "answers": answers},
            "verdict": of_report(report), "questions": question_lines(report),
            "side_by_side": q2.get("answers", []) if q2.get("available") else [],
            "picker": report.get("picker")}


def question_lines(report: dict) -> list[str]:
    """The report's two questions as text lines (the report's own rendering)."""
    if "question1" not in report:
        return []
    from engine.export.equivalence import render_questions

    return render_questions(report)


# -- step 5: the bundle --------------------------------------------------------------------
def rights_checklist(run_dir: Path) -> list[dict]:
    """One line per right the data card states (or leaves unstated), for the user to confirm."""
    dataset = (RunDir(run_dir).manifest().get("data") or {}).get("dataset")
    card = {}
    if dataset and (Path(dataset) / "card.json").is_file():
        card = read_json(Path(dataset) / "card.json")
    elif dataset and (Path(dataset) / "dataset.json").is_file():
        manifest = read_json(Path(dataset) / "dataset.json")
        rights = manifest.get("rights")
        card = {"rights": rights if isinstance(rights, dict) else {"basis": rights}}
    rights = card.get("rights") or {}
    items = []
    for key, label in RIGHTS_LABELS.items():
        stated = card.get("consent") if key == "consent" else rights.get(key)
        stated = "not stated" if stated in (None, "") else stated
        items.append({"key": key, "label": label, "stated": str(stated),
                      "confirmed": stated is True or str(stated).lower() in ("yes", "true")})
    if rights.get("basis"):
        items.append({"key": "basis", "label": "basis of these rights",
                      "stated": str(rights["basis"]), "confirmed": False})
    return items


def finish_bundle(out: Path, model_card: str, checklist: list[dict]) -> None:
    """Save the edited model card with the confirmed rights, and re-sum the bundle."""
    if not (out / "SHA256SUMS").is_file():
        raise ForgebenchError("not an export bundle (no SHA256SUMS)", path=out,
                              hint="run the export step first")
    lines = [model_card.rstrip(), "", "## Rights (from the data card, confirmed at export)", ""]
    lines += [f"- [{'x' if c['confirmed'] else ' '}] {c['label']}: {c['stated']}"
              for c in checklist]
    atomic_write_text(out / "model_card.md", "\n".join(lines) + "\n")
    write_sha256sums(out)


def notification(out: Path | None, ok: bool, message: str) -> tuple[bool, str]:
    """(ok, text) of the export job's desktop notification: the bundle's verdict
    (engine.export.verdict.notification); a defect is a failure."""
    from engine.export.verdict import notification as verdict_notification

    if out is None:
        return ok, message
    return verdict_notification(out, ok, message)
