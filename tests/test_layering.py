"""Layering: no module imports a layer above its own (docs/architecture.md, "What may import what").

Every `import` and `from ... import` in engine/ and app/ is read with `ast`, function-level
(lazy) imports included: a lazy import is still a dependency. `from a import b` counts as
importing both `a` and `a.b`, so `from engine import recipes` is caught like
`import engine.recipes`. The twin test plants an upward import in a scratch package and checks
that the same checker reports it, so this test cannot pass by reading nothing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.recipe_registry import SPECS

REPO = Path(__file__).resolve().parents[1]

# Every registered recipe's training module (engine/recipe_registry.py): a recipe is a leaf.
RECIPE_MODULES = tuple(spec.module for spec in SPECS)

# The library: everything in engine/ except the layers allowed to drive recipes.
ABOVE_RECIPES = ("engine.commands", "engine.export", "engine.checks", "engine.cli",
                 "engine.__main__")


@dataclass(frozen=True)
class Rule:
    importers: tuple[str, ...]          # module prefixes the rule applies to
    forbidden: tuple[str, ...]          # module prefixes they must not import
    why: str
    exempt: tuple[str, ...] = ()        # importer prefixes the rule does not apply to
    allowed: tuple[str, ...] = ()       # imported prefixes the rule lets through

    def allows(self, imported: str) -> bool:
        return any(_under(imported, p) for p in self.allowed)


RULES = (
    Rule(("engine.gguf",), ("engine.recipes", "engine.models", "engine.llm", "engine.kernels",
                            "engine.train", "engine.export", "engine.commands", "engine.checks",
                            "engine.jobs", "engine.lora", "engine.data"),
         "engine/gguf is the file format alone"),
    Rule(("engine.kernels",), ("engine.models", "engine.llm", "engine.recipes", "engine.train",
                               "engine.export", "engine.commands", "engine.checks",
                               "engine.jobs"),
         "kernels are arithmetic under the models"),
    Rule(("engine.llm",), ("engine.models", "engine.recipes", "engine.train", "engine.export",
                           "engine.commands", "engine.checks", "engine.jobs"),
         "llm (tokenizer, chat, SFT data, decode loop) sits under the models that load it"),
    Rule(("engine.models",), ("engine.recipes", "engine.train", "engine.export",
                              "engine.commands", "engine.checks", "engine.jobs"),
         "models are built by recipes, never the reverse"),
    Rule(("engine.data",), ("engine.models", "engine.kernels", "engine.llm", "engine.gguf",
                            "engine.train", "engine.recipes", "engine.export",
                            "engine.commands", "engine.checks", "engine.jobs", "torch"),
         "the data layer is read by the app too: no torch, no model code"),
    Rule(("engine.train",), ("engine.recipes", "engine.export", "engine.commands",
                             "engine.checks"),
         "engine/train holds what recipes share; recipes use it"),
    Rule(("engine",), ("engine.recipes",),
         "the library never imports a recipe (engine.config.recipe_module dispatches by name)",
         exempt=ABOVE_RECIPES + ("engine.recipes",)),
    Rule(("engine.recipes",), RECIPE_MODULES,
         "recipes are leaves: one recipe never imports another (shared code lives in the "
         "library; a run of another recipe is loaded through engine.config.recipe_module)"),
    Rule(("engine",), ABOVE_RECIPES[:3],
         "commands, export and checks are the top: nothing below imports them",
         exempt=ABOVE_RECIPES),
    Rule(("engine",), ("argparse",), "argparse stays in engine/cli.py and engine/commands/",
         exempt=("engine.cli", "engine.commands")),
    Rule(("engine",), ("PySide6", "pyqtgraph", "app"), "engine/ never imports Qt or the app"),
    Rule(("app",), ("torch",), "app/ never imports torch, not even lazily"),
    Rule(("app.viewmodels",), ("PySide6", "pyqtgraph", "app.views"),
         "view-models are Qt-free: state and logic the views (and tests) drive"),
    Rule(("app.views",), ("engine",),
         "views import nothing from the engine but its errors (reads go through view-models)",
         allowed=("engine.errors",)),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in the file, nested ones included."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path, packages: tuple[str, ...] = ("engine", "app")) -> list[str]:
    """Every import in `root/<package>/**.py` that breaks a rule, as 'file:line: a -> b (why)'."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            importer = module_name(path, root)
            for line, imported in imports_of(path, root):
                for rule in RULES:
                    if not any(_under(importer, p) for p in rule.importers) \
                            or any(_under(importer, p) for p in rule.exempt):
                        continue
                    if _under(imported, importer) \
                            or not any(_under(imported, p) for p in rule.forbidden) \
                            or rule.allows(imported):
                        continue
                    found.append(f"{path.relative_to(root)}:{line}: {importer} -> {imported} "
                                 f"({rule.why})")
    return found


