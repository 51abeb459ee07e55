"""Produce the nanochat parity goldens (tests/data/nanochat/goldens.safetensors + goldens.json)
from the reference itself: karpathy/nanochat at commit 92d63d4e8bb4df75c3b71618f31ddde2378b2bcd,
on CPU in fp32, eager (torch.compile off, as the reference runs where no compiler is wanted).

    python tests/data/nanochat/make_goldens.py --nanochat PATH \
        [--part model|tokenizer|dataloader|step10]

PATH is a nanochat git directory (a clone, or a bare mirror) holding that commit. The script
copies the commit's `nanochat/` package into a temporary directory, imports it from there, and
writes numbers only: the reference's code is not kept in this repository. It needs torch and
filelock (nanochat.common imports it); not nanochat's tokenizer deps (rustbpe, tiktoken), which
the model and optimizer do not import. `--part tokenizer` needs those instead (rustbpe 0.1.0 and
tiktoken from PyPI, in a scratch venv) and writes tokenizer_goldens.json: nanochat's
RustBPETokenizer.train_from_iterator on tokenizer_train.txt at vocab size TOKENIZER_VOCAB, then
the bytes of every merged token in id order (hex), the special-token ids, and tiktoken's ids of
tokenizer_heldout.txt (with <|bos|> prepended, as nanochat's dataloader encodes documents).
`--part dataloader` (the same plus torch, pyarrow, requests) writes dataloader_goldens.json: the
first LOADER_BATCHES (inputs, targets) of nanochat's BOS-aligned best-fit loader, its parquet
reader replaced by the documents of loader_documents() in batches of 8, cycled (and two batches
at the loader's defaults). The scratch venv they were made in:

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install rustbpe==0.1.0 tiktoken regex \
        torch==2.13.0 pyarrow filelock requests
    /tmp/ref/bin/python tests/data/nanochat/make_goldens.py --nanochat DIR --part tokenizer
    /tmp/ref/bin/python tests/data/nanochat/make_goldens.py --nanochat DIR --part dataloader

What it dumps, for a tiny config that still exercises every feature (GQA, a sliding window that
bites at T=144 > 128 + 1, value embeddings on alternating layers, vocab padding 60 -> 64):

- init/*: the weights of GPT.init_weights() after torch.manual_seed(0) (built as base_train
  does: meta device, to_empty, init_weights);
- step1/*, step10/*: parameters and optimizer state after 1 and 10 MuonAdamW steps on ten
  fixed batches (setup_optimizer with weight_decay=0.28 so cautious decay acts);
- trace: the loss of 40 such steps (batches from a seeded generator, stored);
- trained/*: the weights after those 40 steps, from which
- fwd/*: for one sequence, each block's input and output, and the logits;
- grad/*: loss and gradients of a batch of two with some targets ignored (-1);
- decode: greedy GPT.generate of 24 tokens.

goldens.json records the CPU kind they were summed on (`cpu_kind`). After ten steps the
reference's own state depends on it (4.8e-3 relative between an AMD EPYC and a Sapphire Rapids),
so `--part step10`, run on another kind of CPU, adds step10-<kind>.safetensors (only step10/*),
which the ten-step rung reads on that kind.

`--part bf16` runs the reference in its bf16 compute scheme (NANOCHAT_DTYPE=bfloat16) and writes
goldens-bf16.safetensors / goldens-bf16.json (see bf16_goldens): the bf16 rungs of the ladder.
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

CONFIG = dict(sequence_len=512, vocab_size=60, n_layer=3, n_head=2, n_kv_head=1, n_embd=32,
              window_pattern="SSL")
FWD_T = 144          # > short window (128) + 1, so the S layers' window masks keys
BATCH, TRAIN_T = 2, 144
STEPS = 40
LRS = dict(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.28,
           scalar_lr=0.5)
PROMPT = [1, 5, 9, 13]
DECODE_TOKENS = 24
BF16_STEPS = 10      # the bf16 loss trace (--part bf16)
TOKENIZER_VOCAB = 512     # with nanochat's 9 specials: 247 merges


LOADER = dict(B=4, T=128, buffer_size=16, tokenizer_batch_size=8)
LOADER_BATCHES = 6


def loader_documents(text: str) -> list[str]:
    """The loader rung's documents: the non-blank lines of the tokenizer's training text (the
    rule of engine/train/bos_bestfit.text_documents, restated: this script runs without the
    engine, in the reference's venv)."""
    return [line for line in text.split("\n") if line.strip()]


def cycled_documents(docs: list[str]):
    """A stand-in for nanochat.dataloader._document_batches (its parquet reader): `docs` in
    order, in batches of the loader's tokenizer_batch_size, cycled with the epoch counted."""
    def document_batches(split, resume_state_dict, tokenizer_batch_size):
        epoch = 1
        while True:
            for i in range(0, len(docs), tokenizer_batch_size):
                yield docs[i:i + tokenizer_batch_size], (0, i, epoch)
            epoch += 1
    return document_batches


def dataloader_goldens(out: Path) -> None:
    import nanochat.dataloader as dl
    from nanochat.tokenizer import RustBPETokenizer

    train = (HERE / "tokenizer_train.txt").read_bytes().decode("utf-8")
    tok = RustBPETokenizer.train_from_iterator(iter([train]), TOKENIZER_VOCAB)
    docs = loader_documents(train)
    dl._document_batches = cycled_documents(docs)
    loader = dl.tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tok, LOADER["B"], LOADER["T"], "train", tokenizer_threads=1,
        tokenizer_batch_size=LOADER["tokenizer_batch_size"], device="cpu",
        buffer_size=LOADER["buffer_size"])
    batches = []
    for _ in range(LOADER_BATCHES):
        x, y, _ = next(loader)
        batches.append({"inputs": x.tolist(), "targets": y.tolist()})
    # at the loader's defaults too (buffer 1000, tokenizer batches of 128), as lm-pretrain packs
    loader = dl.tokenizing_distributed_data_loader_with_state_bos_bestfit(
        tok, LOADER["B"], LOADER["T"], "train", tokenizer_threads=1, device="cpu")
    default_batches = []
    for _ in range(2):
        x, y, _ = next(loader)
        default_batches.append({"inputs": x.tolist(), "targets": y.tolist()})
    meta = {"nanochat_commit": PINNED, "vocab_size": TOKENIZER_VOCAB, "loader": LOADER,
            "documents": len(docs), "batches": batches, "default_batches": default_batches}
    (out / "dataloader_goldens.json").write_text(json.dumps(meta) + "\n")
    print(f"dataloader: {LOADER_BATCHES} batches of {LOADER['B']}x{LOADER['T']}")


