"""The recipe registry (engine/recipe_registry.py): one row per recipe, read by every list of
recipes; each capability's promised functions exist in every module that claims it."""

from __future__ import annotations

import importlib
import types

import pytest

from engine import config
from engine.recipe_registry import CAPABILITY_HOOKS, REGISTRY, SPECS, RecipeSpec, recipes_with


def missing_hooks(spec: RecipeSpec, module: types.ModuleType) -> list[str]:
    """The functions `spec` promises that `module` lacks."""
    return [name for name in spec.hooks if not callable(getattr(module, name, None))]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_recipe_has_the_hooks_its_capabilities_promise(spec):
    module = importlib.import_module(spec.module)
    assert missing_hooks(spec, module) == []
    assert config.schema_for(spec.name).model_fields["recipe"].default == spec.name
    # jobs.base_model_of reads the "base" capability: exactly the modules that name a base
    assert hasattr(module, "base_model") == ("base" in spec.capabilities)


def test_a_capability_without_its_hook_is_reported():
    """The twin: a row promising what its module does not have."""
    module = types.SimpleNamespace(data_manifest=len, train=len, evaluate=len, generate=len)
    chat = RecipeSpec("fake", "x:Y", "x", capabilities=frozenset({"chat", "text"}))
    assert missing_hooks(chat, module) == ["load_trained"]
    assert missing_hooks(RecipeSpec("fake", "x:Y", "x", capabilities=frozenset({"text"})),
                         module) == []
    with pytest.raises(ValueError, match="unknown capabilities"):
        RecipeSpec("fake", "x:Y", "x", capabilities=frozenset({"telepathy"}))


def test_the_lists_of_recipes_elsewhere_are_registry_reads():
    """Today's lists, as the hand-written tuples had them, now read from the table."""
    from app.viewmodels import ab, samples, search
    from engine import serve_local
    from engine.export import bundle, generator_bundle

    assert serve_local.CHAT_RECIPES == ("lm-sft", "lm-dpo", "lm-es", "lm-cartridge")
    assert bundle.GGUF_BASE_RECIPES == ("lm-sft", "lm-dpo", "lm-es")
    assert bundle.EXPORTABLE_RECIPES == ("lm-pretrain", "lm-sft", "lm-dpo", "lm-es")
    assert generator_bundle.GENERATOR_RECIPES == ab.GENERATOR_RECIPES \
        == ("image-generate", "audio-generate")
    assert ab.TEXT_RECIPES == ("lm-pretrain", "lm-sft", "lm-dpo", "lm-es", "lm-cartridge")
    assert search.SEARCH_RECIPES == ("embed-retrieval",)
    assert set(samples.SAMPLE_RECIPES) == {"image-generate", "audio-generate", "lm-sft",
                                           "lm-dpo", "lm-es", "lm-pretrain"}
    assert set(config.RECIPES) == set(REGISTRY) and len(SPECS) == len(REGISTRY)
    # devices: the recipes that may train on a GPU, and on several processes
    assert {s.name for s in SPECS if s.cuda} == {"lm-pretrain", "lm-sft", "image-classify",
                                                "speech-recognize", "embed-retrieval"}
    assert {s.name for s in SPECS if s.multi_process} == {"lm-pretrain", "lm-sft"}
    with pytest.raises(ValueError, match="unknown capability"):
        recipes_with("telepathy")
    assert set(CAPABILITY_HOOKS) >= {"chat", "gguf-base", "generator", "text", "search"}


def test_multi_process_is_refused_for_a_recipe_whose_row_says_one_process(tmp_path):
    from engine.errors import ForgebenchError
    from engine.jobs import require_multi_process

    dpo = config.schema_for("lm-dpo").model_construct(recipe="lm-dpo")
    with pytest.raises(ForgebenchError, match="trains in one process only"):
        require_multi_process(dpo, 2)
    require_multi_process(config.schema_for("lm-sft").model_construct(recipe="lm-sft"), 2)
