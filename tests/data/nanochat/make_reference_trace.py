"""Produce a reference loss trace for a Forgebench lm-pretrain nanochat config: karpathy/nanochat
at commit 92d63d4e8bb4df75c3b71618f31ddde2378b2bcd trains the same model on the same tokens in
the same order with the same seed and schedule, on CPU in fp32, eager, and its per-step training
loss is written as JSON (numbers only). The Runs pane draws it beside a run of that config
(`[compare] reference_trace`), and tests/test_nanochat_pretrain.py holds a real run of the
shipped sample config to it.

    .venv/bin/python tests/data/nanochat/make_reference_trace.py \\
        --config resources/sample-workspace/configs/lm-pretrain-nanochat-tiny.toml \\
        --nanochat /work/.mirror/karpathy+nanochat/repo --ref-python /tmp/ref/bin/python \\
        --out resources/sample-workspace/reference-traces/nanochat-tiny-92d63d4.json

It runs in two processes. Forgebench's (this venv, the engine importable) reads the config and
writes what a run of it draws from Forgebench itself: the order in which its seeded sampler
(engine/train/data_order.py) takes the packed rows, each step's learning rate from lm-pretrain's
schedule (warmup + cosine, not base_train's linear warmdown: the trace is of the model, optimizer
and data, under the run's own schedule), Muon's momentum and weight decay of each step
(base_train's schedules, engine/train/muon.py), and its own packed rows. The reference's (the
scratch venv of make_goldens.py, which has rustbpe and tiktoken; `--ref-python`) imports
nanochat's package from the pinned commit as make_goldens.py does and builds everything else
from nanochat's code: it trains nanochat's tokenizer on the train split, packs the documents
(its non-blank lines) with nanochat's BOS best-fit loader at lm-pretrain's buffer and batch
sizes, checks that these rows are Forgebench's row for row (it stops if not: the trace would
not be of the same data), builds GPT from the config's shape, seeds torch with the config's seed
before init_weights, takes setup_optimizer's MuonAdamW, and steps on the rows in the sampler's
order, each group's rate the schedule's times its share (initial_lr / optim.lr, as
engine.train.optim.set_lr sets it). Why the reference is fed our order rather than nanochat's
stream order: lm-pretrain samples rows in a seeded shuffle (epoch by epoch, resumable) and the
parity ladder showed that on the same batches our steps are the reference's, so the one choice
that makes a trace comparable without changing how runs train is to hand the reference the
order; the rows themselves are the reference's own.

Measured on this repository's machine (Sapphire Rapids, AVX512): a run of the tiny sample config
with `--threads 1` equals the 1-thread trace bit for bit at all 40 steps, and with 2 threads
equals the reference run on 2 threads bit for bit; but the reference on 2 threads differs from
itself on 1 by 3e-6 at step 2 and 3.1e-2 by step 38: training amplifies a summation order's
rounding. So the trace records its thread count and kind of CPU (vendor and torch's vector
width: make_goldens.cpu_kind), and a run is comparable to it at the ladder's 1e-4 only on the
same of both.

The trace's `steps` are numbered as a run's metrics.jsonl numbers its train rows: step k is the
loss of the k-th batch, before that batch's update.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PINNED = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
LABEL = f"nanochat {PINNED[:7]} (reference)"
# lm-pretrain's packed_rows: nanochat's loader at its defaults (1000 buffered documents,
# tokenized 128 at a time), rows taken one at a time
BUFFER_SIZE, TOKENIZER_BATCH = 1000, 128


# -- Forgebench's side: what the run draws from the engine --------------------------------
def forgebench_inputs(config_path: Path) -> dict:
    """The rows, the sampler's order, the schedule and the shapes of a run of `config_path`."""
    sys.path.insert(0, str(REPO))
    import torch

    from engine.config import load_config
    from engine.errors import ForgebenchError
    from engine.nanochat_tokenizer import NanochatTokenizer
    from engine.recipes.lm_pretrain import build_model, read_split, train_windows_of
    from engine.train.data_order import DataCursor
    from engine.train.muon import pretrain_optimizer
    from engine.train.optim import scheduled_lr

    config = load_config(config_path)
    m, opt, tr = config.model, config.optim, config.train
    wanted = {"model.family": (m.family, "nanochat"), "optim.kind": (opt.kind, "muon"),
              "tokenizer.kind": (config.tokenizer.kind, "nanochat"),
              "data.packing": (config.data.packing, "bos_bestfit"),
              "train.precision": (tr.precision, "f32"), "train.grad_accum": (tr.grad_accum, 1),
              "optim.grad_clip": (opt.grad_clip, 0.0)}
    for name, (value, need) in wanted.items():
        if value != need:
            raise ForgebenchError(f"{name} is {value!r}; the reference trace needs {need!r} "
                                  "(nanochat's model, optimizer, tokenizer and rows, fp32, "
                                  "one micro-batch, no clipping)", path=config_path,
                                  where=f"field '{name}'")
    train_text = read_split(config, "train")
    tokenizer = NanochatTokenizer.train([train_text], config.tokenizer.vocab_size)
    rows = train_windows_of(config, tokenizer, train_text)                 # [N, T+1]
    cursor = DataCursor(len(rows), config.seed)
    order = [cursor.take(tr.batch_size) for _ in range(config.steps)]
    model = build_model(config, tokenizer.vocab_size)
    optimizer = pretrain_optimizer(model, opt, tr.batch_size * m.context, config.steps)
    hyper = optimizer.hyper
    c = model.config
    return {
        "train_text": train_text, "vocab_size": config.tokenizer.vocab_size,
        "rows": rows.tolist(), "order": order, "seed": config.seed, "context": m.context,
        "gpt_config": {"sequence_len": c.sequence_len, "vocab_size": c.vocab_size,
                       "n_layer": c.n_layer, "n_head": c.n_head, "n_kv_head": c.n_kv_head,
                       "n_embd": c.n_embd, "window_pattern": c.window_pattern},
        "setup": {"unembedding_lr": hyper.unembedding_lr * hyper.batch_lr_scale,
                  "embedding_lr": hyper.embedding_lr * hyper.batch_lr_scale,
                  "matrix_lr": hyper.matrix_lr * hyper.batch_lr_scale,
                  "scalar_lr": hyper.scalar_lr * hyper.batch_lr_scale,
                  "weight_decay": hyper.scaled_weight_decay},
        "initial_lrs": [g["initial_lr"] for g in optimizer.param_groups],
        "optim_lr": opt.lr,
        "lr": [scheduled_lr(opt, s, config.steps) for s in range(config.steps)],
        "momentum": [hyper.muon_momentum(s) for s in range(config.steps)],
        "muon_weight_decay": [hyper.muon_weight_decay(s) for s in range(config.steps)],
        "torch_threads": torch.get_num_threads(),
    }


