"""Forgebench training engine.

Importable without torch: the app reads run directories, config schemas and datasets through
this package. Modules that need torch import it themselves.
"""

import os

__version__ = "0.1.0"

# Idle OpenMP threads spin briefly, then sleep (libgomp reads this when torch loads, so it is
# set before torch is imported). Both ends of the range lose:
# - libgomp's default spins 300k iterations at every barrier. On a machine shared with other
#   processes a spinning thread holds a core its partner needs: a 2-thread LoRA step of the
#   pirate demo measured 146-265 s wall instead of 2.6-8 s passive (load 25 on 2 cores).
# - Fully passive threads (OMP_WAIT_POLICY=PASSIVE) pay a futex wake-up at each of the
#   thousands of parallel regions in a step: the same step on a quiet 2-core machine took
#   1.32 s at 2 threads, slower than 1.17 s at 1 thread, against 0.70 s with the default spin.
# 10k spins (about half a millisecond) bridge the gap between one op and the next: 0.72 s quiet,
# and with 4 busy processes on the 2 cores about what passive costs (5.6-7.4 s against
# 5.6-6.0 s; the default spin took 10-13 s). A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
# A spin (x86 `pause`) lasts ~50 ns there but 13 ns on an AMX Xeon, where 10k spins are 0.13 ms:
# its bf16 2-thread step took 0.77 s at 10k against 0.48 s at 100k beside bench_lora's PEFT
# processes, 0.55 against 0.47 s alone, while with busy processes 10k stayed the steadiest
# (four busy: 4.8 s at 10k, 4.3-8.9 s at 100k, 14.4 s at 300k).
THREAD_SPIN = "10000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", THREAD_SPIN)

# FORGEBENCH_SIMD=avx2 (engine/kernels/cpu.py): the process computes as an AVX2-only x86 CPU would,
# torch's libraries included. Each reads its cap when torch loads, hence here: ATen's vectorized
# kernels, MKL's (f32 products) and oneDNN's (which then reports no bf16). On an AVX-512 CPU
# whose units are 256 bits wide inside (AMD Zen 4) this is close to an AVX2 machine's speed too:
# f32 matmul measured 93/186 GFLOP/s at 1/2 threads capped, against 97/196 uncapped. A cap the
# caller set wins. The value is read here without engine.kernels.cpu.forced_simd, which refuses
# an unknown one: that refusal belongs to the command that uses it, not to `import engine`
# (which the app does too).
AVX2_LIBRARY_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                     "ONEDNN_MAX_CPU_ISA": "AVX2"}
if os.environ.get("FORGEBENCH_SIMD", "").strip().lower() == "avx2":
    for name, value in AVX2_LIBRARY_CAPS.items():
        os.environ.setdefault(name, value)
