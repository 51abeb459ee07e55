"""LoRA checkpoints of one base served from one loaded copy of it.

A LoRA checkpoint is its base plus a small adapter. Serving two checkpoints of the same base
(two steps of a run, or two runs over one library model) loads the base once: the first
checkpoint loads as `forgebench generate` loads it (the recipe's `load_trained`, its adapters
attached as `engine.lora.LoRALinear` modules); every later one only reads its adapter file and
adds its factors beside the first's. Each adapted projection becomes an `AdapterSwitch` that
holds one LoRALinear per checkpoint over the same frozen base module and runs the one the
`AdapterBank` has selected, so the base's weights are never merged with any adapter and each
request's arithmetic is exactly that of its own checkpoint loaded alone (same module, same
forward). The engine thread (engine/server/scheduler.py) selects a request's adapter before each
forward of it.

Shared: checkpoints whose run is an lm-sft run over a GGUF base with a LoRA adapter file,
whose recipe, base file (SHA-256) and weights setting agree (`share_key`). Anything else (full
fine-tunes, other recipes) loads on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.lora import (
    ADAPTERS_FILE,
    LoRALinear,
    adapter_info,
    load_adapters,
    projection,
    read_adapters,
)

SHAREABLE_RECIPES = ("lm-sft",)


class AdapterSwitch(nn.Module):
    """A projection whose adapter is chosen per forward: `choices[key]` (a LoRALinear over
    `base`) for the bank's selected key, the bare base for a key without one here."""

    def __init__(self, base: nn.Module, bank: "AdapterBank"):
        super().__init__()
        self.base = base
        self.choices: dict[str, LoRALinear] = {}       # not submodules: state_dict stays the base's
        self.bank = bank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.choices.get(self.bank.active)
        return chosen(x) if chosen is not None else self.base(x)


class AdapterBank:
    """The adapters attached to one loaded base, by key, and which one runs now."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.active: str | None = None
        self.keys: list[str] = []

    def select(self, key: str | None) -> None:
        self.active = key

    def _switch(self, parent: nn.Module, attr: str) -> AdapterSwitch:
        module = getattr(parent, attr)
        if isinstance(module, AdapterSwitch):
            return module
        base = module.base if isinstance(module, LoRALinear) else module
        switch = AdapterSwitch(base, self)
        setattr(parent, attr, switch)
        return switch

    def adopt(self, key: str) -> None:
        """Take over the LoRALinear modules a recipe attached for checkpoint `key`."""
        for parent in list(self.model.modules()):
            for attr, child in list(parent.named_children()):
                if isinstance(child, LoRALinear):
                    self._switch(parent, attr).choices[key] = child.eval()
        self.keys.append(key)

    def add(self, key: str, adapters_file: Path, base_sha256: str) -> None:
        """Attach the adapters saved in `adapters_file` under `key` (refused, nothing changed,
        when they were trained on another base or do not fit it)."""
        _, metadata = read_adapters(adapters_file)
        info = adapter_info(metadata, adapters_file)
        made: dict[str, tuple[nn.Module, str, LoRALinear]] = {}
        for index, block in enumerate(self.model.layers):
            for target in info.targets:
                parent, attr = projection(block, target)
                module = getattr(parent, attr)
                base = module.base if isinstance(module, (AdapterSwitch, LoRALinear)) else module
                lora = LoRALinear(base, rank=info.rank, alpha=info.alpha, layer=index,
                                  target=target).eval()
                made[f"layers.{index}.{target}"] = (parent, attr, lora)
        load_adapters(adapters_file, {name: lora for name, (_, _, lora) in made.items()},
                      base_sha256)
        for parent, attr, lora in made.values():
            self._switch(parent, attr).choices[key] = lora
        self.keys.append(key)


@dataclass
class SharedBase:
    """One loaded base and what serves from it: the first checkpoint's System (tokenizer,
    template), the bank and the engine thread."""

    system: Any
    bank: AdapterBank
    runner: Any
    base_path: str
    systems: dict[str, Any] = field(default_factory=dict)


def share_key(load: dict) -> str | None:
    """Which loaded base a checkpoint's `load` request can share, or None when it loads on its
    own (see the module docstring)."""
    from engine.errors import ForgebenchError
    from engine.jobs import run_config
    from engine.rundir import RunDir

    if not load.get("run"):
        return None
    try:
        run = RunDir(load["run"]).require()
        manifest = run.manifest()
        checkpoint = run.checkpoint(load.get("checkpoint") or "latest")
        config = run_config(run)
    except ForgebenchError:
        return None
    sha = (manifest.get("base_model") or {}).get("sha256")
    if (manifest.get("recipe") not in SHAREABLE_RECIPES or not sha
            or not (checkpoint.path / ADAPTERS_FILE).is_file() or not config.model.gguf):
        return None
    return json.dumps([manifest["recipe"], sha, config.model.weights, load.get("workspace")])


def checkpoint_system(shared: SharedBase, name: str, load: dict) -> Any:
    """The System of another checkpoint of the shared base: its adapter added to the bank, the
    base's tokenizer and template, its own run's settings."""
    from engine.jobs import run_config
    from engine.rundir import RunDir
    from engine.serve_local import System

    run = RunDir(load["run"]).require()
    checkpoint = run.checkpoint(load.get("checkpoint") or "latest")
    sha = run.manifest()["base_model"]["sha256"]
    key = json.dumps(load, sort_keys=True)
    shared.bank.add(key, checkpoint.path / ADAPTERS_FILE, sha)
    first = shared.system
    info = {**first.info, "run": str(run.path), "checkpoint": checkpoint.name,
            "step": checkpoint.step, "load_s": 0.0, "shared_base": shared.base_path}
    config = run_config(run)
    return System(name, first.model, first.tokenizer, first.template, info,
                  config.data.enable_thinking)


__all__ = ["AdapterBank", "AdapterSwitch", "SharedBase", "checkpoint_system", "share_key"]
