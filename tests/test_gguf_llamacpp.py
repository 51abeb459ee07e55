"""Parity with llama.cpp (llama-cpp-python as the oracle).

Tiny random fixtures for every family and several quant types (marker `llamacpp`, fast), and the
real gemma-3-270m Q4_K_M (markers `realmodel` + `llamacpp`): every op fed llama.cpp's own input
tensors (read through its eval callback), teacher-forced top-1 agreement and |Δlogit| over >= 500
positions for both numerics, 64-token greedy continuations, and f32 numerics on an f16 GGUF.
Run the real-model part with `make test-real` (FORGEBENCH_REAL=1); `-s` prints the figures.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fixtures_gguf import write_tiny_gguf
from llamacpp_oracle import ggml_cpu_library, require_same_plan

from engine.kernels.numerics import gelu_llamacpp, gelu_tanh_f32
from engine.models.blocks import ACTIVATIONS, apply_rope, attention_mask, rope_tables
from engine.models.gguf_model import load_gguf_model, set_numerics
from engine.models.packed import PackedWeight

torch.set_num_threads(2)
IDS = [1, 40, 7, 200, 12, 99, 5, 261, 33, 18, 2, 77, 150, 64, 3, 250]


def llamacpp_logits(path, ids: list[int], n_ctx: int = 256) -> np.ndarray:
    llm = llamacpp_session(path, n_ctx)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def engine_logits(model, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits, the prompt processed in one batch through the KV cache as llama.cpp
    does."""
    with torch.no_grad():
        cache = model.new_cache(1, len(ids))
        return model.logits(model.hidden(torch.tensor([ids]), 0, cache))[0].numpy()


@pytest.mark.llamacpp
@pytest.mark.parametrize(
    "arch,qtype",
    [
        ("llama", "Q4_K"),
        ("llama", "Q8_0"),
        ("llama", "F16"),
        ("llama", "Q4_0"),
        ("llama", "Q4_1"),
        ("qwen3", "Q5_1"),
        ("llama", "BF16"),
        ("qwen2", "Q5_K"),
        ("qwen3", "Q4_K"),
        ("qwen3", "Q6_K"),
        ("gemma3", "Q4_K"),
        ("gemma3", "Q5_0"),
    ],
)
def test_tiny_fixture_matches_llamacpp(tmp_path, arch, qtype):
    """Every logit against llama.cpp opened as engine/export/llamacpp.py opens it, in the kernel
    configuration the plan names (repacked, or no extra buffer types on an AMX build)."""
    p = require_same_plan()
    path = write_tiny_gguf(
        tmp_path / "m.gguf", arch, qtype, vocab="bpe" if arch.startswith("qwen") else "spm"
    )
    model, _ = load_gguf_model(path, numerics="llamacpp", tokenizer=False)
    ours, ref = engine_logits(model, IDS), llamacpp_logits(path, IDS)
    scale = np.abs(ref).max()
    diff = np.abs(ours - ref)
    if not p.x86_exact or qtype in p.rounding_types:
        # the weight type's kernel (or this CPU's) is matched to f32 rounding only: the engine must
        # still be closer to llama.cpp than plain f32 is, and choose the same tokens
        batched, stepped = llamacpp_batched_and_stepped(llamacpp_session(path, 256), IDS)
        set_numerics(model, "f32")
        f32_diff = np.abs(engine_logits(model, IDS) - ref)
        assert diff.mean() < f32_diff.mean() and (ours.argmax(-1) == ref.argmax(-1)).all()
        reason = f"{qtype} weights" if p.x86_exact else f"this CPU ({p.summary()})"
        pytest.xfail(
            f"{reason}, llama.cpp {p.configuration}: its kernel is not reproduced bit for bit; "
            f"max |Δlogit| "
            f"{diff.max():.2e} (f32 numerics {f32_diff.max():.2e}), llama.cpp's own "
            f"batched-vs-single spread {np.abs(batched - stepped).max():.2e}"
        )
    # every hidden state bit-identical (ggml's kernels where the engine has them, and these tiny
    # models are too small for a last-bit difference to flip a rounding); the logits differ only
    # by the LM head's f32 summation order (measured: <= 5e-7 of the largest logit)
    assert diff.max() <= 2e-6 * scale, f"llama.cpp {p.configuration}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    set_numerics(model, "f32")
    f32_diff = np.abs(engine_logits(model, IDS) - ref)
    assert f32_diff.mean() > diff.mean()  # the llama.cpp numerics are what make it match


