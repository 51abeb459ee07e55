"""`forgebench chat MODEL|RUN` and `forgebench serve-local`: a terminal chat that saves the
same transcript as the Chat pane (engine/conversations.py), and the long-lived streaming
worker (engine/serve_local.py). `chat --calculator` offers the model the built-in calculator
and runs the calls it makes (engine/calculator.py: arithmetic only), each result a tool
message in the transcript that the model then reads. A nanochat checkpoint (an lm-pretrain
run of nanochat's GPT) chats in nanochat's format and runs nanochat's calculator inside the
reply, as its Engine does (engine/llm/nanochat_chat.py), with or without --calculator; each
call is shown on stderr. Outside a workspace `chat FILE` runs without saving. (The model
library's `models` command is engine/commands/models.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine import calculator, model_library
from engine.commands.models import find_workspace
from engine.errors import ForgebenchError
from engine.eval.tool_calls import parse_call


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
    from engine.serve_local import load_system

    workspace = find_workspace(args.workspace)
    request = load_request(args.target, args, workspace)
    label = Path(args.target).name
    print(f"loading {label} …", file=sys.stderr)
    system = load_system("A", request, torch_free=True)
    conversation = _open_conversation(
        args, workspace, {"A": {"label": label, "load": request, "info": system.info}})
    if args.system:
        conversation.add("system", args.system)
    nanochat = system.info.get("format") == "nanochat"
    print("sampling: " + describe_settings(chat_settings(args, nanochat)), file=sys.stderr)
    # a nanochat model runs its own calculator inside the reply: no JSON tool round trips
    tools = [calculator.SCHEMA] if args.calculator and system.info.get("format") != "nanochat" \
        else None

    def reply() -> dict:
        return _stream_reply(system, conversation, label, args, tools)

    for text in _user_turns(args.prompt):
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


def _open_conversation(args, workspace: Path | None, systems: dict):
    """The transcript: --save FILE, else a new one in the workspace's chats/, else unsaved."""
    from engine.conversations import Conversation

    if args.save:
        conversation = Conversation.create(args.save, systems)
    elif workspace is not None:
        conversation = Conversation.new_in(workspace, systems)
    else:
        conversation = Conversation.unsaved(systems)
    print(f"transcript: {conversation.path}" if conversation.path is not None else
          "transcript: not saved (no workspace here; pass --save FILE.jsonl or --workspace "
          "DIR to keep it)", file=sys.stderr)
    return conversation


def _user_turns(prompts: list[str] | None):
    """The user's messages: the --prompt texts, else lines typed at `you> ` until end of
    input, /quit or /exit; blank lines are skipped."""
    given = iter(prompts) if prompts else None
    while True:
        if given is not None:
            text = next(given, None)
        else:
            try:
                text = input("you> ")
            except EOFError:
                text = None
        if text is None or text.strip() in ("/quit", "/exit"):
            return
        if text.strip():
            yield text


def _stream_reply(system, conversation, label: str, args, tools: list | None) -> dict:
    """One reply streamed to the terminal as it is generated, then added to the transcript."""
    from engine.serve_local import chat

    settings = chat_settings(args, system.info.get("format") == "nanochat")
    sys.stdout.write(f"{label}> ")
    streamed: list[str] = []

    def send(line: dict) -> None:
        if line["event"] == "token":
            streamed.append(line["text"])
            sys.stdout.write(line["text"])
            sys.stdout.flush()
        elif line["event"] == "tool":       # a nanochat model's calculator, run in the reply
            result = "no result" if line["result"] is None else line["result"]
            print(f"\n  [calculator {line['expr']} -> {result}]", file=sys.stderr)

    done = chat(system, {"messages": conversation.thread("A"), "settings": settings,
                         "seed": args.seed, "max_tokens": args.max_tokens, "tools": tools},
                send, lambda: False)
    # the tail a stop-string check held back arrives only in the final text
    sys.stdout.write(done["text"][len("".join(streamed)):] + "\n")
    conversation.add_reply("A", done)
    ttft = done["timings"].get("first_streamed_token_s")
    print(f"  [{done['new_tokens']} tokens, {done['stop_reason']}"
          + (f", first token {ttft:.2f} s" if ttft is not None else "")
          + (f", {done['sampler']} sampler" if done.get("sampler") else "") + "]",
          file=sys.stderr)
    return done


def chat_settings(args, nanochat: bool = False) -> dict:
    """The sampling settings of a chat: each option given, else the chat default (a nanochat
    model's own: its sampler, no repetition penalty or DRY)."""
    from engine.sampling import CHAT_DEFAULTS, NANOCHAT_CHAT_DEFAULTS

    defaults = NANOCHAT_CHAT_DEFAULTS if nanochat else CHAT_DEFAULTS
    return {key: default if getattr(args, key, None) is None else getattr(args, key)
            for key, default in defaults.as_dict().items()}


def describe_settings(settings: dict) -> str:
    """One line a user reads at the start of a chat, with how to change what matters most."""
    how = ("greedy" if settings["temperature"] <= 0 else
           f"temperature {settings['temperature']:g}, top-k {settings['top_k']}, "
           f"top-p {settings['top_p']:g}")
    penalty, last_n = settings["repetition_penalty"], settings["repetition_last_n"]
    dry = settings.get("dry_multiplier", 0.0)
    dry_text = (f", DRY {dry:g} (--dry-multiplier 0 turns it off)" if dry else "")
    if penalty == 1.0 or last_n == 0:
        return f"{how}, no repetition penalty{dry_text}"
    window = "all tokens" if last_n < 0 else f"the last {last_n} tokens"
    return (f"{how}, repetition penalty {penalty:g} over {window} "
            f"(--repetition-penalty 1 turns it off){dry_text}")


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
