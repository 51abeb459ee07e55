"""The weight-layout table: every way the engine stores a frozen weight matrix, with its byte
size, its dequantizer, its quantizer (if any) and its product kernels in both numerics.

A layout is one ggml block type (Q4_K, TQ2_0, ...) or a sum of such tensors (PTQTP's two
ternary planes: `name` and `name.plane2`, both TQ2_0 or both TQ1_0; the C kernel can take both
planes of a weight at once, ggml_kernels.c tq_rows). Each row names:

- `block`: (values, bytes) per block, ggml-common.h's sizes (a test holds them to the `gguf`
  package's GGML_QUANT_SIZES and to the quantizers' output);
- `dequantizer`: the torch kernel [n_blocks, bytes] uint8 -> [n_blocks, values] f32
  (engine/gguf/dequant.py: dequantize_<type>), element-exact against `gguf.quants.dequantize`;
- `quantizer`: the quantizer whose bytes equal ggml's reference one (engine/gguf/quantize.py),
  or None;
- `vec_dot`: the type llama.cpp quantizes a matmul's activations to for this weight
  (ggml-cpu type_traits' vec_dot_type; None: they stay f32);
- `llamacpp`: the product under llama.cpp numerics (engine/models/packed.py): `ggml_matmul`
  (llama.cpp's integer kernels and summation order reproduced bit for bit, C or torch), `f16_dot`
  (f16-rounded activations, tinyBLAS / ggml_vec_dot_f16 order) or `activations` (llama.cpp's
  activation quantization, then f32 sums: the right numbers, not its summation order);
- `native`: the C build (ggml_kernels.c) has the layout's kernel, under this type id.

The f32-numerics product of every layout is the same: dequantize row chunks, multiply in torch
(`packed_matmul`). A multi-plane layout's dequantizer and products are the sums over its planes
of its plane layout's.

Kernels are named as "module:function" and imported on first use, so this table (and
engine/gguf/constants.py, which reads it) stays importable without torch. Adding a layout is a
row here plus its kernels; tests/test_weight_layouts.py checks every row.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

F32_PRODUCT = "engine.models.packed:packed_matmul"
QUANTIZER = "engine.gguf.quantize:quantize"        # (values, ggml_type) -> bytes
LLAMACPP_PRODUCTS = {
    "ggml_matmul": "engine.models.packed:exact_matmul",
    "f16_dot": "engine.models.packed:f16_matmul",
    "activations": "engine.models.packed:activation_matmul",
}


@functools.cache
def resolve(ref: str):
    """'package.module:function' -> the function (imported on first use)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Layout:
    """One stored layout (see the module docstring for the fields)."""

    name: str
    ggml_type: T                  # the type of each stored tensor
    block: tuple[int, int]        # (values, bytes) per block of one plane
    dequantizer: str
    vec_dot: T | None
    llamacpp: str                 # a key of LLAMACPP_PRODUCTS
    quantizer: str | None = None
    native: bool = False
    planes: tuple[str, ...] = ("",)   # tensor-name suffixes whose weights are summed

    @property
    def block_values(self) -> int:
        return self.block[0]

    @property
    def block_bytes(self) -> int:
        return self.block[1]

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of one plane (`cols` a multiple of the block)."""
        if cols % self.block_values:
            raise ValueError(f"{self.name} needs rows that are a multiple of "
                             f"{self.block_values} values, not {cols}")
        return cols // self.block_values * self.block_bytes

    def nbytes(self, rows: int, cols: int) -> int:
        """The stored size of a [rows, cols] matrix, all planes."""
        return len(self.planes) * rows * self.row_bytes(cols)

    def bits_per_weight(self) -> float:
        return 8.0 * len(self.planes) * self.block_bytes / self.block_values

    @property
    def dequantize_blocks(self):
        """[n, block bytes] uint8 -> [n, block values] f32 for one plane."""
        return resolve(self.dequantizer)

    @property
    def quantize_rows(self):
        """f32 [..., cols] -> uint8 [..., row bytes] (numpy), or None without a quantizer."""
        if self.quantizer is None:
            return None
        return functools.partial(resolve(self.quantizer), ggml_type=self.ggml_type)

    @property
    def f32_product(self):
        """(x [..., cols], weight: PackedWeight) -> x·Wᵀ, f32 numerics, one plane."""
        return resolve(F32_PRODUCT)

    @property
    def llamacpp_product(self):
        """(x, weight: PackedWeight, bitexact) -> x·Wᵀ as llama.cpp's CPU matmul, one plane."""
        return resolve(LLAMACPP_PRODUCTS[self.llamacpp])

    def dequantize(self, planes, shape):
        """The f32 matrix of `shape` that the planes' bytes (one uint8 tensor per plane, in
        `planes` order) stand for: the sum of each plane's dequantization."""
        total = None
        for raw in planes:
            blocks = raw.reshape(-1).view(-1, self.block_bytes)
            part = self.dequantize_blocks(blocks).reshape(tuple(shape))
            total = part if total is None else total + part
        return total

    def product(self, x, weights, numerics: str = "f32", bitexact: bool = True):
        """x [..., cols] · Wᵀ for W the sum of `weights` (one PackedWeight per plane): the sum of
        the per-plane products in `numerics` ("f32" or "llamacpp")."""
        plane = BY_TYPE[self.ggml_type]
        y = None
        for w in weights:
            part = (plane.f32_product(x, w) if numerics == "f32"
                    else plane.llamacpp_product(x, w, bitexact))
            y = part if y is None else y + part
        return y