# -- the reference's side: nanochat's own code, in its venv -------------------------------
def reference_rows(inputs: dict):
    """nanochat's tokenizer trained on the train split and its BOS best-fit rows of the
    split's documents, as many as Forgebench packed: [N, T+1]."""
    import nanochat.dataloader as dl
    import torch
    from nanochat.tokenizer import RustBPETokenizer

    text = inputs["train_text"]
    tok = RustBPETokenizer.train_from_iterator(iter([text]), inputs["vocab_size"])
    from make_goldens import cycled_documents, loader_documents  # beside this script

    dl._document_batches = cycled_documents(loader_documents(text))  # bos_bestfit's documents
    loader = dl.tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tok, 1, inputs["context"], "train", tokenizer_threads=1,
        tokenizer_batch_size=TOKENIZER_BATCH, device="cpu", buffer_size=BUFFER_SIZE)
    rows = []
    for _ in range(len(inputs["rows"])):
        x, y, _ = next(loader)
        rows.append(torch.cat([x[0], y[0, -1:]]))
    return torch.stack(rows)


def reference_trace(inputs: dict, threads: int) -> dict:
    import torch
    from nanochat.gpt import GPT, GPTConfig
    torch.set_num_threads(threads)

    rows = reference_rows(inputs)
    ours = torch.tensor(inputs["rows"], dtype=torch.long)
    if rows.shape != ours.shape or not torch.equal(rows, ours):
        bad = (rows != ours).any(dim=1).nonzero().flatten().tolist() \
            if rows.shape == ours.shape else "shape"
        raise SystemExit(f"nanochat's rows differ from Forgebench's (rows {bad}): the trace "
                         "would not be of the same data")
    from make_goldens import cpu_kind  # beside this script: the kind the goldens record
    with torch.device("meta"):
        model = GPT(GPTConfig(**inputs["gpt_config"]))
    model.to_empty(device="cpu")
    torch.manual_seed(inputs["seed"])
    model.init_weights()
    optimizer = model.setup_optimizer(**inputs["setup"])
    initial = [g["initial_lr"] for g in optimizer.param_groups]
    if initial != inputs["initial_lrs"]:
        raise SystemExit(f"setup_optimizer's rates {initial} are not Forgebench's "
                         f"{inputs['initial_lrs']}")
    losses = []
    for step, indices in enumerate(inputs["order"]):
        for group in optimizer.param_groups:
            group["lr"] = inputs["lr"][step] * (group["initial_lr"] / inputs["optim_lr"])
            if group["kind"] == "muon":
                group["momentum"] = inputs["momentum"][step]
                group["weight_decay"] = inputs["muon_weight_decay"][step]
        batch = rows[indices]                                            # [B, T+1]
        loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return {"torch": torch.__version__, "threads": threads, "losses": losses,
            "cpu": cpu_kind()}


