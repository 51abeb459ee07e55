"""The two questions an export report answers beyond the staged comparison
(engine/export/equivalence.py), and the quantization picker built on the second.

*Is the file right?* `check_weights` reads every tensor of the exported file back with gguf-py's
reference dequantizer (llama.cpp's own Python package, independent of the engine) and compares
it with the unquantized merged weights it was made from: each tensor's relative RMS error must be
within what its stored type's rounding gives (engine.export.verdict.WEIGHT_REL_ERROR). A damaged
block (a scale written wrong, a tensor of the wrong model) fails it even where llama.cpp and the
engine, reading the same damaged bytes, agree with each other. The llama.cpp half of question 1
is the staged report's llama.cpp stage compared with the engine on the same file.

*What did quantization cost your fine-tune?* `measure` (run in a worker process, `python -m
engine.export.quality SPEC.json`) scores the run's own validation data (its val split; the
training data where it has none, said so) teacher-forced at the supervised positions with the
base, the unquantized fine-tune (the merged f32 file) and each exported file: validation losses,
the share of the fine-tune's gain kept, mean KL(fine-tune ‖ export) and same-top-1 (what
`llama-perplexity --kl-divergence` prints), Δ perplexity, and the validation prompts' greedy
answers side by side (an f32 model's answers follow a native draft's guesses, read off one
batched scoring per round as the staged report's f32 stages read theirs: the exported file's for
the fine-tune, the same file's under llama.cpp numerics for the base; the exported file decodes
token by token, as served). The fine-tune's log-probabilities are held once for every exported type,
and the base scored once: the picker (`compare_types`) quantizes the one merged file to each type
in turn inside the same worker. An export starts the worker right after the merge: it scores the
base and the fine-tune while the exported file is converted, then waits for that file at a gate
(engine.export.equivalence.Gate).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from engine.export.verdict import WEIGHT_REL_ERROR

MAX_SAMPLES = 16          # validation samples scored (the first ones of the split)
MAX_POSITIONS = 192       # supervised positions kept (the fine-tune's rows are held in memory)
ANSWERS = 3               # validation prompts answered greedily by base / fine-tune / export
ANSWER_TOKENS = 16
CHUNK_ROWS = 8192         # rows dequantized at a time (bounded memory on a 262k vocabulary)


# ----------------------------------------------------------------------- question 1: weights

def _rows_f32(info, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a tensor as f32, dequantized by gguf-py (the reference)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    cols = info.shape[-1]
    block, size = GGML_QUANT_SIZES[info.ggml_type]
    row_bytes = cols // block * size
    raw = info.raw[start * row_bytes:stop * row_bytes].reshape(stop - start, row_bytes)
    return dequantize(raw, info.ggml_type).astype(np.float32, copy=False).reshape(stop - start,
                                                                                  cols)


def check_weights(exported: str | os.PathLike, reference: str | os.PathLike | None) -> dict | None:
    """Each tensor of `exported` against the same-named tensor of `reference` (the merged file
    it was quantized from). None where there is no separate reference (the export is the merge's
    own output)."""
    if reference is None or Path(reference) == Path(exported):
        return None
    got, ref = tensor_views(exported), tensor_views(reference)
    planes = _plane_sets(got)
    failed, worst, checked = [], None, 0
    for name, info in got.items():
        if name not in planes:                 # a weight's extra plane: checked with the weight
            continue
        other = ref.get(name)
        kind = planes[name][0]
        bound = WEIGHT_REL_ERROR.get(kind, 0.35)
        if other is None or other.shape != info.shape:
            failed.append({"name": name, "type": kind, "rel_error": math.inf, "bound": bound})
            continue
        checked += 1
        parts = planes[name][1]
        if len(parts) == 1 and info.ggml_type == other.ggml_type:   # kept: the same bytes
            err = 0.0 if np.array_equal(info.raw, other.raw) else math.inf
        else:
            err = _rel_error(info, parts, other)
        row = {"name": name, "type": kind, "rel_error": err, "bound": bound}
        if worst is None or not err <= worst["rel_error"]:
            worst = row
        if not err <= bound:
            failed.append(row)
    return {"checked": checked, "failed": failed, "worst": worst,
            "reference": Path(reference).name}


def _rel_error(info, parts: list, other) -> float:
    """‖Σ parts − other‖ / ‖other‖ in f64, CHUNK_ROWS rows at a time (inf where the
    difference overflows or the reference is zero and the weight is not)."""
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    diff = norm = 0.0
    flat = info if len(info.shape) > 1 else None
    for start in range(0, rows, CHUNK_ROWS):
        stop = min(rows, start + CHUNK_ROWS)
        if flat is None:
            a = _rows_f32(_as_matrix(info), 0, 1)
            b = _rows_f32(_as_matrix(other), 0, 1)
        else:                                  # a weight in planes: their sum
            a = sum(_rows_f32(part, start, stop) for part in parts)
            b = _rows_f32(other, start, stop)
        d = (a - b).astype(np.float64)
        diff += float(np.einsum("ij,ij->", d, d))
        norm += float(np.einsum("ij,ij->", b, b, dtype=np.float64))
    err = math.sqrt(diff / norm) if norm > 0 else (0.0 if diff == 0 else math.inf)
    if not math.isfinite(diff):
        err = math.inf
    return err


def _plane_sets(views: dict) -> dict:
    """name -> (layout name, [TensorInfo per plane]) for every weight of a file, through the
    weight-layout table (a PTQTP weight: its tensor and `.plane2`); extra planes not listed."""
    from engine.gguf.layouts import stored_layout

    out, extra = {}, set()
    for name, info in views.items():
        layout = stored_layout(views, name, info.ggml_type)
        if layout is None or len(layout.planes) == 1:
            out[name] = (info.ggml_type.name, [info])
        else:
            out[name] = (layout.name, [views[name + suffix] for suffix in layout.planes])
            extra.update(name + suffix for suffix in layout.planes[1:])
    return {name: value for name, value in out.items() if name not in extra}


def tensor_views(path: str | os.PathLike) -> dict:
    """name -> TensorInfo (bytes mapped, not read) from the header alone: the metadata's
    262k-token vocabulary is not turned into Python values (open_gguf does that)."""
    from engine.gguf.parser import parse_gguf
    from engine.gguf.reader import TensorInfo

    parsed = parse_gguf(path)
    return {slot.name: TensorInfo(slot.name, slot.shape, slot.ggml_type,
                                  parsed.tensor_bytes(slot)) for slot in parsed.tensors}


def _as_matrix(info):
    from dataclasses import replace

    return replace(info, shape=(1, int(np.prod(info.shape))))


# ----------------------------------------------------------------------- question 2 (worker)

def heldout_samples(run_dir: str, tokenizer, template) -> tuple[list, str]:
    """(encoded samples, which split) of the run's validation data: its val split, else the
    training data (a run without one measures what it memorised, and the report says so)."""
    from types import SimpleNamespace

    from engine.errors import ForgebenchError
    from engine.jobs import run_config
    from engine.llm.sft_data import encode_samples
    from engine.rundir import RunDir

    config = run_config(RunDir(run_dir))
    base = SimpleNamespace(tokenizer=tokenizer, template=template)
    try:
        samples, _ = encode_samples(config, base, split="val")
        split = "validation split"
    except ForgebenchError:
        samples, _ = encode_samples(config, base, split="train")
        split = "training data (the run has no validation split)"
    return samples[:MAX_SAMPLES], split


def _positions(samples) -> list[tuple[list[int], list[int], list[int]]]:
    """(input ids, supervised positions, their targets) per sample, within MAX_POSITIONS."""
    out, total = [], 0
    for sample in samples:
        rows = [i for i, label in enumerate(sample.labels) if label >= 0]
        rows = rows[:max(0, MAX_POSITIONS - total)]
        if not rows:
            continue
        out.append((list(sample.input_ids), rows, [sample.labels[i] for i in rows]))
        total += len(rows)
    return out


def _log_probs(net, items) -> list:
    """Per item: [rows, V] log-softmax of the model's next-token logits at the rows."""
    import torch

    found = []
    with torch.no_grad():
        for ids, rows, _ in items:
            hidden = net.hidden(torch.tensor([ids]))[0, rows]
            found.append(torch.log_softmax(net.logits(hidden).float(), -1))
    return found


