"""`forgebench convert F.gguf|HF_DIR --dtype ... --out G.gguf`: engine.gguf.convert for a GGUF file,
engine.hf.convert for a Hugging Face checkpoint folder, each with a progress bar on stderr."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from engine.fsutil import sha256_file
from engine.gguf.constants import DEQUANTIZED_FROM_KEY
from engine.gguf.convert import convert_gguf
from engine.gguf.writer import TensorEntry


def _convert_folder(args: argparse.Namespace) -> int:
    """Tensor name, bytes written and ETA (tqdm's, from the bytes rate) per finished tensor."""
    from tqdm import tqdm

    from engine.hf.convert import convert_hf

    bars: list[tqdm] = []

    def progress(tensor: TensorEntry, done: int, total: int, written: int, size: int) -> None:
        if not bars:
            # refreshed at every tensor (not tqdm's 0.1 s throttle): a line per tensor at most
            bars.append(tqdm(desc=f"convert → {args.dtype}", total=size, initial=0, unit="B",
                             unit_scale=True, unit_divisor=1024, leave=False, mininterval=0,
                             miniters=1))
        bar = bars[0]
        bar.set_postfix_str(f"{done}/{total} {tensor.name}", refresh=False)
        bar.update(written - bar.n)
    try:
        result = convert_hf(args.file, args.out, args.dtype, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    out = Path(args.out)
    types = ", ".join(f"{name}×{count}" for name, count in sorted(result.types.items()))
    if result.resumed_at:
        print(f"resumed at tensor {result.resumed_at + 1} of {result.n_tensors}")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): {types}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if Path(args.file).expanduser().is_dir():
        return _convert_folder(args)
    from tqdm import tqdm

    src, dst = Path(args.file), Path(args.out)
    bars: list[tqdm] = []  # opened with the first written tensor, so errors print cleanly

    def progress(tensor: TensorEntry, done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(desc=f"convert → {args.dtype}", total=total, unit="tensor",
                             leave=False))
        bars[0].set_postfix_str(tensor.name, refresh=False)
        bars[0].update(1)
    if args.dtype.lower() == "ptqtp":
        return _convert_ptqtp(args, src, dst, progress, bars)
    try:
        result = convert_gguf(src, dst, args.dtype, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    size_mb = dst.stat().st_size / 1e6
    types = ", ".join(f"{name}×{count}" for name, count in sorted(result.types.items()))
    print(f"wrote {dst} ({size_mb:.1f} MB): {types}")
    if result.dtype == "keep":
        same = sha256_file(src) == sha256_file(dst)
        print("byte-identical to the input" if same else
              "same content, re-laid out (the input's tensor data was not in the standard layout)")
    if result.dequantized:
        print(f"note: dequantized from a quantized file; marked with {DEQUANTIZED_FROM_KEY}")
    return 0


def _calibration(args, src: Path):
    """`--calibration TEXT_FILE`: the importance matrix of `src` over that text (None without)."""
    from engine.errors import ForgebenchError

    path = getattr(args, "calibration", None)
    if path is None:
        return None
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ForgebenchError(f"cannot read the calibration text: {exc}", path=path,
                              where="--calibration",
                              hint="a UTF-8 text file of a few thousand tokens") from None
    from engine.ptqtp.gguf_file import decomposable_names
    from engine.ptqtp.imatrix import collect_importance

    # the matrices PTQTP decomposes also get their inputs' full covariance, for the error
    # feedback (GPTQ) fit, unless --no-error-feedback
    full = None if getattr(args, "no_error_feedback", False) else decomposable_names(src)
    print(f"collecting the importance matrix over {path.name} ...", flush=True)
    return collect_importance(src, text, dataset=path.name, covariance=full)


def _convert_ptqtp(args, src: Path, dst: Path, progress, bars) -> int:
    """`--dtype ptqtp`: engine/ptqtp/gguf_file.py (PTQTP ternary planes, TQ2_0/TQ1_0 tensors)."""
    from engine.errors import ForgebenchError
    from engine.ptqtp.gguf_file import PLANE_TYPES, convert_ptqtp

    group = getattr(args, "group", "256")
    if group not in ("256", "row"):
        raise ForgebenchError(f"--group {group!r} cannot be stored as ternary blocks",
                              where="--group",
                              hint="256 (one scale per 256-value block) or 'row'")
    max_size = getattr(args, "max_size", None)
    if max_size is not None and not max_size > 0:
        raise ForgebenchError(f"--max-size {max_size} is not a size in MB", where="--max-size",
                              hint="e.g. 242.0 (megabytes, 10⁶ bytes)")
    importance = _calibration(args, src)
    try:
        result = convert_ptqtp(src, dst, planes=getattr(args, "planes", 2),
                               group=None if group == "row" else 256, progress=progress,
                               plane_type=PLANE_TYPES[getattr(args, "ternary", "tq2_0")],
                               importance=importance,
                               max_bytes=None if max_size is None else int(max_size * 1e6))
    finally:
        for bar in bars:
            bar.close()
    size_mb = dst.stat().st_size / 1e6
    types = ", ".join(f"{name}×{count}" for name, count in sorted(result.types.items()))
    rep = result.report
    print(f"wrote {dst} ({size_mb:.1f} MB): {types}")
    print(f"{rep['decomposed']} matrices decomposed into {rep['planes']} ternary plane(s), "
          f"mean relative Frobenius error {rep['mean_rel_error']:.4f}; {rep['kept']} tensors "
          f"kept as the source holds them; report: {result.report_path}")
    if importance is not None:
        feedback = " and error feedback (GPTQ) over its inputs' covariance" \
            if importance.covariances else ""
        print(f"fit weighted by an importance matrix{feedback} over {importance.tokens} tokens "
              f"of {importance.dataset} (recorded in the file's ptqtp.imatrix.* metadata)")
    if rep.get("budget"):
        steps = rep["budget"]["steps"]
        stepped = Counter(s["type"] for s in steps)
        print(f"size budget {rep['budget']['max_bytes'] / 1e6:.1f} MB: {len(steps)} step(s) "
              "down for the projections PTQTP cannot take "
              f"({', '.join(f'{n} now {k}' for k, n in sorted(stepped.items())) or 'none'})")
    if result.dequantized:
        print(f"note: dequantized from a quantized file; marked with {DEQUANTIZED_FROM_KEY}")
    return 0