def _ggml(kind: T, values: int, nbytes: int, vec_dot: T | None, llamacpp: str,
          quantizer: bool = False, native: bool = False) -> Layout:
    """A ggml block type's row: its kernels are dequant.dequantize_<type> and
    quantize.quantize_<type>."""
    name = kind.name
    return Layout(name, kind, (values, nbytes), f"engine.gguf.dequant:dequantize_{name.lower()}",
                  vec_dot, llamacpp, QUANTIZER if quantizer else None, native)


# one ggml block type each; block sizes from ggml-common.h
BLOCK_LAYOUTS: tuple[Layout, ...] = (
    _ggml(T.F32, 1, 4, None, "activations"),
    _ggml(T.F16, 1, 2, T.F16, "f16_dot", native=True),
    _ggml(T.BF16, 1, 2, T.BF16, "activations"),
    _ggml(T.Q8_0, 32, 34, T.Q8_0, "ggml_matmul", quantizer=True, native=True),
    _ggml(T.Q4_0, 32, 18, T.Q8_0, "ggml_matmul", quantizer=True, native=True),
    _ggml(T.Q4_1, 32, 20, T.Q8_1, "ggml_matmul", quantizer=True, native=True),
    _ggml(T.Q5_0, 32, 22, T.Q8_0, "ggml_matmul", quantizer=True, native=True),
    _ggml(T.Q5_1, 32, 24, T.Q8_1, "ggml_matmul", quantizer=True, native=True),
    _ggml(T.Q4_K, 256, 144, T.Q8_K, "ggml_matmul", quantizer=True, native=True),
    _ggml(T.Q5_K, 256, 176, T.Q8_K, "ggml_matmul", quantizer=True, native=True),
    _ggml(T.Q6_K, 256, 210, T.Q8_K, "ggml_matmul", quantizer=True, native=True),
    _ggml(T.TQ2_0, 256, 66, T.Q8_K, "ggml_matmul", native=True),
    _ggml(T.TQ1_0, 256, 54, T.Q8_K, "ggml_matmul", native=True),
)
BY_TYPE: dict[T, Layout] = {layout.ggml_type: layout for layout in BLOCK_LAYOUTS}

# PTQTP (arXiv 2509.16989; engine/ptqtp): W = plane 1 + plane 2, each a ternary tensor of
# llama.cpp's (TQ2_0: 2 bits a trit; TQ1_0: 5 trits a byte)
PTQTP_PLANE2_SUFFIX = ".plane2"


def _planes(kind: T) -> Layout:
    one = BY_TYPE[kind]
    return Layout(f"PTQTP_2_{kind.name}", kind, one.block, one.dequantizer, one.vec_dot,
                  one.llamacpp, None, False, ("", PTQTP_PLANE2_SUFFIX))


PTQTP_2 = _planes(T.TQ2_0)
PTQTP_2_TQ1 = _planes(T.TQ1_0)
PTQTP_LAYOUTS = (PTQTP_2, PTQTP_2_TQ1)

LAYOUTS: dict[str, Layout] = {**{layout.name: layout for layout in BLOCK_LAYOUTS},
                              **{layout.name: layout for layout in PTQTP_LAYOUTS}}

FLOAT_TYPES: tuple[T, ...] = (T.F32, T.F16, T.BF16)


def layout_of(ggml_type: T) -> Layout | None:
    """The single-plane layout of a ggml type (None: the engine has no kernels for it)."""
    try:
        return BY_TYPE.get(T(ggml_type))
    except ValueError:
        return None


def plane_layout(layout: Layout) -> Layout:
    """The layout of one of `layout`'s planes (itself for a single-plane layout)."""
    return BY_TYPE[layout.ggml_type]


def stored_layout(tensor_names, name: str, ggml_type: T) -> Layout | None:
    """The layout a file stores tensor `name` (of `ggml_type`) in: a multi-plane layout when every
    one of its plane tensors is there, else the type's own layout."""
    names = tensor_names if isinstance(tensor_names, (set, frozenset, dict)) else set(tensor_names)
    for layout in LAYOUTS.values():
        if (len(layout.planes) > 1 and layout.ggml_type == T(ggml_type)
                and all(name + suffix in names for suffix in layout.planes)):
            return layout
    return layout_of(ggml_type)


def plane_suffixes() -> tuple[str, ...]:
    """Every extra-plane suffix a multi-plane layout uses (tensors that are a weight's part)."""
    return tuple(dict.fromkeys(s for layout in LAYOUTS.values() for s in layout.planes if s))


__all__ = ["BLOCK_LAYOUTS", "BY_TYPE", "FLOAT_TYPES", "LAYOUTS", "Layout", "PTQTP_2",
           "PTQTP_2_TQ1", "PTQTP_LAYOUTS", "PTQTP_PLANE2_SUFFIX", "layout_of", "plane_layout",
           "plane_suffixes", "resolve", "stored_layout"]
