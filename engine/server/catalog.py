"""What a workspace can serve, under the ids the HTTP API names them by, and loading them.

- a library base: its library name (`gemma-3-270m`), served from its GGUF;
- a checkpoint of a chat run (lm-sft, lm-dpo, lm-es): `RUN/CHECKPOINT` (`sft/step-000200`),
  and `RUN` for its latest; a LoRA checkpoint is its base with the adapter attached, loaded
  by serve-local's loader (engine/serve_local.py), never exported first;
- an export: `exports/NAME` (its `model.gguf`);
- an embed-retrieval run's checkpoint: `RUN/CHECKPOINT` and `RUN`, type "embedding";
- a GGUF file given by path on the command line: its file name without `.gguf`;
- a cartridge given with `--cartridge FILE` (an lm-cartridge run's cartridge.safetensors)
  beside the base it was trained on, given by `--model` (a GGUF path or a library id):
  `BASE+LABEL`, where LABEL is `RUN/CHECKPOINT` for a run's checkpoint file, else the file's
  name (`gemma-3-270m+guide/step-000006`); the base stays served under its own id too. A
  cartridge that no given base was trained on is refused at start, with the recipe's error.

No torch at module level: listing reads GGUF headers and run manifests only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from engine import model_library
from engine.errors import ForgebenchError
from engine.recipe_registry import recipes_with
from engine.serve_local import CHAT_RECIPES, is_nanochat_chat

EMBEDDING_RECIPES = recipes_with("search")   # runs whose encoder answers /v1/embeddings


@dataclass
class Entry:
    id: str
    type: str            # "base", "checkpoint", "export", "file", "embedding", "cartridge"
    origin: str                      # where it came from, in words
    load: dict                       # serve-local's load request, or {"embedding_run", ...}
    family: str | None = None
    context: int | None = None
    created: int = 0

    def card(self) -> dict:
        """The /v1/models row."""
        return {"id": self.id, "object": "model", "created": self.created,
                "owned_by": "forgebench", "type": self.type, "family": self.family,
                "context_length": self.context, "origin": self.origin}


def _gguf_facts(path: Path) -> tuple[str | None, int | None]:
    facts = model_library.model_facts(path)
    return facts.get("family"), facts.get("context")


def workspace_entries(root: Path) -> list[Entry]:
    from engine.rundir import RunDir

    found: list[Entry] = []
    for entry in model_library.entries(root):
        path = model_library.entry_path(root, entry)
        if not path.is_file():
            continue
        family, context = _gguf_facts(path)
        found.append(Entry(entry["name"], "base", f"model library ({entry['mode']}: "
                           f"{entry.get('source') or path})",
                           {"library": entry["name"], "workspace": str(root)}, family, context,
                           int(entry.get("added") or 0)))
    for run_dir in sorted(p for p in (root / "runs").glob("*") if (p / "run.json").is_file()):
        run = RunDir(run_dir)
        try:
            manifest = run.manifest()
            checkpoints = run.checkpoints()
        except ForgebenchError:
            continue
        recipe = manifest.get("recipe")
        # nanochat (a pretrain run, or its fine-tune): its base is that run, not a library file
        nanochat = recipe in CHAT_RECIPES + ("lm-pretrain",) and is_nanochat_chat(manifest)
        if not checkpoints or (recipe not in CHAT_RECIPES + EMBEDDING_RECIPES and not nanochat):
            continue
        base = manifest.get("base_model") or {}
        library = model_library.find_by_sha256(root, base.get("sha256", "")) \
            if recipe in CHAT_RECIPES else None
        if recipe in CHAT_RECIPES and library is None and not nanochat:
            continue          # its base is not in the library: nothing to serve it from
        family = context = None
        if library is not None:
            family, context = _gguf_facts(model_library.entry_path(root, library))
        for checkpoint in checkpoints:
            kind = "embedding" if recipe in EMBEDDING_RECIPES else "checkpoint"
            load = ({"embedding_run": str(run_dir), "checkpoint": checkpoint.name}
                    if kind == "embedding" else
                    {"run": str(run_dir), "checkpoint": checkpoint.name, "workspace": str(root)})
            origin = f"run {run_dir.name} ({recipe}), checkpoint {checkpoint.name}" + (
                f" over {library['name']}" if library else "") + (
                ", nanochat (calculator in the reply)" if nanochat else "")
            found.append(Entry(f"{run_dir.name}/{checkpoint.name}", kind, origin, load, family,
                               context, int(run_dir.stat().st_mtime)))
        latest = found[-1]
        found.append(Entry(run_dir.name, latest.type, latest.origin + " (latest)",
                           latest.load, family, context, latest.created))
    for gguf in sorted((root / "exports").glob("*/model.gguf")):
        family, context = _gguf_facts(gguf)
        found.append(Entry(f"exports/{gguf.parent.name}", "export", f"export {gguf.parent}",
                           {"model": str(gguf)}, family, context, int(gguf.stat().st_mtime)))
    return found


def file_entry(path: Path) -> Entry:
    if not path.is_file():
        raise ForgebenchError("model file not found", path=path, where="--model")
    family, context = _gguf_facts(path)
    return Entry(path.name.removesuffix(".gguf"), "file", f"file {path}",
                 {"model": str(path)}, family, context, int(path.stat().st_mtime))


def cartridge_label(path: Path) -> str:
    """RUN/CHECKPOINT for runs/RUN/checkpoints/CHECKPOINT/cartridge.safetensors, else the
    file's name without its extension."""
    if path.parent.parent.name == "checkpoints":
        return f"{path.parent.parent.parent.name}/{path.parent.name}"
    return path.stem


