"""A Forgebench LoRA adapter as a GGUF LoRA adapter for llama.cpp (`--lora`, llama-cpp-python's
`lora_path`) and as a PEFT adapter (`adapter_model.safetensors` + `adapter_config.json`).

GGUF LoRA (as llama.cpp's convert_lora_to_gguf.py writes it and llama-adapter.cpp reads it):
`general.type = "adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha`, the base's
`general.architecture`, and per adapted weight `<gguf name>.lora_a` [r, in] and `.lora_b`
[out, r] (torch order; ggml's ne = [in, r] and [r, out]). llama.cpp scales by alpha / r with r
read from lora_a, which is exactly the engine's scale.

PEFT: keys `base_model.model.model.layers.<i>.<module>.lora_{A,B}.weight` with HF module names.
A llama-architecture GGUF converted from HF stores q and k with their rows permuted (HF rotates
halves, llama.cpp adjacent pairs), so for a `llama` base lora_b of q and k is permuted back.
Qwen2/Qwen3/Gemma3 are stored unpermuted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from engine.errors import ForgebenchError
from engine.export.merge import Adapter, load_adapter
from engine.fsutil import atomic_write_bytes, atomic_write_text
from engine.gguf.constants import ADAPTER_BASE_SHA_KEY
from engine.gguf.reader import open_gguf
from engine.gguf.writer import MetaValue, TensorEntry, write_gguf

HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def _base_content(base: str | Path, adapter: Adapter):
    """The base's metadata and tensor table (tensor shapes checked against the adapter)."""
    from engine.gguf.writer import read_gguf_content

    content = read_gguf_content(base)
    tensors = {t.name: t for t in content.tensors}
    for name, gguf_name in adapter.gguf_names().items():
        if gguf_name not in tensors:
            raise ForgebenchError(f"the base has no tensor {gguf_name!r} for adapter {name}",
                                  path=base, where=gguf_name)
        out_f, in_f = tensors[gguf_name].shape
        if adapter.a[name].shape != (adapter.rank, in_f) or \
                adapter.b[name].shape != (out_f, adapter.rank):
            raise ForgebenchError(f"adapter {name} does not fit {gguf_name} {[out_f, in_f]}",
                                  path=adapter.path, where=name)
    return content


def write_gguf_lora(adapter_path: str | Path, base: str | Path, out: str | Path) -> Path:
    """Write the adapter as a GGUF LoRA for `base` (the GGUF it was trained on)."""
    adapter = load_adapter(adapter_path)
    content = _base_content(base, adapter)
    arch = content.metadata["general.architecture"].python()
    name = content.metadata.get("general.name")
    metadata = {
        "general.architecture": MetaValue(V.STRING, arch),
        "general.type": MetaValue(V.STRING, "adapter"),
        "general.name": MetaValue(V.STRING, f"{name.python() if name else arch} LoRA"),
        "adapter.type": MetaValue(V.STRING, "lora"),
        "adapter.lora.alpha": MetaValue(V.FLOAT32, adapter.alpha),
        ADAPTER_BASE_SHA_KEY: MetaValue(V.STRING, adapter.base_sha256),
    }
    names = adapter.gguf_names()
    order = {t.name: i for i, t in enumerate(content.tensors)}
    tensors = []
    for key in sorted(names, key=lambda k: order[names[k]]):
        a, b = adapter.a[key], adapter.b[key]
        tensors.append(TensorEntry(names[key] + ".lora_a", T.F32, a.shape, a))
        tensors.append(TensorEntry(names[key] + ".lora_b", T.F32, b.shape, b))
    return write_gguf(out, metadata, tensors)


def _unpermute_rows(b: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute (HF rotate-half rows -> GGUF adjacent pairs)."""
    out, r = b.shape
    head = out // n_heads
    return b.reshape(n_heads, head // 2, 2, r).swapaxes(1, 2).reshape(out, r)


def write_peft(adapter_path: str | Path, base: str | Path, out_dir: str | Path,
               base_model_name: str | None = None) -> list[Path]:
    """Write `adapter_model.safetensors` + `adapter_config.json` into `out_dir`; a base that is
    not a known HF architecture is refused."""
    import torch
    from safetensors.torch import save

    adapter = load_adapter(adapter_path)
    gf = open_gguf(base)
    arch = gf.architecture
    if arch not in HF_ARCHITECTURES:
        raise ForgebenchError(f"no PEFT layout for architecture {arch!r}", path=base,
                              where="general.architecture",
                              hint="PEFT export covers " + ", ".join(HF_ARCHITECTURES)
                                   + "; use the GGUF LoRA adapter instead")
    _base_content(base, adapter)
    heads = {"q": int(gf.get("{arch}.attention.head_count")),
             "k": int(gf.get("{arch}.attention.head_count_kv",
                             gf.get("{arch}.attention.head_count")))}
    state = {}
    for key in adapter.a:
        _, layer, target = key.split(".")
        a, b = adapter.a[key], adapter.b[key]
        if arch == "llama" and target in heads:
            b = _unpermute_rows(b, heads[target])
        prefix = f"base_model.model.model.layers.{layer}.{HF_MODULES[target]}"
        state[f"{prefix}.lora_A.weight"] = torch.from_numpy(np.ascontiguousarray(a))
        state[f"{prefix}.lora_B.weight"] = torch.from_numpy(np.ascontiguousarray(b))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.rank,
        "lora_alpha": adapter.alpha, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
        "target_modules": sorted({HF_MODULES[t].split(".")[1] for t in adapter.targets}),
        "base_model_name_or_path": base_model_name or gf.get("general.basename")
        or gf.get("general.name") or "",
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    identity = {"format": "pt", "forgebench_base_sha256": adapter.base_sha256,
                "architecture": HF_ARCHITECTURES[arch]}
    atomic_write_bytes(out_dir / PEFT_WEIGHTS, save(state, metadata=identity))
    atomic_write_text(out_dir / PEFT_CONFIG, json.dumps(config, indent=2) + "\n")
    return [out_dir / PEFT_WEIGHTS, out_dir / PEFT_CONFIG]
