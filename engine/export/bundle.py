"""`forgebench export RUN_DIR --checkpoint ... --dtype ... --out DIR`: a run's model as a bundle.

    DIR/model.gguf            the model (lm-pretrain: written as llama GGUF; LoRA: merged into a
                              dense base; full fine-tuning: the trained weights written into the
                              base's layout; then converted/quantized) — or, for --dtype adapter,
    DIR/adapter.gguf          the GGUF LoRA adapter llama.cpp loads with --lora, and
    DIR/peft/                 adapter_model.safetensors + adapter_config.json (known HF bases)
    DIR/model_card.md         base identity and SHA-256, data card, training config, evaluation,
                              equivalence summary, limitations
    DIR/report.json, .txt     the staged equivalence report (engine.export.equivalence)
    DIR/SHA256SUMS            `sha256sum -c` format, every other file

An image-generate or audio-generate run exports as a generator bundle instead (its EMA U-Net as
safetensors, model.json, fixed-seed reference outputs and a verification report: see
engine/export/generator_bundle.py), with the same card, checksums and staging.

The card names files and runs, never a local absolute path: a bundle is meant to be shared.

Everything is written into a hidden staging folder beside DIR and renamed to DIR at the end;
intermediate files (the f32 model before quantization, the merged model before conversion) live
in a scratch folder that is always removed. Any failure, a full disk included, leaves no DIR.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.errors import ForgebenchError
from engine.export.generator_bundle import GENERATOR_RECIPES, export_generator
from engine.export.quant_choices import CHOICES, QUANTIZED, write_export_file
from engine.fsutil import atomic_write_json, atomic_write_text, read_json, sha256_file, staged_dir
from engine.gguf import quant_policy
from engine.recipe_registry import recipes_with
from engine.rundir import Checkpoint, RunDir

DTYPES = tuple(CHOICES) + ("adapter",)     # engine/export/quant_choices.py, and the adapter
# recipes whose runs fine-tune a GGUF base (adapters beside it, or its full weights)
GGUF_BASE_RECIPES = recipes_with("gguf-base")
EXPORTABLE_RECIPES = recipes_with(export="gguf")
MODEL_GGUF = "model.gguf"
ADAPTER_GGUF = "adapter.gguf"
PEFT_DIR = "peft"


@dataclass
class Bundle:
    """What an export produced, for the model card, the report and the CLI summary."""
    run: RunDir
    checkpoint: Checkpoint
    recipe: str
    dtype: str
    files: list[str] = field(default_factory=list)     # relative to the bundle
    base: dict | None = None                            # path, sha256, how it was used
    stages: list = field(default_factory=list)          # engine.export.equivalence.Stage
    llamacpp: object = None                             # Stage or None
    notes: list[str] = field(default_factory=list)
    report: dict | None = None
    chat_template: object = None                        # engine.llm.chat.ChatTemplate (lm-sft)
    threads: int = 1                                    # for quantizing and the report
    reference: Path | None = None     # the unquantized file model.gguf was converted from
    fine_tune: dict | None = None     # worker load spec of the unquantized fine-tune
    base_spec: dict | None = None     # worker load spec of the base it was fine-tuned from
    name: str = ""                    # the fine-tune's name: general.name, the card's title
    # called with the exported file's path once the merged fine-tune is on disk, before the
    # conversion writes that file (the report starts question 2's worker there)
    on_merged: Callable[[Path], None] | None = None
    question2: object = None          # _Question2 while its worker runs

    @property
    def verdict(self):
        """The one verdict of this export (engine.export.verdict)."""
        from engine.export.verdict import of_report

        return of_report(self.report)


def _is_quantized(dtype: str) -> bool:
    return CHOICES[dtype].quantized


_OPENED: dict | None = None       # (kind, file) -> GGUFFile or hash while an export runs


@contextlib.contextmanager
def _parsed_once():
    """Within it, _open_gguf parses each file once: the base and the exported file are each
    read by several steps (type, template, tensors, tokenizer), and every parse turns the
    262k-token vocabulary into Python values again (and _sha256 hashes each file once).
    Dropped at the end, so no file stays mapped after the export."""
    global _OPENED
    outer, _OPENED = _OPENED, {}
    try:
        yield
    finally:
        _OPENED = outer


def _once(kind: str, path: Path, read: Callable[[Path], object]):
    """read(path), once per file (and its size and mtime) in _parsed_once."""
    if _OPENED is None:
        return read(path)
    stat = os.stat(path)
    key = (kind, str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _OPENED:
        _OPENED[key] = read(path)
    return _OPENED[key]


def _open_gguf(path: Path):
    """engine.gguf.reader.open_gguf, once per file in _parsed_once."""
    from engine.gguf.reader import open_gguf

    return _once("gguf", path, open_gguf)


def _sha256(path: Path) -> str:
    """sha256_file, once per file in _parsed_once: the report's hash of the exported file is
    the one its SHA256SUMS line carries."""
    return _once("sha256", path, sha256_file)


def _file_dtype(path: Path) -> str | None:
    """The forgebench dtype name of a dense GGUF's general.file_type (None if not dense)."""
    value = _open_gguf(path).get("general.file_type")
    names = {int(v): k for k, v in quant_policy.FILE_TYPES.items()}
    return names.get(int(value)) if value is not None else None


