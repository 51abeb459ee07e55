"""The C decoder forward (engine/models/native_forward.py, ggml_kernels.c fb_forward) against the
torch path it replaces, which the llama.cpp parity tests hold to llama.cpp's bits.

Every family and exact weight type, both x86 instruction sets' orders (computed on any x86, as
the kernel tests do), prompt batches of the sizes where llama.cpp switches kernels (gemm + gemv
tails, tiled vs vec_dot, tinyBLAS vs vec_dot_f16), one-token steps on the cache it filled, and
Gemma's sliding window (the fixtures' window is 4 positions): hidden states, KV cache and logits
identical to the bit. The thread count never changes a bit (1, 2, 3 threads). Twins show the
checks can fail: the other instruction set's orders give other bits, and what the C forward does
not reproduce (LoRA adapters, f32 numerics) goes to the torch path.
"""

from __future__ import annotations

import pytest
import torch
from fixtures_gguf import write_tiny_gguf

import engine.kernels.ggml_matmul as ggml_matmul
import engine.kernels.numerics as numerics
from engine.kernels import cpu
from engine.kernels.native import kernels
from engine.lora import attach_lora
from engine.models.gguf_model import load_gguf_model, set_numerics
from engine.models.native_forward import native_decoder

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler to build ggml_kernels.c")

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512_VNNI = AVX2 | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"}
IDS = [1, 40, 7, 200, 12, 99, 5, 261, 33, 18, 2, 77, 150, 64, 3, 250, 8, 9, 31, 44, 6,
       *((7 * i + 3) % 250 + 1 for i in range(37))]
