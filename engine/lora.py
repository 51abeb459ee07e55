"""LoRA adapters beside frozen linear layers: y = base(x) + (alpha/r) · B(A(dropout(x))).

The base is any module with `forward(x)` (a dense `nn.Linear` or a frozen packed-quant linear
that dequantizes on the fly); it stays frozen and only A and B go to the optimizer. A starts
kaiming-uniform from a seed derived from (seed, layer, target), B starts at exact zeros, so the
adapted model *is* the base model at step 0 and dL/dA is exactly zero until B moves.

Dropout masks are never stored: each is regenerated from a seed derived from
(seed, step, micro-batch, layer, target), so activation checkpointing recomputes the same mask
and a resumed run replays the same dropout stream.

Adapters are saved as safetensors named `layers.<i>.<target>.lora_{a,b}`, with rank, alpha,
targets and the base file's SHA-256 in the metadata; loading refuses any mismatch. This module
owns that file: its name in a checkpoint (ADAPTERS_FILE) and the parsing of its metadata
(`adapter_info`), for training, generation and export alike.

Under llama.cpp numerics (a base whose `numerics` is "llamacpp", without grad) an adapted layer
computes what llama.cpp computes with the adapter exported as a GGUF LoRA, bit for bit:
`LoRALinear.llamacpp_forward` (llama-graph.cpp build_lora_mm; docs/numerics.md).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ForgebenchError
from engine.models.packed import adapted_matmul

ATTN_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
TARGETS = ATTN_TARGETS + MLP_TARGETS
FORMAT = "forgebench-lora-1"
ADAPTERS_FILE = "adapters.safetensors"       # what an lm-sft LoRA checkpoint holds


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any tuple of ints/strings (same on every machine and version)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _features(base: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a dense or packed linear module."""
    if hasattr(base, "in_features") and hasattr(base, "out_features"):
        return int(base.in_features), int(base.out_features)
    weight = getattr(base, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[1]), int(weight.shape[0])
    raise TypeError(f"cannot tell the shape of {type(base).__name__}: it needs in_features and "
                    "out_features, or a 2-D weight [out, in]")


