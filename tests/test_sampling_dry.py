"""DRY ("Don't Repeat Yourself") in engine.sampling against llama.cpp's own `llama_sampler_dry`
(llama-cpp-python's low-level API), a worked example from llama.cpp's source comment, and the
real Gemma 3 270M base, whose long greedy replies loop under the per-token repetition penalty
alone (FORGEBENCH_REAL=1).

llama.cpp's sampler is given the same vocabulary (the GGUF opened vocab-only), the same
breakers and history; the logits after it must equal ours bit for bit. Twins: without the
breaker table, or with the penalty in f32 throughout, the comparison fails.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from engine.llm.tokenizer import GGUFTokenizer
from engine.sampling import (
    CHAT_DEFAULTS,
    DRY_BREAKERS,
    SamplingSettings,
    apply_dry,
    dry_breakers,
    dry_penalties,
    next_token,
)
from tests.fixtures_gguf import write_tiny_gguf
from tests.test_chat_defaults import llamacpp_sampled, repeated_ngram

DRY = SamplingSettings(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_last_n=-1)


class NoBreakers:
    """A tokenizer stand-in for the worked example: no token is a breaker."""

    vocab_size = 0


def test_the_worked_example_from_llama_cpps_comment():
    """llama.cpp's comment: last tokens `a b c c b c y a b c` have repeat counts
    `0 0 3 1 0 2 0 0 0 0`, so emitting c would extend `a b c` (3 -> 4), y `b c` (2 -> 3) and
    b only `c` (1, under the allowed length 2)."""
    a, b, c, y = 1, 2, 3, 4
    penalties = dry_penalties([a, b, c, c, b, c, y, a, b, c], DRY)
    assert penalties == {c: np.float32(0.8 * 1.75 ** 1), y: np.float32(0.8 * 1.75 ** 0)}
    # twin: a longer allowed length forgives y's 2-token repeat but not c's
    longer = dry_penalties([a, b, c, c, b, c, y, a, b, c],
                           SamplingSettings(dry_multiplier=0.8, dry_allowed_length=3))
    assert set(longer) == {c}


def test_a_breaker_ends_the_repeat_a_match_may_reach_back_through():
    a, b, c, nl = 1, 2, 3, 9
    history = [nl, a, b, c, nl, a, b]
    assert dry_penalties(history, DRY) == {c: np.float32(0.8 * 1.75 ** 1)}    # `nl a b` -> c
    # with the newline a breaker, the repeat counts only `a b`, after the newline
    assert dry_penalties(history, DRY, {nl: ((),)}) == {c: np.float32(0.8 * 1.75 ** 0)}
    # a breaker token itself is never penalised, however long the repeat it would extend
    history = [a, b, nl, c, a, b]
    assert dry_penalties(history, DRY) == {nl: np.float32(0.8)}
    assert dry_penalties(history, DRY, {nl: ((),)}) == {}


def test_dry_is_off_by_default_and_on_in_the_chat_default():
    history = [1, 2, 3] * 20
    assert dry_penalties(history, SamplingSettings()) == {}
    assert dry_penalties(history, CHAT_DEFAULTS)
    assert dry_penalties(history, SamplingSettings(dry_multiplier=0.8, dry_last_n=0)) == {}
    # the window: a repeat older than the last n tokens is not seen
    assert dry_penalties([1, 2, 3] + list(range(10, 40)) + [1, 2],
                         SamplingSettings(dry_multiplier=0.8, dry_last_n=20)) == {}


def test_greedy_picks_change_only_through_the_penalty():
    logits = np.array([0.0, 5.0, 4.9, 0.0], np.float32)
    history = [1, 2, 1, 2, 1]              # emitting 2 would extend `1 2 1 2 1` -> length 4
    assert next_token(logits, SamplingSettings(), previous=history) == 1
    assert next_token(logits, DRY, previous=history) == 1
    history = [2, 1, 2, 1, 2]              # now 1 extends a repeat of 4: 5 - 0.8*1.75^2 < 4.9
    assert next_token(logits, DRY, previous=history) == 2
    assert next_token(logits, SamplingSettings(), previous=history) == 1


# -- against llama.cpp -----------------------------------------------------------------------

def llamacpp_dry(path, logits: np.ndarray, history: list[int], settings: SamplingSettings,
                 breakers: tuple[str, ...]) -> np.ndarray:
    """The logits after llama.cpp's DRY sampler (over the GGUF's vocabulary) saw `history`."""
    import llama_cpp as L
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = L.llama_model_get_vocab(llm.model)
    words = [text.encode() for text in breakers]
    array = (ctypes.c_char_p * len(words))(*words)
    last_n = len(history) if settings.dry_last_n < 0 else settings.dry_last_n
    sampler = L.llama_sampler_init_dry(vocab, settings.dry_multiplier, settings.dry_base,
                                       settings.dry_allowed_length, last_n, array, len(words))
    return llamacpp_sampled(sampler, logits, history)


def looping_history(rng, pieces: list[tuple[int, ...]], length: int) -> list[int]:
    """Random text of `pieces` (token sequences) with repeats of random lengths copied from
    earlier in it."""
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.5:
            start = int(rng.integers(0, len(out)))
            out += out[start:start + int(rng.integers(1, 12))]
        else:
            out += pieces[int(rng.integers(len(pieces)))]
    out = out[:length]
    start = int(rng.integers(0, len(out) - 2))      # end inside a repeat, as a loop does
    return out + out[start:start + int(rng.integers(2, 9))]


@pytest.mark.llamacpp
@pytest.mark.parametrize("vocab", ["spm", "bpe"])
@pytest.mark.parametrize("breakers", [DRY_BREAKERS, ("ab", "c d", "\n\n")])
def test_dry_equals_llama_cpps_sampler(tmp_path, vocab, breakers):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", vocab=vocab)
    tokenizer = GGUFTokenizer.from_gguf(path)
    table = dry_breakers(tokenizer, breakers)
    assert table, "the vocabulary has breaker tokens"
    rng = np.random.default_rng(len(breakers))
    # one piece in eight is a whole breaker (its head and a tail), so restarts happen but
    # repeats still grow
    breaker_pieces = [(head, *tail) for head, tails in sorted(table.items()) for tail in tails]
    pool = breaker_pieces[:3] + [(int(t),) for t in rng.integers(0, tokenizer.vocab_size, 21)]
    compared = differs_without_table = 0
    for case in range(24):
        settings = SamplingSettings(dry_multiplier=float(rng.choice([0.8, 2.0])),
                                    dry_base=float(rng.choice([1.75, 1.1, 3.0])),
                                    dry_allowed_length=int(rng.integers(1, 4)),
                                    dry_last_n=int(rng.choice([-1, 16, 48])))
        history = looping_history(rng, pool, int(rng.integers(8, 120)))
        logits = rng.normal(0, 3, tokenizer.vocab_size).astype(np.float32)
        want = llamacpp_dry(path, logits, history, settings, breakers)
        got = apply_dry(logits, history, settings, table)
        np.testing.assert_array_equal(got, want, err_msg=f"case {case}: {settings}")
        compared += int(not np.array_equal(want, logits))
        # twin: without the breakers the result differs wherever a breaker mattered
        differs_without_table += int(not np.array_equal(apply_dry(logits, history, settings),
                                                        want))
    assert compared >= 12, f"most cases penalise something ({compared} of 24)"
    assert differs_without_table >= 3


@pytest.mark.llamacpp
def test_the_penalty_is_rounded_as_llama_cpp_rounds_it(tmp_path):
    """std::pow(float, int) runs in double and the product is rounded to f32 once. Repeats of
    every length up to 40 equal llama.cpp's logits; the twin (the power and product taken in
    f32) misses them for some lengths."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    vocab = GGUFTokenizer.from_gguf(path).vocab_size
    settings = SamplingSettings(dry_multiplier=0.7, dry_base=1.3, dry_allowed_length=1)
    logits = np.full(vocab, 7.3, np.float32)
    missed = 0
    for length in range(2, 41):
        pattern = list(range(40, 40 + length))
        history = pattern + [90] + pattern        # emitting 90 extends a repeat of `length`
        want = llamacpp_dry(path, logits, history, settings, ())
        np.testing.assert_array_equal(apply_dry(logits, history, settings), want)
        in_f32 = np.float32(0.7) * np.float32(1.3) ** np.float32(length - 1)
        missed += int(np.float32(7.3) - in_f32 != want[90])
    assert missed > 0


