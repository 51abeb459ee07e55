"""Recipe forms generated from the recipe's pydantic config schema.

Every edit re-validates the whole config with the schema itself (never a copy of its rules), so
the form marks exactly the fields `forgebench run` would refuse, and Start stays blocked while
any field is invalid. Path fields (datasets, base models) are also checked on disk, relative to
the config's folder as the engine resolves them, so a wrong path is marked before Start.

List fields are edited one item per line: a prompt may contain commas.

New configs come from the recipe templates in `resources/configs/` (`recipe_templates`,
`new_config_from_template`), their dataset paths re-rooted for a workspace's configs/ folder.
"""

from __future__ import annotations

import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ValidationError

from app.viewmodels.workspace import REPO_ROOT
from engine.config import format_validation_error, schema_for
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_text

HIDDEN_FIELDS = ("recipe", "base_dir")
TEMPLATES_DIR = REPO_ROOT / "resources" / "configs"
# Words for the schema's terse field names (the tooltip keeps the schema's description).
LABELS = {"n_layers": "layers", "n_heads": "attention heads", "n_kv_heads": "key/value heads",
          "ffn_dim": "feed-forward width", "dim": "width", "lr": "learning rate",
          "gguf": "base model (GGUF)", "dir": "dataset folder", "path": "training data",
          "val_path": "validation data", "test_path": "test data", "max_len": "max tokens",
          "emb_dim": "embedding width", "cfg": "guidance (CFG)", "ema": "EMA decay",
          "per_class": "samples per class", "max_tokens": "max new tokens",
          "keep_last": "checkpoints kept", "save_every": "checkpoint every (steps)",
          "eval_every": "evaluate every (steps)", "log_every": "log every (steps)",
          "nonfinite": "on a non-finite loss", "control_path": "control text (cpt)",
          "text_key": "text field (cpt)"}
# Fields that name something on disk, and what: a folder, a file, or either.
PATH_FIELDS = {"data.dir": "folder", "data.path": "any", "data.val_path": "file",
               "data.test_path": "file", "model.gguf": "file", "model.run": "folder",
               "model.sft_run": "folder", "data.control_path": "file"}


