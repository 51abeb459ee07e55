"""Produce the SFT reference loss trace (tests/data/nanochat/sft_trace.json): karpathy/nanochat at
commit 92d63d4e8bb4df75c3b71618f31ddde2378b2bcd takes the SFT steps of scripts/chat_sft.py on
the conversations and in the order an lm-sft run of the config below takes them, on CPU in
fp32, eager, one thread, and its per-step training loss is written as JSON (numbers only).
tests/test_nanochat_sft_trace.py holds a real lm-sft run of the same config to it.

    .venv/bin/python tests/data/nanochat/make_sft_trace.py \\
        --nanochat /work/.mirror/karpathy+nanochat/repo --ref-python /tmp/ref/bin/python \\
        --out tests/data/nanochat/sft_trace.json

The reference's venv is make_goldens.py's scratch venv (rustbpe 0.1.0, tiktoken, torch 2.13.0,
filelock). Two processes, as make_reference_trace.py:

- Forgebench's (this venv) builds the base and the config (`build`): a one-step lm-pretrain run
  of nanochat's GPT with optim.kind = "muon", its checkpoint given the fixed weights of the
  chat goldens (chat_goldens.safetensors: the same numbers on every CPU, unlike weights that
  training made) and nanochat's tokenizer trained on tokenizer_train.txt at 512; then an lm-sft
  config over it (full weights, f32, no clipping, one micro-batch per step, STEPS steps) on
  CONVERSATIONS, calculator calls included. It writes what the run takes from Forgebench: the
  conversations in nanochat's form (parts), the ids and training mask lm-sft encodes, the
  seeded sampler's order (engine/train/data_order.py), each step's learning rate from lm-sft's
  schedule, and MuonAdamW's rates as lm-sft sets them up (engine/train/lm_base.sft_optimizer).
- The reference's trains nanochat's tokenizer on the same text (rustbpe), renders every
  conversation with its own render_conversation and stops unless ids and mask are lm-sft's;
  builds GPT from the config, loads the base weights, takes setup_optimizer's MuonAdamW with
  the pretrain run's rates and weight decay 0 as chat_sft does, and for each step sets every
  group's rate to the schedule's times its share (initial_lr / the pretrain matrix rate) and
  Muon's momentum to chat_sft's get_muon_momentum (restated here: chat_sft is a script, not a
  module), then steps on the step's conversations as chat_sft's loader lays them out: one row
  each, padded with <|bos|> to sequence_len + 1, targets -1 where the mask is 0 (which covers
  the padding), the loss GPT.forward's mean over the targets.

What differs from chat_sft itself, and why the rung still holds its model, optimizer and data:
chat_sft's loader packs several conversations into a row best-fit and they attend across
their boundaries; lm-sft computes each conversation alone (engine/train/lm_base.PackedNanochat).
With one conversation per row the two are the same computation, so the reference is given
one per row. lm-sft's loss is the window's summed cross-entropy over its supervised tokens,
chat_sft's the mean over a micro-batch's: the same number with one micro-batch per step.

The trace records the CPU kind and thread count it was summed with (make_goldens.cpu_kind):
after a few steps the reference's own state depends on them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PINNED = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
LABEL = f"nanochat {PINNED[:7]} chat_sft (reference)"
STEPS = 8
CALL = "<|python_start|>{expr}<|python_end|><|output_start|>{result}<|output_end|>"
CONVERSATIONS = [
    ("What is 6 times 7?", CALL.format(expr="6*7", result="42") + " It is 42."),
    ("What is 12 plus 30?", CALL.format(expr="12+30", result="42") + " It is 42."),
    ("What is 9 times 9?", CALL.format(expr="9*9", result="81") + " It is 81."),
    ("Say hello.", "Hello!"),
    ("What is 100 minus 58?", "Let me work it out. " + CALL.format(expr="100-58", result="42")
     + " So it is 42."),
    ("Name a color.", "Blue is a color."),
]
SFT_CONFIG = """\
recipe = "lm-sft"
seed = 11
steps = {steps}
save_every = {save_every}
keep_last = 5
log_every = 1

[model]
run = "{base}"

[data]
path = "{data}"

[lora]
method = "full"

[optim]
lr = 0.01
warmup = 2
schedule = "cosine"
grad_clip = 0.0

