"""TOML run configs validated into typed schemas, with messages that name file and field.

A config file names its recipe (`recipe = "lm-pretrain"`); the recipe's schema validates the
rest. Schemas live beside their recipes (`engine/recipes/<name>_config.py`) and never import
torch, so the app can build forms from them.

Counts every recipe shares are capped as the CLI caps them (`steps` at 10^9). A config that
declares a transformer's sizes (`model.dim`, `n_layers`, `ffn_dim`, `context`, with
`train.batch_size`) is checked against the machine's memory before anything is allocated
(`check_memory`): a size that could never fit is refused with the estimate, not met as an
allocator failure minutes later.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import ForgebenchError, excerpt
from engine.paths import resolve
from engine.recipe_registry import REGISTRY, RecipeSpec

# recipe name -> its row (schema, training module, devices, capabilities): engine/recipe_registry.py
RECIPES: dict[str, RecipeSpec] = REGISTRY

# Fields resume may change; everything else in the resolved config must match run.json.
RESUMABLE_FIELDS = ("steps", "log_every", "save_every", "eval_every", "keep_last")

# The largest step count or cadence a config may give (the CLI's --steps caps the same).
MAX_COUNT = 10**9

# The words `device` takes (engine/train/devices.py resolves them).
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


class Schema(BaseModel):
    """Base for every config section: unknown keys are errors, never silently ignored."""

    # inf and nan are never a sane setting (an lr of inf trains to NaN without a word).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RecipeConfig(Schema):
    """Fields every recipe shares: identity, seed, length and cadence.

    `base_dir` is the folder relative paths in the config resolve against (the config file's
    folder); `forgebench run` fills it in.
    """

    recipe: str
    base_dir: str | None = None
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of every random draw")
    steps: int = Field(100, ge=1, le=MAX_COUNT,
                       description="optimizer steps to train (resume may raise it)")
    log_every: int = Field(1, ge=1, le=MAX_COUNT, description="steps between train metric lines")
    eval_every: int = Field(0, ge=0, le=MAX_COUNT,
                            description="steps between val evaluations; 0 = at end")
    save_every: int = Field(0, ge=0, le=MAX_COUNT,
                            description="steps between checkpoints; 0 = at end only")
    keep_last: int = Field(3, ge=1, le=MAX_COUNT,
                           description="checkpoints kept (best is always kept too)")
    nonfinite: Literal["skip", "stop"] = Field(
        "skip", description="non-finite loss or gradient: skip the step (counted) or stop")
    device: str = Field(
        "auto", pattern=DEVICE_PATTERN,
        description="auto (CUDA when there is a GPU, else the CPU), cpu, cuda or cuda:N; "
                    "resume may move a run only within its device type (or with "
                    "--allow-device-change)")

    def resolve_path(self, value: str | os.PathLike, field: str = "a config path") -> Path:
        """A path from the config, relative to the config's folder, symlinks resolved (a loop
        is refused with `field` named)."""
        path = Path(value).expanduser()
        if not path.is_absolute() and self.base_dir:
            path = Path(self.base_dir) / path
        return resolve(path, field)


def _import(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def available_recipes() -> list[str]:
    """Recipes whose schema module is present in this build."""
    return [name for name, spec in RECIPES.items()
            if importlib.util.find_spec(spec.schema.partition(":")[0]) is not None]


def schema_for(recipe: str) -> type[Schema]:
    if recipe not in RECIPES:
        raise ForgebenchError(f"unknown recipe '{recipe}'", where="field 'recipe'",
                              hint="one of: " + ", ".join(available_recipes()))
    return _import(RECIPES[recipe].schema)


def recipe_module(recipe: str) -> Any:
    """The training module of a registered recipe, imported now (it may import torch)."""
    return _import(RECIPES[recipe].module)


def format_validation_error(exc: ValidationError, source: str | os.PathLike | None) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        kind = err["type"]
        if kind == "extra_forbidden":
            message = "unknown key; check its spelling against the recipe's schema"
        elif kind == "missing":
            message = "required key is missing"
        else:
            message = err["msg"]
            if "input" in err and kind not in ("missing",):
                message += f" (got {excerpt(err['input'])})"
        lines.append(f"field '{field}': {message}")
    prefix = f"{source}: " if source else ""
    return prefix + ("invalid config\n  " if len(lines) > 1 else "") + "\n  ".join(lines)


def validate_config(data: dict, source: str | os.PathLike | None = None) -> Schema:
    """Validate a config mapping (with its 'recipe' key) into the recipe's schema."""
    if not isinstance(data, dict) or "recipe" not in data:
        raise ForgebenchError("config has no 'recipe' key", path=source,
                              hint="add e.g. recipe = \"lm-pretrain\" at the top")
    recipe = data["recipe"]
    if not isinstance(recipe, str):
        raise ForgebenchError("must be a string", path=source, where="field 'recipe'")
    schema = schema_for(recipe)
    try:
        config = schema.model_validate(data)
    except ValidationError as exc:
        raise ForgebenchError(format_validation_error(exc, None), path=source) from None
    check_memory(config, source)
    return config


