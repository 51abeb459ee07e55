"""`forgebench data validate|split|leaks|stats|card|generate|init`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.errors import ForgebenchError


def cmd_data(args: argparse.Namespace) -> int:
    return ACTIONS[args.data_command](args)


def _print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def _validate(args) -> int:
    from engine.data.dataset import validate_dataset

    report = validate_dataset(args.dir, progress=not args.json)
    if args.json:
        _print_json(report.to_json())
    else:
        for finding in report.findings:
            print(finding.render())
        if report.conversion_note():
            print(report.conversion_note())
        print(f"{report.root}: {report.kind or 'unknown kind'}, {report.n_records} records, "
              f"{len(report.errors)} errors, {len(report.findings) - len(report.errors)} "
              "warnings" + (" - OK" if report.ok else ""))
    return 0 if report.ok else 1


def _split(args) -> int:
    from engine.data.splits import assign_splits, parse_ratios

    result = assign_splits(args.dir, parse_ratios(args.ratios), args.seed, args.out,
                           progress=not args.json)
    if args.json:
        _print_json(result)
        return 0
    if result["assigned"]:
        print(f"assigned {result['assigned']} new groups; wrote version {result['version']} "
              f"(parent {result['parent']}) to {result['path']}; {args.dir} is unchanged")
    else:
        print(f"every group already has a split; nothing written ({result['path']}, version "
              f"{result['version']})")
    print("records per split: " + ", ".join(f"{k} {v}" for k, v in result["counts"].items()))
    return 0


def _leaks(args) -> int:
    from engine.data.dataset import load_dataset
    from engine.data.leaks import find_leaks

    datasets = [load_dataset(d, check_media=False, progress=not args.json)
                for d in [args.dir, *(args.against or [])]]
    report = find_leaks(datasets, progress=not args.json)
    if args.json:
        _print_json(report.to_json())
    else:
        for finding in report.findings:
            print(finding.render())
        for check, settings in report.settings.items():
            print(f"{check}: " + (settings.get("explain") or
                                  ", ".join(f"{k} {v}" for k, v in settings.items())))
        print(f"{report.n_items} records checked ({', '.join(report.checks)}): "
              f"{len(report.leaks)} leaks across splits, "
              f"{len(report.findings) - len(report.leaks)} duplicates within a split")
    return 1 if report.leaks else 0


def _stats(args) -> int:
    from engine.data.dataset import load_dataset
    from engine.data.stats import dataset_stats

    tokenizer = name = None
    if args.tokenizer:
        tokenizer, name = _gguf_tokenizer(args.tokenizer)
    stats = dataset_stats(load_dataset(args.dir, check_media=False), tokenizer=tokenizer,
                          tokenizer_name=name, max_length=args.max_length,
                          slices=args.slice, progress=not args.json)
    if args.json:
        _print_json(stats)
    else:
        _print_stats(stats)
    return 0


def _gguf_tokenizer(path: str):
    try:
        from engine.gguf.reader import open_gguf
        from engine.llm.tokenizer import GGUFTokenizer
    except ImportError as exc:
        raise ForgebenchError(f"the GGUF tokenizer is not available in this build ({exc})",
                              where="--tokenizer") from exc
    return GGUFTokenizer.from_gguf(open_gguf(path)), Path(path).name


def _print_stats(stats: dict) -> None:
    print(f"{stats['name']} ({stats['kind']}, version {stats['version']}): "
          f"{stats['records']} records")
    counts = stats["counts"]
    print("  per split: " + ", ".join(f"{k} {v}" for k, v in counts["by_split"].items()))
    for split, per in counts.get("by_class", {}).items():
        print(f"  {split} classes: " + ", ".join(f"{k} {v}" for k, v in per.items()))
    for field, per_split in counts.get("by_slice", {}).items():
        for split, per in per_split.items():
            print(f"  {split} by {field}: " + ", ".join(f"{k} {v}" for k, v in per.items()))
    if "text_lengths" in stats:
        lengths = stats["text_lengths"]
        print(f"  lengths in {lengths['unit']}:")
        for split, s in lengths["by_split"].items():
            over = lengths.get("over_max_length", {}).get(split)
            print(f"    {split}: n {s['n']}, min {s.get('min', 0):g}, p50 {s.get('p50', 0):g}, "
                  f"p90 {s.get('p90', 0):g}, max {s.get('max', 0):g}" +
                  (f", {over} over {lengths['max_length']} (would be truncated)"
                   if over is not None else ""))
    if "images" in stats:
        _print_image_stats(stats["images"])
    if "audio" in stats:
        _print_audio_stats(stats["audio"])


def _print_image_stats(images: dict) -> None:
    from engine.data.dataset import conversion_note

    print("  image sizes: " + ", ".join(f"{k} ({v})" for k, v in images["sizes"].items()))
    print("  image modes: " + ", ".join(f"{k} ({v})" for k, v in images["modes"].items()))
    if images.get("converted_to_rgb"):
        print(f"  {conversion_note(images['converted_to_rgb'])}")
    if images["unreadable"]:
        print(f"  unreadable images: {images['unreadable']}")


def _print_audio_stats(audio: dict) -> None:
    for key in ("duration_s", "rms_dbfs", "peak_dbfs", "silent_fraction", "dc_offset"):
        s = audio[key]
        if s["n"]:
            print(f"  {key}: min {s['min']:.4g}, p50 {s['p50']:.4g}, max {s['max']:.4g}")
    print(f"  clipped clips: {audio['clipped_clips']}")
    for flag, ids in audio["flagged"].items():
        print(f"  {flag}: {len(ids)} ({', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''})")


def _card(args) -> int:
    from engine.data.card import write_card
    from engine.data.dataset import load_dataset

    json_path, md_path = write_card(load_dataset(args.dir, progress=not args.json))
    if args.json:
        _print_json({"card_json": str(json_path), "card_md": str(md_path)})
    else:
        print(f"wrote {json_path} and {md_path}")
    return 0


def _generate(args) -> int:
    from engine.data.generators import catalog, generate_samples, sfx, shapes, text

    generators = {
        "shapes": lambda: shapes.generate_shapes(args.out, **_some(n=args.n), seed=args.seed),
        "sfx": lambda: sfx.generate_sfx(args.out, **_some(n_per_class=args.n), seed=args.seed),
        "pirate": lambda: text.generate_pirate(args.out),
        "style": lambda: text.generate_style_pairs(args.out, **_some(n=args.n), seed=args.seed),
        "tools": lambda: catalog.generate_tool_conversations(args.out, **_some(n=args.n),
                                                             seed=args.seed),
        "cpt": lambda: catalog.generate_cpt_corpus(args.out, **_some(n=args.n), seed=args.seed),
        "records": lambda: _records(args),
        "sensors": lambda: _sensors(args),
        "speech": lambda: _speech(args),
        "tickets": lambda: _tickets(args),
        "samples": lambda: generate_samples(args.out),
        "help-articles": lambda: _help_articles(args, "hard"),
        "help-articles-easy": lambda: _help_articles(args, "easy"),
    }
    if args.kind not in generators:
        raise ForgebenchError(f"unknown sample dataset {args.kind!r}", where="KIND",
                              hint="use one of " + ", ".join(sorted(generators)))
    paths = generators[args.kind]()
    for path in paths if isinstance(paths, list) else [paths]:
        print(f"wrote {path}")
    return 0


def _sensors(args):
    from engine.data.generators.sensors import generate_sensors
    return generate_sensors(args.out, **_some(machines=args.n), seed=args.seed)


def _speech(args):
    from engine.data.generators.speech import generate_speech
    return generate_speech(args.out, **_some(n_speakers=args.n), seed=args.seed)


def _tickets(args):
    from engine.data.generators.tickets import generate_tickets
    return generate_tickets(args.out, **_some(n=args.n), seed=args.seed)


def _records(args):
    from engine.data.generators.records import generate_records
    questions = tuple(args.questions.split(",")) if args.questions else None
    return generate_records(args.out, **_some(n=args.n, questions=questions), seed=args.seed)


def _help_articles(args, variant: str):
    from engine.data.generators.retrieval import generate_help_articles
    return generate_help_articles(args.out, variant, seed=args.seed)


def _some(**values) -> dict:
    """Only the options the user gave, so each generator keeps its own defaults."""
    return {k: v for k, v in values.items() if v is not None}


MAX_PRINTED = 20      # findings `init` prints before it counts the rest


def _init(args) -> int:
    """Write dataset.json for a folder, after checking it: a folder that does not validate
    gets its problems listed and no manifest (exit 2), so nothing half-made is left."""
    from engine.data import formats as F
    from engine.data.dataset import validate_dataset, write_manifest

    root = Path(args.dir)
    _check_init(root, args)
    fields = _manifest_fields(root, args)
    if args.dry_run:
        print("dry run: nothing written")
        return 0
    manifest = write_manifest(root, args.kind, args.name or root.name, progress=True, **fields)
    report = validate_dataset(root)
    for finding in report.findings[:MAX_PRINTED]:
        print(finding.render())
    if len(report.findings) > MAX_PRINTED:
        print(f"... and {len(report.findings) - MAX_PRINTED} more")
    if not report.ok:
        (root / F.MANIFEST).unlink()
        first = report.errors[0]
        raise ForgebenchError(
            f"the folder does not validate as {args.kind}: {len(report.errors)} error(s), "
            "listed above; no dataset.json was written", path=root / first.file,
            where=", ".join(p for p in (first.where, first.field and f"field {first.field!r}")
                            if p) or None, hint="fix them and run `forgebench data init` again")
    if report.conversion_note():
        print(report.conversion_note())
    print(f"wrote {root / F.MANIFEST} ({args.kind}, {report.n_records} records, version "
          f"{manifest['version']})")
    from engine.data.dataset import load_dataset

    if not any(record.get("split") for record in load_dataset(root, check_media=False).records()):
        print(f"next: no record has a split yet; `forgebench data split {root}` assigns them by "
              "group (a recipe trains on train and chooses on val)")
    return 0


def _check_init(root: Path, args) -> None:
    """Refuse an `init` that cannot be right before anything is read or written."""
    from engine.data import formats as F

    if (root / F.MANIFEST).exists():
        raise ForgebenchError("already holds a dataset.json", path=root / F.MANIFEST,
                              hint="a dataset's file list is never rewritten in place; copy "
                                   "the files to a new folder to start a new version")
    if not root.is_dir():
        raise ForgebenchError("folder not found", path=root)
    if args.kind not in F.KINDS:
        raise ForgebenchError(f"unknown dataset kind {args.kind!r}", where="--kind",
                              hint="use one of " + ", ".join(F.kind_names()))
    for option in ("target", "group", "leave_out"):
        if getattr(args, option) and args.kind != "tabular":
            flag = "--" + option.replace("_", "-")
            raise ForgebenchError(f"{flag} is for --kind tabular", where=flag)


def _manifest_fields(root: Path, args) -> dict:
    """The manifest's records file, layout and (tabular) inferred table section."""
    from engine.data import formats as F

    fields = {"records": args.records} if args.records else {}
    kind = F.KINDS[args.kind]
    if args.layout:
        fields["layout"] = args.layout
    elif args.kind == "image-classify" and not args.records and not any(
            (root / name).is_file() for name in (kind.records, *kind.alt_records)):
        fields["layout"] = "folders"
        print(f"no {kind.records}: reading a folder per class (--layout folders)")
    if args.kind == "tabular":
        fields.update(_infer_table(root, args))
    return fields