def _base_file(entry: Entry) -> Path | None:
    """The GGUF file a base or file entry serves (None for runs, exports and encoders)."""
    if entry.type == "file":
        return Path(entry.load["model"])
    if entry.type == "base":
        library = model_library.get_entry(entry.load["workspace"], entry.load["library"])
        return model_library.entry_path(entry.load["workspace"], library)
    return None


def cartridge_entry(path: Path, bases: list[Entry]) -> Entry:
    """The base among `bases` that the cartridge at `path` was trained on, reading it first,
    as an entry of its own; refused (engine.cartridge.prefix.load_cartridge's error, naming
    both SHA-256s) when it was trained on none of them."""
    from engine.cartridge.prefix import load_cartridge, read_cartridge
    from engine.fsutil import sha256_file

    files = [(entry, _base_file(entry)) for entry in bases]
    files = [(entry, file) for entry, file in files if file is not None]
    if not files:
        raise ForgebenchError("a cartridge is served beside its base model", path=path,
                              where="--cartridge",
                              hint="name the base it was trained on: --model FILE.gguf (or "
                                   "its library id)")
    trained_on = read_cartridge(path).meta.get("base_sha256")
    hashes = [(entry, file, sha256_file(file)) for entry, file in files]
    base, _file, sha = next((h for h in hashes if h[2] == trained_on), hashes[0])
    cartridge = load_cartridge(path, sha)          # refused here when none is its base
    shift = cartridge.tokens - (1 if cartridge.meta.get("leading_bos") else 0)
    return Entry(f"{base.id}+{cartridge_label(path)}", "cartridge",
                 f"{base.origin} reading cartridge {path} ({cartridge.tokens} rows)",
                 {**base.load, "cartridge": str(path)}, base.family,
                 base.context - shift if base.context else None, int(path.stat().st_mtime))


@dataclass
class Catalog:
    """The served models: every entry of the workspace, or only those `--model` names (ids
    or GGUF paths)."""

    entries: dict[str, Entry]
    loaded: dict[str, object] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(cls, workspace: Path | None, names: list[str] | None = None,
              cartridges: list[str] | None = None) -> "Catalog":
        catalog = cls._models(workspace, names)
        bases = list(catalog.entries.values())
        for name in cartridges or []:
            entry = cartridge_entry(Path(name).expanduser().resolve(), bases)
            catalog.entries[entry.id] = entry
        return catalog

    @classmethod
    def _models(cls, workspace: Path | None, names: list[str] | None) -> "Catalog":
        available = {e.id: e for e in workspace_entries(workspace)} if workspace else {}
        if not names:
            return cls(available)
        chosen = {}
        for name in names:
            if name in available:
                chosen[name] = available[name]
            elif name.endswith(".gguf") or Path(name).expanduser().is_file():
                entry = file_entry(Path(name).expanduser().resolve())
                chosen[entry.id] = entry
            else:
                raise ForgebenchError(f"no model {name!r} in the workspace", where="--model",
                                      hint="served ids: " + (", ".join(available) or "none "
                                                             "(pass a GGUF file)"))
        return cls(chosen)

    def cards(self) -> list[dict]:
        return [entry.card() for entry in self.entries.values()]
