"""A GGUF model to generate text with, as `forgebench generate`, `forgebench chat`, the chat
pane's worker and the server load it: the torch-free C decoder (engine/llm/native_lm.py) where it
serves the file exactly, else the torch model with the adapters or cartridge asked for.

Library code above the models, LoRA and cartridges it attaches: the commands and
engine.serve_local both read it (the library never imports a command module)."""

from __future__ import annotations


def load_generator(path, numerics: str, weights: str = "dense-cache", lora: str | None = None,
                   torch_free: bool = True, cartridge: str | None = None):
    """(model, tokenizer) to generate with from a GGUF file: the torch-free C decoder
    (engine/llm/native_lm.py) under llama.cpp numerics without adapters or a cartridge where it
    serves the file (and `torch_free`), else the torch model with `weights`, the adapters
    attached and the cartridge's rows in front of every prompt."""
    if torch_free and numerics == "llamacpp" and not lora and not cartridge:
        from engine.llm.native_lm import load_native_lm

        native = load_native_lm(path)
        if native is not None:
            return native
    from engine.lora import attach_adapter_file
    from engine.models.gguf_model import load_gguf_model

    model, tokenizer = load_gguf_model(path, numerics=numerics, weights=weights)
    if lora:
        attach_adapter_file(model, lora)
    if cartridge:
        from engine.cartridge.prefix import attach_cartridge

        model = attach_cartridge(model, tokenizer, cartridge)
    return model, tokenizer


def model_memory(model) -> dict:
    """engine.models.gguf_model.memory_report for either kind of model load_generator gives."""
    if getattr(model, "torch_free", False):
        return model.memory_report()
    from engine.models.gguf_model import memory_report

    return memory_report(model)
