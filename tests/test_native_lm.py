"""Generation without torch (engine/llm/native_lm.py) against the torch path it stands in for:
the same logits to the bit and the same tokens, greedy and seeded, on every family and a spread
of weight types; `forgebench generate` under llama.cpp numerics never imports torch, while the
paths that need it (FORGEBENCH_NATIVE=0, f32 numerics) still do; the numpy helpers (repetition
penalty, GELU table) equal their torch originals; and the GGUF string-array parser gives the
`gguf` package's vocabulary, odd strings included.

The C kernels follow this machine's llama.cpp configuration on both paths alike, so the checks
hold on AVX2, AVX-512 and AMX CPUs (which weights run in C can differ: Q4_0 falls back to torch
where llama.cpp repacks it, and then load_native_lm says None)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from fixtures_gguf import write_tiny_gguf

from engine.errors import ForgebenchError
from engine.gguf.reader import open_gguf
from engine.kernels.native import kernels
from engine.llm.generate import generate
from engine.llm.native_lm import ThreadGovernor, gelu_table, load_native_lm
from engine.models.gguf_model import load_gguf_model
from engine.sampling import SamplingSettings, apply_repetition_penalty

ROOT = Path(__file__).resolve().parents[1]
needs_c = pytest.mark.skipif(kernels() is None, reason="no C compiler to build ggml_kernels.c")
CASES = [("gemma3", "Q4_K"), ("gemma3", "Q5_0"), ("llama", "Q8_0"), ("llama", "F16"),
         ("qwen2", "Q5_K"), ("qwen3", "Q6_K"), ("qwen3", "Q5_1")]
PROMPT = [1, 40, 7, 200, 12, 99, 5, 261, 33, 18, 2, 77, 150]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("native-lm")
    return {case: write_tiny_gguf(root / f"{case[0]}-{case[1]}.gguf", *case,
                                  vocab="bpe" if case[0].startswith("qwen") else "spm")
            for case in CASES}


def both(path):
    """(torch model, tokenizer), (NativeLM, tokenizer) over the same file."""
    native = load_native_lm(path, threads=1)
    assert native is not None, "the C decoder serves every exact weight type"
    return load_gguf_model(path, numerics="llamacpp", weights="dense-cache"), native


@pytest.fixture
def one_torch_thread():
    """The torch path on one thread, like the C decoder it is compared with; the suite's count
    comes back afterwards (a later test's f32 sums would otherwise run in another order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@needs_c
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_same_logits_and_greedy_tokens_as_the_torch_path(files, case, one_torch_thread):
    (model, tok), (lm, native_tok) = both(files[case])
    with torch.no_grad():
        ref = model.logits(model.hidden(torch.tensor([PROMPT]), 0, model.new_cache(1, 32))[:, -1])
    got = lm.last_logits(PROMPT, 0, lm.new_cache(32))
    assert np.array_equal(ref[0].float().numpy(), got)
    penalised = SamplingSettings(repetition_penalty=1.3)
    for settings in (SamplingSettings(), penalised):
        a = generate(model, tok, PROMPT, max_new_tokens=24, settings=settings, stop_ids=[])
        b = generate(lm, native_tok, PROMPT, max_new_tokens=24, settings=settings, stop_ids=[])
        assert a.ids == b.ids and a.text == b.text and len(a.ids) == 24


@needs_c
def test_a_changed_decoder_gives_other_logits(files):
    """Twin: the comparison above sees a difference in the C description (Gemma's √dim
    embedding scale left out)."""
    (model, _), (lm, _) = both(files["gemma3", "Q4_K"])
    with torch.no_grad():
        ref = model.logits(model.hidden(torch.tensor([PROMPT]), 0, model.new_cache(1, 32))[:, -1])
    lm.gemma = False
    assert not np.array_equal(ref[0].float().numpy(), lm.last_logits(PROMPT, 0, lm.new_cache(32)))


@needs_c
@pytest.mark.parametrize("case", [("gemma3", "Q4_K"), ("llama", "Q8_0")], ids=lambda c: "-".join(c))
def test_decode_steps_on_more_threads_than_cores_give_the_same_bits(files, case):
    """Decode steps on 7 threads, more than this machine has cores, so the OS holds some back
    while the others take their rows (each matmul's row chunks in per-thread runs, the rest
    taken from a held-back thread's run; each thread's own copy of the position's residual
    state), against one thread: the prompt's logits and 8 greedy steps' to the bit. Twin: one
    step fed another token differs."""
    one, _ = load_native_lm(files[case], threads=1)
    many, _ = load_native_lm(files[case], threads=7)
    caches = one.new_cache(32), many.new_cache(32)
    ref = one.last_logits(PROMPT, 0, caches[0])
    assert np.array_equal(many.last_logits(PROMPT, 0, caches[1]), ref)
    for pos in range(len(PROMPT), len(PROMPT) + 8):
        token = int(np.argmax(ref))
        ref = one.last_logits([token], pos, caches[0])
        assert np.array_equal(many.last_logits([token], pos, caches[1]), ref), f"position {pos}"
    other = many.last_logits([token + 1], pos, caches[1])
    assert not np.array_equal(other, ref)


def run_governor(governor: ThreadGovernor, step_seconds, steps: int, share=None) -> list[int]:
    """The counts `governor` picks over `steps` steps, a step at count c taking
    step_seconds(c, i) and, where `share` is given, share(c, i) · c times that of CPU."""
    picked = []
    for i in range(steps):
        count = governor.pick()
        seconds = step_seconds(count, i)
        cpu = None if share is None else share(count, i) * count * seconds
        governor.record(count, seconds, cpu)
        picked.append(count)
    return picked


def test_thread_governor_leaves_a_count_that_other_load_slows():
    """Worked numbers from this 2-core machine: quiet, a step took 12.4 ms on 2 threads (CPU
    share 0.9 a thread) and 17 ms on 1; with another process on a core, 25.8 ms on 2 (share 0.5)
    and 18 ms on 1. Quiet, the governor stays on 2, probing 1 (four steps) at step 63 and 131
    steps later (none in a short reply); once the load comes (step 300) it runs at 1 within 3
    steps, and goes back to 2 within 16 steps of the load leaving (step 600)."""
    def busy(i):
        return 300 <= i < 600

    def seconds(count, i):
        return (0.0258 if busy(i) else 0.0124) if count == 2 else (0.018 if busy(i) else 0.017)

    def share(count, i):
        return (0.5 if busy(i) else 0.9) if count == 2 else 1.0

    picked = run_governor(ThreadGovernor(2), seconds, 900, share)
    assert ThreadGovernor(2).counts == [2, 1] and ThreadGovernor(8).counts == [8, 4, 2, 1]
    probes = [i for i, c in enumerate(picked[:300]) if c == 1]
    assert [i for i in probes if i - 1 not in probes] == [63, 194] and len(probes) == 8
    assert picked[303:600].count(1) >= 255              # busy: one thread, the rare probe of 2
    assert picked[616:679] == [2] * 63                  # quiet again: back on two,
    assert picked[616:].count(2) >= 276                 # probing 1 after PROBE_QUIET steps


def test_thread_governor_sees_starved_threads_before_a_slowdown():
    """Other load that slows 2 threads only from 12.4 to 15 ms (less than SLOWDOWN) while 1
    thread takes 13: the CPU share (0.55 a thread) brings the probe forward and the governor
    is on 1 thread from step 102 (probing 2 now and then); the twin without CPU times stays on
    2 until the next scheduled probe (step 194)."""
    def seconds(count, i):
        return (0.015 if i >= 100 else 0.0124) if count == 2 else 0.013

    def share(count, i):
        return (0.55 if i >= 100 else 0.9) if count == 2 else 1.0

    with_share = run_governor(ThreadGovernor(2), seconds, 300, share)
    without = run_governor(ThreadGovernor(2), seconds, 300)
    assert with_share[102:113] == [1] * 11 and with_share[105:190].count(1) >= 70
    assert without[100:194] == [2] * 94


def test_thread_governor_keeps_its_count_against_a_near_tie():
    """The twin: a count only 2% faster (inside HYSTERESIS) does not take over, so noise
    between two equal counts does not make the governor flap; 10% faster does."""
    def near(count, i):
        return 0.0100 if count == 2 else 0.0098

    def clearly(count, i):
        return 0.0100 if count == 2 else 0.0090

    assert run_governor(ThreadGovernor(2), near, 200).count(1) <= 8    # the probes only
    assert run_governor(ThreadGovernor(2), clearly, 200)[67:].count(1) >= 110


@needs_c
def test_decode_steps_follow_the_thread_count_set_after_loading(files, monkeypatch):
    """The bench and the chat worker set `threads` after loading: decode steps are governed at
    that count (one thread: not governed, every step on it); FORGEBENCH_ADAPTIVE_THREADS=0 runs
    every step at `threads`. A prompt is never governed."""
    lm, _ = load_native_lm(files["gemma3", "Q4_K"], threads=1)
    cache = lm.new_cache(32)
    lm.last_logits(PROMPT, 0, cache)
    assert lm.governor is None
    lm.threads = 2
    lm.last_logits([5], len(PROMPT), cache)
    assert lm.governor.counts == [2, 1] and len(lm.governor.samples[2]) == 1
    monkeypatch.setenv("FORGEBENCH_ADAPTIVE_THREADS", "0")
    assert lm._decode_governor() is None


@needs_c
def test_seeded_sampling_and_logprobs_match(files):
    (model, tok), (lm, native_tok) = both(files["llama", "Q8_0"])
    settings = SamplingSettings(temperature=0.9, top_k=40, top_p=0.95)
    events: dict[str, list] = {"torch": [], "native": []}
    a = generate(model, tok, PROMPT, max_new_tokens=16, settings=settings, seed=7, stop_ids=[],
                 on_token=events["torch"].append)
    b = generate(lm, native_tok, PROMPT, max_new_tokens=16, settings=settings, seed=7,
                 stop_ids=[], on_token=events["native"].append)
    assert a.ids == b.ids
    assert [e.id for e in events["torch"]] == [e.id for e in events["native"]]
    np.testing.assert_allclose([e.logprob for e in events["native"]],
                               [e.logprob for e in events["torch"]], rtol=0, atol=1e-5)
    other = generate(lm, native_tok, PROMPT, max_new_tokens=16, settings=settings, seed=8,
                     stop_ids=[])
    assert other.ids != b.ids          # twin: the seed does reach the draw


def test_repetition_penalty_in_numpy_equals_torch():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(5000) * 7).astype(np.float32)
    seen = rng.integers(0, 5000, 300).tolist()
    for penalty in (1.1, 1.3, 0.7):
        ref = apply_repetition_penalty(torch.from_numpy(logits.copy()), seen, penalty).numpy()
        got = apply_repetition_penalty(logits, seen, penalty)
        assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    assert not np.array_equal(got, logits)     # twin: the penalty changes what it should


