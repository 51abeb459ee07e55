"""Build a runnable model from a GGUF file without dequantizing it up front.

The module tree is built on the meta device (no memory), then every linear and the embedding is
bound to its packed bytes in the file's memory map (FrozenQuantLinear / PackedEmbedding) and the
small f32 tensors (norms, biases) are copied in. Shapes, vocabulary size and quant types are
checked against the metadata, each mismatch reported with the file and the tensor or key.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from engine.errors import ForgebenchError
from engine.gguf.constants import LAYER_TENSORS
from engine.gguf.dequant import dequantize
from engine.gguf.hparams import model_hparams
from engine.gguf.layouts import stored_layout
from engine.gguf.reader import GGUFFile, open_gguf
from engine.kernels.native import kernels
from engine.kernels.numerics import NUMERICS, attention_llamacpp
from engine.models.blocks import Attention, RMSNorm
from engine.models.gemma3 import Gemma3, Gemma3Config
from engine.models.llama import Llama, LlamaConfig
from engine.models.packed import FrozenQuantLinear, PackedEmbedding, PackedWeight
from engine.models.qwen import qwen2_config, qwen3_config
from engine.ptqtp.weight import frozen_linear

WEIGHTS = ("packed", "dense-cache")

_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_")


@contextmanager
def _meta_modules():
    """Build modules on the meta device with their initializers switched off. Initializing a meta
    tensor changes nothing, but torch runs `normal_` on meta through a Python reference that
    first imports torch._dynamo, which costs seconds of every load."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def config_from_gguf(gf: GGUFFile) -> LlamaConfig | Gemma3Config:
    """The family config from GGUF metadata (engine.gguf.hparams reads and checks it)."""
    arch, fields = model_hparams(gf)
    if arch == "gemma3":
        return Gemma3Config(**fields)
    build = {"llama": LlamaConfig, "qwen2": qwen2_config, "qwen3": qwen3_config}[arch]
    return build(**fields)


def _packed(gf: GGUFFile, name: str, shape: tuple[int, int]) -> PackedWeight:
    info = gf.tensor(name)
    gf.check_type(info)
    if tuple(info.shape) != tuple(shape):
        raise ForgebenchError(f"tensor {name!r} has shape {info.shape}, the metadata implies "
                              f"{shape}", path=gf.path, where=name,
                              hint="the file's metadata and weights disagree")
    return PackedWeight(torch.from_numpy(info.raw), info.ggml_type, shape[0], shape[1], name)