@pytest.mark.llamacpp
def test_gelu_table_is_ggmls():
    """Our GELU table equals ggml's ggml_table_gelu_f16 entry for entry (read from libggml-cpu)."""
    import ctypes

    lib = ggml_cpu_library()  # ggml_cpu_init fills the tables
    raw = np.ctypeslib.as_array((ctypes.c_uint16 * 65536).in_dll(lib, "ggml_table_gelu_f16")).copy()
    theirs = torch.from_numpy(raw.view(np.float16).astype(np.float32))
    x = torch.from_numpy(np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32))
    inside = torch.isfinite(x) & (x.abs() < 10)
    ours = gelu_llamacpp(x)
    assert torch.equal(ours[inside], theirs[inside])
    assert int((gelu_tanh_f32(x[inside]).to(torch.float16).float() != theirs[inside]).sum()) == 0
    plain = torch.nn.functional.gelu(x[inside], approximate="tanh").to(torch.float16).float()
    assert int((plain != theirs[inside]).sum()) > 0  # the exact formula is what it takes


# --- real model: gemma-3-270m Q4_K_M ---------------------------------------------------------

PASSAGES = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    'combined movable metal type, oil-based ink and '
    'a wooden press adapted from wine making. Within '
    'fifty years, presses were operating in more tha'
    'n two hundred European cities, and the price of '
    "books fell so sharply that reading spread far beyond monasteries and universities. Scholars "
    "argue about how quickly ideas changed, but almost all agree that the printed page made it "
    'possible to compare, correct and accumulate know'
    'ledge at a pace that hand copying never allowed.',
    'def fibonacci(n: int) -> list[int]:\n    """Return the first n Fibonacci numbers."""\n'
    '    values = [0, 1]\n    while len(values) < n:\n'
    '        values.append(values[-1] + values[-2])\n'
    '    return values[:n]\n\n\nif __name__ == "__main'
    '__":\n    for i, v in enumerate(fibonacci(12)):\n'
    '        print(f"{i:>3}: {v}")\n\n# Expected output starts with 0, 1, 1, 2, 3, 5, 8, 13.\n',
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
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def add(a, b):\n    return",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite thing about the weekend is",
]


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    path = gemma_gguf
    model, tok = load_gguf_model(path, numerics="llamacpp", weights="dense-cache")
    return path, model, tok


def llamacpp_session(path, n_ctx: int = 512, logits_all: bool = True):
    """llama.cpp opened as engine/export/llamacpp.py opens it (the kernel configuration the plan
    follows); logits_all=False computes only the last row's logits, as generating does."""
    from engine.export.llamacpp import open_llama

    return open_llama(path, logits_all=logits_all, n_ctx=n_ctx, n_threads=2, verbose=False)