def test_gelu_table_equals_the_torch_table():
    from engine.kernels.numerics import gelu_table as torch_table

    ours, ref = gelu_table(), torch_table().numpy()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    assert not np.array_equal(ours.view(np.uint32), np.roll(ref, 1).view(np.uint32))


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`forgebench ARGS` in a fresh interpreter, then whether torch got imported (last line)."""
    code = ("import sys\nfrom engine.cli import main\ncode = main(sys.argv[1:])\n"
            "print(json.dumps({'torch': 'torch' in sys.modules}))\nsys.exit(code)")
    return subprocess.run([sys.executable, "-c", "import json\n" + code, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                               **(env or {})})


def cli_result(done: subprocess.CompletedProcess) -> tuple[dict, bool]:
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-2]), json.loads(lines[-1])["torch"]


@needs_c
def test_generate_command_never_imports_torch(files):
    path = str(files["gemma3", "Q4_K"])
    args = ("generate", "--model", path, "--prompt", "the cat sat", "--max-tokens", "12",
            "--json")
    done, imported = cli_result(cli(*args))
    assert not imported
    model, tok = load_gguf_model(path, numerics="llamacpp", weights="dense-cache")
    ref = generate(model, tok, done_prompt(tok), max_new_tokens=12)
    assert done["ids"] == ref.ids and done["text"] == ref.text
    # twins: where the C decoder is off, or numerics are f32, torch is what runs
    assert cli_result(cli(*args, env={"FORGEBENCH_NATIVE": "0"}))[1]
    assert cli_result(cli(*args, "--numerics", "f32"))[1]


def done_prompt(tok) -> list[int]:
    return tok.encode("the cat sat", add_special=True, parse_special=True)


@needs_c
def test_chat_worker_loads_the_torch_free_decoder(files):
    from engine.serve_local import chat, load_system

    path = str(files["qwen3", "Q6_K"])
    request = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    replies = []
    for torch_free in (True, False):
        system = load_system("A", {"model": path}, torch_free=torch_free)
        assert getattr(system.model, "torch_free", False) is torch_free
        replies.append(chat(system, request, lambda line: None, lambda: False))
    assert replies[0]["ids"] == replies[1]["ids"] and replies[0]["text"] == replies[1]["text"]


def test_unserved_files_fall_back(tmp_path, monkeypatch):
    """Q4_0 weights go to torch where llama.cpp repacks them (no exact kernel for its gemm) and
    run in C where it does not; without the C build every file goes to torch."""
    from engine.kernels import exact_plan

    q4_0 = write_tiny_gguf(tmp_path / "q4_0.gguf", "llama", "Q4_0")
    q8_0 = write_tiny_gguf(tmp_path / "q8_0.gguf", "llama", "Q8_0")
    if kernels() is not None:
        rows = open_gguf(q4_0).tensor("blk.0.attn_q.weight").shape[0]
        served = load_native_lm(q4_0) is not None
        assert served is not exact_plan.repacked(gguf.GGMLQuantizationType.Q4_0, rows)
        assert load_native_lm(q8_0) is not None
    import engine.llm.native_lm as native_lm

    monkeypatch.setattr(native_lm, "kernels", lambda: None)
    assert load_native_lm(q8_0) is None


# ---- the vocabulary parser -------------------------------------------------------------

def write_vocab(path: Path, tokens: list) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_string("after", "still read")
    w.add_tensor("x", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_package_strings(path: Path, key: str) -> list[str]:
    field = gguf.GGUFReader(str(path)).fields[key]
    return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]


ODD = ["", "a", "▁the", "中文", "\n", "é" * 300, "<0x00>", "\udcff\udcfe", "\udcc3", "x\udce9y"]


@pytest.mark.parametrize("extra", [[], ["nul\x00inside"]], ids=["joined", "one-by-one"])
def test_vocabulary_equals_the_gguf_package(tmp_path, extra):
    rng = np.random.default_rng(1)
    alphabet = list("abcdefghij▁éü中") + ["\udcc3", "\udca9"]
    tokens = ODD + extra + ["".join(rng.choice(alphabet, rng.integers(1, 9))) + str(i)
                            for i in range(3000)]
    path = tmp_path / "v.gguf"
    raw = [t.encode("utf-8", "surrogateescape") for t in tokens]
    write_vocab(path, raw)
    got = open_gguf(path).metadata["tokenizer.ggml.tokens"]
    expected = [r.decode("utf-8", "surrogateescape") for r in raw]
    assert got == gguf_package_strings(path, "tokenizer.ggml.tokens") == expected
    assert len(got) == len(tokens) and open_gguf(path).metadata["after"] == "still read"
    assert got != expected[:-1] + ["other"]            # twin: a changed token is seen


def test_truncated_vocabulary_is_refused(tmp_path):
    path = write_vocab(tmp_path / "v.gguf", [b"abc"] * 100)
    data = path.read_bytes()
    at = data.index(b"abc" * 1)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:at + 14 * 50])
    with pytest.raises(ForgebenchError, match="truncated"):
        open_gguf(cut)


@needs_c
@pytest.mark.realmodel
def test_gemma_torch_free_generation_equals_the_torch_path(gemma_gguf):
    """gemma-3-270m Q4_K_M: 24 greedy tokens on three prompts, the torch-free path against the
    torch path (each the engine's llama.cpp numerics); and its 262k-token vocabulary as the
    `gguf` package reads it."""
    (model, tok), (lm, native_tok) = both(gemma_gguf)
    for prompt in ("The capital of France is", "def add(a, b):\n    return",
                   "Once upon a time, in a small village,"):
        ids = tok.encode(prompt)
        a = generate(model, tok, ids, max_new_tokens=24, stop_ids=[])
        b = generate(lm, native_tok, ids, max_new_tokens=24, stop_ids=[])
        assert a.ids == b.ids and a.text == b.text
    tokens = open_gguf(gemma_gguf).metadata["tokenizer.ggml.tokens"]
    assert tokens == gguf_package_strings(gemma_gguf, "tokenizer.ggml.tokens")
    assert len(tokens) == 262144