# (tokens, start) per call: a 13-row prompt (Q4_K gemm rows + a gemv row, tiled Q6_K, tinyBLAS),
# one-token steps, then a 5-row batch (vec_dot Q6_K, gemm 4 + gemv 1) past Gemma's window, then
# a 37-row batch (two bands of 16 rows for the AVX512-VNNI band kernels, a tile of 4, a row)
CALLS = ((0, 13), (13, 14), (14, 15), (15, 20), (20, 21), (21, 58))
CASES = [("gemma3", "Q4_K"), ("gemma3", "Q5_0"), ("llama", "Q8_0"), ("llama", "F16"),
         ("qwen2", "Q4_K"), ("qwen3", "Q6_K"), ("qwen2", "Q5_K"), ("llama", "Q4_0"),
         ("llama", "Q4_1"), ("qwen3", "Q5_1")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    loaded = {}
    for arch, qtype in CASES:
        path = write_tiny_gguf(root / f"{arch}-{qtype}.gguf", arch, qtype,
                               vocab="bpe" if arch.startswith("qwen") else "spm")
        loaded[arch, qtype] = load_gguf_model(path, numerics="llamacpp", tokenizer=False)[0]
    return loaded


def use_plan(monkeypatch, features, repacked: bool | None = None):
    """Make the engine (C and torch) follow the orders of llama.cpp built for `features`, with
    its extra buffer types on (`repacked`) or off (--no-repack)."""
    p = cpu.plan_for(features, repacked=repacked)
    monkeypatch.setattr(ggml_matmul, "plan", lambda: p)
    monkeypatch.setattr(numerics, "plan", lambda: p)


def run(model, native: bool, threads: int = 1, ids: list[int] = IDS, calls=CALLS):
    """Hidden states and logits of every call in `calls` over `ids`, and the final KV cache."""
    model.native = native
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = model.new_cache(1, len(ids))
        outs = []
        with torch.no_grad():
            for start, end in calls:
                h = model.hidden(torch.tensor([ids[start:end]]), start, cache)
                outs += [h, model.logits(h)]
        return outs, cache
    finally:
        model.native = True
        torch.set_num_threads(saved)


def same(a, b) -> bool:
    (outs_a, cache_a), (outs_b, cache_b) = a, b
    tensors_a, tensors_b = outs_a + cache_a.k + cache_a.v, outs_b + cache_b.k + cache_b.v
    return all(torch.equal(x, y) for x, y in zip(tensors_a, tensors_b))


@pytest.mark.parametrize("repacked", [True, False], ids=["repacked", "no-repack"])
@pytest.mark.parametrize("features", [AVX2, AVX512_VNNI], ids=["avx2", "avx512-vnni"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_c_forward_equals_torch_path(models, case, features, repacked, monkeypatch):
    use_plan(monkeypatch, features, repacked)
    model = models[case]
    if case[1] == "Q4_0" and repacked:  # llama.cpp repacks these layers (q4_0_8x8): not followed
        assert native_decoder(model) is None
        return
    assert native_decoder(model) is not None  # the C forward serves this model
    assert same(run(model, native=True), run(model, native=False))


@pytest.mark.parametrize("repacked", [True, False], ids=["repacked", "no-repack"])
@pytest.mark.parametrize("case", [("gemma3", "Q4_K"), ("qwen3", "Q6_K"), ("qwen2", "Q5_K")],
                         ids=["gemma3-Q4_K", "qwen3-Q6_K", "qwen2-Q5_K"])
def test_c_forward_of_the_avx2_build_equals_torch_path(models, case, repacked, monkeypatch):
    """The forward built for an AVX2-only CPU (-march=x86-64-v3: the K-quant band kernels with 8
    rows per ymm on the 37-row call, maddubs in place of dpbusd) gives the bits of the per-op path,
    whose matmuls run this machine's build: the two builds agree in both configurations."""
    import engine.models.native_forward as native_forward
    from engine.kernels import native

    lib = native.build_kernels("avx2")
    if lib is None:
        pytest.skip("the -march=x86-64-v3 build of ggml_kernels.c failed")
    use_plan(monkeypatch, AVX2, repacked)
    model = models[case]
    monkeypatch.setattr(native_forward, "kernels", lambda: lib)
    monkeypatch.setattr(model, "_native_decoder", None, raising=False)  # built anew on lib
    assert native_decoder(model).lib is lib
    assert same(run(model, native=True), run(model, native=False))


@pytest.mark.parametrize("case", [("gemma3", "Q5_0"), ("llama", "F16")], ids=["gemma3", "f16"])
def test_thread_count_never_changes_a_bit(models, case):
    """Layers, cache and LM head (fb_matmul) at 1, 2 and 3 threads. (Not the Q4_K fixtures: their
    313-row head has no bit-exact kernel, and torch's f32 matmul that serves it sums in an order
    that follows its thread count.)"""
    model = models[case]
    one = run(model, native=True, threads=1)
    for threads in (2, 3):
        assert same(run(model, native=True, threads=threads), one), f"{threads} threads differ"


def test_last_rows_only_as_llamacpp_outputs_them(models):
    """`rows` keeps only the asked-for positions after the last attention (llama.cpp's
    inp_out_ids): the last MLP then runs on fewer rows, with the kernels for that many."""
    model = models["gemma3", "Q4_K"]
    rows = torch.zeros(1, 13, dtype=torch.bool)
    rows[0, [3, 12]] = True
    got = []
    for native in (True, False):
        model.native = native
        with torch.no_grad():
            got.append(model.hidden(torch.tensor([IDS[:13]]), 0, model.new_cache(1, 13), rows=rows))
    model.native = True
    assert got[0].shape == (2, 256) and torch.equal(got[0], got[1])


def test_twin_the_other_instruction_set_gives_other_bits(models, monkeypatch):
    """The comparison above can fail: the C forward under the AVX2 orders differs from the torch
    path under the AVX-512 ones (16-lane f16 sums, another expf)."""
    model = models["llama", "F16"]
    use_plan(monkeypatch, AVX2)
    c_avx2 = run(model, native=True)
    use_plan(monkeypatch, AVX512_VNNI)
    assert not same(c_avx2, run(model, native=False))


def test_what_it_does_not_reproduce_goes_to_the_torch_path(tmp_path):
    model, _ = load_gguf_model(write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0"),
                               numerics="llamacpp", tokenizer=False)
    assert native_decoder(model) is not None
    set_numerics(model, "f32")
    assert native_decoder(model) is None
    set_numerics(model, "llamacpp")
    attach_lora(model, targets=["q", "v"], rank=2, alpha=4.0)
    assert native_decoder(model) is None
    rounding_only, _ = load_gguf_model(write_tiny_gguf(tmp_path / "q.gguf", "llama", "BF16"),
                                       numerics="llamacpp", tokenizer=False)
    assert native_decoder(rounding_only) is None


@pytest.mark.realmodel
def test_gemma_thread_count_never_changes_a_bit(gemma_gguf):
    """gemma-3-270m Q4_K_M: a prompt batch and one-token steps, hidden states and logits, at 1, 2
    and 3 threads; and the C forward equals the torch path."""
    model, tok = load_gguf_model(gemma_gguf, numerics="llamacpp")
    ids = tok.encode("The capital of France is Paris, and the capital of Germany is Berlin. The")
    n = len(ids)
    calls = ((0, n - 3), (n - 3, n - 2), (n - 2, n))  # a prompt batch, a step, a 2-row batch
    one = run(model, native=True, threads=1, ids=ids, calls=calls)
    for threads in (2, 3):
        assert same(run(model, native=True, threads=threads, ids=ids, calls=calls), one)
    assert same(run(model, native=False, threads=2, ids=ids, calls=calls), one)