class _Progress:
    """One tqdm bar per file written, fed by the writers' per-tensor callback."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    @contextlib.contextmanager
    def tensors(self, desc: str):
        if not self.enabled:
            yield None
            return
        from tqdm import tqdm

        with tqdm(desc=desc, unit="tensor", leave=False) as bar:
            def update(tensor, done: int, total: int) -> None:
                bar.total = total
                bar.set_postfix_str(tensor.name, refresh=False)
                bar.update(1)
            yield update

    def say(self, message: str) -> None:
        if self.enabled:
            from tqdm import tqdm
            tqdm.write(message)


def _holds_quantized(path: Path) -> bool:
    return any(t.ggml_type not in quant_policy.FLOAT_TYPES
               for t in _open_gguf(path).tensors.values())


def _gguf_stage(name: str, description: str, path: Path, bundle_dir: Path, lora=None,
                requantized: bool = False):
    """An engine stage; `requantized` when its weights were quantized after training, so it
    is held to the quantized bar rather than the dense one and run under llama.cpp numerics
    (the native kernels on the packed bytes: what llama.cpp computes on the file)."""
    from engine.export.equivalence import MIN_TOP1_DENSE, MIN_TOP1_QUANTIZED, Stage

    model = _native_spec(path) if requantized else {"kind": "gguf", "path": str(path),
                                                    "numerics": "f32"}
    if lora:
        model["lora"] = str(lora)
    shown = path.name if path.parent == bundle_dir else f"(intermediate) {path.name}"
    return Stage(name, description, model, shown,
                 MIN_TOP1_QUANTIZED if requantized else MIN_TOP1_DENSE)


def _native_spec(path: Path) -> dict:
    return {"kind": "gguf", "path": str(path), "numerics": "llamacpp"}


def _llamacpp_stage(path: Path, description: str, lora: Path | None = None,
                    lora_name: str | None = None):
    """llama.cpp on a file with quantized weights quantizes activations too: the quantized bar.
    None for a file stock llama.cpp does not load (a weight in several planes: PTQTP's)."""
    from engine.export.equivalence import MIN_TOP1_DENSE, MIN_TOP1_QUANTIZED, Stage
    from engine.gguf.layouts import plane_suffixes

    if any(name.endswith(plane_suffixes()) for name in _open_gguf(path).tensors):
        return None

    model = {"kind": "llamacpp", "path": str(path)}
    if lora:
        model["lora"] = str(lora)
    return Stage("llama.cpp", description, model, lora_name or path.name,
                 MIN_TOP1_QUANTIZED if _holds_quantized(path) else MIN_TOP1_DENSE)


# ----------------------------------------------------------------------- per recipe

def _export_pretrain(bundle: Bundle, staging: Path, scratch: Path, progress: _Progress) -> None:
    from engine.export.from_pretrain import write_pretrain_gguf

    if bundle.dtype == "adapter":
        raise ForgebenchError("an lm-pretrain run has no adapter to export", where="--dtype",
                              hint="choose f32, f16, bf16 or a quantized type")
    final = staging / MODEL_GGUF
    quantized = _is_quantized(bundle.dtype)
    dense = scratch / "model-f32.gguf" if quantized else final
    with progress.tensors(f"write {dense.name}") as update:
        write_pretrain_gguf(bundle.run, bundle.checkpoint, dense,
                            "f32" if quantized else bundle.dtype, progress=update)
    bundle.stages.append(_gguf_stage("dense", "the model written as llama GGUF "
                                     f"({'f32' if quantized else bundle.dtype})", dense, staging))
    if quantized:
        with progress.tensors(f"quantize → {bundle.dtype}") as update:
            write_export_file(dense, final, bundle.dtype, progress=update,
                              threads=bundle.threads)
        bundle.stages.append(_gguf_stage("quantized", f"quantized to {bundle.dtype}, under "
                                         "llama.cpp numerics", final, staging, requantized=True))
    bundle.files.append(MODEL_GGUF)
    bundle.llamacpp = _llamacpp_stage(final, "the exported model.gguf in llama.cpp")
    if quantized:
        bundle.reference = dense


def _sft_base(bundle: Bundle, base_arg: str | None, scratch: Path,
              progress: _Progress) -> tuple[Path, str]:
    """The GGUF to merge into (or to describe an adapter against), and how it was chosen."""
    from engine.export.from_pretrain import write_pretrain_gguf

    manifest = bundle.run.manifest()
    if base_arg:
        return Path(base_arg).resolve(), "--base"
    base_path = Path(manifest["base_model"]["path"])
    if base_path.suffix == ".gguf":
        return base_path, "the run's base model"
    # an lm-sft run over an lm-pretrain run: its base is that run's checkpoint weights
    base_run, base_ckpt = RunDir(base_path.parents[2]), base_path.parent.name
    out = scratch / "base-f32.gguf"
    from engine.train.lm_base import PLAIN_TEMPLATE

    with progress.tensors("write base (lm-pretrain) as GGUF") as update:
        write_pretrain_gguf(base_run, base_run.checkpoint(base_ckpt), out, "f32",
                            progress=update, chat_template=PLAIN_TEMPLATE)
    return out, f"the lm-pretrain base {base_run.path.name}/{base_ckpt}, written as GGUF"


def _export_sft(bundle: Bundle, staging: Path, scratch: Path, base_arg: str | None,
                progress: _Progress) -> None:
    from engine.lora import ADAPTERS_FILE

    adapter = bundle.checkpoint.path / ADAPTERS_FILE
    full = not adapter.is_file()
    if full and bundle.dtype == "adapter":
        raise ForgebenchError("this checkpoint holds full fine-tuned weights, not an adapter",
                              path=bundle.checkpoint.path, where="--dtype",
                              hint="export it as a model: --dtype f16, q8_0, q4_k_m, ...")
    base, how = _sft_base(bundle, base_arg, scratch, progress)
    bundle.base = {"path": str(base), "sha256": None, "chosen": how}
    # the base's hash (for the card) on a thread of its own while the merge reads the base
    hashing = _in_background(_sha256, base) if base.is_file() else None
    # The layout the run trained with (lm_base.load_base: the base's own template, else its
    # family's built-in one) goes into every export, so llama.cpp prompts the model as trained.
    # (None when the base has neither: lm-sft could not have trained on it, and the checks
    # below say what is wrong with it.)
    from engine.llm.chat import ChatTemplate

    try:
        bundle.chat_template = ChatTemplate.from_gguf(_open_gguf(base) if base.is_file()
                                                      else base)
    except ForgebenchError:
        bundle.chat_template = None
    if bundle.dtype == "adapter":
        _export_adapter(bundle, staging, base, adapter)
    else:
        _export_merged(bundle, staging, scratch, base, None if full else adapter, progress)
    if hashing is not None:
        bundle.base["sha256"] = hashing.result()


def _in_background(function: Callable, *args, name: str = "forgebench-export"):
    """function(*args) on a thread of its own (named `name`), started now: its future."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    future = pool.submit(function, *args)
    pool.shutdown(wait=False)             # the thread ends with the call
    return future


def _export_adapter(bundle: Bundle, staging: Path, base: Path, adapter: Path) -> None:
    """adapter.gguf for llama.cpp (and a PEFT folder for a known HF architecture), checked
    against the exact base file it was trained on."""
    from engine.export.lora_export import HF_ARCHITECTURES, write_gguf_lora, write_peft
    from engine.export.merge import check_base, load_adapter
    from engine.gguf.reader import open_gguf
    from engine.gguf.writer import read_gguf_content

    matched = check_base(read_gguf_content(base), load_adapter(adapter))
    if matched != "file":
        raise ForgebenchError(
            "an adapter is exported against the exact GGUF file it was trained on; this "
            f"base is only related to it ({matched} that file)", path=base, where="--base",
            hint="export the adapter of a GGUF-based run without --base, or merge it into "
                 "this base with a model --dtype (f16, q4_k_m, ...)")
    write_gguf_lora(adapter, base, staging / ADAPTER_GGUF)
    bundle.files.append(ADAPTER_GGUF)
    arch = open_gguf(base).architecture
    if arch in HF_ARCHITECTURES:
        for path in write_peft(adapter, base, staging / PEFT_DIR):
            bundle.files.append(f"{PEFT_DIR}/{path.name}")
        if bundle.chat_template is not None:
            atomic_write_json(staging / PEFT_DIR / "tokenizer_config.json", {
                "chat_template": bundle.chat_template.source,
                "bos_token": bundle.chat_template.bos_token,
                "eos_token": bundle.chat_template.eos_token})
            bundle.files.append(f"{PEFT_DIR}/tokenizer_config.json")
    else:
        bundle.notes.append(f"no PEFT adapter: {arch!r} is not a known HF architecture")
    bundle.stages.append(_gguf_stage("adapter", "base + adapter reloaded in the engine",
                                     base, staging, lora=adapter))
    bundle.llamacpp = _llamacpp_stage(base, "the base with adapter.gguf in llama.cpp",
                                      lora=staging / ADAPTER_GGUF,
                                      lora_name=f"{base.name} + {ADAPTER_GGUF}")


def _export_merged(bundle: Bundle, staging: Path, scratch: Path, base: Path,
                   adapter: Path | None, progress: _Progress) -> None:
    """model.gguf: the full fine-tuned weights (adapter None) or the adapters merged into the
    base, then converted or quantized to the export's type."""
    from engine.export.merge import merge_into_gguf, write_full_weights
    from engine.train.checkpoint import MODEL_FILE

    template = bundle.chat_template.source if bundle.chat_template else None
    final = staging / MODEL_GGUF
    same_type = _file_dtype(base) == bundle.dtype
    merged = final if same_type else scratch / f"merged{base.suffix}"
    if adapter is None:
        with progress.tensors("write full weights") as update:
            result = write_full_weights(base, bundle.checkpoint.path / MODEL_FILE, merged,
                                        bundle.run.manifest()["base_model"]["sha256"],
                                        progress=update, chat_template=template,
                                        name=bundle.name)
        bundle.stages.append(_gguf_stage(
            "full weights", f"the fine-tuned weights written into the base's layout "
            f"({len(result.merged)} tensors, stored as the base stores them)", merged, staging))
    else:
        with progress.tensors("merge adapters") as update:
            result = merge_into_gguf(base, adapter, merged, progress=update,
                                     chat_template=template, name=bundle.name)
        bundle.stages.append(_gguf_stage("merged", f"adapters merged into the dense base "
                                         f"({len(result.merged)} matrices)", merged, staging))
    bundle.base["matched_by"] = result.base_match
    bundle.fine_tune = {"kind": "gguf", "path": str(merged), "numerics": "f32"}
    bundle.base_spec = {"kind": "gguf", "path": str(base), "numerics": "f32"}
    if bundle.on_merged is not None:
        bundle.on_merged(final)
    if not same_type:
        with progress.tensors(f"convert → {bundle.dtype}") as update:
            write_export_file(merged, final, bundle.dtype, progress=update,
                              allow_dequantized=True, threads=bundle.threads)
        kind = "quantized" if _is_quantized(bundle.dtype) else "converted"
        bundle.stages.append(_gguf_stage(
            kind, f"{kind} to {bundle.dtype}" + (", under llama.cpp numerics"
                                                 if kind == "quantized" else ""),
            final, staging, requantized=kind == "quantized"))
    if result.base_match == "dequantized from":
        bundle.notes.append("the base is a dense copy dequantized from a quantized file: the "
                            "first quantization's rounding stays in every merged weight")
    bundle.files.append(MODEL_GGUF)
    bundle.llamacpp = _llamacpp_stage(final, "the exported model.gguf in llama.cpp")
    bundle.reference = None if same_type else merged


# ----------------------------------------------------------------------- the card and sums

def _evaluations(run: RunDir, checkpoint: Checkpoint) -> list[dict]:
    found = []
    if run.evals_dir.is_dir():
        for path in sorted(run.evals_dir.glob(f"*-{checkpoint.name}.json")):
            found.append(read_json(path))
    val = [m for m in run.metrics() if m.get("split") == "val"
           and m.get("step") == checkpoint.step]
    return found + val[-1:]


def _data_card(config: dict) -> str:
    data = config.get("data", {})
    folder = data.get("dir") or data.get("path")
    if not folder:
        return "no dataset recorded"
    root = Path(config.get("base_dir") or ".") / folder
    if not root.is_dir():
        return f"`{root.name}` (a single file, no dataset card)"
    if (root / "card.md").is_file():
        return f"`{root.name}/card.md` (in the dataset)"
    return f"dataset `{root.name}` (no card.md; write one with `forgebench data card`)"


def _shareable(value):
    """A config with local absolute paths reduced to their last part (a card is shared)."""
    if isinstance(value, dict):
        return {k: _shareable(v) for k, v in value.items() if k != "base_dir"}
    if isinstance(value, list):
        return [_shareable(v) for v in value]
    if isinstance(value, str) and (value.startswith("/") or value.startswith("~")):
        return Path(value).name
    return value


def model_card(bundle: Bundle) -> str:
    manifest = bundle.run.manifest()
    config = manifest["config"]
    verdict = bundle.verdict
    lines = [f"# {bundle.name or bundle.run.path.name} — {bundle.checkpoint.name} "
             f"({bundle.dtype})", "",
             f"Exported by `forgebench export` from run `{bundle.run.path.name}` "
             f"(recipe `{bundle.recipe}`, step {bundle.checkpoint.step}).", "",
             f"**Verdict — {verdict.line}**", "",
             "## Files", ""]
    lines += [f"- `{name}`" for name in bundle.files + ["report.json", "report.txt"]]
    lines += _run_section(bundle, verdict)
    lines += _base_section(bundle, manifest)
    lines += ["", "## Data", "", f"- data card: {_data_card(config)}"]
    for name, digest in sorted(manifest.get("data", {}).get("files", {}).items()):
        lines.append(f"- `{name}` SHA-256 `{digest}`")
    lines += ["", "## Training config", "", "```json",
              json.dumps(_shareable(config), indent=2, sort_keys=True), "```", "",
              "## Evaluation", ""]
    evals = _evaluations(bundle.run, bundle.checkpoint)
    lines += [f"- {json.dumps(e, sort_keys=True)}" for e in evals] or \
        ["- no evaluation recorded for this checkpoint (run `forgebench eval`)"]
    lines += ["", "## Equivalence", ""] + _equivalence_lines(bundle.report)
    lines += ["", "## Limitations", ""] + [f"- {text}" for text in _limitations(bundle)]
    return "\n".join(lines) + "\n"


def _base_section(bundle: Bundle, manifest: dict) -> list[str]:
    """The base the run trained on, the base the export was made against, the prompt format."""
    lines = ["", "## Base model", ""]
    base = manifest.get("base_model")
    if base:
        lines.append(f"- trained on: `{Path(base['path']).name}`  \n  "
                     f"SHA-256 `{base['sha256']}`")
    else:
        lines.append("- trained from random initialisation (no base model)")
    if bundle.base:
        lines.append(f"- merged into / exported against: `{Path(bundle.base['path']).name}` "
                     f"({bundle.base['chosen']})  \n  SHA-256 `{bundle.base['sha256']}`"
                     + (f", recognised as the adapter's base by: {bundle.base['matched_by']}"
                        if bundle.base.get("matched_by") else ""))
    if bundle.chat_template is not None:
        example = bundle.chat_template.render([{"role": "user", "content": "Hello!"}])
        lines += ["", "## Prompt format", "",
                  f"Fine-tuned with this chat layout ({bundle.chat_template.origin}); it is "
                  "written into the export (`tokenizer.chat_template`), so llama.cpp prompts "
                  "the model as it was trained. One user turn renders as:", "", "```text",
                  example, "```"]
    return lines


def _equivalence_lines(report: dict | None) -> list[str]:
    """The report's questions and stages as the card's Equivalence section."""
    lines: list[str] = []
    if report is not None and "question1" in report:
        from engine.export.equivalence import render_questions

        lines += ["```text", *render_questions(report), "```", ""]
    if report is None:
        lines.append("- not computed (--no-report)")
    elif report.get("kind") == "generator":
        stage = report["stages"][1]
        lines.append(f"- {'VERIFIED' if report['passed'] else 'NOT verified'} "
                     f"(needs {report['bar']}): the bundle, loaded from its own files, "
                     f"drew one fixed-seed sample per class; max |Δ| from the checkpoint's "
                     f"{stage['max_abs_diff']:.4g}, mean |Δ| {stage['mean_abs_diff']:.4g}")
        lines.append("- listen to / look at `reference/`; details: `report.txt`, "
                     "`report.json`")
    else:
        lines += _llm_equivalence_lines(report)
    return lines


def _llm_equivalence_lines(report: dict) -> list[str]:
    lines = []
    for stage in report["stages"][1:]:
        m = stage["vs_checkpoint"]
        lines.append(f"- {stage['name']}: top-1 agreement {m['top1_agreement']:.2%} with the "
                     f"checkpoint, max |Δlogit| {m['max_abs_logit_diff']:.4g}, "
                     f"KL {m['kl_mean']:.3g}")
    cpp = report["llamacpp"]
    if cpp.get("available"):
        g = cpp["greedy_vs_checkpoint"]
        agreement = cpp["vs_checkpoint"]["top1_agreement"]
        lines.append(f"- llama.cpp: top-1 agreement {agreement:.2%}"
                     f" with the checkpoint; greedy answers identical for "
                     f"{sum(g['matches'])}/{len(g['matches'])} prompts"
                     + (f" ({cpp['note']})" if cpp.get("note") else ""))
    else:
        lines.append(f"- llama.cpp: not run ({cpp.get('reason')})")
    lines.append("- details: `report.txt`, `report.json`")
    return lines


def _limitations(bundle: Bundle) -> list[str]:
    limitations = list(bundle.notes)
    if bundle.dtype not in ("f32", "adapter"):
        limitations.append(f"{bundle.dtype} rounds the weights; the report shows how far the "
                           "answers move")
    if bundle.recipe == "lm-pretrain":
        limitations.append("a tiny model trained from scratch on one corpus: it continues text "
                           "in the corpus's style and knows nothing else")
    if bundle.recipe in GENERATOR_RECIPES:
        limitations.append("a tiny class-conditional generator trained from scratch: it makes "
                           "things like its training examples of the listed classes only; "
                           "the Samples pane shows each output's nearest training example")
    limitations.append("evaluated only on the data and prompts above; check it on your own "
                       "inputs before relying on it")
    return limitations


NO_REPACK_REASON = ("llama.cpp built for this CPU (pip's -march=native build) has ggml's AMX "
                    "kernels, and its AMX matmul crashes on any batch of more than one token "
                    "(llama.cpp issue #20824); --no-repack turns off the extra buffer types "
                    "(repacked and AMX weights), so llama.cpp runs its plain CPU kernels, the "
                    "configuration this export was checked in")


def needs_no_repack() -> tuple[bool, str | None]:
    """Whether llama.cpp on this CPU must run with --no-repack, and why: where the installed
    llama-cpp-python has ggml's AMX kernels (engine.export.llamacpp.amx_build: open_llama then
    opens files as --no-repack does, and the report's note is AMX_NOTE); without one, a CPU with
    AMX-INT8 and AVX512-VNNI is where pip's -march=native build has them."""
    from engine.export.llamacpp import amx_build

    try:
        amx = amx_build()
    except ImportError:
        from engine.kernels.cpu import plan

        amx = {"amx_int8", "avx512_vnni"} <= plan().features
    return amx, (NO_REPACK_REASON if amx else None)


def _run_section(bundle: Bundle, verdict) -> list[str]:
    """How to run the export with llama.cpp (nothing to run for a defect)."""
    from engine.export.verdict import run_command

    model = next((f for f in bundle.files if f.endswith(".gguf")), None)
    if bundle.recipe in GENERATOR_RECIPES or model is None:
        return []
    if not verdict.usable:
        return ["", "## Run it", "", "Do not: the file failed question 1 (see the verdict); it "
                "is kept only for diagnosis."]
    no_repack, note = needs_no_repack()
    if model == ADAPTER_GGUF:
        base = Path(bundle.base["path"]).name if bundle.base else "BASE.gguf"
        flag = " --no-repack" if no_repack else ""
        commands = [f"llama-cli -m {base} --lora {ADAPTER_GGUF}{flag} -cnv"]
    else:
        commands = run_command(model, no_repack)
    text = ["", "## Run it", "", "With llama.cpp (`llama-cli` to chat, `llama-server` for an "
            "OpenAI-compatible endpoint):", "", "```sh", *commands, "```"]
    if no_repack:
        text += ["", "`--no-repack` is needed on this machine's CPU (AMX): " + note + "."]
    return text


def write_sha256sums(folder: Path) -> Path:
    """`<sha256>  <relative path>` for every file, sorted (what `sha256sum -c` reads)."""
    rows = [f"{_sha256(p)}  {p.relative_to(folder).as_posix()}"
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "SHA256SUMS"]
    atomic_write_text(folder / "SHA256SUMS", "\n".join(rows) + "\n")
    return folder / "SHA256SUMS"


# ----------------------------------------------------------------------- the whole export

def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, *, checkpoint: str = "latest",
               dtype: str = "f16", base: str | None = None, report: bool = True,
               threads: int | None = None, show_progress: bool = False,
               compare: list[str] | None = None) -> Bundle:
    """Export a run's checkpoint as a bundle folder at `out` (which must not exist).

    `compare`: quantization types the picker measures beside `dtype` (question 2 per type, on
    the same merged model and base pass); the report's `picker` holds the rows and the
    recommendation. A file that fails question 1 is kept as `model.gguf.defective`
    (engine.export.verdict.DEFECT_SUFFIX): no runtime or file picker takes it for a model."""
    dtype = dtype.lower()
    if dtype not in DTYPES:
        raise ForgebenchError(f"unknown --dtype {dtype!r}", where="--dtype",
                              hint="one of " + ", ".join(DTYPES))
    compare = _compare_types(compare or [], dtype)
    out = Path(out).resolve()
    if out.exists():
        raise ForgebenchError("the output folder already exists; an export never writes over "
                              "another", path=out, where="--out",
                              hint="choose a new --out or delete the old export")
    run = RunDir(run_dir).require()
    recipe = run.manifest()["recipe"]
    if recipe not in EXPORTABLE_RECIPES + GENERATOR_RECIPES:
        raise ForgebenchError(f"recipe '{recipe}' has no export", path=run.path,
                              hint="export works for "
                              + ", ".join(EXPORTABLE_RECIPES + GENERATOR_RECIPES) + " runs")
    if run.is_active():
        raise ForgebenchError("the run is still training", path=run.path,
                              hint="wait for it, or stop it: forgebench stop RUN_DIR")
    threads = threads or run.manifest().get("environment", {}).get("threads") or 1
    bundle = Bundle(run, run.checkpoint(checkpoint), recipe, dtype, threads=threads,
                    name=out.name)
    progress = _Progress(show_progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f".{out.name}.scratch-{os.getpid()}"
    scratch.mkdir()
    try:
        with staged_dir(out) as staging, _parsed_once():
            _fill_bundle(bundle, staging, scratch, base, report, threads, progress, compare)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ForgebenchError("the disk filled up during the export; nothing was written",
                                  path=out, hint="free some space and export again") from exc
        raise
    finally:
        # a question-2 worker still held at its gate (the export failed before its files were
        # written) is stopped, and waited for, before its files go
        held = bundle.question2
        if held is not None and held.gate is not None and held.gate.opened is None:
            held.gate.cancel()
            with contextlib.suppress(Exception):
                held.future.result()
        shutil.rmtree(scratch, ignore_errors=True)
    from engine.export.verdict import record_in_run

    record_in_run(run.path, out, dtype, bundle.verdict,
                  (bundle.report or {}).get("export", {}).get("sha256"))
    return bundle


def _compare_types(types: list[str], dtype: str) -> list[str]:
    """The picker's types, checked: quantized file types only, each once."""
    wanted = []
    for name in (t.strip().lower() for t in types):
        if not name:
            continue
        if name not in QUANTIZED:
            raise ForgebenchError(f"--compare takes quantized file types, not {name!r}",
                                  where="--compare",
                                  hint="e.g. --compare q4_k_m,q5_k_m,q6_k,q8_0 (one of "
                                  + ", ".join(QUANTIZED) + ")")
        if name not in wanted:
            wanted.append(name)
    if wanted and dtype == "adapter":
        raise ForgebenchError("--compare measures model exports; an adapter is not quantized",
                              where="--compare", hint="export with --dtype q4_k_m (or another "
                              "model type) to compare types")
    return wanted


def _fill_bundle(bundle: Bundle, staging: Path, scratch: Path, base: str | None, report: bool,
                 threads: int, progress: _Progress, compare: list[str] | None = None) -> None:
    """Everything of the bundle into `staging`: model or adapter, report, card, checksums."""
    from engine.export.equivalence import PROMPT_SUITE, build_report, render_text, stopwatch

    run, recipe, dtype = bundle.run, bundle.recipe, bundle.dtype
    elapsed = stopwatch()
    if recipe in GENERATOR_RECIPES:
        bundle.report = export_generator(run, bundle.checkpoint, dtype, staging, progress)
        bundle.files = bundle.report["export"]["files"]
        bundle.report["verdict"] = bundle.verdict.as_dict()
        _finish_bundle(bundle, staging)
        return
    if report and dtype in CHOICES and CHOICES[dtype].llamacpp:
        # question 2's worker starts as soon as the merged fine-tune is written: it scores the
        # base and the fine-tune while the exported file is converted (one core's work, the
        # other idle), then waits for that file (_open_question2)
        bundle.on_merged = lambda exported: _start_question2(bundle, exported, scratch,
                                                             compare or [], progress)
    if recipe == "lm-pretrain":
        _export_pretrain(bundle, staging, scratch, progress)
    else:   # lm-sft, lm-dpo and lm-es: the same adapters file, or full weights in the base's layout
        _export_sft(bundle, staging, scratch, base, progress)
    if report:
        written, elapsed = elapsed(), stopwatch()
        # question 2's worker runs beside the staged report's workers
        question2 = _open_question2(bundle, scratch, compare or [], progress)
        weights = _start_weights_check(bundle)
        held = run.manifest()["config"].get("sample", {}).get("prompts", [])
        # the draft the stages follow (equivalence.follow_guesses): the exported model file
        cpp = bundle.llamacpp
        draft = _native_spec(Path(cpp.model["path"])) if cpp and "lora" not in cpp.model \
            else None
        tokenizer = _llamacpp_tokenizer(bundle)
        bundle.report = build_report(
            {"kind": "run", "run": str(run.path), "checkpoint": bundle.checkpoint.name},
            bundle.stages, llamacpp=bundle.llamacpp, draft=draft, threads=threads,
            prompts=tuple(dict.fromkeys([*held, *PROMPT_SUITE])),
            decode=tokenizer.decode if tokenizer is not None else None,
            progress=lambda m: progress.say(f"equivalence: {m}"), same_file=_same_file(bundle),
            llamacpp_tokenizer=tokenizer)
        bundle.report["export"] = {"run": str(run.path), "checkpoint": bundle.checkpoint.name,
                                   "dtype": dtype, "files": bundle.files, "name": bundle.name}
        timings = {"model files": written, **bundle.report["timings"], "report": elapsed()}
        _answer_questions(bundle, question2, compare or [], timings, weights)
        bundle.report["timings"] = timings
        atomic_write_text(staging / "report.json",
                          json.dumps(bundle.report, indent=2) + "\n")
        atomic_write_text(staging / "report.txt", render_text(bundle.report))
    _finish_bundle(bundle, staging)


def _exported_model(bundle: Bundle) -> tuple[Path | None, Path | None]:
    """(the model file llama.cpp runs, the exported model file: None for an adapter export)."""
    model = Path(bundle.llamacpp.model["path"]) if bundle.llamacpp else None
    exported = model if model is not None and "lora" not in bundle.llamacpp.model else None
    return model, exported


@dataclass
class _Question2:
    """Question 2's worker, running in the background (`future`), or why it does not run."""
    reason: str | None
    future: object = None
    started: float = 0.0
    gate: object = None               # equivalence.Gate: the exported file is written
    exported: Path | None = None      # the file it measures


def _start_question2(bundle: Bundle, exported: Path, scratch: Path, compare: list[str],
                     progress: _Progress) -> None:
    """Question 2 (what quantization cost the fine-tune, engine.export.quality) in its worker,
    started now, right after the merge, on a thread of its own and held at a gate until
    `exported` is written (_open_question2): it needs only the base, the merged and the exported
    files, so it runs beside the conversion and the staged report's workers instead of after
    them. It reads the tokenizer and the chat template from the merged file, which the
    conversion copies into the exported one."""
    import time

    from engine.export import quality
    from engine.export.equivalence import Gate, _beside_threads

    reason = _no_question2(bundle)
    if reason:
        bundle.question2 = _Question2(reason)
        return
    exports = [{"dtype": bundle.dtype, "model": _stage_spec(exported, bundle.dtype)}]
    exports += [{"dtype": t, "quantize": True, "answers": False,
                 "model": _native_spec(scratch / f"compare-{t}.gguf")}
                for t in compare if t != bundle.dtype]
    spec = {"run": str(bundle.run.path), "tokenizer_file": bundle.fine_tune["path"],
            "base": bundle.base_spec, "fine_tune": bundle.fine_tune,
            "merged": bundle.fine_tune["path"], "exports": exports}
    gate = Gate()
    future = _in_background(quality.run_measure, spec, _beside_threads(bundle.threads),
                            lambda m: progress.say(m), gate, name="forgebench-quality")
    bundle.question2 = _Question2(None, future, time.perf_counter(), gate, exported)


def _open_question2(bundle: Bundle, scratch: Path, compare: list[str],
                    progress: _Progress) -> _Question2:
    """The model files are written: question 2's worker (started after the merge, or now where
    the export had no merge) goes on to the exported file, or is stopped where there is none
    it can measure."""
    _, exported = _exported_model(bundle)
    if exported is not None and bundle.question2 is None:
        _start_question2(bundle, exported, scratch, compare, progress)
    question2 = bundle.question2
    if exported is None or question2 is None:
        if question2 is not None and question2.gate is not None:
            question2.gate.cancel()
        return _Question2("no exported model file")
    if question2.gate is not None:
        if question2.exported != exported:          # not the file it was started for
            question2.gate.cancel()
            return _Question2("no exported model file")
        question2.gate.open()
    return question2


def _start_weights_check(bundle: Bundle):
    """Question 1's weights check (quality.check_weights: every tensor of the exported file
    read back by gguf-py) and the file's hash, on a thread of their own from now: they need only
    the model files, so they run beside the report's workers instead of alone after them.
    A future of (check, its wall and CPU seconds); None without an exported file."""
    import time

    from engine.export import quality

    _, exported = _exported_model(bundle)
    if exported is None:
        return None

    def check():
        wall, cpu = time.perf_counter(), time.thread_time()
        weights = quality.check_weights(exported, bundle.reference)
        _sha256(exported)
        return weights, {"wall_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu}

    return _in_background(check)


def _answer_questions(bundle: Bundle, question2: _Question2, compare: list[str],
                      timings: dict, weights_check=None) -> None:
    """Question 1 (the weights against the merged ones, llama.cpp against the engine), question
    2 (its worker's answer, `_start_question2`), the picker's rows, and the verdict, into the
    report; a defect's model file is renamed out of the way."""
    import time

    from engine.export import quality
    from engine.export.equivalence import stopwatch
    from engine.export.verdict import (
        DEFECT_SUFFIX,
        adapter_claimed_exact,
        file_claimed_exact,
        of_report,
        question1,
        recommend,
    )
    from engine.kernels.cpu import plan

    report = bundle.report
    clock = stopwatch()
    model, exported = _exported_model(bundle)
    checked = None
    if weights_check is not None:             # _start_weights_check: already under way
        weights, checked = weights_check.result()
    else:
        weights = quality.check_weights(exported, bundle.reference) if exported else None
    cpp = report.get("llamacpp", {})
    compared = None
    if cpp.get("available") and "vs_engine_same_file" in cpp:
        m, g = cpp["vs_engine_same_file"], cpp["greedy_vs_engine_same_file"]
        engine_stage = _same_file(bundle)
        matrices = [(info.ggml_type.name, info.shape[0]) for info in _matrices(model)]
        types = sorted({kind for kind, _ in matrices})
        compared = {"available": True, "top1": m["top1_agreement"], "kl_mean": m["kl_mean"],
                    "max_abs": m["max_abs_logit_diff"], "greedy_matched": sum(g["matches"]),
                    "greedy_total": len(g["matches"]), "weight_types": types,
                    "claimed_exact": engine_stage.get("numerics") == "llamacpp"
                    and ("lora" not in engine_stage or adapter_claimed_exact(plan().kernels))
                    and file_claimed_exact(plan(), matrices),
                    "note": cpp.get("note")}
    elif cpp.get("available"):
        compared = {"available": False, "reason": "no engine stage ran on the same file"}
    else:
        compared = {"available": False, "reason": cpp.get("reason")}
    report["question1"] = question1(weights, compared)
    timings["question 1 (weights)"] = checked or clock()
    if exported is not None:
        report["export"]["sha256"] = _sha256(exported)
    report["question2"] = {"available": False, "reason": question2.reason}
    if question2.future is not None:
        measured = question2.future.result()
        report["question2"] = quality.question2(measured, bundle.dtype)
        if compare:
            rows = quality.picker_rows(measured)
            report["picker"] = {"rows": rows, "recommended": recommend(rows)}
        # from its start, beside the staged report, to its answer
        timings["question 2"] = {"wall_s": time.perf_counter() - question2.started,
                                 "cpu_s": measured["timing"]["cpu_s"]}
    verdict = of_report(report)
    report["verdict"] = verdict.as_dict()
    if not verdict.usable and exported is not None and exported.parent == model.parent \
            and exported.name in bundle.files:
        # a defect stays for diagnosis under a name no runtime or picker takes for a model
        kept = exported.with_name(exported.name + DEFECT_SUFFIX)
        os.replace(exported, kept)
        bundle.files[bundle.files.index(exported.name)] = kept.name


def _same_file(bundle: Bundle) -> dict | None:
    """What llama.cpp runs, as the engine runs it under llama.cpp numerics (question 1 compares
    the two): the exported file, or the base with the adapter (the engine reads the run's
    adapters.safetensors, llama.cpp the adapter.gguf written from it)."""
    cpp = bundle.llamacpp
    if cpp is None:
        return None
    spec = _native_spec(Path(cpp.model["path"]))
    if cpp.model.get("lora"):
        spec["lora"] = bundle.stages[-1].model["lora"]
    return spec


def _matrices(path: Path | None) -> list:
    from engine.export.quality import tensor_views

    if path is None:
        return []
    return [t for t in tensor_views(path).values() if len(t.shape) >= 2]


def _stage_spec(path: Path, dtype: str) -> dict:
    """How the engine loads an exported file: a quantized one under llama.cpp numerics."""
    return _native_spec(path) if _is_quantized(dtype) else \
        {"kind": "gguf", "path": str(path), "numerics": "f32"}


def _no_question2(bundle: Bundle) -> str | None:
    """Why question 2 cannot be measured for this export, or None."""
    if bundle.dtype == "adapter":
        return "an adapter export rounds nothing: llama.cpp applies it to the base as trained"
    if bundle.recipe != "lm-sft":
        return (f"measured for lm-sft runs; an {bundle.recipe} run has no supervised "
                "validation answers to score" if bundle.recipe != "lm-pretrain" else
                "an lm-pretrain run has no base: there is no fine-tune gain to measure")
    if bundle.fine_tune is None or bundle.base_spec is None:
        return "no unquantized fine-tune to measure against"
    return None


def _finish_bundle(bundle: Bundle, staging: Path) -> None:
    """The model card and checksums of a filled bundle, readable by everyone."""
    atomic_write_text(staging / "model_card.md", model_card(bundle))
    write_sha256sums(staging)
    for path in staging.rglob("*"):     # temp files are created private; a bundle is shared
        path.chmod(0o755 if path.is_dir() else 0o644)


def _llamacpp_tokenizer(bundle: Bundle):
    """The tokenizer of the file llama.cpp runs (the exported file, or the adapter's base): its
    decode writes the report's answers, and the llama.cpp worker takes its BOS flag and stop ids
    from it instead of reading the vocabulary again. None without a llama.cpp stage."""
    from engine.llm.tokenizer import GGUFTokenizer

    path = bundle.llamacpp.model["path"] if bundle.llamacpp else None
    if path is None:
        return None
    return GGUFTokenizer.from_gguf(_open_gguf(path))


def compare_types(run_dir: str | os.PathLike, types: list[str], *, checkpoint: str = "latest",
                  base: str | None = None, threads: int | None = None,
                  show_progress: bool = False) -> dict:
    """The quantization picker without an export: the run's adapters merged once into a
    scratch file, then question 2 measured per type (engine.export.quality), the base scored
    once. Returns {"rows": [{dtype, bytes, gain_kept, kl_mean, same_top1, loss}], "recommended",
    "split", "base_loss", "fine_tune_loss", "timing"}; nothing is left on disk."""
    import tempfile

    from engine.export import quality
    from engine.export.merge import merge_into_gguf, write_full_weights
    from engine.export.verdict import recommend
    from engine.llm.chat import ChatTemplate
    from engine.lora import ADAPTERS_FILE
    from engine.train.checkpoint import MODEL_FILE

    types = _compare_types(types, "f16")
    if not types:
        raise ForgebenchError("the picker needs at least one type", where="--compare",
                              hint="e.g. --compare q4_k_m,q5_k_m,q6_k,q8_0")
    run = RunDir(run_dir).require()
    recipe = run.manifest()["recipe"]
    if recipe != "lm-sft":
        raise ForgebenchError(f"the quantization picker measures lm-sft runs, not {recipe}",
                              path=run.path, where="--compare",
                              hint="export with a chosen --dtype instead")
    if run.is_active():
        raise ForgebenchError("the run is still training", path=run.path,
                              hint="wait for it, or stop it: forgebench stop RUN_DIR")
    threads = threads or run.manifest().get("environment", {}).get("threads") or 1
    bundle = Bundle(run, run.checkpoint(checkpoint), recipe, "f16", threads=threads)
    progress = _Progress(show_progress)
    with tempfile.TemporaryDirectory(prefix="forgebench-picker-") as tmp:
        scratch = Path(tmp)
        base_path, _ = _sft_base(bundle, base, scratch, progress)
        try:
            template = ChatTemplate.from_gguf(base_path).source
        except ForgebenchError:
            template = None
        merged = scratch / "merged.gguf"
        adapter = bundle.checkpoint.path / ADAPTERS_FILE
        with progress.tensors("merge") as update:
            if adapter.is_file():
                merge_into_gguf(base_path, adapter, merged, progress=update,
                                chat_template=template)
            else:
                write_full_weights(base_path, bundle.checkpoint.path / MODEL_FILE, merged,
                                   run.manifest()["base_model"]["sha256"], progress=update,
                                   chat_template=template)
        measured = quality.run_measure(
            {"run": str(run.path), "tokenizer_file": str(merged),
             "base": {"kind": "gguf", "path": str(base_path), "numerics": "f32"},
             "fine_tune": {"kind": "gguf", "path": str(merged), "numerics": "f32"},
             "merged": str(merged),
             "exports": [{"dtype": t, "quantize": True, "answers": False,
                          "model": _native_spec(scratch / f"compare-{t}.gguf")}
                         for t in types]}, threads, progress.say)
    if not measured.get("available"):
        raise ForgebenchError(f"the picker cannot measure this run: {measured.get('reason')}",
                              path=run.path, where="--compare")
    rows = quality.picker_rows(measured)
    return {"rows": rows, "recommended": recommend(rows), "split": measured["split"],
            "base_loss": measured["base_loss"], "fine_tune_loss": measured["fine_tune_loss"],
            "timing": measured["timing"]}
