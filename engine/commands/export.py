"""`forgebench export RUN --dtype ... --out DIR [--compare T1,T2,...]`:
engine.export.bundle.export_run, summarised.

The summary ends with the export's verdict (engine.export.verdict), the same words the report,
the card, the wizard and the notification show. Exit status: 0 for a usable file, 3 when the file
failed question 1 (a defect: it is kept as model.gguf.defective for diagnosis), 2 for bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.export.bundle import export_run

DEFECT_EXIT = 3


def cmd_export(args: argparse.Namespace) -> int:
    if getattr(args, "format", "gguf") == "hf":
        from engine.export.hf_export import export_run_hf

        files = export_run_hf(args.run_dir, args.out, checkpoint=args.checkpoint,
                              base=args.base, hf_source=args.hf_source)
        print(f"exported a merged Hugging Face folder → {args.out}: {', '.join(files)}")
        return 0
    compare = [t for t in (getattr(args, "compare", "") or "").split(",") if t.strip()]
    if getattr(args, "compare_only", False):
        return _picker(args, compare)
    bundle = export_run(args.run_dir, args.out, checkpoint=args.checkpoint, dtype=args.dtype,
                        base=args.base, report=not args.no_report, show_progress=True,
                        compare=compare)
    out = Path(args.out)
    print(f"exported {bundle.run.path.name}/{bundle.checkpoint.name} as {bundle.dtype} → {out}")
    for name in bundle.files + ["model_card.md", "SHA256SUMS"] + \
            (["report.json", "report.txt"] if bundle.report else []):
        print(f"  {name:<34} {(out / name).stat().st_size / 1e6:10.2f} MB")
    for note in bundle.notes:
        print(f"note: {note}")
    if bundle.report:
        print()
        print((out / "report.txt").read_text("utf-8"), end="")
    verdict = bundle.verdict
    print()
    print(f"verdict: {verdict.line}")
    if not verdict.usable:
        print(f"the file is kept only for diagnosis: {', '.join(bundle.files)}")
        return DEFECT_EXIT
    return 0


def _picker(args: argparse.Namespace, compare: list[str]) -> int:
    """`--compare-only`: the picker's table, and DIR/picker.json for the wizard."""
    from engine.errors import ForgebenchError
    from engine.export.bundle import compare_types
    from engine.export.verdict import KEPT_MIN
    from engine.fsutil import atomic_write_json

    out = Path(args.out)
    if out.exists():
        raise ForgebenchError("the output folder already exists", path=out, where="--out",
                              hint="choose a new --out")
    result = compare_types(args.run_dir, compare, checkpoint=args.checkpoint, base=args.base,
                           show_progress=True)
    out.mkdir(parents=True)
    atomic_write_json(out / "picker.json", result)
    print(f"quantization picker on the run's {result['split']}: base loss "
          f"{result['base_loss']:.4f}, fine-tune {result['fine_tune_loss']:.4f}")
    for row in result["rows"]:
        kept = row["gain_kept"]
        print(f"  {row['dtype']:<8} {row['bytes'] / 1e6:9.2f} MB   keeps "
              + (f"{kept:7.1%}" if kept is not None else "    n/a")
              + f" of the gain   KL {row['kl_mean']:.4g}   same top-1 {row['same_top1']:.2%}")
    print(f"recommended: {result['recommended'] or 'none'} (the smallest file keeping "
          f"≥ {KEPT_MIN:.0%} of the fine-tune's gain)")
    return 0