[train]
window = 3
micro_batch = 3
precision = "f32"
"""


# -- Forgebench's side ----------------------------------------------------------------------
def build(root: Path, steps: int = STEPS, save_every: int = 0) -> Path:
    """The base run root/base and the lm-sft config root/sft.toml over it (see the module
    docstring); returns the config's path. Runs in Forgebench's venv, the engine importable."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from lm_pretrain_support import make_corpus
    from nanochat_chat_support import GOLDENS, nanochat_run_config
    from safetensors.numpy import load_file, save_file

    from engine.cli import main
    from engine.nanochat_tokenizer import NanochatTokenizer
    from engine.rundir import SENTINEL
    from engine.train.integrity import file_records

    goldens = json.loads(GOLDENS.read_text("utf-8"))
    config = nanochat_run_config(root / "pretrain.toml", make_corpus(root), goldens["config"])
    text = config.read_text().replace("[optim]\nlr = 3e-3\nwarmup = 2\n",
                                      '[optim]\nkind = "muon"\nlr = 0.02\nwarmup = 0\n')
    config.write_text(text)
    if main(["run", str(config), "--out", str(root / "base"), "--threads", "1"]) != 0:
        raise SystemExit("the base's lm-pretrain run failed")
    checkpoint = sorted((root / "base" / "checkpoints").glob("step-*"))[-1]
    tensors = load_file(str(HERE / "chat_goldens.safetensors"))
    save_file({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")},
              str(checkpoint / "model.safetensors"))
    train_text = (HERE / "tokenizer_train.txt").read_bytes().decode("utf-8")
    tokenizer = NanochatTokenizer.train([train_text], goldens["config"]["vocab_size"])
    (checkpoint / "tokenizer.json").write_text(tokenizer.to_json(), "utf-8")
    state = json.loads((checkpoint / SENTINEL).read_text("utf-8"))
    state["files"].update(file_records(checkpoint, ["model.safetensors", "tokenizer.json"]))
    (checkpoint / SENTINEL).write_text(json.dumps(state), "utf-8")
    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]})
                            + "\n" for q, a in CONVERSATIONS))
    path = root / "sft.toml"
    path.write_text(SFT_CONFIG.format(steps=steps, save_every=save_every or steps,
                                      base=root / "base", data=data))
    return path


def forgebench_inputs(config_path: Path) -> dict:
    """What an lm-sft run of `config_path` takes from Forgebench (see the module docstring)."""
    import torch

    from engine.config import load_config
    from engine.llm.nanochat_chat import conversation_of
    from engine.llm.sft_data import split_examples
    from engine.train.data_order import DataCursor
    from engine.train.lm_base import encode_nanochat, load_base, sft_optimizer
    from engine.train.optim import scheduled_lr

    config = load_config(config_path)
    base = load_base(config)
    samples, _ = encode_nanochat(config, base)
    examples = split_examples(config)
    optimizer = sft_optimizer(config, base, list(base.model.named_parameters()))
    cursor = DataCursor(len(samples), config.seed)
    pretrain = base.nanochat.optim
    c = base.model.config
    with tempfile.NamedTemporaryFile(suffix=".pt", delete=False) as f:
        torch.save(base.model.state_dict(), f.name)
    return {
        "weights": f.name,
        "train_text": (HERE / "tokenizer_train.txt").read_bytes().decode("utf-8"),
        "vocab_size": c.vocab_size,
        "conversations": [conversation_of(e.messages) for e in examples],
        "ids": [s.sequence for s in samples],
        "supervised": [[0] + [int(t != -100) for t in s.labels] for s in samples],
        "order": [cursor.take(config.train.window) for _ in range(config.steps)],
        "gpt_config": {"sequence_len": c.sequence_len, "vocab_size": c.vocab_size,
                       "n_layer": c.n_layer, "n_head": c.n_head, "n_kv_head": c.n_kv_head,
                       "n_embd": c.n_embd, "window_pattern": c.window_pattern},
        "setup": {"unembedding_lr": pretrain.unembedding_lr,
                  "embedding_lr": pretrain.embedding_lr, "matrix_lr": pretrain.lr,
                  "weight_decay": 0.0},
        "initial_lrs": [g["initial_lr"] for g in optimizer.param_groups],
        "matrix_lr": pretrain.lr,
        "lr": [scheduled_lr(config.optim, s, config.steps) for s in range(config.steps)],
    }