def test_no_layer_imports_a_layer_above_it():
    assert violations(REPO) == []


def test_the_checker_sees_a_planted_upward_import(tmp_path):
    """The same checker over a scratch tree with upward imports planted in it."""
    for folder in ("engine/gguf", "engine/recipes", "engine/kernels", "app"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "engine/__init__.py").write_text("")
    (tmp_path / "engine/gguf/reader.py").write_text(
        "import numpy\n\ndef late():\n    from engine.recipes import lm_sft\n")
    (tmp_path / "engine/kernels/fast.py").write_text("from ..models import llama\n")
    (tmp_path / "engine/recipes/lm_sft.py").write_text("from engine.recipes import lm_pretrain\n")
    (tmp_path / "app/pane.py").write_text("def plot():\n    import torch.nn\n")
    (tmp_path / "engine/fine.py").write_text("from engine.gguf import reader\n")
    found = violations(tmp_path)
    assert any(v.startswith("engine/gguf/reader.py:4: engine.gguf.reader -> engine.recipes")
               for v in found), found
    assert any("engine.kernels.fast -> engine.models" in v for v in found), found
    assert any("engine.recipes.lm_sft -> engine.recipes.lm_pretrain" in v for v in found), found
    assert any("app.pane -> torch.nn" in v for v in found), found
    assert not any("engine/fine.py" in v for v in found), found


def _scratch_tree(root: Path, folders: tuple[str, ...]) -> None:
    for folder in folders:
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").write_text("")


@pytest.mark.parametrize("target", RECIPE_MODULES)
def test_a_planted_import_of_any_recipe_by_another_is_caught(tmp_path, target):
    """Every registered recipe (the registry's list, so a new recipe is covered on its own) is
    protected: a planted import of it in another recipe, plain or lazy, is reported."""
    _scratch_tree(tmp_path, ("engine", "engine/recipes"))
    other = next(m for m in RECIPE_MODULES if m != target).rpartition(".")[2]
    name = target.rpartition(".")[2]
    (tmp_path / f"engine/recipes/{other}.py").write_text(
        f"def late():\n    from engine.recipes import {name}\n")
    (tmp_path / f"engine/recipes/{other}_config.py").write_text(
        "from engine.recipes.lm_sft_config import TrainSection\n")
    found = violations(tmp_path)
    assert any(f"engine.recipes.{other} -> {target} (recipes are leaves" in v
               for v in found), found
    assert not any(f"{other}_config.py" in v for v in found), found


def test_the_registry_names_every_recipe_module():
    """The rule's list is complete: every training module in engine/recipes/ is registered."""
    modules = {f"engine.recipes.{p.stem}" for p in (REPO / "engine/recipes").glob("*.py")
               if p.stem != "__init__" and not p.stem.endswith("_config")
               and p.stem not in ("media_config", "optim_config")}
    assert modules == set(RECIPE_MODULES)


def test_view_models_never_import_qt_and_views_only_engine_errors(tmp_path):
    """The twin of the two app rules: a planted Qt import in a view-model and an engine import
    in a view (plain, lazy or relative to the engine's errors' package) are reported; a view's
    engine.errors import is not."""
    _scratch_tree(tmp_path, ("app", "app/viewmodels", "app/views"))
    (tmp_path / "app/viewmodels/runs.py").write_text(
        "def late():\n    from PySide6.QtCore import QTimer\n")
    (tmp_path / "app/views/charts.py").write_text(
        "from engine.errors import ForgebenchError\nfrom engine.rundir import RunDir\n")
    (tmp_path / "app/views/runs_pane.py").write_text(
        "def stop(path):\n    from engine import rundir\n")
    found = violations(tmp_path, packages=("app",))
    assert any("app.viewmodels.runs -> PySide6.QtCore" in v for v in found), found
    assert any("app/views/charts.py:2: app.views.charts -> engine.rundir" in v
               for v in found), found
    assert any("app/views/runs_pane.py:2: app.views.runs_pane -> engine.rundir" in v
               for v in found), found
    assert not any("engine.errors" in v for v in found), found
