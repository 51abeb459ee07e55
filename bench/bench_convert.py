"""HF checkpoint folder -> Q4_K_M GGUF: forgebench beside llama.cpp's converter + quantizer.

    python bench/bench_convert.py [--hidden 2048] [--layers 8] [--vocab 32000] [--keep DIR]

Builds a random bf16 Llama checkpoint folder (two safetensors shards + index; about 1 GB at the
defaults) with a SentencePiece tokenizer, then times, each in its own process:

- forgebench: `forgebench convert DIR --dtype q4_k_m` (one streaming pass);
- llama.cpp: `convert_hf_to_gguf.py --outtype f16` (from the llama-cpp-python sdist, as
  `make verify-extra` extracts it) then `llama_model_quantize` to Q4_K_M (llama-cpp-python,
  threads = the machine's cores);

and prints wall times and peak RSS side by side with their ratio, whether the two files are
byte-identical, and the memory demonstration: the forgebench conversion run again under an
address-space limit (RLIMIT_AS) of a third of the model's size, its peak RSS, and whether its
output equals the unlimited one. Needs torch (to write the shards), sentencepiece, and for the
llama.cpp side llama-cpp-python, transformers and the extracted converter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


LAUNCH = """
import atexit, resource, runpy, sys
limit = int(sys.argv[1])
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
def report():
    status = open("/proc/self/status").read()
    peak = {k: int(status.split(k + ":")[1].split()[0]) * 1024 for k in ("VmHWM", "VmPeak")}
    print(f"@@memory {peak['VmHWM']} {peak['VmPeak']}", file=sys.stderr)
atexit.register(report)
kind, target, *args = sys.argv[2:]
sys.argv = [target, *args]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, target.rsplit("/", 1)[0])   # as `python script.py` would
    runpy.run_path(target, run_name="__main__")
"""


def timed(kind: str, target: str, args: list[str], limit: int = 0, **extra_env: str
          ) -> tuple[float, int, int, subprocess.CompletedProcess]:
    """(wall seconds, peak RSS, peak address space, result) of `target` (a module run as
    `python -m`, or a script) in a fresh process whose RLIMIT_AS is `limit` (0: none); the peaks
    are the process's own VmHWM / VmPeak, read at its exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               **extra_env)
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", LAUNCH, str(limit), kind, target, *args],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    line = [x for x in res.stderr.splitlines() if x.startswith("@@memory")]
    rss, vm = map(int, line[-1].split()[1:]) if line else (0, 0)
    return wall, rss, vm, res


def mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def llamacpp_pipeline(folder: Path, work: Path, ours: Path, wall: float, rss: int) -> None:
    """llama.cpp's converter to f16 then llama_model_quantize to Q4_K_M, each in a process of
    its own, against forgebench's `wall` seconds and `rss` bytes and its file `ours`."""
    from hf_fixtures import converter_path

    script = converter_path()
    if script is None:
        print("llama.cpp's converter is not extracted (make verify-extra): skipped")
    else:
        w1, r1, _, res = timed("script", str(script), [str(folder), "--outtype", "f16",
                                                       "--outfile", str(work / "ref-f16.gguf")])
        assert res.returncode == 0, res.stderr[-2000:]
        quant_script = work / "quantize.py"
        quant = ("import ctypes, llama_cpp, sys\n"
                 "p = llama_cpp.llama_model_quantize_default_params()\n"
                 "p.ftype = 15\np.nthread = %d\n"
                 "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), "
                 "sys.argv[2].encode(), ctypes.byref(p)))" % (os.cpu_count() or 1))
        quant_script.write_text(quant)
        w2, r2, _, res = timed("script", str(quant_script),
                               [str(work / "ref-f16.gguf"), str(work / "ref.gguf")])
        assert res.returncode == 0, res.stderr[-2000:]
        print(f"llama.cpp convert_hf_to_gguf f16  {w1:7.1f} s   peak RSS {mb(r1)}")
        print(f"llama.cpp llama_model_quantize    {w2:7.1f} s   peak RSS {mb(r2)}")
        print(f"llama.cpp pipeline total          {w1 + w2:7.1f} s")
        print(f"speed ratio (llama.cpp / forgebench): {(w1 + w2) / wall:.2f}×; "
              f"peak RSS ratio (llama.cpp converter / forgebench): {r1 / rss:.2f}×")
        same = ours.read_bytes() == (work / "ref.gguf").read_bytes()
        print(f"files byte-identical: {same}")


def limited_run(folder: Path, work: Path, ours: Path, model_bytes: int) -> None:
    """forgebench convert again with its address space limited to a third of the model."""
    limit = model_bytes // 3
    w3, r3, v3, res = timed("module", "engine", ["convert", str(folder), "--dtype", "q4_k_m",
                                                 "--out", str(work / "limited.gguf")], limit,
                         # OpenBLAS reserves address space per thread at import; the
                         # conversion does no matrix products
                         OPENBLAS_NUM_THREADS="1")
    ok = res.returncode == 0
    print(f"\nunder RLIMIT_AS = {mb(limit)} (model / 3): "
          f"{'converted' if ok else 'FAILED'} in {w3:.1f} s, peak RSS {mb(r3)}, "
          f"peak address space {mb(v3)}")
    if ok:
        print(f"  output equals the unlimited run: "
              f"{(work / 'limited.gguf').read_bytes() == ours.read_bytes()}")
    else:
        print(res.stderr[-1500:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--keep", help="build the model here (and keep it)")
    ap.add_argument("--skip-llamacpp", action="store_true")
    args = ap.parse_args()

    from hf_fixtures import make_raw_llama

    from engine.hf.checkpoint import HFCheckpoint

    work = Path(args.keep or tempfile.mkdtemp(prefix="bench-convert-"))
    folder = work / "bench-llama"
    if not (folder / "config.json").exists():
        t = time.perf_counter()
        make_raw_llama(folder, hidden=args.hidden, ffn=args.ffn, layers=args.layers,
                       vocab=args.vocab, heads=args.hidden // 128, kv_heads=args.hidden // 512,
                       shards=2)
        print(f"built the checkpoint in {time.perf_counter() - t:.0f} s")
    ckpt = HFCheckpoint.open(folder)
    model_bytes = ckpt.total_bytes
    largest = ckpt.largest_tensor
    largest_f32 = largest.n_bytes * 4 // 2 if largest.dtype == "BF16" else largest.n_bytes
    print(f"model: {mb(model_bytes)} bf16 in 2 shards; largest tensor {largest.name} "
          f"({mb(largest_f32)} as f32)")
    print(f"CPU: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")

    ours = work / "ours.gguf"
    for p in (ours, work / "limited.gguf", work / "ref-f16.gguf", work / "ref.gguf"):
        p.unlink(missing_ok=True)
    wall, rss, vm, res = timed("module", "engine", ["convert", str(folder), "--dtype", "q4_k_m",
                                                    "--out", str(ours)])
    assert res.returncode == 0, res.stderr[-2000:]
    print(f"\nforgebench convert → Q4_K_M     {wall:7.1f} s   peak RSS {mb(rss)} "
          f"(address space {mb(vm)})")
    bound = 1.2 * largest_f32 + 300 * 2**20
    print(f"  bound 1.2 × largest f32 + 300 MiB = {mb(int(bound))}: "
          f"{'within' if rss <= bound else 'OVER'}")

    if not args.skip_llamacpp:
        llamacpp_pipeline(folder, work, ours, wall, rss)

    limited_run(folder, work, ours, model_bytes)
    print(f"\nfiles in {work}")


if __name__ == "__main__":
    main()
