"""Parity with llama.cpp (llama-cpp-python as the oracle).

Tiny random fixtures for every family and several quant types (marker `llamacpp`, fast), and the
real gemma-3-270m Q4_K_M (markers `realmodel` + `llamacpp`): teacher-forced top-1 agreement and
|Δlogit| over >= 500 positions for both numerics, and 64-token greedy continuations.
Run the real-model part with `make test-real` (FORGEBENCH_REAL=1); `-s` prints the figures.
"""

from __future__ import annotations

import json
import numpy as np
import pytest
import torch

from engine.models.gguf_model import load_gguf_model, set_numerics
from fixtures_gguf import write_tiny_gguf

torch.set_num_threads(2)
IDS = [1, 40, 7, 200, 12, 99, 5, 261, 33, 18, 2, 77, 150, 64, 3, 250]


def llamacpp_logits(path, ids: list[int], n_ctx: int = 256) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=n_ctx, n_threads=2, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def engine_logits(model, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits, the prompt processed in one batch through the KV cache as llama.cpp does."""
    with torch.no_grad():
        cache = model.new_cache(1, len(ids))
        return model.logits(model.hidden(torch.tensor([ids]), 0, cache))[0].numpy()


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_K"), ("llama", "Q8_0"), ("llama", "F16"),
                                        ("qwen2", "Q5_K"), ("qwen3", "Q4_K"), ("qwen3", "Q6_K"),
                                        ("gemma3", "Q4_K"), ("gemma3", "Q5_0")])
def test_tiny_fixture_matches_llamacpp(tmp_path, arch, qtype):
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, qtype, vocab="bpe" if arch.startswith("qwen") else "spm")
    model, _ = load_gguf_model(path, numerics="llamacpp", tokenizer=False)
    ours, ref = engine_logits(model, IDS), llamacpp_logits(path, IDS)
    scale = np.abs(ref).max()
    diff = np.abs(ours - ref)
    # bit-level agreement until a rounding flip (e.g. one activation landing on the other side of a
    # Q8 step) propagates through the cache; from then on differences stay small
    assert diff[0].max() <= 1e-5 * scale
    assert diff.max() <= 0.02 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    set_numerics(model, "f32")
    f32_diff = np.abs(engine_logits(model, IDS) - ref)
    assert f32_diff.mean() > diff.mean()       # the llama.cpp numerics are what make it match


# --- real model: gemma-3-270m Q4_K_M ---------------------------------------------------------

PASSAGES = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. Within "
    "fifty years, presses were operating in more than two hundred European cities, and the price of "
    "books fell so sharply that reading spread far beyond monasteries and universities. Scholars "
    "argue about how quickly ideas changed, but almost all agree that the printed page made it "
    "possible to compare, correct and accumulate knowledge at a pace that hand copying never allowed.",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    values = [0, 1]\n    while len(values) < n:\n        values.append(values[-1] + values[-2])\n"
    "    return values[:n]\n\n\nif __name__ == \"__main__\":\n    for i, v in enumerate(fibonacci(12)):\n"
    "        print(f\"{i:>3}: {v}\")\n\n# Expected output starts with 0, 1, 1, 2, 3, 5, 8, 13.\n",
    "Recipe for a simple bread: mix 500 g of flour, 350 ml of warm water, 10 g of salt and 7 g of "
    "dried yeast. Knead for ten minutes until the dough is smooth, then let it rise for about an "
    "hour in a warm place. Shape the loaf, let it rest for another thirty minutes, and bake at 230 "
    "degrees Celsius for 35 to 40 minutes. The crust should sound hollow when you tap the bottom.",
    "Q: What is the capital of Australia?\nA: Canberra.\nQ: How many legs does a spider have?\n"
    "A: Eight.\nQ: Which planet is known as the red planet?\nA: Mars.\nQ: What is 12 times 12?\n"
    "A: 144.\nQ: Who wrote the play Romeo and Juliet?\nA: William Shakespeare.\nQ: What gas do "
    "plants absorb from the air?\nA: Carbon dioxide.\n",
    "Travel notes, 14 March 2024: the train from München to Zürich left at 07:42 and cost €89.50. "
    "Café prices near the station were high (a latte was 6,20 CHF), but the view of the lake made "
    "up for it. Tomorrow: Lausanne → Genève, then a ferry across Lac Léman. Weather forecast: "
    "12–15 °C, light rain after 16:00. Remember to buy a Swiss half-fare card; it pays for itself "
    "after two long journeys. 日本語のメモ: 次は京都に行きたい。",
]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def add(a, b):\n    return", "The three primary colors are",
           "Water boils at a temperature of", "My favourite thing about the weekend is"]


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    path = gemma_gguf
    model, tok = load_gguf_model(path, numerics="llamacpp", weights="dense-cache")
    return path, model, tok


def teacher_forced(path, model, tok) -> dict:
    ours, refs = {"llamacpp": [], "f32": []}, []
    for text in PASSAGES:
        ids = tok.encode(text)
        refs.append(llamacpp_logits(path, ids, n_ctx=512))
        for numerics in ours:
            set_numerics(model, numerics)
            ours[numerics].append(engine_logits(model, ids))
    set_numerics(model, "llamacpp")
    ref = np.concatenate(refs)
    figures = {"positions": int(ref.shape[0])}
    for numerics, parts in ours.items():
        got = np.concatenate(parts)
        d = np.abs(got - ref)
        figures[numerics] = {"top1": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                             "max_abs_dlogit": float(d.max()), "mean_abs_dlogit": float(d.mean())}
    return figures


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_teacher_forced_parity(gemma):
    figures = teacher_forced(*gemma)
    print("\nteacher-forced parity vs llama.cpp:", json.dumps(figures))
    assert figures["positions"] >= 500
    assert figures["llamacpp"]["top1"] >= 0.995
    assert figures["f32"]["top1"] >= 0.90


def llamacpp_greedy(llm, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    llm.reset()
    llm.eval(prompt)
    out, logits = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1])
        token = int(row.argmax())
        out.append(token)
        logits.append(row)
        llm.eval([token])
    return out, logits


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_greedy_continuations_match(gemma):
    import llama_cpp
    from engine.llm.generate import generate

    path, model, tok = gemma
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=256, n_threads=2, verbose=False)
    report = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref, ref_logits = llamacpp_greedy(llm, ids, 64)
        ours = generate(model, tok, ids, max_new_tokens=64, stop_ids=[]).ids
        same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
        entry = {"prompt": prompt, "identical_tokens": same}
        if same < len(ref):
            top2 = np.sort(ref_logits[same])[-2:]
            entry["llamacpp_top2_gap_at_divergence"] = float(top2[1] - top2[0])
        report.append(entry)
    print("\ngreedy continuations vs llama.cpp:", json.dumps(report))
    assert sum(e["identical_tokens"] == 64 for e in report) >= 5