def llamacpp_batched_and_stepped(llm, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's logits for `ids` evaluated as one batch (how it reads a prompt) and one token
    at a time (how it generates): two default paths of the same library on the same tokens."""
    llm.reset()
    llm.eval(ids)
    batched = np.array(llm.scores[: len(ids)])
    llm.reset()
    for token in ids:
        llm.eval([token])
    return batched, np.array(llm.scores[: len(ids)])


def agreement(got: np.ndarray, ref: np.ndarray) -> dict:
    d = np.abs(got - ref)
    return {
        "top1": float((got.argmax(-1) == ref.argmax(-1)).mean()),
        "max_abs_dlogit": float(d.max()),
        "mean_abs_dlogit": float(d.mean()),
    }


def teacher_forced(path, model, tok, *, numerics=("llamacpp", "f32"), self_check=True) -> dict:
    """Agreement with llama.cpp's batched prompt logits over every position of PASSAGES, for each
    engine numerics and (self_check) for llama.cpp's own token-at-a-time logits."""
    llm = llamacpp_session(path)
    ours, refs, stepped = {n: [] for n in numerics}, [], []
    for text in PASSAGES:
        ids = tok.encode(text)
        if self_check:
            batched, one_by_one = llamacpp_batched_and_stepped(llm, ids)
            stepped.append(one_by_one)
        else:
            llm.reset()
            llm.eval(ids)
            batched = np.array(llm.scores[: len(ids)])
        refs.append(batched)
        for name in numerics:
            set_numerics(model, name)
            ours[name].append(engine_logits(model, ids))
    set_numerics(model, "llamacpp")
    ref = np.concatenate(refs)
    figures = {"positions": int(ref.shape[0])}
    figures.update({name: agreement(np.concatenate(parts), ref) for name, parts in ours.items()})
    if self_check:
        figures["llamacpp_token_at_a_time"] = agreement(np.concatenate(stepped), ref)
    return figures


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_teacher_forced_parity(gemma):
    """llama.cpp numerics against llama.cpp's batched prompt logits on gemma-3-270m Q4_K_M: the
    issue's top-1 >= 99.5% over >= 500 positions, with max and mean |Δlogit| reported.

    Measured 2026-11-29 (llama-cpp-python 0.3.36, AVX2 CPU), 578 positions: top-1 100%, max and
    mean |Δlogit| 0 (every logit bit-identical). For scale: plain f32 numerics 96.0% (max |Δ| 4.40,
    mean 0.233), and llama.cpp's own token-at-a-time logits against its batched ones 96.0% (its
    repacked Q4_K and tiled Q6_K kernels sum in a different order for one row than for a batch,
    and Gemma's post-norm gains amplify that). Measured 2026-12-05 on an AMX Xeon, llama.cpp
    without extra buffer types (as open_llama opens it there): 578 positions, every logit
    bit-identical; f32 numerics 96.4%, llama.cpp token-at-a-time 95.2%.
    """
    if not require_same_plan().x86_exact:
        pytest.xfail(
            "this CPU's llama.cpp kernels are not reproduced (forgebench doctor says which)"
        )
    figures = teacher_forced(*gemma)
    figures["configuration"] = require_same_plan().configuration
    print("\nteacher-forced parity vs llama.cpp:", json.dumps(figures))
    assert figures["positions"] >= 500
    assert figures["llamacpp"]["top1"] >= 0.995
    assert figures["llamacpp"]["mean_abs_dlogit"] < 0.01 * figures["f32"]["mean_abs_dlogit"]


def llamacpp_greedy(
    llm, prompt: list[int], n: int, stepped_prompt: bool = False
) -> tuple[list[int], list[np.ndarray]]:
    llm.reset()
    if stepped_prompt:
        for token in prompt:
            llm.eval([token])
    else:
        llm.eval(prompt)
    out, logits = [], []
    for _ in range(n):
        row = last_logits(llm)
        token = int(row.argmax())
        out.append(token)
        logits.append(row)
        llm.eval([token])
    return out, logits


def last_logits(llm) -> np.ndarray:
    """The last evaluated token's logits (llama_get_logits_ith(-1)): llama-cpp-python fills
    `scores` only under logits_all."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_greedy_continuations_match(gemma):
    """64-token greedy continuations against llama.cpp (prompt batched, then token by token):
    identical on at least 5 of the 6 prompts; any divergence is reported with llama.cpp's top-2
    logit gap at that token. llama.cpp's own continuation with the prompt fed one token at a time
    is reported beside it. Measured 2026-11-29: 6/6 identical for 64 tokens; llama.cpp against
    itself 3/6 (diverging at tokens 3, 47 and 25).
    """
    if not require_same_plan().x86_exact:
        pytest.xfail(
            "this CPU's llama.cpp kernels are not reproduced (forgebench doctor says which)"
        )
    from engine.llm.generate import generate

    path, model, tok = gemma
    # only the last row's logits, as the engine's generate (and llama.cpp's own) computes them:
    # with every row, llama.cpp runs the last layer's MLP and the head with batch kernels
    llm = llamacpp_session(path, n_ctx=256, logits_all=False)
    report = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref, ref_logits = llamacpp_greedy(llm, ids, 64)
        own, _ = llamacpp_greedy(llm, ids, 64, stepped_prompt=True)
        ours = generate(model, tok, ids, max_new_tokens=64, stop_ids=[]).ids
        same = first_difference(ours, ref)
        entry = {
            "prompt": prompt,
            "identical_tokens": same,
            "llamacpp_self_identical_tokens": first_difference(own, ref),
        }
        if same < len(ref):
            top2 = np.sort(ref_logits[same])[-2:]
            entry["llamacpp_top2_gap_at_divergence"] = float(top2[1] - top2[0])
        report.append(entry)
    configuration = require_same_plan().configuration
    print(f"\ngreedy continuations vs llama.cpp {configuration}:", json.dumps(report))
    assert sum(e["identical_tokens"] == 64 for e in report) >= 5, configuration


@pytest.fixture(scope="module")
def gemma_f16(gemma_gguf, tmp_path_factory):
    """An f16 GGUF of the same weights, made with `forgebench convert` as a user would."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("f16") / "gemma-3-270m-f16.gguf"
    forgebench = Path(sys.executable).with_name("forgebench")
    subprocess.run(
        [str(forgebench), "convert", str(gemma_gguf), "--dtype", "f16", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    model, tok = load_gguf_model(out, numerics="f32", weights="dense-cache")
    return out, model, tok


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_f16_gguf_f32_parity(gemma_f16):
    """f32 numerics (the training numerics) against llama.cpp on an f16 GGUF: top-1 >= 99%.
    Measured 2026-11-29 over 578 positions: 99.83% (max |Δ| 0.072, mean 0.0041); llama.cpp
    numerics on the same file: 100%, every logit bit-identical."""
    if not require_same_plan().x86_exact:
        pytest.xfail(
            "this CPU's llama.cpp kernels are not reproduced (forgebench doctor says which)"
        )
    figures = teacher_forced(*gemma_f16, numerics=("f32", "llamacpp"), self_check=False)
    print("\nf16 GGUF parity vs llama.cpp:", json.dumps(figures))
    assert figures["positions"] >= 500
    assert figures["f32"]["top1"] >= 0.99
    assert figures["llamacpp"]["top1"] >= 0.995


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma_greedy_parity_on_20_prompts(gemma_gguf):
    """The issue's acceptance figure: greedy 64-token continuations identical to llama.cpp
    (opened by open_llama, in the configuration the plan names) on >= 19 of bench_generate.py's
    20 varied prompts, and teacher-forced top-1 >= 99.5% over every position of the prompts and
    llama.cpp's continuations. The same as `python bench/bench_generate.py --parity`.
    Measured 2026-12-05 on an AMX Xeon (no extra buffer types): see docs/numerics.md."""
    import sys
    from pathlib import Path

    p = require_same_plan()
    if not p.x86_exact:
        pytest.xfail(
            "this CPU's llama.cpp kernels are not reproduced (forgebench doctor says which)"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_generate import greedy_parity

    figures = greedy_parity(str(gemma_gguf), 64)
    print(f"\n20-prompt parity vs llama.cpp {p.configuration}:",
          json.dumps({k: v for k, v in figures.items() if k != "per_prompt"}))
    assert figures["prompts"] == 20
    assert figures["identical"] >= 19, (p.configuration, figures["per_prompt"])
    assert figures["teacher_forced"]["top1"] >= 0.995, p.configuration


# --- op-level parity: llama.cpp's own intermediate tensors as inputs ---------------------------


class _GGMLTensor(__import__("ctypes").Structure):
    """struct ggml_tensor (ggml.h of the ggml vendored by llama-cpp-python 0.3.36)."""

    import ctypes as c

    _fields_ = [
        ("type", c.c_int),
        ("buffer", c.c_void_p),
        ("ne", c.c_int64 * 4),
        ("nb", c.c_size_t * 4),
        ("op", c.c_int),
        ("op_params", c.c_int32 * 16),
        ("flags", c.c_int32),
        ("src", c.c_void_p * 10),
        ("view_src", c.c_void_p),
        ("view_offs", c.c_size_t),
        ("data", c.c_void_p),
        ("name", c.c_char * 64),
        ("extra", c.c_void_p),
        ("padding", c.c_char * 8),
    ]


def llamacpp_intermediates(path, ids: list[int]) -> list[tuple[str, np.ndarray]]:
    """Every f32 tensor llama.cpp computes for `ids` (one batch), in graph order, as
    (name, array [ne3, ne2, ne1, ne0]), read through the scheduler's eval callback."""
    import ctypes

    import llama_cpp.llama_cpp as L

    seen: list[tuple[str, np.ndarray]] = []

    @L.ggml_backend_sched_eval_callback
    def callback(ptr, ask, _user):
        t = _GGMLTensor.from_address(ptr)
        if not ask and t.type == 0 and t.data:  # GGML_TYPE_F32
            ne, nb = list(t.ne), list(t.nb)
            size = sum((n - 1) * s for n, s in zip(ne, nb)) + 4
            raw = np.frombuffer((ctypes.c_char * size).from_address(t.data), dtype=np.uint8)
            view = np.lib.stride_tricks.as_strided(
                raw, shape=ne[::-1] + [4], strides=nb[::-1] + [1]
            )
            seen.append((t.name.decode(), view.copy().view(np.float32)[..., 0]))  # own the bytes
        return True

    default_params = L.llama_context_default_params

    def params_with_callback():
        p = default_params()
        p.cb_eval, p.cb_eval_user_data = callback, None
        return p

    L.llama_context_default_params = params_with_callback
    try:
        llm = llamacpp_session(path, n_ctx=64)
    finally:
        L.llama_context_default_params = default_params
    llm.eval(ids)
    del llm
    return seen


def layers_covering_each_quant_type(model) -> list[int]:
    """The first layer for each (linear, weight type) pair, so every kernel llama.cpp runs is
    hit."""
    firsts: dict[tuple[str, str], int] = {}
    for i, layer in enumerate(model.layers):
        for name, m in layer.named_modules():
            if isinstance(getattr(m, "weight", None), PackedWeight):
                firsts.setdefault((name, m.weight.ggml_type.name), i)
    return sorted(set(firsts.values()))


@pytest.mark.realmodel
@pytest.mark.llamacpp
@pytest.mark.parametrize("n_tokens", [12, 5])
def test_gemma_ops_match_llamacpp_given_its_inputs(gemma, n_tokens):
    """Each op of the engine's llama.cpp numerics, fed llama.cpp's own input tensor for that op,
    reproduces llama.cpp's output tensor bit for bit (the LM head, summed in f32 order, to 1e-5).

    12 tokens run the batch kernels (repacked Q4_K gemm, or the tiled Q4_K without extra buffer
    types; tiled Q6_K, tinyBLAS for Q5_0/Q8_0 and the f16 attention products); 5 tokens add the
    gemv row of the repacked Q4_K (or vec_dot_q4_K_q8_K) and vec_dot_q6_K_q8_K. One-token steps
    run the same per-row kernels as the 5-token batch's tail.
    """
    if not require_same_plan().x86_exact:
        pytest.xfail(
            "this CPU's llama.cpp kernels are not reproduced (forgebench doctor says which)"
        )
    path, model, tok = gemma
    ids = tok.encode(PASSAGES[1])[:n_tokens]
    dump = llamacpp_intermediates(path, ids)
    names = [n for n, _ in dump]

    T = len(ids)

    def first(name: str, *shape: int) -> torch.Tensor:
        """The first tensor called `name` whose trailing dims are [T, *shape] (leading dims are
        1)."""
        a = next(a for n, a in dump if n == name and a.shape[-len(shape) - 1 :] == (T, *shape))
        return torch.from_numpy(a.reshape(T, *shape).copy())

    def after(name: str, *shape: int) -> torch.Tensor:
        """The tensor computed right after the first `name` (llama.cpp leaves some unnamed)."""
        return torch.from_numpy(dump[names.index(name) + 1][1].reshape(T, *shape).copy())

    def close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5):
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= rel * scale, (
            ours - ref
        ).abs().max().item() / scale

    def same(ours: torch.Tensor, ref: torch.Tensor):
        assert torch.equal(ours, ref), f"{int((ours != ref).sum())} of {ref.numel()} values differ"

    cfg = model.config
    h0 = first("inp_scaled", cfg.dim)
    with torch.no_grad():
        scaled = model.tok_embeddings(torch.tensor([ids]))[0] * np.sqrt(model.config.dim)
        assert torch.equal(scaled, h0)
        for i in layers_covering_each_quant_type(model):
            layer = model.layers[i]
            x = first(f"l_out-{i - 1}", 640) if i else h0
            assert torch.equal(layer.attn_norm(x), first(f"attn_norm-{i}", 640))  # exact RMSNorm
            normed = first(f"attn_norm-{i}", 640)
            same(layer.attn.q(normed), first(f"Qcur-{i}", 1024))
            same(layer.attn.k(normed), first(f"Kcur-{i}", 256))
            same(layer.attn.v(normed), first(f"Vcur-{i}", 256))
            heads = {"Q": cfg.n_heads, "K": cfg.n_kv_heads}
            q_normed, k_normed = (
                first(f"{x}cur_normed-{i}", heads[x], cfg.head_dim).transpose(0, 1)[None]
                for x in "QK"
            )  # [1,H,T,hd]
            q_roped, k_roped = (
                after(f"{x}cur_normed-{i}", heads[x], cfg.head_dim).transpose(0, 1)[None]
                for x in "QK"
            )
            local = cfg.sliding[i]
            rope = rope_tables(
                torch.arange(T),
                cfg.head_dim,
                cfg.rope_local_theta if local else cfg.rope_theta,
                freq_scale=1.0 if local else 1.0 / cfg.rope_scale,
                libm=True,
            )
            same(apply_rope(q_normed, *rope, model.rope_type, fused=True), q_roped)
            same(apply_rope(k_normed, *rope, model.rope_type, fused=True), k_roped)
            v = first(f"Vcur-{i}", 256)[None, None]  # [1,1,T,hd]
            mask = attention_mask(0, T, T, cfg.sliding_window if local else None)
            out = model.attn_core(q_roped * cfg.query_scale, k_roped, v, mask, 1.0)  # [1,H,T,hd]
            same(out[0].transpose(0, 1).reshape(T, -1), first(f"kqv_out-{i}", 1024))
            same(layer.attn.o(first(f"kqv_out-{i}", 1024)), after(f"kqv_out-{i}", cfg.dim))
            gate, up = first(f"ffn_gate-{i}", 2048), first(f"ffn_up-{i}", 2048)
            same(layer.mlp.gate(first(f"ffn_norm-{i}", 640)), gate)
            same(layer.mlp.up(first(f"ffn_norm-{i}", 640)), up)
            geglu = ACTIVATIONS[layer.mlp.activation](gate) * up  # ggml's table GELU
            same(geglu, first(f"ffn_geglu-{i}", 2048))
            same(layer.mlp.down(first(f"ffn_geglu-{i}", 2048)), first(f"ffn_out-{i}", 640))
        assert torch.equal(
            model.norm(first(f"l_out-{cfg.n_layers - 1}", 640)), first("result_norm", 640)
        )
        final = first("result_norm", 640)
        close(model.logits(final[None])[0], first("result_output", model.config.vocab_size))
        # the emulation is what makes ops match: plain f32 misses the Q8_0 activation rounding
        normed, q_ref = first("attn_norm-0", cfg.dim), first("Qcur-0", cfg.n_heads * cfg.head_dim)
        set_numerics(model, "f32")
        try:
            plain = (model.layers[0].attn.q(normed) - q_ref).abs().max()
        finally:
            set_numerics(model, "llamacpp")
        print("\nq-projection max |diff| vs llama.cpp: emulated 0, plain f32", plain.item())
        assert plain > 0