def _nll(log_probs, items) -> float:
    total = count = 0.0
    for lp, (_, rows, targets) in zip(log_probs, items):
        total -= float(lp[range(len(rows)), targets].double().sum())
        count += len(rows)
    return total / count


def _answers(runner, prompts: list[list[int]], decode, draft=None) -> list[str]:
    """The runner's greedy answer to each prompt. A model under f32 numerics with a draft
    follows the draft's guesses (engine.export.equivalence.follow_guesses: every token its own
    argmax, read off one batched scoring per round, as the report's f32 stages read theirs)
    instead of decoding token by token: an f32 step reads every dense weight and the whole
    262k-row LM head for one token. Under llama.cpp numerics it decodes token by token, as
    llama.cpp serves an answer."""
    from engine.export.equivalence import decode_all, follow_guesses

    if draft is None or getattr(runner.net, "numerics", "f32") == "llamacpp":
        return [decode(a) for a in decode_all(runner, [(p, ANSWER_TOKENS) for p in prompts])]
    guesses = decode_all(draft, [(p, ANSWER_TOKENS) for p in prompts])
    scored = runner.score_many([(p + g, len(p) - 1) for p, g in zip(prompts, guesses)])
    return [decode(answer) for answer, _ in follow_guesses(runner, prompts, guesses, scored,
                                                          ANSWER_TOKENS, draft)]


