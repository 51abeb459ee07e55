"""Frozen GGUF weights kept in their stored block format, dequantized on the fly.

`FrozenQuantLinear` dequantizes its weight (in row chunks, so a large matrix never exists in f32
at once) for the forward pass and again in the backward pass for the input gradient dx = dy·W;
the weight itself carries no gradient, so LoRA adapters beside it train while it stays packed.
`weights="dense-cache"` keeps a per-layer dequantized copy (f32 or bf16) for speed when memory
allows. Where oneDNN multiplies bf16 on the CPU, a bf16 cache is held as oneDNN's own layouts
of the weight and (for dx, and the LM head's gradient) its transpose, each block reordered once
from the dequantized rows (`PackedWeight.product`, `product_t`), with no plain copy beside them:
torch's plain bf16 product would reorder a plain weight at every call. Under llama.cpp numerics
the activations are quantized the way llama.cpp's matmul does.

Which dequantizer and which llama.cpp-numerics product a weight gets comes from the weight-layout
table (engine/gguf/layouts.py): `packed_matmul` is every layout's f32 product, `exact_matmul`,
`f16_matmul` and `activation_matmul` its llama.cpp ones. The LM head's fused loss over a packed
weight is engine/models/lm_head_loss.py.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from torch import nn

from engine.gguf.dequant import dequantize
from engine.gguf.layouts import layout_of
from engine.heap import release_free_heap
from engine.kernels.cpu import torch_threads
from engine.kernels.ggml_matmul import ExactWeight, supports_exact
from engine.kernels.native import kernels
from engine.kernels.numerics import activation_values, dot_f16, round_f16, tinyblas_serves

CHUNK_ELEMENTS = 1 << 22          # dequantize at most ~4M weights (16 MB f32) at a time


# -- one thread for the glue, all of them for the products ----------------------------------
_GLUE = threading.local()    # .threads: the step's thread count while its glue runs on one


@contextlib.contextmanager
def one_thread_glue(enabled: bool = True):
    """A training step's forward and backward with torch on one thread, except where a frozen
    layer's product (`packed_matmul`, `_frozen_dx_under`) or a share-out of its own (the LM
    head's vocabulary shares, packed attention, through `step_threads`) takes the step's full
    count back for its duration. Without `enabled`, on one thread, or already inside: as is.

    Why: between the products a step runs ~3000 small ops (casts, residual adds, the
    gradients' sums) over ~100k values each, which torch splits over the threads; each is an
    OpenMP region whose partner thread wakes, works a few microseconds and spins at the
    barrier, and on a busy machine waits for a descheduled partner. On one thread they give the
    same bits (elementwise ops; torch splits no reduction of this size), and the products,
    where the threads pay, still get them all. Only for a model whose every large product goes
    through these paths (`glue_serves`)."""
    threads = torch.get_num_threads()
    if not enabled or threads == 1 or getattr(_GLUE, "threads", None) is not None:
        yield
        return
    _GLUE.threads = threads
    try:
        with torch_threads(1):
            yield
    finally:
        _GLUE.threads = None


def step_threads() -> int:
    """The threads the step runs on: inside `one_thread_glue` its full count (torch is at one),
    else torch's own."""
    return getattr(_GLUE, "threads", None) or torch.get_num_threads()


@contextlib.contextmanager
def all_step_threads():
    """Inside `one_thread_glue` (on this Python thread), torch at the step's full count for
    what runs within; elsewhere nothing changes."""
    threads = getattr(_GLUE, "threads", None)
    if threads is None or torch.get_num_threads() == threads:
        yield
        return
    with torch_threads(threads):
        yield


ONEDNN_BLOCK_ROWS = 16384   # rows per block reordered for oneDNN: a whole layer, or exactly one
                            # chunk of the LM head's bf16 pass (lm_head_loss.HEAD_CHUNK_ROWS_BF16)


class PackedWeight:
    """A [rows, cols] matrix as packed bytes [rows, row_bytes] (a view of the GGUF memory map)."""

    def __init__(self, raw: torch.Tensor, ggml_type: T, rows: int, cols: int, name: str = ""):
        self.raw = raw.reshape(rows, -1)
        self.ggml_type, self.rows, self.cols, self.name = T(ggml_type), rows, cols, name
        self.dense: torch.Tensor | None = None       # optional plain dense cache
        self.lazy_dtype: torch.dtype | None = None   # fill the cache on first use in this dtype
        self.in_layouts = False                      # a bf16 cache held as the layouts alone
        self._exact: ExactWeight | None = None       # integer layout for llama.cpp's kernels
        self._onednn: dict[int, torch.Tensor] = {}     # block start -> its bf16 rows, W
        self._onednn_t: dict[int, torch.Tensor] = {}   # and Wᵀ, in oneDNN's own layout

    @property
    def packed_bytes(self) -> int:
        return self.raw.numel()

    def move_to(self, device: torch.device) -> None:
        """Packed bytes (and the dense cache) onto `device`, never cast: on a GPU the weight
        dequantizes there, and a cache held as oneDNN layouts becomes a plain bf16 cache filled
        there on first use. llama.cpp's integer kernels stay a CPU path."""
        if self.raw.device == device:
            return
        self.raw = self.raw.to(device)
        self.dense = None if self.dense is None else self.dense.to(device)
        if device.type != "cpu":
            if self.in_layouts:
                self.in_layouts, self.lazy_dtype = False, torch.bfloat16
            self._exact, self._onednn, self._onednn_t = None, {}, {}

    @property
    def cache_bytes(self) -> int:
        return 0 if self.dense is None else self.dense.numel() * self.dense.element_size()

    @property
    def layout_bytes(self) -> int:
        """The bf16 cache's blocks reordered for oneDNN so far (`product` and `product_t`
        fill them on use)."""
        layouts = [*self._onednn.values(), *self._onednn_t.values()]
        return sum(t.numel() * t.element_size() for t in layouts)

    @property
    def cache_dtype(self) -> torch.dtype | None:
        """The dtype of the dense cache, however it is held (plain, lazy or as layouts)."""
        if self.in_layouts:
            return torch.bfloat16
        return self.dense.dtype if self.dense is not None else self.lazy_dtype

    def cache(self, dtype: torch.dtype | None, lazy: bool = False) -> None:
        """Keep a dense copy in `dtype` (None drops it); `lazy` defers it to the first use, so
        loading stays instant and a layer is dequantized once, when it first runs.

        A bf16 cache on a CPU where oneDNN multiplies bf16 is held as its oneDNN layouts alone
        (`in_layouts`), each block filled from the dequantized rows when a product first needs
        it. Why: every product of such a cache reads the layouts, so a plain copy beside them
        was only read to build them (gemma-3-270m's 511 MB; with the LM head's gradient through
        its Wᵀ layout too, a pirate LoRA step on AMX, interleaved medians: 0.433 -> 0.407 s and
        peak RSS 2468 -> 2289 MB at 1 thread, 0.311 -> 0.298 s and 2535 -> 2320 MB at 2; the
        first step, which fills both layouts, took 0.2-2.7 s more in those measurements)."""
        self.dense, self.lazy_dtype = None, None
        self._onednn, self._onednn_t = {}, {}
        self.in_layouts = (dtype == torch.bfloat16 and self.raw.device.type == "cpu"
                           and onednn_bf16())
        if dtype is None or self.in_layouts:
            return
        if lazy:
            self.lazy_dtype = dtype
        else:
            self.dense = self.rows_f32(0, self.rows).to(dtype)

    def _fill(self) -> None:
        if self.lazy_dtype is not None and self.dense is None:
            dtype, self.lazy_dtype = self.lazy_dtype, None
            self.dense = self.rows_f32(0, self.rows).to(dtype)

    @property
    def exact_cache(self) -> bool:
        """The dense cache holds the exact dequantized values (f32; a bf16 cache is rounded)."""
        return self.dense is not None and self.dense.dtype == torch.float32

    def cached_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as the cache holds them: a slice of the plain cache, or for a cache
        held as layouts the same values dequantized again (what the layouts were built from)."""
        if self.in_layouts:
            return self.rows_f32(start, end).to(torch.bfloat16)
        self._fill()
        return self.dense[start:end]

    def rows_f32(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as exact f32 [end-start, cols] (from an f32 cache, else the bytes)."""
        if self.exact_cache:
            return self.dense[start:end]
        return dequantize(self.raw[start:end], self.ggml_type, (end - start, self.cols), self.name)

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows at `index` (any shape) as exact f32 [..., cols] (embedding lookup)."""
        flat = index.reshape(-1)
        if self.exact_cache:
            out = self.dense[flat]
        else:
            out = dequantize(self.raw[flat], self.ggml_type, (flat.numel(), self.cols), self.name)
        return out.reshape(*index.shape, self.cols)

    def chunks(self, rows: int | None = None, lo: int = 0, hi: int | None = None):
        """(start, end, rows) over the matrix's rows [lo, hi) (default all) for a product:
        slices of the dense cache in its dtype (f32, or bf16 for a bf16 run), `rows` at a time
        or in one piece; without a cache, f32 dequantized `rows` or ~CHUNK_ELEMENTS at a time.
        For a cache held as layouts the rows are None: `product` and `product_t` read the
        layouts (or, for a product they do not serve, `cached_rows`)."""
        self._fill()
        cached = self.dense is not None or self.in_layouts
        hi = self.rows if hi is None else hi
        step = rows or (hi - lo if cached else max(1, CHUNK_ELEMENTS // max(1, self.cols)))
        for start in range(lo, hi, step):
            end = min(hi, start + step)
            if self.in_layouts:
                yield start, end, None
            else:
                yield start, end, self.dense[start:end] if cached else self.rows_f32(start, end)

    def product(self, x: torch.Tensor, start: int, end: int,
                chunk: torch.Tensor | None) -> torch.Tensor:
        """x [..., cols] · chunkᵀ for a chunk that `chunks` yielded for rows [start, end), in
        the chunk's dtype as `in_cache_dtype` takes it. A cache held as layouts goes through
        oneDNN in its own blocked layout, reordered once per ONEDNN_BLOCK_ROWS rows and kept
        (one copy, whichever row ranges the products ask for).

        Why: torch's bf16 product reorders a plain weight into that layout at every call, and
        with the few rows a LoRA step or a decode step has, the reorder costs as much as the
        arithmetic (AMX, 1 thread: 148 rows against gemma's 2048x640 gate 1.54 -> 1.29 ms, 70
        rows against a 16384-row head chunk 9.5 -> 5.4 ms, one decode row 0.48 -> 0.28 ms)."""
        if not self._onednn_serves(x, chunk):
            return in_cache_dtype(F.linear, x, self._rows_or(chunk, start, end))
        xb = x.to(torch.bfloat16)
        parts = []
        for block in range(start - start % ONEDNN_BLOCK_ROWS, end, ONEDNN_BLOCK_ROWS):
            y = self._block_product(xb, block, transposed=False)
            lo, hi = max(start, block) - block, min(end, block + ONEDNN_BLOCK_ROWS) - block
            parts.append(y if (lo, hi) == (0, y.shape[-1]) else y[..., lo:hi])
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y if torch.is_autocast_enabled("cpu") else y.to(x.dtype)

    def product_t(self, dy: torch.Tensor, start: int, end: int,
                  chunk: torch.Tensor | None) -> torch.Tensor:
        """dy [..., end-start] · chunk (rows [start, end) of W, as `chunks` yielded them): the
        input gradient's product, as `product` is the forward's (and the LM head's dh, from
        its softmax). Through oneDNN with the blocks' Wᵀ reordered once where [start, end) is
        whole blocks (a layer's dx takes the whole matrix, the head's pass one block a chunk);
        else torch's product.

        Why: the same per-call reorder as in `product`, of the larger operand (a pirate LoRA
        step on AMX, medians of 13 interleaved steps: 0.585 -> 0.550 s at 2 threads, 0.754 ->
        0.711 s at 1; the head's dh 131 -> 105 ms a pass at 1 thread)."""
        whole_blocks = start % ONEDNN_BLOCK_ROWS == 0 and (end % ONEDNN_BLOCK_ROWS == 0
                                                           or end == self.rows)
        if not (whole_blocks and self._onednn_serves(dy, chunk)):
            return in_cache_dtype(torch.matmul, dy, self._rows_or(chunk, start, end))
        dyb, dx = dy.to(torch.bfloat16), None
        for block in range(start, end, ONEDNN_BLOCK_ROWS):
            hi = min(self.rows, block + ONEDNN_BLOCK_ROWS)
            part = self._block_product(dyb[..., block - start:hi - start], block, transposed=True)
            dx = part if dx is None else dx + part
        return dx if torch.is_autocast_enabled("cpu") else dx.to(dy.dtype)

    def fill_layouts(self, start: int, end: int) -> None:
        """Both layouts (W and Wᵀ) of every block holding rows [start, end), each from one
        dequantization of its rows, for a caller that needs both (a layer's forward that a dx
        will follow, the LM head's pass with its gradient); a cache not held as layouts, or a
        block already filled, is left as it is."""
        if self.in_layouts:
            for block in range(start - start % ONEDNN_BLOCK_ROWS, end, ONEDNN_BLOCK_ROWS):
                self._fill_block(block, (False, True))

    def _fill_block(self, block: int, orientations: tuple[bool, ...]) -> None:
        """The block's layouts in `orientations` (False: W, True: Wᵀ) that are missing, all
        reordered from one dequantization of its rows, which are then handed back."""
        missing = [t for t in orientations if block not in (self._onednn_t if t else self._onednn)]
        if not missing:
            return
        rows = self.cached_rows(block, min(self.rows, block + ONEDNN_BLOCK_ROWS))
        for transposed in missing:
            (self._onednn_t if transposed else self._onednn)[block] = \
                torch.ops.mkldnn._reorder_linear_weight(
                    rows.t().contiguous() if transposed else rows, ONEDNN_ROWS_HINT)
        del rows
        release_free_heap()

    def _block_product(self, x: torch.Tensor, block: int, transposed: bool) -> torch.Tensor:
        """x · Bᵀ through oneDNN for B the block's bf16 rows starting at `block` (or, transposed,
        their Wᵀ), its layout reordered on first use and kept."""
        self._fill_block(block, (transposed,))
        layouts = self._onednn_t if transposed else self._onednn
        return torch.ops.mkldnn._linear_pointwise(x, layouts[block], None, "none", [], "")

    def _onednn_serves(self, x: torch.Tensor, chunk: torch.Tensor | None) -> bool:
        """A cache held as layouts, in a bf16 product (the rows as chunks yields them, or the
        caller's bf16 copy of them, not an f32 one)."""
        return (self.in_layouts and (chunk is None or chunk.dtype == torch.bfloat16)
                and _bf16_product(x))

    def _rows_or(self, chunk: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
        return chunk if chunk is not None else self.cached_rows(start, end)


ONEDNN_ROWS_HINT = 128   # the batch the layout is chosen for: fixed, so a run and its resume
                         # multiply alike (with 1 the sums round differently; 64-1024 agreed
                         # with torch's plain bf16 product bit for bit on AMX, 1-600 rows)


@functools.cache
def onednn_bf16() -> bool:
    """oneDNN is built in and multiplies bf16 on this CPU."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _bf16_product(x: torch.Tensor) -> bool:
    """A product with a bf16 weight runs in bf16: under bf16 autocast or outside autocast (where
    `in_cache_dtype` casts x to bf16); a gradient (x requiring it) never goes to oneDNN."""
    if x.requires_grad and torch.is_grad_enabled():
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") == torch.bfloat16
    return True


def llamacpp_matmul(x: torch.Tensor, w: PackedWeight, bitexact: bool = True) -> torch.Tensor:
    """x [..., cols] · Wᵀ as llama.cpp's CPU matmul computes it, with the product the layout table
    names for the weight's type: bit for bit where ggml_matmul has the type's kernel (and
    `bitexact`), else with llama.cpp's activation quantization and f32 sums."""
    return layout_of(w.ggml_type).llamacpp_product(x, w, bitexact)


def f16_matmul(x: torch.Tensor, w: PackedWeight, bitexact: bool = True) -> torch.Tensor:
    """f16 weights: activations rounded to f16, tinyBLAS where llamafile_sgemm takes the product,
    else ggml_vec_dot_f16 (the C build reads the halves itself); output rows are independent
    sums, so the weight goes chunk by chunk (never all in f32)."""
    if not bitexact:
        return activation_matmul(x, w)
    if kernels() is not None:
        return exact_matmul(x, w)
    rows = x.reshape(-1, w.cols).float()
    tinyblas = tinyblas_serves(w.rows, w.cols, rows.shape[0])
    x16 = round_f16(rows)[None]
    y = torch.cat([dot_f16(x16, chunk[None], tinyblas)[0] for _, _, chunk in w.chunks()], dim=-1)
    return y.reshape(*x.shape[:-1], w.rows)


def exact_matmul(x: torch.Tensor, w: PackedWeight, bitexact: bool = True) -> torch.Tensor:
    """llama.cpp's integer kernel for the weight's type, in its summation order
    (engine/kernels/ggml_matmul.py), where this machine's configuration has it; else
    `activation_matmul`."""
    if not bitexact or not (w.ggml_type == T.F16 or supports_exact(w.ggml_type, w.rows)):
        return activation_matmul(x, w)
    if w._exact is None:
        w._exact = ExactWeight(w.raw, w.ggml_type, w.rows, w.cols)
    y = w._exact.matmul(x.reshape(-1, w.cols).float())
    return y.reshape(*x.shape[:-1], w.rows)


def activation_matmul(x: torch.Tensor, w: PackedWeight, bitexact: bool = True) -> torch.Tensor:
    """The activations llama.cpp's matmul multiplies (quantized to the weight type's vec_dot
    type), times the dequantized weight in f32: llama.cpp's numbers up to the order of its
    sums."""
    return packed_matmul(activation_values(x, w.ggml_type), w)


def in_cache_dtype(product, x: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """product(x, chunk) where the dtypes agree or autocast casts both (a bf16 cache under bf16
    autocast is what autocast would have cast an f32 one to); else, a bf16 cache read outside
    autocast (sampling during a bf16 run), with x cast to bf16 as autocast would and the result
    back in x's dtype, rather than the whole matrix cast to f32 at every call."""
    if chunk.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return product(x, chunk)
    return product(x.to(chunk.dtype), chunk).to(x.dtype)


def packed_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [..., cols] · Wᵀ -> [..., rows], W dequantized chunk by chunk (or its dense cache), on
    the step's full thread count (`all_step_threads`)."""
    with all_step_threads():
        return _packed_matmul(x, w)


def _packed_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    if (layout := _whole_layout(w, _autocast_dtype(), False)) is not None \
            and not (x.requires_grad and torch.is_grad_enabled()):
        return _onednn_linear(x.to(torch.bfloat16), layout)
    parts = [w.product(x, start, end, chunk) for start, end, chunk in w.chunks()]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _autocast_dtype() -> torch.dtype | None:
    """The CPU autocast dtype where CPU autocast is on, else None."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _whole_layout(w: PackedWeight, autocast_dtype: torch.dtype | None,
                  transposed: bool) -> torch.Tensor | None:
    """W's oneDNN layout (or Wᵀ's), where one block holds the whole weight, that layout is
    filled, and the product runs in bf16 under bf16 autocast: the one `_block_product` that
    `product` (or `product_t`) would make, with its result in bf16 as theirs is under autocast;
    else None (their general walk over blocks and dtypes).

    Why: a layer's product goes through `chunks`, `product`, `_onednn_serves`, `_fill_block`
    and a loop over blocks to reach this one call; ~250 products a step of a LoRA on
    gemma-3-270m, each a few dozen microseconds of Python beside a product of ~1 ms."""
    if autocast_dtype != torch.bfloat16 or not w.in_layouts or w.rows > ONEDNN_BLOCK_ROWS:
        return None
    return (w._onednn_t if transposed else w._onednn).get(0)


def _onednn_linear(x: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layout, None, "none", [], "")


class _DequantMatmul(torch.autograd.Function):
    """y = x·Wᵀ with W re-dequantized for dx = dy·W; W gets no gradient and is never saved.
    The backward runs under the forward's CPU autocast state (as torch.amp.custom_bwd would
    run it: a bf16 dy), entered only where the one-layout product does not serve it."""

    @staticmethod
    def forward(ctx, x, w_holder):
        ctx.w = w_holder.weight
        ctx.w.fill_layouts(0, ctx.w.rows)          # the dx ahead reads Wᵀ: both at once
        ctx.autocast = _autocast_dtype()
        return packed_matmul(x, ctx.w)

    @staticmethod
    def backward(ctx, dy):
        return _frozen_dx_under(ctx.w, dy, ctx.autocast), None


def _frozen_dx_under(w: PackedWeight, dy: torch.Tensor,
                     autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """`_frozen_dx` as it runs under CPU autocast in `autocast_dtype` (None: autocast off), on
    the step's full thread count (`all_step_threads`)."""
    with all_step_threads():
        return _frozen_dx_under_threads(w, dy, autocast_dtype)


def _frozen_dx_under_threads(w: PackedWeight, dy: torch.Tensor,
                             autocast_dtype: torch.dtype | None) -> torch.Tensor:
    if (layout := _whole_layout(w, autocast_dtype, True)) is not None:
        return _onednn_linear(dy.to(torch.bfloat16), layout)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        return _frozen_dx(w, dy)


def _frozen_dx(w: PackedWeight, dy: torch.Tensor) -> torch.Tensor:
    """dy·W for a frozen packed W, chunk by chunk (Wᵀ's layouts where the cache holds them);
    `_frozen_dx_under` has taken the one-layout product where it serves."""
    dx = None
    for start, end, chunk in w.chunks():
        part = w.product_t(dy[..., start:end], start, end, chunk)
        dx = part if dx is None else dx + part
    return dx


class _AdaptedMatmul(torch.autograd.Function):
    """y = x·Wᵀ + scale·(x·Aᵀ)·Bᵀ for a frozen packed W and a LoRA pair A [r, in], B [out, r]:
    a LoRA layer without dropout as one autograd node. x is cast once for both products (under
    autocast), the delta is added inside its product (addmm), and dx sums both paths in x's
    dtype, as autograd summed them.

    Why: the two paths as plain ops are about fifteen nodes a layer (casts of x, A and B, two
    products, the scale, the add, and each one's backward) around products of a few MFLOP; the
    pirate LoRA has 36 of them a step.

    The backward's products are on operands already in the forward's dtype, so it needs no
    autocast of its own; the frozen dx runs under the forward's autocast state, as
    torch.amp.custom_bwd would run it (`_frozen_dx_under`)."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, w_holder, scale):
        w = w_holder.weight
        if x.requires_grad:
            w.fill_layouts(0, w.rows)              # the dx ahead reads Wᵀ: both at once
        y, xc, t, a, b = _adapted_product(x, lora_a, lora_b, w, scale)
        ctx.save_for_backward(xc, t, a, b)
        ctx.w, ctx.scale, ctx.autocast = w, scale, _autocast_dtype()
        ctx.dtypes = x.dtype, lora_a.dtype, lora_b.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, t, a, b = ctx.saved_tensors
        dyc = dy.to(xc.dtype)
        rank, out = t.shape[-1], dyc.shape[-1]
        # the delta's scale goes on the rank-wide factors (B and t, [out, r] and [N, r]), not
        # on dy [N, out]: one small product fewer over dy's size; with a power-of-two scale
        # (alpha/r: 16/8 in the pirate LoRA) the same bits as scaling dy first. Products of the
        # thin factors are taken transposed ([r, ...] · [..., out]), the layout oneDNN runs
        # fastest (the [out, N]·[N, r] grad_b: 57 -> 40 us at out 1024, one Zen 4 thread)
        flat = dyc.reshape(-1, out)
        dt = (b.t() * ctx.scale @ flat.t()).t()                         # [N, r]
        x_dtype, a_dtype, b_dtype = ctx.dtypes
        dx = None
        if ctx.needs_input_grad[0]:
            # the base path's dx in x's dtype, the adapter's added in place (in x's dtype, as
            # `.to(x_dtype) + .to(x_dtype)` summed them, without the second cast's copy)
            dx = _frozen_dx_under(ctx.w, dyc, ctx.autocast).to(x_dtype)
            dx = dx.add_((dt @ a).view(dx.shape))
        grad_a = dt.t() @ xc.reshape(-1, xc.shape[-1])                          # [r, in]
        grad_b = (t.reshape(-1, rank).t() * ctx.scale @ flat).t()               # [out, r]
        return dx, grad_a.to(a_dtype), grad_b.to(b_dtype), None, None


def _adapted_product(x, lora_a, lora_b, w: PackedWeight, scale: float):
    """(x·Wᵀ + scale·(x·Aᵀ)·Bᵀ, and the operands the backward reads: x, x·Aᵀ, A and B in the
    products' dtype), x cast once to autocast's dtype where autocast is on."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    xc, a, b = x.to(dtype), lora_a.to(dtype), lora_b.to(dtype)
    t = xc @ a.t()                                                      # [..., r]
    y = packed_matmul(xc, w).reshape(-1, w.rows)                        # [N, out]
    y.addmm_(t.view(-1, t.shape[-1]), b.t(), alpha=scale)
    return y.view(*x.shape[:-1], w.rows), xc, t, a, b


def adapted_matmul(base: nn.Module, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   scale: float) -> torch.Tensor | None:
    """base(x) + scale·(x·Aᵀ)·Bᵀ as one node (_AdaptedMatmul) where base is a FrozenQuantLinear
    on the CPU (no bias, not llama.cpp numerics); without a gradient the same arithmetic, so a
    model scored without grad (DPO's reference, an eval) gives the bits it trains with. Else
    None (the caller runs the two paths)."""
    if not (isinstance(base, FrozenQuantLinear) and base.bias is None
            and base.numerics != "llamacpp" and x.device.type == "cpu"):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or lora_a.requires_grad
                                    or lora_b.requires_grad):
        return _AdaptedMatmul.apply(x, lora_a, lora_b, base, scale)
    with torch.no_grad():
        return _adapted_product(x, lora_a, lora_b, base.weight, scale)[0]


class FrozenQuantLinear(nn.Module):
    """Linear layer over a frozen packed GGUF weight [out, in] (+ optional f32 bias)."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight              # not a Parameter: never trained, never in an optimizer
        self.in_features, self.out_features = weight.cols, weight.rows
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.numerics = "f32"
        self.bitexact = True              # under llama.cpp numerics: ggml's summation order too

    def _apply(self, fn, recurse=True):
        _move_packed(self.weight, fn)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics == "llamacpp":
            y = llamacpp_matmul(x, self.weight, self.bitexact)
        elif torch.is_grad_enabled() and x.requires_grad:
            y = _DequantMatmul.apply(x, self)
        else:
            y = packed_matmul(x, self.weight)
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        """The full f32 weight [out, in] (for merging/export; allocates it)."""
        return self.weight.rows_f32(0, self.weight.rows)

    def extra_repr(self) -> str:
        w = self.weight
        return (f"in={self.in_features}, out={self.out_features}, type={w.ggml_type.name}, "
                f"cache={w.cache_dtype or 'none'}{' (oneDNN layouts)' if w.in_layouts else ''}")


class PackedEmbedding(nn.Module):
    """Token embedding over a frozen packed weight: only the looked-up rows are dequantized."""

    def __init__(self, weight: PackedWeight):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.take_rows(tokens)

    def _apply(self, fn, recurse=True):
        _move_packed(self.weight, fn)
        return super()._apply(fn, recurse)


def _move_packed(weight: PackedWeight, fn) -> None:
    """`module.to(device)` moves a packed weight too (it is no Parameter or buffer); the
    device comes from what `fn` does to a probe tensor, and dtype casts never touch the bytes."""
    weight.move_to(fn(torch.empty(0)).device)
