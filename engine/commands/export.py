"""`forgebench export RUN --dtype ... --out DIR`: engine.export.bundle.export_run, summarised."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.export.bundle import export_run


def cmd_export(args: argparse.Namespace) -> int:
    if getattr(args, "format", "gguf") == "hf":
        from engine.export.hf_export import export_run_hf

        files = export_run_hf(args.run_dir, args.out, checkpoint=args.checkpoint,
                              base=args.base, hf_source=args.hf_source)
        print(f"exported a merged Hugging Face folder → {args.out}: {', '.join(files)}")
        return 0
    bundle = export_run(args.run_dir, args.out, checkpoint=args.checkpoint, dtype=args.dtype,
                        base=args.base, report=not args.no_report, show_progress=True)
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
    return 0