# -- the reference's side: nanochat's own code, in its venv ---------------------------------
def get_muon_momentum(it: int) -> float:
    """scripts/chat_sft.py's get_muon_momentum, restated (the script is not importable)."""
    frac = min(it / 300, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def reference_trace(inputs: dict, threads: int) -> dict:
    import torch
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import RustBPETokenizer
    torch.set_num_threads(threads)

    tok = RustBPETokenizer.train_from_iterator(iter([inputs["train_text"]]),
                                               inputs["vocab_size"])
    rendered = [tok.render_conversation(c) for c in inputs["conversations"]]
    for k, (ids, mask) in enumerate(rendered):
        if ids != inputs["ids"][k] or mask != inputs["supervised"][k]:
            raise SystemExit(f"nanochat renders conversation {k} otherwise than lm-sft "
                             "encodes it: the trace would not be of the same data")
    from make_goldens import cpu_kind  # beside this script
    with torch.device("meta"):
        model = GPT(GPTConfig(**inputs["gpt_config"]))
    model.to_empty(device="cpu")
    model.init_weights()                       # the rotary buffers; the weights come next
    model.load_state_dict(torch.load(inputs["weights"]))
    optimizer = model.setup_optimizer(**inputs["setup"])
    initial = [g["initial_lr"] for g in optimizer.param_groups]
    if initial != inputs["initial_lrs"]:
        raise SystemExit(f"setup_optimizer's rates {initial} are not lm-sft's "
                         f"{inputs['initial_lrs']}")
    capacity = inputs["gpt_config"]["sequence_len"] + 1
    bos = tok.get_bos_token_id()
    losses = []
    for step, indices in enumerate(inputs["order"]):
        for group in optimizer.param_groups:
            group["lr"] = inputs["lr"][step] * (group["initial_lr"] / inputs["matrix_lr"])
            if group["kind"] == "muon":
                group["momentum"] = get_muon_momentum(step)
        rows = torch.tensor([rendered[i][0] + [bos] * (capacity - len(rendered[i][0]))
                             for i in indices])
        masks = torch.tensor([rendered[i][1] + [0] * (capacity - len(rendered[i][1]))
                              for i in indices])
        inputs_, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        targets[masks[:, 1:] == 0] = -1
        loss = model(inputs_, targets)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return {"torch": torch.__version__, "threads": threads, "losses": losses,
            "cpu": cpu_kind()}


# -- driver ---------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanochat", required=True, help="nanochat git dir or clone")
    ap.add_argument("--ref-python", default=sys.executable,
                    help="python of the reference's venv (rustbpe, tiktoken, torch)")
    ap.add_argument("--out", help="where to write the trace (JSON)")
    ap.add_argument("--threads", type=int, default=1, help="the reference's torch threads")
    ap.add_argument("--reference-side", nargs=2, metavar=("INPUTS", "RESULT"),
                    help=argparse.SUPPRESS)   # the second process
    args = ap.parse_args()
    if args.reference_side:
        os.environ["NANOCHAT_DTYPE"] = "float32"
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        sys.path.insert(0, str(HERE))
        from make_goldens import import_reference
        import_reference(args.nanochat)
        inputs = json.loads(Path(args.reference_side[0]).read_text("utf-8"))
        Path(args.reference_side[1]).write_text(json.dumps(reference_trace(inputs,
                                                                         args.threads)))
        return 0
    if not args.out:
        ap.error("--out is required")
    with tempfile.TemporaryDirectory(prefix="nanochat-sft-trace-") as tmp:
        inputs = forgebench_inputs(build(Path(tmp)))
        (Path(tmp) / "inputs.json").write_text(json.dumps(inputs), encoding="utf-8")
        subprocess.run([args.ref_python, __file__, "--nanochat", args.nanochat,
                        "--threads", str(args.threads),
                        "--reference-side", str(Path(tmp) / "inputs.json"),
                        str(Path(tmp) / "result.json")], check=True)
        result = json.loads((Path(tmp) / "result.json").read_text("utf-8"))
        os.unlink(inputs["weights"])
    losses = result["losses"]
    trace = {"kind": "reference-loss-trace", "label": LABEL,
             "reference": {"repo": "karpathy/nanochat", "commit": PINNED,
                           "script": "scripts/chat_sft.py", "torch": result["torch"],
                           "threads": result["threads"], "cpu": result["cpu"],
                           "dtype": "float32", "device": "cpu"},
             "made_by": "tests/data/nanochat/make_sft_trace.py",
             "steps": list(range(1, len(losses) + 1)), "loss": losses}
    Path(args.out).write_text(json.dumps(trace, indent=1) + "\n", encoding="utf-8")
    print(f"{len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