@dataclass(frozen=True)
class FieldSpec:
    name: str            # dotted path, e.g. "optim.lr"
    kind: str            # int | float | bool | choice | str | list
    default: Any
    required: bool
    description: str
    choices: tuple = ()
    optional: bool = False  # None is an accepted value (an empty box)

    @property
    def label(self) -> str:
        leaf = self.name.rsplit(".", 1)[-1]
        return LABELS.get(leaf, leaf.replace("_", " "))

    @property
    def section(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else ""

    @property
    def note(self) -> str:
        """A line the form shows under the editor: what precision "auto" becomes here."""
        if self.name.rsplit(".", 1)[-1] != "precision" or "auto" not in self.choices:
            return ""
        from engine.train.precision import (
            BF16_MIN_SPEEDUP,
            cached_bf16_speedup,
            choose_precision,
            listed_bf16_features,
        )

        units, speedup = listed_bf16_features(), cached_bf16_speedup()
        if units and speedup is None:
            return (f"auto = bf16 or f32 on this machine: it has {' and '.join(sorted(units))}; "
                    f"the first run measures if its bf16 matmul is {BF16_MIN_SPEEDUP}x its f32")
        choice = choose_precision("auto", units, speedup)
        return f"auto = {choice.precision} on this machine ({choice.reason[len('auto: '):]})"

    @property
    def path_kind(self) -> str | None:
        """folder | file | any for a field naming something on disk, else None."""
        return PATH_FIELDS.get(self.name) if self.kind == "str" else None


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def field_specs(schema: type[BaseModel], prefix: str = "") -> list[FieldSpec]:
    """The editable fields of a schema, nested sections flattened to dotted names."""
    specs = []
    for name, info in schema.model_fields.items():
        if not prefix and name in HIDDEN_FIELDS:
            continue
        annotation, optional = _unwrap_optional(info.annotation)
        dotted = prefix + name
        if _is_model(annotation):
            specs += field_specs(annotation, dotted + ".")
            continue
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        if _is_model(type(default)):
            default = default.model_dump()
        if typing.get_origin(annotation) is Literal:
            kind, choices = "choice", tuple(typing.get_args(annotation))
        elif annotation is bool:
            kind, choices = "bool", ()
        elif annotation is int:
            kind, choices = "int", ()
        elif annotation is float:
            kind, choices = "float", ()
        elif typing.get_origin(annotation) in (list, tuple):
            kind, choices = "list", ()
        else:
            kind, choices = "str", ()
        specs.append(FieldSpec(dotted, kind, default, info.is_required(),
                               info.description or "", choices, optional))
    return specs


def _get(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _set(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value


def _delete(data: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.get(part, {})
    data.pop(leaf, None)


def to_text(spec: FieldSpec, value: Any) -> str:
    if value is None:
        return ""
    if spec.kind == "list":
        return "\n".join(str(v) for v in value)
    return str(value)


class RecipeForm:
    """Field values as the user typed them, plus the per-field errors of the current state."""

    def __init__(self, recipe: str, values: dict | None = None, base_dir: str | None = None):
        self.recipe = recipe
        self.schema = schema_for(recipe)
        self.fields = field_specs(self.schema)
        self.base_dir = base_dir
        self.extra: dict = {}  # keys of a loaded config that have no form field (kept as is)
        self.text: dict[str, str] = {}
        values = dict(values or {})
        values.pop("recipe", None)
        self.base_dir = values.pop("base_dir", None) or base_dir
        for spec in self.fields:
            given = _get(values, spec.name)
            self.text[spec.name] = to_text(spec, spec.default if given is None else given)
            if given is not None:
                _delete(values, spec.name)
        self.extra = {k: v for k, v in values.items() if v not in ({}, None)}
        self.errors: dict[str, str] = {}
        self.general_error: str | None = None
        self.validate()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "RecipeForm":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ForgebenchError(f"cannot read the config: {exc}", path=path) from None
        if not isinstance(data.get("recipe"), str):
            raise ForgebenchError("config has no 'recipe' key", path=path)
        return cls(data["recipe"], data, base_dir=str(path.resolve().parent))

    def spec(self, name: str) -> FieldSpec:
        return next(s for s in self.fields if s.name == name)

    def set_text(self, name: str, text: str) -> None:
        self.text[name] = text
        self.validate()

    def _parse(self, spec: FieldSpec, text: str) -> Any:
        """Turn typed text into the value to validate; the schema judges it."""
        text = text.strip()
        if text == "":
            return None if spec.optional else ...
        if spec.kind == "bool":
            return text.lower() in ("1", "true", "yes", "on")
        if spec.kind == "int":
            try:
                return int(text)
            except ValueError:
                raise ValueError("expected a whole number") from None
        if spec.kind == "float":
            try:
                return float(text)
            except ValueError:
                raise ValueError("expected a number") from None
        if spec.kind == "list":
            return [item.strip() for item in text.splitlines() if item.strip()]
        if spec.kind == "choice":   # the choice itself: Literal[16000] wants the int 16000
            return next((choice for choice in spec.choices if str(choice) == text), text)
        return text

    def config_dict(self) -> dict:
        """The config as a TOML-ready mapping (unparseable fields left out)."""
        data: dict = {"recipe": self.recipe}
        if self.base_dir:
            data["base_dir"] = self.base_dir
        for key, value in self.extra.items():
            data[key] = value
        for spec in self.fields:
            try:
                value = self._parse(spec, self.text[spec.name])
            except ValueError:
                continue
            if value is not ... and value is not None:
                _set(data, spec.name, value)
        return data

    def validate(self) -> bool:
        errors: dict[str, str] = {}
        for spec in self.fields:
            try:
                value = self._parse(spec, self.text[spec.name])
            except ValueError as exc:
                errors[spec.name] = str(exc)
                continue
            if value is ... and spec.required:
                errors[spec.name] = "required"
            elif spec.path_kind and isinstance(value, str):
                problem = self.path_problem(spec, value)
                if problem:
                    errors[spec.name] = problem
        self.general_error = None
        try:
            self.schema.model_validate(self.config_dict())
        except ValidationError as exc:
            for err in exc.errors():
                dotted = ".".join(str(p) for p in err["loc"])
                owner = next((s.name for s in self.fields
                              if dotted == s.name or dotted.startswith(s.name + ".")), None)
                if owner is None:
                    self.general_error = format_validation_error(exc, None)
                elif owner not in errors:
                    errors[owner] = "required" if err["type"] == "missing" else err["msg"]
        self.errors = errors
        return self.valid

    @property
    def valid(self) -> bool:
        return not self.errors and self.general_error is None

    def resolve(self, value: str) -> Path:
        """A path as the engine resolves it: `~` expanded, relative to the config's folder."""
        path = Path(value).expanduser()
        if not path.is_absolute() and self.base_dir:
            path = Path(self.base_dir) / path
        return path.resolve()

    def relative(self, path: str | os.PathLike) -> str:
        """A chosen path written relative to the config's folder when it is inside the same
        workspace (the config then moves with the workspace), else absolute."""
        path = Path(path).resolve()
        if self.base_dir:
            try:
                return os.path.relpath(path, self.base_dir)
            except ValueError:      # another drive
                pass
        return str(path)

    def path_problem(self, spec: FieldSpec, value: str) -> str | None:
        path = self.resolve(value)
        if not path.exists():
            hint = (" (relative paths start at the config's folder; a workspace dataset is "
                    f"../datasets/{Path(value).name})" if not Path(value).is_absolute()
                    and not value.startswith(("~", "../")) else "")
            return f"not found: {path}{hint}"
        if spec.path_kind == "folder" and not path.is_dir():
            return f"not a folder: {path}"
        if spec.path_kind == "file" and not path.is_file():
            return f"not a file: {path}"
        return None

    def write_toml(self, path: str | os.PathLike) -> Path:
        if not self.valid:
            problem = ", ".join(sorted(self.errors)) or str(self.general_error)
            raise ForgebenchError(f"the config has invalid fields: {problem}", path=path,
                                  hint="fix the fields marked in red")
        path = Path(path)
        atomic_write_text(path, dump_toml(self.config_dict()))
        return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def dump_toml(data: dict, table: str = "") -> str:
    """A small TOML writer for configs: scalars and lists first, then one table per section."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in data.items()
             if not isinstance(value, dict)]
    for key, value in data.items():
        if isinstance(value, dict):
            name = f"{table}.{key}" if table else key
            lines += ["", f"[{name}]", dump_toml(value, name).strip("\n")]
    return "\n".join(lines).strip("\n") + "\n"


# -- new configs from recipe templates -------------------------------------------------------
def recipe_templates(folder: Path = TEMPLATES_DIR) -> dict[str, Path]:
    """One template per recipe (file stem -> path), from the bundled example configs."""
    return {p.stem: p for p in sorted(folder.glob("*.toml"))} if folder.is_dir() else {}


_DATASET_PATH = re.compile(
    r'^(\s*(?:dir|path|val_path|test_path|control_path)\s*=\s*")datasets/', re.MULTILINE)


def new_config_from_template(template: Path, configs_dir: Path, name: str) -> Path:
    """Copy a recipe template into a workspace's configs/ folder under a new name, comments
    kept; its `datasets/...` paths (written relative to a repository checkout) are re-rooted
    to `../datasets/...`, where a workspace keeps them relative to configs/."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ForgebenchError(f"not a usable config name: {name!r}", where="config name",
                              hint="letters, digits, '.', '_' and '-' only")
    target = configs_dir / f"{name}.toml"
    if target.exists():
        raise ForgebenchError("a config with this name already exists", path=target,
                              hint="choose another name")
    text = _DATASET_PATH.sub(r"\1../datasets/", template.read_text(encoding="utf-8"))
    configs_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, text)
    return target