def _native_draft(model: dict):
    """A draft for an f32 model's answers: the same file under llama.cpp numerics on the native
    kernels (the packed bytes, mapped: no dequantized copy), whose greedy answers are nearly
    always the f32 model's; None where the native kernels cannot run it."""
    from engine.export.equivalence import _draft_runner

    if model.get("kind") != "gguf" or model.get("lora") or model.get("numerics") == "llamacpp":
        return None                     # a model under llama.cpp numerics decodes as served
    return _draft_runner({**model, "numerics": "llamacpp"})


def measure(spec: dict) -> dict:
    """Question 2 for every exported file in `spec["exports"]` (quantized from
    `spec["merged"]` first where an entry says `quantize`), against `spec["fine_tune"]` and
    `spec["base"]` (worker load specs); see the module docstring."""
    import gc

    import torch

    from engine.export.equivalence import _load_engine, _Runner
    from engine.gguf.reader import open_gguf
    from engine.llm.chat import ChatTemplate
    from engine.llm.tokenizer import GGUFTokenizer

    torch.set_num_threads(spec.get("threads", 1))
    say = lambda m: print(m, flush=True)           # noqa: E731 (the parent relays progress)
    tokenizer_file = spec["tokenizer_file"]
    opened = open_gguf(tokenizer_file)     # parsed once: its 262k-token vocabulary is slow
    tokenizer = GGUFTokenizer.from_gguf(opened)
    template = ChatTemplate.from_gguf(opened)
    samples, split = heldout_samples(spec["run"], tokenizer, template)
    items = _positions(samples)
    if not items:
        return {"available": False, "reason": "the validation data has no supervised token"}
    prompts = [ids[:rows[0] + 1] for ids, rows, _ in items[:ANSWERS]]
    decode = tokenizer.decode

    def load(model: dict) -> _Runner:
        return _Runner(*_load_engine(model)[:2])

    say("quality: base")
    runner = load(spec["base"])
    base_loss = _nll(_log_probs(runner.net, items), items)
    base_answers = _answers(runner, prompts, decode, _native_draft(spec["base"]))
    del runner
    gc.collect()
    say("quality: fine-tune")
    runner = load(spec["fine_tune"])
    reference = _log_probs(runner.net, items)
    fine_tune_loss = _nll(reference, items)
    # The base and the merged fine-tune are on disk before the exported file is: a worker
    # started beside the quantization waits here for it (equivalence.wait_at_gate).
    from engine.export.equivalence import wait_at_gate

    wait_at_gate(spec)
    # The exported file under llama.cpp numerics (its packed bytes mapped: the picker's types
    # are quantized later) stays loaded: its answers are the fine-tune's draft, and it is then
    # scored as its own row. A dense export loads in turn, as before.
    exported = next((entry for entry in spec["exports"] if not entry.get("quantize")
                     and entry["model"].get("numerics") == "llamacpp"), None)
    export_runner = load(exported["model"]) if exported is not None else None
    fine_tune_answers = _answers(runner, prompts, decode, export_runner
                                 if export_runner is not None and getattr(
                                     export_runner.net, "numerics", "f32") == "llamacpp"
                                 else _native_draft(spec["fine_tune"]))
    del runner
    gc.collect()
    rows = []
    for entry in spec["exports"]:
        path = Path(entry["model"]["path"])
        if entry.get("quantize"):
            from engine.export.quant_choices import write_export_file

            say(f"quality: quantize {entry['dtype']}")
            write_export_file(spec["merged"], path, entry["dtype"], allow_dequantized=True,
                              threads=spec.get("threads", 1))
        say(f"quality: {entry['dtype']}")
        if entry is exported:
            runner, export_runner = export_runner, None
        else:
            runner = load(entry["model"])
        got = _log_probs(runner.net, items)
        kl = same = count = 0.0
        for p, q in zip(reference, got):
            kl += float((p.exp() * (p - q)).sum(-1).double().sum())
            same += int((p.argmax(-1) == q.argmax(-1)).sum())
            count += p.shape[0]
        loss = _nll(got, items)
        rows.append({"dtype": entry["dtype"], "bytes": path.stat().st_size, "loss": loss,
                     "kl_mean": kl / count, "same_top1": same / count,
                     "answers": _answers(runner, prompts, decode,
                                         _native_draft(entry["model"]))
                     if entry.get("answers", True) else None})
        del runner, got
        gc.collect()
        if entry.get("quantize"):
            path.unlink(missing_ok=True)
    return {"available": True, "split": split, "samples": len(items),
            "positions": sum(len(r) for _, r, _ in items), "base_loss": base_loss,
            "fine_tune_loss": fine_tune_loss, "exports": rows,
            "prompts": [decode(p) for p in prompts], "base_answers": base_answers,
            "fine_tune_answers": fine_tune_answers}