def _dense(gf: GGUFFile, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    info = gf.tensor(name)
    gf.check_type(info)
    if tuple(info.shape) != tuple(shape):
        raise ForgebenchError(f"tensor {name!r} has shape {info.shape}, expected {shape}",
                              path=gf.path, where=name,
                              hint="the file's metadata and weights disagree")
    return dequantize(torch.from_numpy(info.raw), info.ggml_type, shape, name).clone()


def _bind(model: nn.Module, gf: GGUFFile) -> None:
    """Replace every meta-device module/parameter with the file's tensors."""
    n_vocab, dim = model.config.vocab_size, model.config.dim
    embd = _packed(gf, "token_embd.weight", (n_vocab, dim))
    model.tok_embeddings = PackedEmbedding(embd)
    model.output = FrozenQuantLinear(embd if model.config.tie_embeddings
                                     else _packed(gf, "output.weight", (n_vocab, dim)))
    # the torch reference kernel would need ~10 GB of lane intermediates over a 262k vocabulary;
    # without the C build the head is summed in f32 order (logits feed no later requantization,
    # so only exact ties could differ)
    model.output.bitexact = kernels() is not None
    model.norm.weight = nn.Parameter(_dense(gf, "output_norm.weight", (dim,)), requires_grad=False)
    for i, layer in enumerate(model.layers):
        for path, gname in LAYER_TENSORS.items():
            parent_path, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_path) if parent_path else layer
            module = getattr(parent, attr, None)
            if module is None:
                continue
            tname = f"blk.{i}.{gname}.weight"
            if isinstance(module, nn.Linear):
                bias = None
                if module.bias is not None:
                    bias = _dense(gf, f"blk.{i}.{gname}.bias", (module.out_features,))
                shape = (module.out_features, module.in_features)
                # the weight-layout table says which tensors hold it (a PTQTP file's two planes)
                layout = stored_layout(gf.tensors, tname, gf.tensor(tname).ggml_type)
                planes = [_packed(gf, tname + suffix, shape)
                          for suffix in (layout.planes if layout else ("",))]
                setattr(parent, attr, frozen_linear(layout, planes, bias))
            else:                                                        # RMSNorm
                module.weight = nn.Parameter(_dense(gf, tname, tuple(module.weight.shape)),
                                             requires_grad=False)
    if isinstance(model, Llama) and "rope_freqs.weight" in gf.tensors:
        model.rope_freq_factors = _dense(gf, "rope_freqs.weight", (model.config.head_dim // 2,))
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_meta:
            raise ForgebenchError(f"no tensor in the file for {name}", path=gf.path, where=name)


def set_numerics(model: nn.Module, numerics: str) -> None:
    """Switch between plain f32 ("f32", for training) and llama.cpp's arithmetic ("llamacpp")."""
    if numerics not in NUMERICS:
        raise ForgebenchError(f"numerics must be one of {NUMERICS}, not {numerics!r}",
                              where="numerics")
    llamacpp = numerics == "llamacpp"
    model.numerics = numerics
    model.kv_dtype = torch.float16 if llamacpp else torch.float32
    model.attn_core = attention_llamacpp if llamacpp else None
    for m in model.modules():
        if isinstance(m, FrozenQuantLinear):
            m.numerics = numerics
        if isinstance(m, (RMSNorm, Attention)):
            m.ggml_exact = llamacpp
        if getattr(m, "activation", None) in ("gelu_tanh", "gelu_llamacpp"):
            m.activation = "gelu_llamacpp" if llamacpp else "gelu_tanh"
        elif getattr(m, "activation", None) in ("silu", "silu_llamacpp"):
            m.activation = "silu_llamacpp" if llamacpp else "silu"


def packed_weights(model: nn.Module) -> list[PackedWeight]:
    seen: dict[int, PackedWeight] = {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, PackedWeight):
            seen[id(w)] = w
    return list(seen.values())


def memory_report(model: nn.Module) -> dict:
    """Bytes each weight mode costs: packed (memory-mapped), the plain dense caches, and a full
    f32 copy; and the bf16 caches held as oneDNN layouts, which the first products fill (W for
    every weight, Wᵀ for a layer's dx and the LM head's gradient: a bf16 run's cache comes to at
    most what the f32 cache would, with no plain copy beside it)."""
    weights = packed_weights(model)
    small = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"packed_bytes": sum(w.packed_bytes for w in weights),
            "dense_cache_bytes": sum(w.cache_bytes for w in weights),
            "onednn_layout_bytes": sum(w.layout_bytes for w in weights),
            "f32_dense_bytes": sum(w.rows * w.cols * 4 for w in weights),
            "bf16_dense_bytes": sum(w.rows * w.cols * 2 for w in weights),
            "small_f32_bytes": small}


def load_gguf_model(path: str | Path, numerics: str = "f32", weights: str = "packed",
                    cache_dtype: torch.dtype | None = None, tokenizer: bool = True,
                    lazy_cache: bool = True):
    """(model, tokenizer) for a llama/qwen2/qwen3/gemma3 GGUF, or a Hugging Face checkpoint
    folder of those families (converted in memory at its own precision, engine.hf.load).

    weights="packed" dequantizes on the fly; "dense-cache" keeps each layer's weight dequantized
    (f32, or `cache_dtype`, e.g. torch.bfloat16 for f32-numerics training), filled as each layer
    first runs unless `lazy_cache=False`. The model is frozen:
    train LoRA adapters beside it. `model.gguf` is the open file, `memory_report(model)` the cost.
    """
    if weights not in WEIGHTS:
        raise ForgebenchError(f"weights must be one of {WEIGHTS}, not {weights!r}", where="weights")
    if Path(path).is_dir():          # a Hugging Face checkpoint folder (engine.hf.load)
        from engine.hf.load import open_hf

        gf = open_hf(path)
    else:
        gf = open_gguf(path)
    cfg = config_from_gguf(gf)
    with _meta_modules():
        model = Gemma3(cfg) if isinstance(cfg, Gemma3Config) else Llama(cfg)
    _bind(model, gf)
    model.gguf = gf
    model.requires_grad_(False)
    set_numerics(model, numerics)
    if weights == "dense-cache":
        dtype = cache_dtype or torch.float32
        if numerics == "llamacpp" and dtype != torch.float32:
            raise ForgebenchError(
                "llama.cpp numerics need the exact weights: use an f32 dense cache",
                where="cache_dtype",
            )
        for w in packed_weights(model):
            w.cache(dtype, lazy=lazy_cache)
    model.eval()
    tok = None
    if tokenizer:
        from engine.llm.tokenizer import GGUFTokenizer

        tok = GGUFTokenizer.from_gguf(gf)
    return model, tok


def densify(model: nn.Module, path: Path, quantized_ok: bool = False) -> None:
    """Replace a GGUF's frozen packed linears and embedding by dense modules holding the
    dequantized weights (full fine-tuning needs float weights; gradient checks accept any)."""
    packed = [(name, m) for name, m in model.named_modules()
              if isinstance(m, (FrozenQuantLinear, PackedEmbedding))]
    quantized = sorted({m.weight.ggml_type.name for _, m in packed} - {"F32", "F16", "BF16"})
    if quantized and not quantized_ok:
        raise ForgebenchError(
            "full fine-tuning needs a dense base; this one keeps packed quantized weights ("
            + ", ".join(quantized) + ")", path=path, where="field 'lora.method'",
            hint="use method = \"lora\" (QLoRA) on a quantized GGUF, or start from an "
                 "f32/f16/bf16 GGUF")
    tied = model.output is not None and model.output.weight is model.tok_embeddings.weight
    for name, module in packed:
        if tied and name == "output":
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight = module.weight.rows_f32(0, module.weight.rows)
        if isinstance(module, PackedEmbedding):
            dense = nn.Embedding.from_pretrained(weight, freeze=False)
        else:
            dense = nn.Linear(module.in_features, module.out_features,
                              bias=module.bias is not None, device="meta")
            dense.weight = nn.Parameter(weight)
            if module.bias is not None:
                dense.bias = nn.Parameter(module.bias.detach().clone())
        setattr(parent, attr, dense)
    if tied:
        model.output = None   # logits() then uses the (trainable) embedding matrix