# -- driver -------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a Forgebench lm-pretrain nanochat config (TOML)")
    ap.add_argument("--nanochat", required=True, help="nanochat git dir or clone")
    ap.add_argument("--ref-python", default=sys.executable,
                    help="python of the reference's venv (rustbpe, tiktoken, torch)")
    ap.add_argument("--out", help="where to write the trace (JSON)")
    ap.add_argument("--threads", type=int, default=1,
                    help="the reference's torch threads (1: one summation order on any machine; "
                         "a run matches it bit for bit with `forgebench run --threads 1`)")
    ap.add_argument("--reference-side", nargs=2, metavar=("INPUTS", "RESULT"),
                    help=argparse.SUPPRESS)   # the second process
    args = ap.parse_args()
    if args.reference_side:
        os.environ["NANOCHAT_DTYPE"] = "float32"
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        from make_goldens import import_reference  # beside this script
        import_reference(args.nanochat)
        inputs = json.loads(Path(args.reference_side[0]).read_text("utf-8"))
        Path(args.reference_side[1]).write_text(json.dumps(reference_trace(inputs,
                                                                         args.threads)))
        return 0
    if not args.config or not args.out:
        ap.error("--config and --out are required")
    config = Path(args.config).resolve()
    inputs = forgebench_inputs(config)
    with tempfile.TemporaryDirectory(prefix="nanochat-trace-") as tmp:
        (Path(tmp) / "inputs.json").write_text(json.dumps(inputs), encoding="utf-8")
        subprocess.run([args.ref_python, __file__, "--nanochat", args.nanochat,
                        "--threads", str(args.threads),
                        "--reference-side", str(Path(tmp) / "inputs.json"),
                        str(Path(tmp) / "result.json")], check=True)
        result = json.loads((Path(tmp) / "result.json").read_text("utf-8"))
    losses = result["losses"]
    try:
        shown = str(config.relative_to(REPO))
    except ValueError:
        shown = config.name
    trace = {"kind": "reference-loss-trace", "label": LABEL,
             "reference": {"repo": "karpathy/nanochat", "commit": PINNED,
                           "torch": result["torch"], "threads": result["threads"],
                           "cpu": result["cpu"],
                           "dtype": "float32", "device": "cpu"},
             "config": shown, "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
             "made_by": "tests/data/nanochat/make_reference_trace.py",
             "steps": list(range(1, len(losses) + 1)), "loss": losses}
    Path(args.out).write_text(json.dumps(trace, indent=1) + "\n", encoding="utf-8")
    print(f"{len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