def tokenizer_goldens(out: Path) -> None:
    import rustbpe
    import tiktoken
    from nanochat.tokenizer import RustBPETokenizer

    train = (HERE / "tokenizer_train.txt").read_bytes().decode("utf-8")  # keeps CRLF
    held = (HERE / "tokenizer_heldout.txt").read_bytes().decode("utf-8")
    tok = RustBPETokenizer.train_from_iterator(iter([train]), TOKENIZER_VOCAB)
    enc = tok.enc
    n_ranks = enc.n_vocab - len(enc.special_tokens_set)
    merged = [enc.decode_single_token_bytes(i).hex() for i in range(256, n_ranks)]
    meta = {"nanochat_commit": PINNED, "rustbpe": rustbpe.__version__ if hasattr(
                rustbpe, "__version__") else "0.1.0", "tiktoken": tiktoken.__version__,
            "vocab_size": TOKENIZER_VOCAB, "n_vocab": enc.n_vocab,
            "merged_token_bytes_hex": merged, "bos_id": tok.get_bos_token_id(),
            "special_ids": {name: tok.encode_special(name) for name in sorted(
                enc.special_tokens_set)},
            "heldout_ids": tok.encode(held, prepend="<|bos|>"),
            "train_head_ids": tok.encode(train[:3000])}
    (out / "tokenizer_goldens.json").write_text(json.dumps(meta) + "\n")
    print(f"tokenizer: {len(merged)} merges, {len(meta['heldout_ids'])} held-out ids")