def question2(measured: dict, dtype: str | None = None) -> dict:
    """The report's question-2 entry for one exported type (the first row, or `dtype`'s)."""
    from engine.export.verdict import gain_kept

    if not measured.get("available"):
        return {"available": False, "reason": measured.get("reason")}
    row = next((r for r in measured["exports"] if dtype in (None, r["dtype"])))
    base, tuned, loss = measured["base_loss"], measured["fine_tune_loss"], row["loss"]
    return {"available": True, "split": measured["split"], "samples": measured["samples"],
            "positions": measured["positions"], "base_loss": base, "fine_tune_loss": tuned,
            "export_loss": loss, "gain_kept": gain_kept(base, tuned, loss),
            "kl_mean": row["kl_mean"], "same_top1": row["same_top1"],
            "delta_ppl": math.exp(loss) - math.exp(tuned), "fine_tune_ppl": math.exp(tuned),
            "answers": [{"prompt": p, "base": b, "fine_tune": f, "export": e}
                        for p, b, f, e in zip(measured["prompts"], measured["base_answers"],
                                              measured["fine_tune_answers"],
                                              row["answers"] or [])]}


def picker_rows(measured: dict) -> list[dict]:
    """Size against gain kept per measured type, for the picker's table."""
    from engine.export.verdict import gain_kept

    return [{"dtype": r["dtype"], "bytes": r["bytes"], "loss": r["loss"],
             "gain_kept": gain_kept(measured["base_loss"], measured["fine_tune_loss"],
                                    r["loss"]),
             "kl_mean": r["kl_mean"], "same_top1": r["same_top1"]}
            for r in measured.get("exports", [])]


# ----------------------------------------------------------------------- the parent

def run_measure(spec: dict, threads: int, progress=None, gate=None) -> dict:
    """`measure(spec)` in a fresh worker process (its memory goes back when it ends). With a
    `gate` (equivalence.Gate) it starts before the exported files exist: it scores the base and
    the fine-tune, then waits for the gate to open."""
    from engine.export.equivalence import _run_worker

    with tempfile.TemporaryDirectory(prefix="forgebench-quality-") as tmp:
        out = Path(tmp) / "quality.json"
        spec = dict(spec, out=str(out))
        timing = _run_worker(dict(spec, worker="quality"), Path(tmp), "quality", threads,
                             lambda line: progress(line) if progress and line else None, gate)
        result = json.loads(out.read_text("utf-8"))
    result["timing"] = timing
    return result


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text("utf-8"))
    result = measure(spec)
    Path(spec["out"]).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