def test_the_breaker_table_reads_single_tokens_and_overlaps(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    tokenizer = GGUFTokenizer.from_gguf(path)
    newline = tokenizer.encode("\n", add_special=False)[-1]
    assert () in dry_breakers(tokenizer)[newline]
    # "ab": a token ending in "a" heads a breaker whose tail is the tokens of "b"
    table = dry_breakers(tokenizer, ("ab",))
    a = tokenizer.token_to_id["a"]
    assert tuple(tokenizer.encode("b", add_special=False, parse_special=False)) in table[a]
    # cached per vocabulary and per breaker list
    assert dry_breakers(tokenizer, ("ab",)) is table
    assert dry_breakers(tokenizer) is not table


@pytest.mark.realmodel
@pytest.mark.slow
def test_the_chat_default_stops_a_long_loop_the_penalty_alone_does_not(gemma_gguf, tmp_path):
    """Greedy `forgebench chat` on the Gemma 3 270M base, 192 tokens: with the repetition
    penalty alone (DRY off) the reply says one 40-word paragraph three times; with the chat
    default (DRY on) no run of 12 words comes twice (measured: the longest repeat is 8 words,
    across a newline, which is a sequence breaker)."""
    def reply(*options: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "engine", "chat", str(gemma_gguf), "--prompt",
             "Tell me about the history of Rome.", "--max-tokens", "192", *options],
            cwd=tmp_path, capture_output=True, text=True, timeout=900, check=True)
        return done.stdout

    penalty_only, chat_default = reply("--dry-multiplier", "0"), reply()
    gram, count = repeated_ngram(penalty_only, n=12)
    print(f"penalty only: {gram} x{count}: {penalty_only!r}")
    assert count >= 2, penalty_only
    gram, count = repeated_ngram(chat_default, n=12)
    print(f"chat default: {gram} x{count}: {chat_default!r}")
    assert count < 2, chat_default
