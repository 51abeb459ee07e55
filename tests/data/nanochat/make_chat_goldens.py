"""Produce the calculator-chat goldens (tests/data/nanochat/chat_goldens.json and
chat_goldens.safetensors) from the reference itself: karpathy/nanochat at commit
92d63d4e8bb4df75c3b71618f31ddde2378b2bcd, on CPU in fp32.

    cd /tmp && PYTHONPATH=/tmp/refpkgs REPO/.venv/bin/python \
        REPO/tests/data/nanochat/make_chat_goldens.py --nanochat PATH

PATH is a nanochat git directory holding that commit (a bare mirror will do); its `nanochat/`
package is copied to a temporary directory and imported from there (make_goldens.py's
import_reference). nanochat.engine imports the tokenizer, so this needs torch, filelock,
rustbpe 0.1.0 and tiktoken; they were installed beside the project's venv, not into it:

    python -m pip install --target /tmp/refpkgs rustbpe==0.1.0 tiktoken

Numbers only are written (the reference's code is not kept in this repository):

- calculator: nanochat.engine.use_calculator on every expression of CALCULATOR_TABLE: the
  result's type name and str() (or "str_error" where str() raises, as for an int past 4300
  digits), None where it returns None. Rows whose reference value depends on the machine
  are left out: `'a'.center(999999999).count('a')` allocates 1 GB and gives 1, or None when
  the 3 s alarm fires first (both were seen here under load);
- render: RustBPETokenizer.render_conversation (ids, mask) of RENDER_CONVERSATION (a system
  message, tool parts) and render_for_completion of each chat case;
- engine: for each of CASES, nanochat.engine.Engine.generate(prompt, num_samples=1,
  max_tokens=MAX_TOKENS, temperature=0.0): every token column, its mask (1 sampled, 0 forced)
  and the last-position logits of each model forward the Engine made (the golden stops at the
  row's <|assistant_end|>, before the forward the Engine makes after it);
- sampling: nanochat.engine.sample_next_token on every stored logits row (the logits/i in
  key order, concatenated) for each of SAMPLINGS, one generator seeded SAMPLE_SEED.

Made with the project's venv (Python 3.11.7, torch 2.13.0+cpu, one thread) plus
/tmp/refpkgs; the calculator's values are Python's, so they hold for that Python line.

The model is a tiny GPT (CONFIG) with init_weights() under torch.manual_seed(0), then every
block's output projections drawn too (so attention and the MLP act, where init leaves them at
zero) and its lm_head solved so that greedy decoding follows the scripts of CASES: the
calculator calls and answers. The lm_head is the least-squares solution (pinv) making the
logit of each scripted next token SCRIPT_LOGIT and every other logit 0 at each sampled
position, on hidden states the reference model computes for the whole scripted sequence (the
lm_head does not change them). All weights are stored (chat_goldens.safetensors), so the test
loads these numbers and nothing is re-derived. The tokenizer is
RustBPETokenizer.train_from_iterator on tokenizer_train.txt at vocab 512
(tokenizer_goldens.json's; the engine trains the same merges).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_goldens import PINNED, TOKENIZER_VOCAB, import_reference  # noqa: E402

CONFIG = dict(sequence_len=256, vocab_size=TOKENIZER_VOCAB, n_layer=2, n_head=2, n_kv_head=1,
              n_embd=96, window_pattern="SL")
MAX_TOKENS = 48
# nanochat's sample_next_token on the stored logits rows, one generator seeded SAMPLE_SEED
# across them all: a temperature high enough that the draws spread over many tokens
SAMPLE_SEED = 42
SAMPLINGS = [{"temperature": 3.0, "top_k": 50}, {"temperature": 3.0, "top_k": None},
             {"temperature": 0.6, "top_k": 50}]
SCRIPT_LOGIT = 12.0

# What the scripted model says after each user message: text, then calculator calls (each
# with the reference's output forced after it when there is one), then text.
CASES = [
    {"user": "What is 6 times 7?", "script": [("python", "6*7"), ("text", " It is 42.")]},
    {"user": "Divide 1 by 0.", "script": [("python", "1/0"), ("text", " Undefined.")]},
    {"user": "How many r in strawberry?",
     "script": [("text", "Let me count:"), ("python", "'strawberry'.count('r')"),
                ("text", " three")]},
    {"user": "Share 1,000 among 8.", "script": [("python", "1,000/8"), ("text", " each")]},
]

RENDER_CONVERSATION = {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 * 3?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Computing "},
        {"type": "python", "text": "12*3"},
        {"type": "python_output", "text": "36"},
        {"type": "text", "text": " so 36."}]},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]}

# The calculator table: each rule of use_calculator, and hostile inputs.
CALCULATOR_TABLE = [
    # arithmetic
    "1+2", "6*7", "10/4", "10/5", "7//2", "-7//2", "1/3", "0.1+0.2", "2.5*4", ".5+1", "5.",
    "(1+2)*3", " 3 + 4", "3 + 4 ", "-(-3)", "+-+3", "1/0", "7//0", "", " ", "()", "(1)",
    "...", "()*3", "1,000*3", "1,2,3", "12,345.5/5", "2**8", "2* *8", "2*-8", "012",
    "1.5.5", "3)", "((((2))))", "123456789*987654321",
    "99999999999999999999/3", "1" * 400 + "/3",
    # characters outside both rules
    "5%3", "2^3", "1e5", "2\t+3", "a=1", "[1].count(1)", "{}", "1;2", "x\n",
    # the string rule
    "'strawberry'.count('r')", "\"banana\".count(\"an\")", "'aaa'.count('')",
    "'a b a'.split().count('a')", "'Hello'.lower().count('l')", "'abc'.count('d')",
    "'abc'.count('a') + 1", "'abc'.upper()", "'abc'.count", "len('abc'.count('a'))",
    "'direction'.count('i')", "'profile'.count('f')", "'x'.count('x') if 1 else 2",
    "not 'a'.count('b')", "'abc'.count('a') and 'x'", "'abc'.count('z') or 'y'",
    "'a' in 'abc'.count('a')", "'b' in 'abc' and 'abc'.count('b')", "f'abc'.count('c')",
    "b'abcb'.count(b'b')", "'ab'.count('a').bit_length()", "'a'.count('a').real",
    "('a' 'b').count('b')", "'mississippi'.count('ss')", "'a'.join('xyz').count('a')",
    "'A B'.casefold().split().count('a')", "'x'.count('x')()",
    "'abc'.count('a') is 1", "'x'.join(c for c in 'abc').count('x')",
    "'abc'.count('a').bit_length", "True.count('a')", "None.count('a')",
    "(1).count(1)", "().count(())", "'x'.center(20).count(' ')",
    # hostile
    "__import__('os').system('echo hi')", "().__class__.__bases__[0]", "'a'.__class__.count('a')",
    "open('x').read().count('a')", "eval('1').count(1)", "exec('x')", "globals().count(1)",
    "'a'.format().count('a')", "'a'.encode('rot13').count(b'a')",
    "'a'.zfill(99999999999).count('0')",
    "9**9**9", "9*" * 2000 + "9", "99999999999*" * 400 + "9", "9" * 4400,
    "(" * 150 + "1" + ")" * 150, "(" * 250 + "1" + ")" * 250, "-" * 150 + "1",
    "-" * 5000 + "1", "1+" * 3000 + "1", "'" + "a" * 5000 + "'.count('a')",
    "1" * 10000,
]


def value_record(value):
    if value is None:
        return None
    record = {"type": type(value).__name__}
    try:
        text = str(value)
    except ValueError as exc:       # an int past the 4300-digit limit
        record["str_error"] = type(exc).__name__
        return record
    if " at 0x" in text:            # a method object: its text is a memory address
        record["str_prefix"] = text.split(" at 0x")[0]
    else:
        record["str"] = text
    return record


def calculator_goldens() -> list[dict]:
    from nanochat.engine import use_calculator

    return [{"expr": expr, "value": value_record(use_calculator(expr))}
            for expr in CALCULATOR_TABLE]


def scripted_sequence(tokenizer, use_calculator, prompt: list[int], script) -> tuple:
    """The whole scripted sequence after the prompt, and for each position of it whether its
    token is sampled (the ones the lm_head must predict)."""
    special = tokenizer.encode_special
    seq, sampled = [], []

    def say(ids, is_sampled=True):
        seq.extend(ids)
        sampled.extend([is_sampled] * len(ids))

    for kind, text in script:
        if kind == "text":
            say(tokenizer.encode(text))
        else:
            say([special("<|python_start|>")] + tokenizer.encode(text)
                + [special("<|python_end|>")])
            result = use_calculator(text)
            if result is not None:
                say([special("<|output_start|>")] + tokenizer.encode(str(result))
                    + [special("<|output_end|>")], is_sampled=False)
    say([special("<|assistant_end|>")])
    return seq, sampled


def solve_head(torch, model, rows: list[tuple[list[int], list[int], list[int]]]) -> None:
    """Set lm_head so each (ids, positions, targets): the logit of targets[j] at positions[j] is
    SCRIPT_LOGIT before the soft cap and every other logit 0."""
    hidden, targets = [], []
    captured = {}
    hook = model.lm_head.register_forward_hook(
        lambda module, args, output: captured.__setitem__("h", args[0].detach()))
    for ids, positions, wanted in rows:
        model.forward(torch.tensor([ids]))
        hidden.append(captured["h"][0, positions])                    # [n, C]
        targets += wanted
    hook.remove()
    H = torch.cat(hidden).double()                                     # [N, C]
    Y = torch.zeros(H.size(0), model.lm_head.weight.size(0), dtype=torch.float64)
    Y[torch.arange(H.size(0)), torch.tensor(targets)] = SCRIPT_LOGIT
    W = (torch.linalg.pinv(H) @ Y).T                                   # [V, C]
    model.lm_head.weight.data.copy_(W.float())


def sampling_goldens(torch, tensors: dict) -> list[dict]:
    """The draws of nanochat.engine.sample_next_token over every stored logits row."""
    from nanochat.engine import sample_next_token

    rows = torch.cat([tensors[k] for k in sorted(k for k in tensors
                                                 if k.startswith("logits/"))])
    out = []
    for setting in SAMPLINGS:
        rng = torch.Generator(device="cpu")
        rng.manual_seed(SAMPLE_SEED)
        draws = [int(sample_next_token(row[None], rng, **setting)[0, 0]) for row in rows]
        out.append({**setting, "seed": SAMPLE_SEED, "draws": draws})
    return out


def engine_goldens(out_dir: Path) -> dict:
    import torch
    from nanochat.engine import Engine, use_calculator
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import RustBPETokenizer
    from safetensors.torch import save_file
    torch.set_num_threads(1)

    train = (HERE / "tokenizer_train.txt").read_bytes().decode("utf-8")
    tokenizer = RustBPETokenizer.train_from_iterator(iter([train]), TOKENIZER_VOCAB)
    with torch.device("meta"):
        model = GPT(GPTConfig(**CONFIG))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.normal_(0.0, 0.05)
            block.mlp.c_proj.weight.normal_(0.0, 0.05)
        model.smear_lambda.fill_(0.3)
    model.eval()

    cases, rows = [], []
    for case in CASES:
        conversation = {"messages": [{"role": "user", "content": case["user"]},
                                     {"role": "assistant", "content": ""}]}
        prompt = tokenizer.render_for_completion(conversation)
        seq, sampled = scripted_sequence(tokenizer, use_calculator, prompt, case["script"])
        full = prompt + seq
        positions = [len(prompt) - 1 + j for j, s in enumerate(sampled) if s]
        rows.append((full, positions, [full[p + 1] for p in positions]))
        cases.append({"user": case["user"], "prompt": prompt, "scripted": seq})
    with torch.no_grad():
        solve_head(torch, model, rows)

    engine = Engine(model, tokenizer)
    for case in cases:
        logits_seen = []
        forward = model.forward

        def recording(*args, forward=forward, logits_seen=logits_seen, **kwargs):
            out = forward(*args, **kwargs)
            logits_seen.append(out[0, -1].detach().clone())
            return out
        model.forward = recording
        columns, masks = [], []
        for column, mask in engine.generate(case["prompt"], num_samples=1,
                                            max_tokens=MAX_TOKENS, temperature=0.0):
            columns.append(column[0])
            masks.append(mask[0])
            if column[0] == tokenizer.encode_special("<|assistant_end|>"):
                break
        model.forward = forward
        case.update(tokens=columns, masks=masks, n_forwards=len(logits_seen))
        assert columns == case["scripted"], (case["user"], columns, case["scripted"])
        case["_logits"] = torch.stack(logits_seen)                     # [forwards, V]

    tensors = {f"model/{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, case in enumerate(cases):
        tensors[f"logits/{i}"] = case.pop("_logits").contiguous()
        case["logits_key"] = f"logits/{i}"
    save_file(tensors, str(out_dir / "chat_goldens.safetensors"))
    render_ids, render_mask = tokenizer.render_conversation(RENDER_CONVERSATION)
    return {"config": CONFIG, "max_tokens": MAX_TOKENS, "cases": cases,
            "sampling": sampling_goldens(torch, tensors),
            "special_ids": {s: tokenizer.encode_special(s) for s in (
                "<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                "<|assistant_end|>", "<|python_start|>", "<|python_end|>",
                "<|output_start|>", "<|output_end|>")},
            "render": {"conversation": RENDER_CONVERSATION, "ids": render_ids,
                       "mask": render_mask}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanochat", required=True, help="nanochat git dir or clone")
    ap.add_argument("--out", default=str(HERE))
    args = ap.parse_args()
    os.environ["NANOCHAT_DTYPE"] = "float32"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import_reference(args.nanochat)
    import torch
    out = Path(args.out)
    meta = {"nanochat_commit": PINNED, "torch": torch.__version__,
            "python": sys.version.split()[0], "threads": 1,
            "calculator": calculator_goldens(), **engine_goldens(out)}
    (out / "chat_goldens.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"calculator: {len(meta['calculator'])} rows; cases: "
          + "; ".join(f"{len(c['tokens'])} tokens" for c in meta["cases"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
