"""The recipe registry: one row per recipe, read by everything that asks what a recipe can do.

A row (`RecipeSpec`) names the recipe's config schema and training module (imported only when a
job needs them, by `engine.config`), where it trains (`cuda`: may train on a GPU;
`multi_process`: shards its batch over several processes) and its capabilities. Every list of
recipes elsewhere (which runs chat, which export to GGUF, which the Samples or A/B panes show,
which answer `forgebench search`) is `recipes_with(...)` over this table, never a hand-written
tuple, so adding a recipe is one module (with its `<name>_config.py` schema) and one row here.

A capability promises module functions (`CAPABILITY_HOOKS`); tests/test_recipe_registry.py
imports every registered module and checks that it has them. This module imports nothing but
the standard library: the app reads it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# What each capability means, and the module functions it promises.
CAPABILITY_HOOKS: dict[str, tuple[str, ...]] = {
    # its runs answer in the chat pane and `serve-local` (the base with the run's weights)
    "chat": ("load_trained", "generate"),
    # it fine-tunes a GGUF base (adapters beside it, or its full weights); export merges them
    "gguf-base": ("load_trained", "base_model"),
    # it starts from a base model file, hashed into run.json (`jobs.base_model_of`)
    "base": ("base_model",),
    # an image or audio generator: `forgebench sample`, the generator bundle
    "generator": ("sample", "unet_config"),
    # a text model: `forgebench generate`, the A/B pane's text comparison
    "text": ("generate",),
    # a retrieval index: `forgebench search`, the Runs pane's search box
    "search": ("search",),
    # its runs write samples/ that the Samples pane shows
    "samples": (),
    # a decision service: `forgebench decide`
    "decide": ("decide",),
}
# What every recipe module provides.
REQUIRED_HOOKS = ("data_manifest", "train", "evaluate")
# export kinds: "gguf" (engine/export/bundle.py), "generator" (engine/export/generator_bundle.py)
EXPORT_KINDS = ("gguf", "generator")


@dataclass(frozen=True)
class RecipeSpec:
    """One recipe: its schema ("module:Class"), its training module, and what it can do."""

    name: str
    schema: str
    module: str
    cuda: bool = False              # may train on a GPU (engine/train/devices.py)
    multi_process: bool = False     # trains on several processes (engine/train/distributed.py)
    capabilities: frozenset[str] = frozenset()
    export: str | None = None       # one of EXPORT_KINDS, or None: no export
    # the config field a multi-process run splits over its ranks (checked before they start)
    sharded_batch: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.capabilities) - set(CAPABILITY_HOOKS)
        if unknown:
            raise ValueError(f"recipe {self.name!r}: unknown capabilities {sorted(unknown)}")
        if self.export is not None and self.export not in EXPORT_KINDS:
            raise ValueError(f"recipe {self.name!r}: unknown export kind {self.export!r}")

    @property
    def hooks(self) -> tuple[str, ...]:
        """The module functions this row promises."""
        found = list(REQUIRED_HOOKS)
        for capability in sorted(self.capabilities):
            found += [h for h in CAPABILITY_HOOKS[capability] if h not in found]
        return tuple(found)


def _spec(name: str, schema_class: str, *capabilities: str, cuda: bool = False,
          multi_process: bool = False, export: str | None = None,
          sharded_batch: str | None = None) -> RecipeSpec:
    module = "engine.recipes." + name.replace("-", "_")
    return RecipeSpec(name, f"{module}_config:{schema_class}", module, cuda, multi_process,
                      frozenset(capabilities), export, sharded_batch)


SPECS: tuple[RecipeSpec, ...] = (
    _spec("lm-pretrain", "LMPretrainConfig", "text", "samples", cuda=True,
          multi_process=True, export="gguf", sharded_batch="train.batch_size"),
    _spec("lm-sft", "LMSFTConfig", "chat", "gguf-base", "base", "text", "samples", cuda=True,
          multi_process=True, export="gguf", sharded_batch="train.window"),
    _spec("lm-dpo", "LMDPOConfig", "chat", "gguf-base", "base", "text", "samples",
          export="gguf"),
    _spec("lm-es", "LMESConfig", "chat", "gguf-base", "base", "text", "samples",
          export="gguf"),
    _spec("lm-cartridge", "LMCartridgeConfig", "chat", "base", "text"),
    _spec("image-classify", "ImageClassifyConfig", cuda=True),
    _spec("image-detect", "ImageDetectConfig"),
    _spec("image-segment", "ImageSegmentConfig"),
    _spec("image-generate", "ImageGenerateConfig", "generator", "samples",
          export="generator"),
    _spec("audio-generate", "AudioGenerateConfig", "generator", "samples",
          export="generator"),
    _spec("tabular-classify", "TabularClassifyConfig"),
    _spec("speech-recognize", "SpeechRecognizeConfig", cuda=True),
    _spec("lm-decision", "LMDecisionConfig", "base", "decide"),
    _spec("embed-retrieval", "EmbedRetrievalConfig", "base", "search", cuda=True),
)
REGISTRY: dict[str, RecipeSpec] = {spec.name: spec for spec in SPECS}


def recipe_spec(name: str) -> RecipeSpec | None:
    """The row of a recipe, or None for a name that is not registered."""
    return REGISTRY.get(name)


def recipes_with(capability: str | None = None, *, export: str | None = None) -> tuple[str, ...]:
    """The names of the recipes with `capability` (and/or exporting as `export`), in table
    order."""
    if capability is not None and capability not in CAPABILITY_HOOKS:
        raise ValueError(f"unknown capability {capability!r}")
    return tuple(spec.name for spec in SPECS
                 if (capability is None or capability in spec.capabilities)
                 and (export is None or spec.export == export))
