"""A GGUF decoder run wholly by the C llama.cpp kernels, with numpy for the glue: generation that
starts without importing torch (`forgebench generate`, `forgebench chat`, the serve-local worker).

Under llama.cpp numerics the torch model hands every forward to the C decoder already
(engine/models/native_forward.py: ggml_kernels.c fb_forward) and its LM head to fb_matmul; what
torch still did at start was only the glue, and importing it costs about a second. `NativeLM`
describes the file to the same C entry points straight from the memory-mapped GGUF: the weights
unpacked by fb_unpack (engine/kernels/exact_plan.py, the layout the torch path's ExactWeight
uses), the norms and biases as f32 arrays, the embedding rows dequantized by the `gguf` package's
numpy kernels (which engine/gguf/dequant.py matches element for element), an f16 KV cache in
numpy. The logits are the torch path's, bit for bit (tests/test_native_lm.py holds the two to
the same tokens and logits), so greedy continuations are identical; sampling with a temperature
imports torch then, for its generator (engine/sampling.py), and draws the same tokens.

Decode steps run at the thread count ThreadGovernor picks (the given one, or fewer while other
load keeps its threads off their cores; FORGEBENCH_ADAPTIVE_THREADS=0: always the given one);
the bits never depend on the count.

`load_native_lm` returns None where the C decoder would not serve the model bit for bit (no C
build or FORGEBENCH_NATIVE=0, a weight type without an exact kernel in this machine's llama.cpp
configuration, a head dimension the attention kernel does not take, a final logit soft-cap, or
any tensor the torch model would add): the caller loads the torch model instead
(engine.models.gguf_model.load_gguf_model). A PTQTP file's projections (TQ plane 1 + `.plane2`)
are one fb_weight each, the kernel summing the two planes' products as the torch model's
PlaneSumLinear does.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from engine.gguf.constants import LAYER_TENSORS, NON_PARAMETER_TENSORS
from engine.gguf.hparams import model_hparams
from engine.gguf.layouts import PTQTP_PLANE2_SUFFIX
from engine.gguf.reader import GGUFFile, open_gguf
from engine.kernels.exact_plan import (
    UBATCH,
    plan_struct,
    supports_exact,
    unpack_parts,
    weight_struct,
)
from engine.kernels.native import Layer, Model, kernels, ptr

# fb_layer's weights -> the GGUF tensor after "blk.{i}." (engine/models/native_forward.py LINEARS)
LINEARS = (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"),
           ("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down"))
# fb_layer's norms -> the GGUF tensor (NULL in C where the family has none)
NORMS = (("attn_norm", "attn_norm"), ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm"),
         ("post_attn_norm", "post_attention_norm"), ("mlp_norm", "ffn_norm"),
         ("post_mlp_norm", "post_ffw_norm"))
GEMMA_ROPE_LOCAL_THETA = 10_000.0   # Gemma3Config.rope_local_theta: sliding-window layers


def default_threads() -> int:
    """The thread count the torch path would run the kernels on: OMP_NUM_THREADS, else the
    CPUs this process may use (torch's default on a machine without SMT siblings)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count() or 1)


def _f32(gf: GGUFFile, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A small tensor (norm, bias, rope factors) as contiguous f32, as the torch loader's
    `_dense` reads it (F32 bytes as they are; other types through gguf's numpy dequantize)."""
    info = gf.tensor(name)
    gf.check_type(info)
    if tuple(info.shape) != tuple(shape):
        return None
    if info.ggml_type == T.F32:
        return np.ascontiguousarray(info.raw.view(np.float32).reshape(shape))
    return np.ascontiguousarray(quants.dequantize(info.raw, info.ggml_type).reshape(shape),
                                dtype=np.float32)


class ThreadGovernor:
    """The thread count of each decode step: the given count, or fewer where fewer run faster now.

    A decode step on several threads meets at a barrier 7 times a layer; where other load takes
    one of those threads off its core, every barrier waits for it, and on a busy 2-core machine
    2 threads decoded slower than 1 (the bits never depend on the count: each output is summed by
    one thread in one order). So the steps run at the count whose recent steps were fastest:
    now and then the steps run at another count (a probe), the last PROBE_SAMPLES steps of each
    count kept; a probe faster by HYSTERESIS than the current count's median (of its last 3
    steps) makes it the current count. A probe is PROBE_STEPS steps, judged by its fastest: the
    first step on more threads than the last one ran on wakes a sleeping worker thread, and alone
    made more threads look slower than they are.
    When to probe: on the given count, first after PROBE_QUIET steps, the interval doubling after
    each probe that confirms the count, up to PROBE_MAX (a quiet machine pays four slower steps in
    PROBE_MAX, none in a short reply); sooner where the count's threads are seen not to get their
    cores: process CPU time over wall time per thread (`share`: near 1 while every thread runs,
    spinning included; about 0.5 for 2 threads with other load on the cores) below STARVED over
    the last 3 steps, or 3 steps much slower (SLOWDOWN) than the count's median at the last
    probe, bring the probe
    forward, at most to a quarter of the interval after the last one. On fewer threads than given
    (where CPU time says nothing of the load leaving) every PROBE_FIRST steps, doubling up to
    PROBE_MAX_FEWER, so that the count comes back soon after the load goes.
    Counts: `threads`, then halved down to 1 (2 -> [2, 1])."""

    PROBE_FIRST, PROBE_QUIET, PROBE_MAX, PROBE_MAX_FEWER = 8, 64, 256, 32
    PROBE_SAMPLES, PROBE_STEPS = 5, 4
    HYSTERESIS, SLOWDOWN, STARVED = 0.95, 1.3, 0.7

    def __init__(self, threads: int):
        self.counts = [threads]
        while self.counts[-1] > 1:
            self.counts.append(self.counts[-1] // 2)
        self.current = threads
        self.samples = {c: deque(maxlen=self.PROBE_SAMPLES) for c in self.counts}
        self.shares: deque = deque(maxlen=3)     # the current count's last CPU shares
        self.recent: deque = deque(maxlen=3)     # and its last step times
        self.settled = math.inf   # its median when the last probe ended
        self.interval = self.until_probe = self.PROBE_QUIET
        self.since_probe = 0
        self.turn = 0        # which other count the next probe tries (round robin)
        self.probe_count, self.probe_left, self.probe_best = 0, 0, math.inf

    def pick(self) -> int:
        """The count the next step runs at."""
        if len(self.counts) == 1:
            return self.current
        if self.probe_left:
            return self.probe_count
        self.until_probe -= 1
        self.since_probe += 1
        if self.until_probe > 0:
            return self.current
        others = [c for c in self.counts if c != self.current]
        self.turn += 1
        self.probe_count, self.probe_left = others[self.turn % len(others)], self.PROBE_STEPS
        self.probe_best = math.inf
        return self.probe_count

    def record(self, count: int, seconds: float, cpu_seconds: float | None = None) -> None:
        """The step just run at `count` took `seconds` (and the process `cpu_seconds` of CPU)."""
        if len(self.counts) == 1:
            return
        mine = self.samples[self.current]
        if count == self.current:
            self.recent.append(seconds)
            slow = len(self.recent) == 3 and min(self.recent) > self.SLOWDOWN * self.settled
            if cpu_seconds is not None and count > 1 and seconds > 0:
                self.shares.append(cpu_seconds / seconds / count)
            starved = len(self.shares) == 3 and _median(self.shares) < self.STARVED
            if (slow or starved) and self.since_probe >= self.interval // 4:
                self.until_probe = min(self.until_probe, 1)
            mine.append(seconds)
            return
        self.samples[count].append(seconds)
        self.probe_best = min(self.probe_best, seconds)
        self.probe_left -= 1
        if self.probe_left > 0:
            return
        # against the current count's last 3 steps where it has them (the load of the moment)
        baseline = _median(self.recent) if len(self.recent) == 3 else _median(mine) if mine else 0
        if self.probe_best < self.HYSTERESIS * baseline:
            self.current = count
            self.interval = self.PROBE_QUIET if count == self.counts[0] else self.PROBE_FIRST
        else:
            most = self.PROBE_MAX if self.current == self.counts[0] else self.PROBE_MAX_FEWER
            self.interval = min(2 * self.interval, most)
        self.until_probe, self.since_probe = self.interval, 0
        self.shares.clear()
        self.recent.clear()
        settled = self.samples[self.current]
        self.settled = _median(settled) if settled else math.inf


def _median(values) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@dataclass
class _Matrix:
    """One 2-D weight in the C kernels' layout; `parts` keep the memory fb_weight points into."""

    struct: object
    parts: dict
    raw_bytes: int


def _matrix(gf: GGUFFile, name: str, shape: tuple[int, int], threads: int) -> _Matrix | None:
    info = gf.tensor(name)
    gf.check_type(info)
    if tuple(info.shape) != tuple(shape):
        return None
    rows, cols = shape
    if info.ggml_type != T.F16 and not supports_exact(info.ggml_type, rows):
        return None
    parts = unpack_parts(info.raw, info.ggml_type, rows, threads)
    plane2, raw_bytes = None, info.raw.nbytes
    if name + PTQTP_PLANE2_SUFFIX in gf.tensors:   # a PTQTP weight: plane 1 + plane 2 in one kernel
        second = gf.tensor(name + PTQTP_PLANE2_SUFFIX)
        gf.check_type(second)
        if (info.ggml_type not in (T.TQ1_0, T.TQ2_0) or second.ggml_type != info.ggml_type
                or tuple(second.shape) != tuple(shape)):
            return None
        plane2 = unpack_parts(second.raw, second.ggml_type, rows, threads)
        parts = {**parts, "plane2": plane2["blocks"]}
        raw_bytes += second.raw.nbytes
    struct = weight_struct(parts, info.ggml_type, rows, cols, plane2=plane2)
    if info.ggml_type == T.Q6_K:   # decode reads the 210-byte blocks, not the 276 bytes unpacked
        parts = {**parts, "raw": info.raw}
        struct.raw = ptr(info.raw)
    return _Matrix(struct, parts, raw_bytes)


class NativeLM:
    """A decoder-only GGUF model for `engine.llm.generate.generate`: `config`, `gguf`,
    `numerics`, `new_cache(max_len)` and `last_logits(ids, start_pos, cache)` (the logits
    [vocab] f32 of the last of `ids` fed at `start_pos`)."""

    numerics = "llamacpp"
    torch_free = True

    def __init__(self, gf: GGUFFile, arch: str, fields: dict, threads: int | None = None):
        self.gguf, self.arch, self.lib = gf, arch, kernels()
        self.threads = threads or default_threads()
        self.governor: ThreadGovernor | None = None   # made for self.threads (_decode_governor)
        gemma = arch == "gemma3"
        self.config = SimpleNamespace(arch=arch, **fields)
        cfg = self.config
        self.gemma = gemma
        self.query_scale = 1.0 / math.sqrt(cfg.head_dim) if gemma else 1.0
        self.keep: list = []
        self.matrices: list[_Matrix] = []
        structs = (Layer * cfg.n_layers)()
        kv = cfg.n_kv_heads * cfg.head_dim
        shapes = {"q": (cfg.n_heads * cfg.head_dim, cfg.dim), "k": (kv, cfg.dim),
                  "v": (kv, cfg.dim), "o": (cfg.dim, cfg.n_heads * cfg.head_dim),
                  "gate": (cfg.ffn_dim, cfg.dim),
                  "up": (cfg.ffn_dim, cfg.dim), "down": (cfg.dim, cfg.ffn_dim)}
        self.ok = True
        for i in range(cfg.n_layers):
            if not self._load_layer(i, structs[i], shapes):
                self.ok = False
                return
            self._set_rope(i, structs[i])
        norm = _f32(gf, "output_norm.weight", (cfg.dim,))
        head = "token_embd.weight" if cfg.tie_embeddings else "output.weight"
        self.head = _matrix(gf, head, (cfg.vocab_size, cfg.dim), self.threads)
        embd = gf.tensor("token_embd.weight")
        self.embd_type = embd.ggml_type
        self.embd_rows = embd.raw.reshape(cfg.vocab_size, -1)
        if norm is None or self.head is None or tuple(embd.shape) != (cfg.vocab_size, cfg.dim):
            self.ok = False
            return
        table = gelu_table()
        self.keep += [structs, table, norm]
        rope_neox = gemma or arch in ("qwen2", "qwen3")   # Gemma3.rope_type, qwen*_config
        self.struct = Model(cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                            cfg.ffn_dim, cfg.norm_eps, self.query_scale,
                            1.0 if gemma else 1.0 / math.sqrt(cfg.head_dim), int(rope_neox),
                            int(gemma), ptr(table), ptr(norm), ctypes.addressof(structs))
        self.plan = plan_struct()

    def _load_layer(self, i: int, s: Layer, shapes: dict) -> bool:
        """Fills layer `i`'s matrices, biases and norms into `s`; False when one of them is
        in a type or shape the native kernels do not run."""
        gf, cfg = self.gguf, self.config
        for attr, gname in LINEARS:
            m = _matrix(gf, f"blk.{i}.{gname}.weight", shapes[attr], self.threads)
            if m is None:
                return False
            bias_name = f"blk.{i}.{gname}.bias"
            if bias_name in gf.tensors:
                bias = _f32(gf, bias_name, (shapes[attr][0],))
                if bias is None:
                    return False
                m.struct.bias = ptr(bias)
                self.keep.append(bias)
            setattr(s, attr, m.struct)
            self.matrices.append(m)
        for attr, gname in NORMS:
            name = f"blk.{i}.{gname}.weight"
            if name not in gf.tensors:
                continue
            size = cfg.head_dim if attr in ("q_norm", "k_norm") else cfg.dim
            norm = _f32(gf, name, (size,))
            if norm is None:
                return False
            self.keep.append(norm)
            setattr(s, attr, ptr(norm))
        return True

    def _set_rope(self, i: int, s: Layer) -> None:
        """Layer `i`'s rotary base, window and frequency scale (Gemma 3: local layers slide
        with their own base; others: the GGUF's rope_freqs factors when present)."""
        gf, cfg = self.gguf, self.config
        if self.gemma:
            local = cfg.sliding[i]
            base = GEMMA_ROPE_LOCAL_THETA if local else cfg.rope_theta
            s.window = cfg.sliding_window if local else 0
            s.rope_freq_scale = 1.0 if local else 1.0 / cfg.rope_scale
        else:
            base, s.window, s.rope_freq_scale = cfg.rope_theta, 0, 1.0
            if "rope_freqs.weight" in gf.tensors:
                factors = _f32(gf, "rope_freqs.weight", (cfg.head_dim // 2,))
                self.keep.append(factors)
                s.rope_freq_factors = ptr(factors)
        s.rope_step = base ** (-2.0 / cfg.head_dim)

    def new_cache(self, max_len: int) -> list[np.ndarray]:
        """f16 keys then values per layer, [n_kv_heads, max_len, head_dim] each (KVCache's
        layout for one sequence)."""
        c = self.config
        shape = (c.n_kv_heads, max_len, c.head_dim)
        return [np.zeros(shape, np.float16) for _ in range(2 * c.n_layers)]

    def embed(self, ids: list[int]) -> np.ndarray:
        """[T, dim] f32 embedding rows (Gemma: times √dim in f32, as Gemma3.hidden does)."""
        rows = quants.dequantize(self.embd_rows[np.asarray(ids, dtype=np.int64)], self.embd_type)
        h = np.ascontiguousarray(rows.reshape(len(ids), self.config.dim), dtype=np.float32)
        if self.gemma:
            h = h * np.float32(math.sqrt(self.config.dim))
        return h

    def _cache_pointers(self, cache: list[np.ndarray]) -> tuple[ctypes.Array, ctypes.Array]:
        """The layers' key and value buffers of `cache` as the C arrays fb_forward takes, made
        once per cache (about 0.1 ms a call, a percent of a decode step): kept with the arrays
        they point into, and made again when `cache` holds other arrays."""
        c = self.config
        kept = getattr(self, "_pointers", None)
        if kept is None or len(kept[0]) != len(cache) or any(
                a is not b for a, b in zip(kept[0], cache)):
            keys = (ctypes.c_void_p * c.n_layers)(*(ptr(k) for k in cache[:c.n_layers]))
            values = (ctypes.c_void_p * c.n_layers)(*(ptr(v) for v in cache[c.n_layers:]))
            self._pointers = kept = (list(cache), keys, values)
        return kept[1], kept[2]

    def last_logits(self, ids: list[int], start_pos: int, cache: list[np.ndarray]) -> np.ndarray:
        """The logits [vocab] f32 after feeding `ids` at `start_pos`, as generate's torch path
        computes them: every position through every layer (the matmuls' kernels depend on the
        batch size), prompt ubatch by ubatch (NativeDecoder.hidden), the last row's LM head."""
        c = self.config
        max_len = cache[0].shape[1]
        if start_pos + len(ids) > max_len:
            raise ValueError(f"KV cache holds {max_len} positions; asked for "
                             f"{start_pos + len(ids)}")
        h = self.embed(ids)
        keys, values = self._cache_pointers(cache)
        n = len(ids)
        # one position (a decode step): the governor's count, timed for it; a prompt: all threads
        governor = self._decode_governor() if n == 1 else None
        threads = governor.pick() if governor else self.threads
        start, cpu_start = time.perf_counter(), time.process_time()
        for u0 in range(0, n, UBATCH):
            u1 = min(n, u0 + UBATCH)
            chunk = np.ascontiguousarray(h[u0:u1])
            out = np.empty((u1 - u0, c.dim), np.float32)
            status = self.lib.fb_forward(
                ctypes.byref(self.struct), ctypes.byref(self.plan), u1 - u0, start_pos + u0,
                ptr(chunk), keys, values, max_len, u1 - u0, None, ptr(out), threads)
            if status != 0:
                raise MemoryError(f"fb_forward failed for {u1 - u0} positions at {start_pos + u0}")
        out = np.ascontiguousarray(out[-1:])
        logits = np.empty((1, c.vocab_size), np.float32)
        if self.lib.fb_matmul(ctypes.byref(self.head.struct), 1, ptr(out),
                              ctypes.byref(self.plan), threads, ptr(logits)) != 0:
            raise MemoryError("fb_matmul: no memory for the LM head's activations")
        if governor:
            governor.record(threads, time.perf_counter() - start, time.process_time() - cpu_start)
        return logits[0]

    def _decode_governor(self) -> ThreadGovernor | None:
        """The decode steps' ThreadGovernor for the current `threads` (a caller may change it
        after loading, as the bench and the chat worker do), None for one thread or with
        FORGEBENCH_ADAPTIVE_THREADS=0 (every step on `threads`)."""
        if self.threads <= 1 or os.environ.get("FORGEBENCH_ADAPTIVE_THREADS", "1") == "0":
            return None
        if self.governor is None or self.governor.counts[0] != self.threads:
            self.governor = ThreadGovernor(self.threads)
        return self.governor

    def memory_report(self) -> dict:
        """engine.models.gguf_model.memory_report's keys for this model: the packed weights
        stay memory-mapped, nothing is cached dense."""
        weights = [*self.matrices, self.head]
        elements = sum(m.struct.rows * m.struct.cols for m in weights)
        return {"packed_bytes": sum(m.raw_bytes for m in weights), "dense_cache_bytes": 0,
                "onednn_layout_bytes": 0, "f32_dense_bytes": elements * 4,
                "bf16_dense_bytes": elements * 2,
                "small_f32_bytes": sum(a.nbytes for a in self.keep if isinstance(a, np.ndarray))}


_GELU_SQRT_2_OVER_PI, _GELU_A = 0.7978845608028654, 0.044715


def gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16 (engine.kernels.numerics.gelu_table, without torch): f16(gelu(v))
    for every f16 bit pattern v, each step an f32 operation, fma and tanh in f64 rounded once."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    s, a = np.float32(_GELU_SQRT_2_OVER_PI), np.float32(_GELU_A)
    with np.errstate(all="ignore"):
        inner = ((a * x).astype(np.float64) * x.astype(np.float64) + 1.0).astype(np.float32)
        t = np.tanh((s * x * inner).astype(np.float64)).astype(np.float32)
        g = np.float32(0.5) * x * (np.float32(1.0) + t)
        return np.nan_to_num(g).astype(np.float16).astype(np.float32)   # inf beyond f16's range


def _expected_tensors(n_layers: int) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight", "output.weight", *NON_PARAMETER_TENSORS}
    for i in range(n_layers):
        for gname in LAYER_TENSORS.values():
            names |= {f"blk.{i}.{gname}.weight", f"blk.{i}.{gname}.bias"}
        names |= {f"blk.{i}.{gname}.weight{PTQTP_PLANE2_SUFFIX}" for _, gname in LINEARS}
    return names


def load_native_lm(path: str | Path, threads: int | None = None):
    """(NativeLM, tokenizer) for a GGUF the C decoder serves bit for bit, else None (load the
    torch model: engine.models.gguf_model.load_gguf_model). ForgebenchErrors for a bad file are
    the loader's own (engine.gguf.reader, engine.gguf.hparams)."""
    if kernels() is None or Path(path).is_dir():
        return None
    gf = open_gguf(path)
    arch, fields = model_hparams(gf)
    cfg = SimpleNamespace(**fields)
    if (cfg.head_dim % 16 or cfg.n_heads % cfg.n_kv_heads or fields.get("final_softcap")
            or set(gf.tensors) - _expected_tensors(cfg.n_layers)):
        return None
    lm = NativeLM(gf, arch, fields, threads)
    if not lm.ok:
        return None
    from engine.llm.tokenizer import GGUFTokenizer

    return lm, GGUFTokenizer.from_gguf(gf)


__all__ = ["NativeLM", "ThreadGovernor", "default_threads", "gelu_table", "load_native_lm"]