def _infer_table(root: Path, args) -> dict:
    """The records CSV and its inferred `table` section, printed for the user to confirm."""
    from engine.data.tabular import infer_table, schema_lines

    rel = args.records
    if rel is None:
        csvs = sorted(p.name for p in root.glob("*.csv"))
        if "rows.csv" in csvs or len(csvs) != 1:
            rel = "rows.csv"
            if not (root / rel).is_file():
                raise ForgebenchError(
                    "no CSV to read" if not csvs else f"{len(csvs)} CSV files; which one holds "
                    "the rows?", path=root, where="--records",
                    hint="pass --records FILE.csv" + (f" (one of {', '.join(csvs)})"
                                                      if csvs else ""))
        else:
            rel = csvs[0]
    table, guesses = infer_table(root / rel, target=args.target, group=args.group,
                                 leave_out=args.leave_out or ())
    print(f"{rel}: {len(guesses)} columns, schema inferred from the header and values:")
    for line in schema_lines(table, guesses):
        print(line)
    print("not right? run again with --target COLUMN, --group COLUMN or --leave-out COLUMN, or "
          "edit dataset.json's table section")
    return {"records": rel, "table": table}


ACTIONS = {"validate": _validate, "split": _split, "leaks": _leaks, "stats": _stats,
           "card": _card, "generate": _generate, "init": _init}