def memory_estimate(config: Schema) -> dict[str, int] | None:
    """Bytes a transformer-shaped config needs to train in f32, by part (None for a config that
    declares no such sizes): the parameters with their gradients and AdamW's two moments, and
    one micro-batch's activations kept for the backward pass (a lower bound: the real peak
    is higher, so a refusal is never wrong)."""
    model, train = getattr(config, "model", None), getattr(config, "train", None)
    sizes = [getattr(model, k, None) for k in ("dim", "n_layers", "ffn_dim", "context")]
    batch = getattr(train, "batch_size", None)
    if not all(isinstance(v, int) for v in sizes + [batch]):
        return None
    dim, layers, ffn, context = sizes
    tokenizer = getattr(config, "tokenizer", None)
    vocab = getattr(tokenizer, "vocab_size", 260) if getattr(tokenizer, "kind", "") == "bpe" \
        else 260
    params = 2 * vocab * dim + layers * (4 * dim * dim + 3 * dim * ffn)
    activations = batch * context * (layers * (6 * dim + 3 * ffn) + vocab)
    return {"parameters": 4 * 4 * params, "activations": 4 * activations}


def check_memory(config: Schema, source: str | os.PathLike | None = None) -> None:
    """Refuse sizes that cannot fit in this machine's memory (see the module docstring)."""
    estimate = memory_estimate(config)
    if estimate is None:
        return
    import psutil

    from engine.fsutil import human_bytes

    total = psutil.virtual_memory().total
    needed = sum(estimate.values())
    if needed <= total:
        return
    part = max(estimate, key=estimate.get)
    field = "train.batch_size" if part == "activations" else "model.ffn_dim" if (
        config.model.ffn_dim >= config.model.dim) else "model.dim"
    raise ForgebenchError(
        f"training this needs at least {human_bytes(needed)} of memory (parameters, gradients "
        f"and AdamW moments {human_bytes(estimate['parameters'])}; one micro-batch's "
        f"activations {human_bytes(estimate['activations'])}), and this machine has "
        f"{human_bytes(total)}", path=source, where=f"field '{field}'",
        hint="make the model or the batch smaller")


def load_config(path: str | os.PathLike) -> Schema:
    """Read a TOML config file. Relative data paths resolve against the config's folder."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ForgebenchError("config file not found", path=path) from None
    except IsADirectoryError:
        raise ForgebenchError("expected a TOML file, got a directory", path=path) from None
    except OSError as exc:   # a symlink loop (ELOOP), no permission, ...
        raise ForgebenchError(f"cannot read the config ({exc.strerror})", path=path,
                              hint="give a readable TOML file (not a link that points to "
                                   "itself)") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ForgebenchError(f"not UTF-8 text (byte {exc.start})", path=path) from None
    except tomllib.TOMLDecodeError as exc:
        raise ForgebenchError(f"malformed TOML: {exc}", path=path,
                              hint="see https://toml.io for the syntax") from None
    data.setdefault("base_dir", str(path.resolve().parent))
    return validate_config(data, path)


def added_since(stored: dict, name: str) -> bool:
    """Whether the dotted field `name` is missing from a config recorded before the schema
    gained it. Validating such a config fills the field with its default, and a field is only
    ever added with a default that keeps what runs did before it existed, so resuming reads
    the run as it was started."""
    node = stored
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return True
        node = node[part]
    return False


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two resolved configs."""
    changed = []
    for key in sorted(set(old) | set(new)):
        name = f"{prefix}{key}"
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            changed += config_diff(a, b, name + ".")
        elif a != b:
            changed.append(name)
    return changed
