"""Batched decode (engine/models/native_forward.py decode_batch, ggml_kernels.c fb_decode_batch):
one step advances several sequences, each at its own position in its own KV cache, and every
sequence gets the bits it gets decoded alone (model.hidden + model.logits on its cache, which
tests/test_native_forward.py holds to the torch path and the llama.cpp parity tests to llama.cpp).

Exact, not within a bound, for every family and weight type, both x86 instruction sets' orders
and llama.cpp with and without repacking: the step runs each row through the kernel llama.cpp
runs for ONE token. llama.cpp's own kernels for B rows of a batch agree with its one-row kernels
only for the Q8_0-activation and Q8_1 types (Q8_0, Q5_0, Q4_0, Q4_1, Q5_1: the same per-row sum
at every batch size); for the K-quants (gemm / tiled) and F16 (tinyBLAS) they sum in another
order, which the twin shows: those kernels on the same rows give other bits, so a batched step
built on them would fail the comparison.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from fixtures_gguf import write_tiny_gguf

import engine.kernels.ggml_matmul as ggml_matmul
import engine.kernels.numerics as numerics
from engine.kernels import cpu
from engine.kernels.native import kernels
from engine.lora import attach_lora
from engine.models.gguf_model import load_gguf_model
from engine.models.native_forward import _exact_weight, decode_batch, native_decoder

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler to build ggml_kernels.c")

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512_VNNI = AVX2 | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"}
CASES = [("gemma3", "Q4_K"), ("gemma3", "Q5_0"), ("llama", "Q8_0"), ("llama", "F16"),
         ("qwen2", "Q4_K"), ("qwen3", "Q6_K"), ("qwen2", "Q5_K"), ("llama", "Q4_1")]
# four sequences of different lengths (past Gemma's 4-position window), then decode steps
PROMPTS = ([1, 40, 7], [200, 12, 99, 5, 261, 33, 18], [2, 77, 150, 64, 3, 250, 8, 9, 31, 44, 6],
           [11, 22])
STEPS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {(arch, qtype): load_gguf_model(
        write_tiny_gguf(root / f"{arch}-{qtype}.gguf", arch, qtype,
                        vocab="bpe" if arch.startswith("qwen") else "spm"),
        numerics="llamacpp", tokenizer=False)[0] for arch, qtype in CASES}


def use_plan(monkeypatch, features, repacked: bool | None = None):
    p = cpu.plan_for(features, repacked=repacked)
    monkeypatch.setattr(ggml_matmul, "plan", lambda: p)
    monkeypatch.setattr(numerics, "plan", lambda: p)


def prefilled(model):
    """A cache per prompt with the prompt processed; the next token of each (greedy)."""
    caches, nexts = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            cache = model.new_cache(1, max(map(len, PROMPTS)) + STEPS)
            h = model.hidden(torch.tensor([prompt]), 0, cache)
            caches.append(cache)
            nexts.append(int(model.logits(h[:, -1]).argmax()))
    return caches, nexts


def alone(model):
    """Each sequence decoded on its own: logits of every step, and the final caches."""
    caches, nexts = prefilled(model)
    logits = []
    with torch.no_grad():
        for step in range(STEPS):
            row = []
            for b, prompt in enumerate(PROMPTS):
                h = model.hidden(torch.tensor([[nexts[b]]]), len(prompt) + step, caches[b])
                row.append(model.logits(h[:, -1]).float())
            logits.append(torch.cat(row))
            nexts = [int(x) for x in logits[-1].argmax(-1)]
    return logits, caches


def batched(model, swap_caches: bool = False):
    """The same steps as one decode_batch call each (`swap_caches`: sequences 0 and 1 given each
    other's cache, the twin's mistake)."""
    caches, nexts = prefilled(model)
    order = [1, 0, 2, 3] if swap_caches else [0, 1, 2, 3]
    logits = []
    for step in range(STEPS):
        positions = [len(p) + step for p in PROMPTS]
        logits.append(decode_batch(model, nexts, positions, [caches[i] for i in order]))
        nexts = [int(x) for x in logits[-1].argmax(-1)]
    return logits, caches


def identical(a, b) -> bool:
    (logits_a, caches_a), (logits_b, caches_b) = a, b
    return all(torch.equal(x, y) for x, y in zip(
        [*logits_a, *(t for c in caches_a for t in (*c.k, *c.v))],
        [*logits_b, *(t for c in caches_b for t in (*c.k, *c.v))]))


@pytest.mark.parametrize("repacked", [True, False], ids=["repacked", "no-repack"])
@pytest.mark.parametrize("features", [AVX2, AVX512_VNNI], ids=["avx2", "avx512-vnni"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_batched_step_equals_each_sequence_alone(models, case, features, repacked, monkeypatch):
    use_plan(monkeypatch, features, repacked)
    model = models[case]
    assert native_decoder(model) is not None      # the C step serves it
    assert identical(batched(model), alone(model))


def test_thread_count_never_changes_a_bit(models):
    model = models["gemma3", "Q5_0"]
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = batched(model)
        torch.set_num_threads(3)
        assert identical(batched(model), one)
    finally:
        torch.set_num_threads(saved)


def test_twin_swapped_caches_give_other_logits(models):
    """Attention reads each sequence's own cache: handing sequences 0 and 1 each other's cache
    changes their logits (so the comparison above sees a mix-up between requests)."""
    model = models["llama", "Q8_0"]
    got, want = batched(model, swap_caches=True), alone(model)
    assert not torch.equal(got[0][0][:2], want[0][0][:2])


@pytest.mark.parametrize("case", [("qwen3", "Q6_K"), ("llama", "F16"), ("qwen2", "Q5_K")],
                         ids=["Q6_K-tiled", "F16-tinyblas", "Q5_K-tiled"])
def test_twin_llamacpp_batch_kernels_give_other_bits(models, case, monkeypatch):
    """The B-row kernels llama.cpp picks for a batch (tiled K-quants for 8+ rows, tinyBLAS for
    F16 from 2) sum in other orders than its one-row kernels: on the same 8 rows they give other
    bits, while the step's rowwise matmul equals the one-row matmul of each row."""
    use_plan(monkeypatch, AVX2, repacked=False)
    model = models[case]
    exact = _exact_weight(model.layers[0].mlp.down)
    x = torch.randn(8, exact.cols, generator=torch.Generator().manual_seed(0))
    one_by_one = torch.cat([exact.matmul(x[r:r + 1]) for r in range(8)])
    lib = kernels()
    rowwise = torch.empty(8, exact.rows)
    lib.fb_matmul_rowwise(ctypes.byref(exact.struct), 8, x.data_ptr(),
                          ctypes.byref(ggml_matmul.plan_struct()), 1, rowwise.data_ptr())
    assert torch.equal(rowwise, one_by_one)
    assert not torch.equal(exact.matmul(x), one_by_one)


def test_lora_models_decode_one_after_another(tmp_path):
    """With adapters attached the C step does not serve the model; decode_batch still gives each
    sequence its own logits, through the torch path."""
    model, _ = load_gguf_model(write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0"),
                               numerics="llamacpp", tokenizer=False)
    adapters = attach_lora(model, targets=["q", "v"], rank=2, alpha=4.0)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.lora_b.normal_(generator=torch.Generator().manual_seed(1))
    assert native_decoder(model) is None
    assert identical(batched(model), alone(model))


@pytest.mark.realmodel
@pytest.mark.slow
def test_gemma_270m_batched_steps_equal_each_sequence_alone(gemma_gguf):
    """The real gemma-3-270m Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K weights, a 262144-row LM head)
    in the configuration this machine's llama.cpp runs: four sequences, three batched steps,
    every logit and cache entry as each sequence decoded alone."""
    model = load_gguf_model(gemma_gguf, numerics="llamacpp", tokenizer=False)[0]
    assert native_decoder(model) is not None
    assert identical(batched(model), alone(model))