def batches(torch, n: int):
    """Arithmetic progressions mod 60 with a random start and stride: learnable, so the
    trained model's greedy decode is not one repeated token."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        start = torch.randint(0, 60, (BATCH, 1), generator=g)
        stride = torch.randint(1, 6, (BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(TRAIN_T + 1)) % 60          # [B, T+1]
        out.append(seq)
    return torch.stack(out)                                              # [n, B, T+1]


def import_reference(nanochat: str) -> None:
    """Copy the pinned commit's `nanochat/` package out of the git directory `nanochat` into a
    temporary directory and put that first on sys.path."""
    git = ["git", "--git-dir", nanochat] if not (Path(nanochat) / ".git").exists() \
        else ["git", "-C", nanochat]
    tmp = tempfile.mkdtemp(prefix="nanochat-ref-")
    archive = subprocess.run(git + ["archive", PINNED, "nanochat"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    sys.path.insert(0, tmp)


def train_goldens(torch, model, out: dict) -> list[float]:
    """STEPS MuonAdamW steps on the stored batches: parameters and optimizer state after steps
    1 and 10, and the trained weights, into `out`; returns the loss trace."""
    data = batches(torch, STEPS)
    out["train/batches"] = data.to(torch.int32)
    optimizer = model.setup_optimizer(**LRS)
    names = {p: k for k, p in model.named_parameters()}
    losses = []
    for step in range(STEPS):
        x, y = data[step, :, :-1].contiguous(), data[step, :, 1:].contiguous()
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        model.zero_grad(set_to_none=True)
        if step + 1 in (1, 10):
            tag = f"step{step + 1}"
            for p, k in names.items():
                out[f"{tag}/param/{k}"] = p.detach().clone()
                for sk, sv in optimizer.state[p].items():
                    if isinstance(sv, torch.Tensor):
                        out[f"{tag}/state/{k}/{sk}"] = sv.detach().clone()
    for p, k in names.items():
        out[f"trained/{k}"] = p.detach().clone()
    return losses


def forward_goldens(torch, model, out: dict) -> None:
    """One sequence's input and output of every block, and its logits, into `out`."""
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, CONFIG["vocab_size"], (1, FWD_T), generator=g)
    out["fwd/idx"] = idx
    acts = []
    hooks = [b.register_forward_pre_hook(lambda m, a: acts.append(a[0].detach().clone()))
             for b in model.transformer.h]
    hooks += [b.register_forward_hook(lambda m, a, o: acts.append(o.detach().clone()))
              for b in model.transformer.h]
    with torch.no_grad():
        logits = model(idx)
    for h in hooks:
        h.remove()
    n = CONFIG["n_layer"]
    for i in range(n):
        out[f"fwd/block{i}.in"] = acts[2 * i]
        out[f"fwd/block{i}.out"] = acts[2 * i + 1]
    out["fwd/logits"] = logits


def grad_goldens(torch, model, out: dict) -> None:
    """The loss and every gradient of a batch of two with some targets ignored, into `out`."""
    g = torch.Generator().manual_seed(8)
    gx = torch.randint(0, CONFIG["vocab_size"], (BATCH, TRAIN_T + 1), generator=g)
    gx[0, 100:] = -1                     # ignored targets (the reference's ignore_index)
    out["grad/batch"] = gx.to(torch.int32)
    x, y = gx[:, :-1].clamp_min(0).contiguous(), gx[:, 1:].contiguous()
    loss = model(x, y)
    loss.backward()
    out["grad/loss"] = loss.detach().reshape(1)
    for k, p in model.named_parameters():
        out[f"grad/{k}"] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)


def cpu_kind() -> str:
    """What decides fp32 summation order beyond one step on CPU: the vendor (MKL takes other
    code paths on AMD than on Intel) and the vector width torch dispatches to. The reference
    itself, run on an AMD EPYC and on a Sapphire Rapids (both "AVX512"), is bit-identical after
    one MuonAdamW step but differs by 4.8e-3 relative after ten."""
    import torch

    vendor = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
                break
    except OSError:
        pass
    return f"{vendor}-{torch.backends.cpu.get_cpu_capability()}"


