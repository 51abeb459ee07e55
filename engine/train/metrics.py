"""Per-step measurements (token-weighted loss, throughput, elapsed time, peak memory, model FLOPs
utilisation) and the one builder of a training row of `metrics.jsonl` (docs/design.md, "The
metrics row").

Model FLOPs utilisation (MFU) is a step's model FLOPs per second of wall time over this machine's
peak: `StepFlops` counts the FLOPs of the matmuls, convolutions and attention a step executes
(from the shapes torch.profiler records), and
`peak_matmul_flops` measures the peak once per machine, thread count and dtype with a large
square matmul, timed in CPU time per thread so that a shared machine's load does not lower it,
cached in forgebench's cache folder. MFU itself is over wall time: on a busy machine it says
how much of the machine a step got. Elementwise work counts nothing: it is overhead MFU
exposes.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import resource
import sys
import time


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB.

    Linux: VmHWM, the process's own high-water mark. Its ru_maxrss is not: across fork + exec it
    starts at the parent's peak, so a job started from a big process would report that memory.
    Elsewhere ru_maxrss (KB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


class StepClock:
    """Wall time of the run across invocations and supervised tokens/s of the latest step.

    `elapsed_before` carries the elapsed time of earlier invocations (from trainer_state).
    """

    def __init__(self, elapsed_before: float = 0.0):
        self.elapsed_before = elapsed_before
        self.started = time.perf_counter()
        self.last = self.started
        self.seconds = 0.0          # the latest step's wall time

    @property
    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def tick(self, tokens: int) -> float:
        """Mark the end of a step that processed `tokens`; return tokens per second."""
        now = time.perf_counter()
        self.seconds, self.last = now - self.last, now
        return tokens / self.seconds if self.seconds > 0 else 0.0


class WindowLoss:
    """Loss over one accumulation window, weighted by tokens: sum of CE / supervised tokens.

    Micro-batches with different numbers of supervised tokens count in proportion to their
    tokens (a mean of per-batch means would not).
    """

    def __init__(self) -> None:
        self.sum = 0.0
        self.tokens = 0

    def add(self, loss_sum, tokens: int) -> None:
        """`loss_sum` a float, or a float64 tensor on the training device (summing on the
        device keeps the step free of host syncs until the value is read)."""
        self.sum += loss_sum
        self.tokens += tokens

    @property
    def value(self) -> float:
        return float(self.sum) / self.tokens if self.tokens else float("nan")


PEAK_SIZE = 1536          # the peak microbench's square matmul: big enough for MKL's best blocking
PEAK_SECONDS = 0.4        # wall seconds per timed round; the best of 3 rounds


def _peak_cache_key(precision: str, threads: int) -> str:
    """The cache's key of a peak: the CPU (its model name and a digest of its flags, from
    /proc/cpuinfo), FORGEBENCH_SIMD where it caps the libraries at AVX2, the installed torch and
    the thread count. Computed without importing torch or the native kernels, so that the app's
    run form can read the cache on the GUI thread."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    from engine.kernels.cpu import forced_simd
    from engine.train.precision import cpuinfo_flags

    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo_lines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    flags = cpuinfo_flags()
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    simd = f"|simd {forced}" if (forced := forced_simd()) else ""
    return f"{model}|flags {digest}{simd}|torch {torch_version}|{precision}|{threads}|cpu-time"


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            return handle.read().splitlines()
    except OSError:
        return []


def measure_peak_matmul_flops(precision: str, threads: int, clock: str = "cpu") -> float:
    """FLOP/s of torch's matmul of two PEAK_SIZE squares in `precision` ("f32"/"bf16") on
    `threads` threads: the best of 3 timed rounds after a warm-up.

    `clock="cpu"` times it in process CPU time per thread, which other processes on a shared
    machine barely disturb: the machine's own peak, what the cache keeps. `clock="wall"` times
    it in wall time: the peak reachable under the load of the moment (benches measure it
    between their rounds)."""
    import torch

    from engine.train.precision import torch_dtype

    dtype = torch_dtype(precision)
    now = time.perf_counter if clock == "wall" else (lambda: time.process_time() / threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=generator).to(dtype)
        b = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=generator).to(dtype)
        torch.mm(a, b)
        best = 0.0
        for _ in range(3):
            start, wall, count = now(), time.perf_counter(), 0
            while count == 0 or time.perf_counter() - wall < PEAK_SECONDS:
                torch.mm(a, b)
                count += 1
            best = max(best, count * 2 * PEAK_SIZE ** 3 / max(now() - start, 1e-9))
        return best
    finally:
        torch.set_num_threads(before)


def _peak_cache_path():
    from engine.fsutil import cache_dir

    return cache_dir() / "peak-flops.json"