class DropoutClock:
    """Which (step, micro-batch) the next forward belongs to; shared by all adapters of a model.

    The trainer sets it before each micro-batch; it is part of the resume state via the step.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self.step = 0
        self.micro = 0

    def set(self, step: int, micro: int = 0) -> None:
        self.step, self.micro = step, micro


def llamacpp_lora_scale(alpha: float, rank: int) -> torch.Tensor:
    """llama.cpp's adapter scale, an f32 scalar: adapter_scale · alpha / rank in f32 with
    adapter_scale 1 (llama-cpp-python's lora_scale); an alpha of 0 means no alpha there, 1."""
    one, a, r = (torch.tensor(v, dtype=torch.float32) for v in (1.0, alpha, float(rank)))
    return one * a / r if alpha else one


class LoRALinear(nn.Module):
    """A frozen linear `base` plus a trainable rank-r correction."""

    def __init__(self, base: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
                 seed: int = 0, layer: int = 0, target: str = "q",
                 clock: DropoutClock | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        in_features, out_features = _features(base)
        if not 1 <= rank <= min(in_features, out_features):
            raise ForgebenchError(
                f"LoRA rank {rank} is outside 1..{min(in_features, out_features)} for "
                f"{target} [{out_features}x{in_features}]", where="field 'lora.rank'",
                hint="a rank wider than the matrix is just a slower dense update")
        if not 0.0 <= dropout < 1.0:
            raise ForgebenchError(f"LoRA dropout {dropout} must be in [0, 1)",
                                  where="field 'lora.dropout'")
        self.base = base
        for param in base.parameters():
            param.requires_grad_(False)
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.alpha, self.scale = rank, float(alpha), float(alpha) / rank
        self.dropout, self.layer, self.target = float(dropout), layer, target
        self.clock = clock if clock is not None else DropoutClock(seed)
        # A [r, in]: kaiming-uniform, a=sqrt(5) (nn.Linear's and PEFT's default): U(±1/sqrt(in))
        generator = torch.Generator().manual_seed(derive_seed(seed, "lora_a", layer, target))
        bound = 1.0 / math.sqrt(in_features)
        a = (torch.rand(rank, in_features, generator=generator, dtype=torch.float64) * 2 - 1)
        self.lora_a = nn.Parameter((a * bound).to(dtype))
        # B [out, r]: exact zeros, so the adapted layer starts as the base layer, bit for bit.
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype))

    def dropout_mask(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverted-dropout mask regenerated from (seed, step, micro, layer, target)."""
        clock = self.clock
        generator = torch.Generator().manual_seed(
            derive_seed(clock.seed, "dropout", clock.step, clock.micro, self.layer, self.target))
        keep = torch.rand(shape, generator=generator) >= self.dropout
        return keep.to(dtype) / (1.0 - self.dropout)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha/r) · B(A(dropout(x))): two thin matmuls, never the [out, in] product."""
        if self.training and self.dropout > 0:
            x = x * self.dropout_mask(x.shape, x.dtype).to(x.device)
        a, b = self.lora_a, self.lora_b
        return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if getattr(self.base, "numerics", None) == "llamacpp" and not torch.is_grad_enabled():
            return self.llamacpp_forward(x)
        if not (self.training and self.dropout > 0):    # both paths as one node where it can
            fused = adapted_matmul(self.base, x, self.lora_a, self.lora_b, self.scale)
            if fused is not None:
                return fused
        return self.base(x) + self.delta(x)

    @torch.no_grad()
    def llamacpp_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What llama.cpp computes for this layer with the adapter loaded as a GGUF LoRA
        (llama-graph.cpp build_lora_mm): res = mul_mat(W, x); ab = mul_mat(B, mul_mat(A, x)),
        both f32 x f32 products (the GGUF adapter is F32, engine/export/lora_export.py) summed
        as ggml sums them (numerics.matmul_f32); ab = ggml_scale(ab, s) with s formed in f32
        as llama_adapter_lora_weight::get_scale forms it (1.0f · alpha / rank, alpha as the
        GGUF stores it: f32); res + ab."""
        from engine.kernels.numerics import matmul_f32

        flat = x.reshape(-1, x.shape[-1]).float()
        t = matmul_f32(flat, self.lora_a)                               # [N, r], f32
        ab = matmul_f32(t, self.lora_b) * llamacpp_lora_scale(self.alpha, self.rank)
        return self.base(x) + ab.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, "
                f"alpha={self.alpha:g}, dropout={self.dropout:g}")


def target_module(target: str) -> str:
    """The module path of a target projection inside a decoder block ("q" -> "attn.q")."""
    return ("attn." if target in ATTN_TARGETS else "mlp.") + target


def projection(block: nn.Module, target: str) -> tuple[nn.Module, str]:
    """(parent module, attribute) of a target projection in a decoder block."""
    if target in ATTN_TARGETS:
        return block.attn, target
    if target in MLP_TARGETS:
        return block.mlp, target
    raise ForgebenchError(f"unknown LoRA target '{target}'", where="field 'lora.targets'",
                          hint="choose from " + ", ".join(TARGETS))


def freeze(model: nn.Module) -> None:
    """Mark every existing parameter of `model` as frozen (no grad, not for the optimizer)."""
    for param in model.parameters():
        param.requires_grad_(False)


def attach_lora(model: nn.Module, *, targets: list[str] | tuple[str, ...], rank: int,
                alpha: float, dropout: float = 0.0, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict[str, LoRALinear]:
    """Freeze `model` and wrap the target projections of every layer with LoRA.

    Returns the adapters by name `layers.<i>.<target>`, in layer order.
    """
    if not targets:
        raise ForgebenchError("no LoRA targets given", where="field 'lora.targets'",
                              hint="choose a subset of " + ", ".join(TARGETS))
    for target in targets:
        projection(model.layers[0], target)  # validates the name
    freeze(model)
    clock = DropoutClock(seed)
    adapters: dict[str, LoRALinear] = {}
    for index, block in enumerate(model.layers):
        for target in sorted(set(targets), key=TARGETS.index):
            parent, attr = projection(block, target)
            base = getattr(parent, attr)
            if isinstance(base, LoRALinear):
                raise ForgebenchError(f"layers.{index}.{target} already has a LoRA adapter")
            adapter = LoRALinear(base, rank=rank, alpha=alpha, dropout=dropout, seed=seed,
                                 layer=index, target=target, clock=clock, dtype=dtype)
            setattr(parent, attr, adapter)
            adapters[f"layers.{index}.{target}"] = adapter
    model.lora_clock = clock
    return adapters


def lora_parameters(adapters: dict[str, LoRALinear]) -> list[nn.Parameter]:
    """The trainable factors, in a fixed order (A then B per adapter): what the optimizer gets."""
    return [p for adapter in adapters.values() for p in (adapter.lora_a, adapter.lora_b)]


def adapter_state(adapters: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    """`layers.<i>.<target>.lora_{a,b}` -> tensor (detached, contiguous, CPU)."""
    state = {}
    for name, adapter in adapters.items():
        state[f"{name}.lora_a"] = adapter.lora_a.detach().cpu().contiguous()
        state[f"{name}.lora_b"] = adapter.lora_b.detach().cpu().contiguous()
    return state


def adapter_metadata(adapters: dict[str, LoRALinear], base_sha256: str | None) -> dict[str, str]:
    """What a saved adapter must agree on with the model it is loaded into (strings only)."""
    first = next(iter(adapters.values()))
    targets = sorted({a.target for a in adapters.values()}, key=TARGETS.index)
    return {"format": FORMAT, "rank": str(first.rank), "alpha": repr(first.alpha),
            "targets": ",".join(targets),
            "layers": str(1 + max(a.layer for a in adapters.values())),
            "base_sha256": base_sha256 or ""}


def adapter_bytes(adapters: dict[str, LoRALinear], base_sha256: str | None) -> bytes:
    """The adapters as one safetensors blob (for checkpoint.extra_files or a plain file)."""
    from safetensors.torch import save

    return save(adapter_state(adapters), metadata=adapter_metadata(adapters, base_sha256))


def save_adapters(path: str | os.PathLike, adapters: dict[str, LoRALinear],
                  base_sha256: str | None) -> Path:
    from engine.fsutil import atomic_write_bytes

    atomic_write_bytes(path, adapter_bytes(adapters, base_sha256))
    return Path(path)


def read_adapters(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of an adapters.safetensors file, with a clear error when unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except FileNotFoundError:
        raise ForgebenchError("adapter file not found", path=path) from None
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ForgebenchError(f"not a readable safetensors file ({exc})", path=path,
                              hint="the file may be truncated; use another checkpoint") from None
    if metadata.get("format") != FORMAT:
        raise ForgebenchError(f"not a Forgebench LoRA adapter file (format "
                              f"{metadata.get('format')!r}, expected {FORMAT!r})", path=path)
    return tensors, metadata


def load_adapters(path: str | os.PathLike, adapters: dict[str, LoRALinear],
                  base_sha256: str | None) -> dict[str, str]:
    """Copy saved factors into `adapters`; refuse a different base, rank, alpha or target set.

    Nothing is modified unless every check passes.
    """
    tensors, metadata = read_adapters(path)
    expected = adapter_metadata(adapters, base_sha256)
    for key, what in (("base_sha256", "base model SHA-256"), ("rank", "rank"),
                      ("alpha", "alpha"), ("targets", "targets"), ("layers", "layer count")):
        if key == "base_sha256" and not (expected[key] and metadata.get(key)):
            continue  # a base without a file (a from-scratch model) has no hash to compare
        if metadata.get(key) != expected[key]:
            raise ForgebenchError(
                f"adapter {what} is {metadata.get(key)!r} but this model expects "
                f"{expected[key]!r}", path=path, where=f"metadata '{key}'",
                hint="load adapters only into the base and LoRA settings they were trained with")
    names = set(adapter_state(adapters))
    if set(tensors) != names:
        missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
        raise ForgebenchError(f"adapter tensors do not match the model (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})", path=path)
    for name, adapter in adapters.items():
        for kind, param in (("lora_a", adapter.lora_a), ("lora_b", adapter.lora_b)):
            if tensors[f"{name}.{kind}"].shape != param.shape:
                raise ForgebenchError(
                    f"tensor shape {list(tensors[f'{name}.{kind}'].shape)} != "
                    f"{list(param.shape)}", path=path, where=f"tensor '{name}.{kind}'")
    with torch.no_grad():
        for name, adapter in adapters.items():
            adapter.lora_a.copy_(tensors[f"{name}.lora_a"])
            adapter.lora_b.copy_(tensors[f"{name}.lora_b"])
    return metadata


def describe_adapters(adapters: dict[str, LoRALinear]) -> dict:
    """Counts for logs and the run manifest."""
    trainable = sum(p.numel() for p in lora_parameters(adapters))
    metadata = adapter_metadata(adapters, None)
    del metadata["base_sha256"]
    return {"adapters": len(adapters), "trainable_parameters": trainable, **metadata}


@dataclass(frozen=True)
class AdapterInfo:
    """What a saved adapter file says about itself (its safetensors metadata, parsed)."""
    rank: int
    alpha: float
    targets: list[str]
    base_sha256: str             # "" for a base without a file (a from-scratch model)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapter_info(metadata: dict[str, str], path: str | os.PathLike) -> AdapterInfo:
    """Parse an adapter file's metadata; incomplete or nonsensical values are refused."""
    try:
        info = AdapterInfo(int(metadata["rank"]), float(metadata["alpha"]),
                           metadata["targets"].split(","), metadata.get("base_sha256", ""))
    except (KeyError, ValueError) as exc:
        raise ForgebenchError(f"adapter metadata is incomplete ({exc})", path=path,
                              where="safetensors metadata") from None
    if info.rank < 1 or not math.isfinite(info.alpha) \
            or not set(info.targets) <= set(TARGETS):
        raise ForgebenchError(f"adapter metadata is invalid (rank {info.rank}, alpha "
                              f"{info.alpha}, targets {info.targets})", path=path,
                              where="safetensors metadata")
    return info


def attach_adapter_file(model, path: str | os.PathLike) -> None:
    """Attach the adapters saved in `path` to a GGUF model (`model.gguf` the open file), with
    the rank, alpha and targets its metadata records; the base must be the one it was trained
    on."""
    _, meta = read_adapters(path)
    info = adapter_info(meta, path)
    adapters = attach_lora(model, targets=info.targets, rank=info.rank, alpha=info.alpha)
    load_adapters(path, adapters, model.gguf.sha256())