def model_goldens(out_dir: Path) -> None:
    """goldens.safetensors and goldens.json (see the module docstring)."""
    import torch
    from nanochat.gpt import GPT, GPTConfig
    from safetensors.torch import save_file
    torch.set_num_threads(1)   # one summation order, whatever the machine

    config = GPTConfig(**CONFIG)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        out[f"init/{k}"] = v.detach().clone()

    # training: gradients, 1 and 10 optimizer steps, a 40-step loss trace
    losses = train_goldens(torch, model, out)
    # forward and gradients on the trained weights: at init the zeroed projections make every
    # block a rescaling of the embedding, which would leave attention and the MLP untested
    forward_goldens(torch, model, out)
    grad_goldens(torch, model, out)
    decode = list(model.generate(PROMPT, max_tokens=DECODE_TOKENS, temperature=0))

    out = {k: v.contiguous() for k, v in out.items()}
    save_file(out, str(out_dir / "goldens.safetensors"))
    meta = {"nanochat_commit": PINNED, "torch": torch.__version__, "threads": 1,
            "cpu": cpu_kind(),
            "config": CONFIG, "lrs": LRS, "fwd_T": FWD_T, "batch": BATCH, "train_T": TRAIN_T,
            "loss_trace": losses, "prompt": PROMPT, "decode": decode,
            "window_sizes": [list(w) for w in model.window_sizes]}
    (out_dir / "goldens.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {len(out)} tensors; losses {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"decode {decode}")


def step10_goldens(out_dir: Path) -> None:
    """step10-<cpu kind>.safetensors: the state after ten steps as the reference computes it on
    this kind of CPU (the rest of the goldens hold across kinds at their tolerances)."""
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        model_goldens(Path(tmp))
        tensors = load_file(str(Path(tmp) / "goldens.safetensors"))
    path = out_dir / f"step10-{cpu_kind()}.safetensors"
    save_file({k: v for k, v in tensors.items() if k.startswith("step10/")}, str(path))
    print(f"wrote {path}")


def bf16_goldens(out_dir: Path) -> None:
    """goldens-bf16.safetensors and goldens-bf16.json: the reference with NANOCHAT_DTYPE=bfloat16
    (its own bf16 scheme: embeddings stored in bf16, Linear weights cast in forward, bf16
    norms, rotary tables and activations, fp32 logits; Muon orthogonalising in bf16) on the
    same config, one thread:

    - bf16/init/*: the embedding tables after the seeded init (stored in bf16);
    - bf16/fwd/*, bf16/grad/*: forward (each block's input and output, logits) and the loss and
      gradients of the model goldens' batches, on goldens.safetensors' trained/* weights loaded
      into the bf16 model (trained weights: see model_goldens);
    - bf16/step1/*: parameters and optimizer state after one MuonAdamW step from the init;
    - the loss of the first BF16_STEPS steps (goldens-bf16.json `loss_trace`).
    """
    import torch
    from nanochat.common import COMPUTE_DTYPE
    from nanochat.gpt import GPT, GPTConfig
    from safetensors.torch import load_file, save_file
    assert COMPUTE_DTYPE == torch.bfloat16, "NANOCHAT_DTYPE must be set before the import"
    torch.set_num_threads(1)

    def fresh():
        with torch.device("meta"):
            model = GPT(GPTConfig(**CONFIG))
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        return model

    out: dict[str, torch.Tensor] = {}
    model = fresh()
    out["bf16/init/transformer.wte.weight"] = model.transformer.wte.weight.detach().clone()
    data = batches(torch, BF16_STEPS)
    optimizer = model.setup_optimizer(**LRS)
    names = {p: k for k, p in model.named_parameters()}
    losses = []
    for step in range(BF16_STEPS):
        loss = model(data[step, :, :-1].contiguous(), data[step, :, 1:].contiguous())
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        model.zero_grad(set_to_none=True)
        if step == 0:
            for p, k in names.items():
                out[f"bf16/step1/param/{k}"] = p.detach().clone()
                for sk, sv in optimizer.state[p].items():
                    if isinstance(sv, torch.Tensor):
                        out[f"bf16/step1/state/{k}/{sk}"] = sv.detach().clone()

    trained = load_file(str(out_dir / "goldens.safetensors"))
    model = fresh()
    model.load_state_dict({k[len("trained/"):]: v for k, v in trained.items()
                           if k.startswith("trained/")})
    fwd: dict[str, torch.Tensor] = {}
    forward_goldens(torch, model, fwd)
    grad_goldens(torch, model, fwd)
    out.update({f"bf16/{k}": v for k, v in fwd.items()
                if not k.startswith(("fwd/idx", "grad/batch"))})
    save_file({k: v.contiguous() for k, v in out.items()},
              str(out_dir / "goldens-bf16.safetensors"))
    meta = {"nanochat_commit": PINNED, "torch": torch.__version__, "threads": 1,
            "cpu": cpu_kind(), "compute_dtype": "bfloat16", "config": CONFIG, "lrs": LRS,
            "loss_trace": losses}
    (out_dir / "goldens-bf16.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {len(out)} bf16 tensors; losses {losses[0]:.4f} -> {losses[-1]:.4f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanochat", required=True, help="nanochat git dir or clone")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--part", choices=("model", "tokenizer", "dataloader", "step10", "bf16"),
                    default="model")
    args = ap.parse_args()
    os.environ["NANOCHAT_DTYPE"] = "bfloat16" if args.part == "bf16" else "float32"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import_reference(args.nanochat)
    if args.part == "tokenizer":
        tokenizer_goldens(Path(args.out))
    elif args.part == "dataloader":
        dataloader_goldens(Path(args.out))
    elif args.part == "step10":
        step10_goldens(Path(args.out))
    elif args.part == "bf16":
        bf16_goldens(Path(args.out))
    else:
        model_goldens(Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