def _cached_peaks() -> dict:
    try:
        cached = json.loads(_peak_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def cached_peak_matmul_flops(precision: str, threads: int) -> float | None:
    """The peak `peak_matmul_flops` measured on this machine before, or None: never measures."""
    value = _cached_peaks().get(_peak_cache_key(precision, threads))
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


@functools.lru_cache(maxsize=None)
def peak_matmul_flops(precision: str, threads: int) -> float:
    """This machine's measured matmul peak (FLOP/s) for `precision` and `threads`, measured once
    and kept in forgebench's cache folder (peak-flops.json), keyed by CPU, torch and threads."""
    from engine.fsutil import atomic_write_json

    value = cached_peak_matmul_flops(precision, threads)
    if value is not None:
        return value
    value = measure_peak_matmul_flops(precision, threads)
    try:
        atomic_write_json(_peak_cache_path(),
                          {**_cached_peaks(), _peak_cache_key(precision, threads): value})
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return value


def _product(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def matmul_dims(name: str, shapes: list) -> tuple[int, int, int] | None:
    """(m, k, n) of one profiled matrix product from its input shapes, batches folded into m
    (an [m, k] · [k, n] product; oneDNN's with a prepacked weight, `PackedWeight.product`,
    too), or None for an op that is no matrix product."""
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
        return m, k, n
    if name == "mkldnn::_linear_pointwise":            # x [..., k] · prepacked W [n, k]ᵀ
        x, (n, k) = shapes[0], shapes[1]
        return _product(x[:-1]), k, n
    if name in ("aten::addmm", "aten::addmm_"):
        (m, k), (_, n) = shapes[1], shapes[2]
        return m, k, n
    if name == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return b * m, k, n
    if name in ("aten::baddbmm", "aten::baddbmm_"):
        (b, m, k), (_, _, n) = shapes[1], shapes[2]
        return b * m, k, n
    return None


def op_flops(name: str, shapes: list) -> int:
    """FLOPs of one profiled op from its input shapes: matmuls (2·m·k·n, `matmul_dims`), CPU
    flash attention forward and backward (torch's own formulas), and a convolution counted at
    its backward (forward, dx and dw: 3 × 2 · output elements · weight elements per output
    channel); anything else counts nothing."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    dims = matmul_dims(name, shapes)
    if dims is not None:
        m, k, n = dims
        return 2 * m * k * n
    if name == "aten::_scaled_dot_product_flash_attention_for_cpu":
        return sdpa_flop_count(*shapes[:3])
    if name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
        return sdpa_backward_flop_count(*shapes[:4])
    if name == "aten::convolution_backward":
        grad_out, weight = shapes[0], shapes[2]
        return 3 * 2 * _product(grad_out) * _product(weight[1:])
    return 0


class StepFlops:
    """`with StepFlops() as count: <forward and backward>` then `count.total`: the FLOPs of the
    matmuls, convolutions and attention executed inside (recomputation included).

    torch.profiler records each op's input shapes without touching the arithmetic (torch's
    FlopCounterMode, a dispatch mode, changes the last bits of some results, which would break
    exact resume). Inside another profiling session nothing is counted (total 0)."""

    def __enter__(self) -> "StepFlops":
        import torch
        from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

        self.total = 0
        self._profile = None
        if not torch._C._autograd._profiler_enabled():
            # kineto (torch >= 2.13) prints "profiler_start"/"profiler_stop" lines on stderr,
            # which would land in the user's terminal and the run's log; it reads this
            # level when a session starts. A user's own setting wins.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            # every thread's ops: the LM head's row shares run on threads of their own
            self._profile = profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                                    experimental_config=_ExperimentalConfig(
                                        profile_all_threads=True))
            self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._profile is None:
            return
        self._profile.__exit__(*exc)
        self.total = sum(op_flops(e.name, e.input_shapes) for e in self._profile.events())
        self._profile = None            # its event records are large: keep only the count


class StepUtilisation:
    """The MFU a recipe logs. The FLOPs of the invocation's first step are counted (StepFlops;
    counting slows that one step) per unit of its `work` (tokens or examples); every step is
    credited that many per unit it did, over its wall time, against the peak for the run's
    precision and thread count."""

    def __init__(self, precision: str, threads: int):
        self.peak = peak_matmul_flops(precision, threads)
        self.per_unit: float | None = None
        self._count: StepFlops | None = None

    def begin(self) -> None:
        """Call before a step's forward and backward: the first one is counted."""
        if self._count is None:
            self._count = StepFlops().__enter__()

    def step(self, work: int, seconds: float) -> dict:
        """`flops`, `flops_per_s` and `mfu` of a step that did `work` units in `seconds`; call
        it after every step (the first one fixes the FLOPs per unit)."""
        if self.per_unit is None and self._count is not None:
            self._count.__exit__(None, None, None)
            self.per_unit = self._count.total / max(work, 1)
        flops = (self.per_unit or 0.0) * work
        per_s = flops / seconds if seconds > 0 else 0.0
        return {"flops": flops, "flops_per_s": per_s, "mfu": per_s / self.peak}


def train_row(*, invocation: int, step: int, loss: float, outcome, skipped_total: int, lr: float,
              elapsed_s: float, utilisation: dict | None = None,
              **throughput: float | int) -> dict:
    """The `metrics.jsonl` row of a logged optimizer step, the same keys for every recipe.

    `outcome` is the step's engine.train.optim.StepOutcome; `throughput` the recipe's own
    figures (`input_tokens`, `supervised_tokens`, `tokens_per_s`; or `examples`,
    `examples_per_s`, `epoch`); `utilisation` what `StepUtilisation.step` returns (`flops`,
    `flops_per_s`, `mfu`). The app plots any numeric key, so a new key is additive.
    """
    return {"invocation": invocation, "step": step, "split": "train", "loss": loss,
            "grad_norm": outcome.grad_norm, "clipped": outcome.clipped,
            "skipped": outcome.skipped, "skipped_total": skipped_total, "lr": lr, **throughput,
            **(utilisation or {}), "elapsed_s": elapsed_s,
            "process_cpu_s": time.process_time(),   # this invocation's CPU, all threads
            "peak_rss_mb": peak_rss_mb()}


def write_eval_record(run, checkpoint, split: str, values: dict) -> dict:
    """`forgebench eval`'s record of a checkpoint on a split (split, checkpoint, step, `values`,
    source), written as evals/<split>-<checkpoint>.json and as one line of metrics.jsonl."""
    record = {"split": split, "checkpoint": checkpoint.name, "step": checkpoint.step, **values,
              "source": "forgebench eval"}
    run.write_eval(f"{split}-{checkpoint.name}", record)
    run.log_metric(record)
    return record
