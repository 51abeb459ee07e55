"""Chat's one sampling default (engine.sampling.CHAT_DEFAULTS): a 1.1 repetition penalty over
the last 64 tokens, as Ollama's repeat_penalty/repeat_last_n defaults, and DRY at 0.8
(tests/test_sampling_dry.py), in the Chat pane and in
`forgebench chat`; `forgebench generate` and serve-local requests that say nothing stay at 1.0.

The penalty window is checked against llama.cpp's own penalties sampler (llama-cpp-python), and
on the real Gemma 3 270M base (FORGEBENCH_REAL=1) a greedy chat reply with the chat default does
not loop where the same reply without the penalty does.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from app.viewmodels import chat as vm
from engine.cli import build_parser
from engine.commands.chat import chat_settings, describe_settings
from engine.errors import ForgebenchError
from engine.sampling import (
    CHAT_DEFAULTS,
    NANOCHAT_CHAT_DEFAULTS,
    SamplingSettings,
    apply_repetition_penalty,
    next_token,
)
from engine.serve_local import sampling_settings


def test_the_chat_view_model_starts_from_the_engines_chat_default(tmp_path):
    assert vm.DEFAULT_SETTINGS == CHAT_DEFAULTS.as_dict()
    session = vm.ChatSession(tmp_path)
    assert session.settings == CHAT_DEFAULTS.as_dict()
    assert session.settings["repetition_penalty"] == 1.1
    assert session.settings["repetition_last_n"] == 64
    # twin: the sampler's own default is no penalty, so the chat default is a choice, not luck
    assert SamplingSettings().as_dict() != session.settings
    session.settings["repetition_penalty"] = 1.0        # the user's change is the session's
    assert vm.DEFAULT_SETTINGS["repetition_penalty"] == 1.1


def test_the_chat_pane_shows_the_chat_default_and_sends_what_the_user_sets(qtbot, tmp_path):
    from app.views.chat_pane import ChatPane

    pane = ChatPane()
    qtbot.addWidget(pane)
    assert (pane.repetition.value(), pane.repetition_last_n.value()) == (1.1, 64)
    assert pane.dry.value() == CHAT_DEFAULTS.dry_multiplier == 0.8
    pane.session = vm.ChatSession(tmp_path)
    pane._apply_settings()
    assert pane.session.settings == CHAT_DEFAULTS.as_dict()
    # twin: the user's change reaches the next request
    pane.repetition.setValue(1.0)
    pane.repetition_last_n.setValue(-1)
    assert pane.repetition_last_n.text() == "all"
    pane.dry.setValue(0.0)
    pane._apply_settings()
    assert pane.session.settings["repetition_penalty"] == 1.0
    assert pane.session.settings["repetition_last_n"] == -1
    assert pane.session.settings["dry_multiplier"] == 0.0


def test_forgebench_chat_defaults_to_the_chat_default_and_generate_does_not():
    parser = build_parser()
    chat = parser.parse_args(["chat", "model.gguf"])
    assert chat_settings(chat) == CHAT_DEFAULTS.as_dict()
    assert "repetition penalty 1.1 over the last 64 tokens" in describe_settings(
        chat_settings(chat))
    # twin: options given win over the default
    off = parser.parse_args(["chat", "model.gguf", "--repetition-penalty", "1",
                             "--repetition-last-n", "-1", "--temperature", "0.7"])
    assert chat_settings(off) == dict(CHAT_DEFAULTS.as_dict(), repetition_penalty=1.0,
                                      repetition_last_n=-1, temperature=0.7)
    assert describe_settings(chat_settings(off)).endswith(
        "no repetition penalty, DRY 0.8 (--dry-multiplier 0 turns it off)")
    none = parser.parse_args(["chat", "model.gguf", "--repetition-penalty", "1",
                              "--dry-multiplier", "0"])
    assert describe_settings(chat_settings(none)).endswith("no repetition penalty")
    # a nanochat model's own default: its sampler, unless the user asks otherwise
    assert chat_settings(chat, nanochat=True) == NANOCHAT_CHAT_DEFAULTS.as_dict()
    assert chat_settings(chat, nanochat=True)["dry_multiplier"] == 0.0
    assert chat_settings(off, nanochat=True)["repetition_penalty"] == 1.0
    generate = parser.parse_args(["generate", "run", "--prompt", "x"])
    assert generate.repetition_penalty == 1.0


def test_a_serve_local_request_without_settings_has_no_penalty_and_checks_the_window():
    assert sampling_settings({}) == SamplingSettings()
    given = sampling_settings({"settings": CHAT_DEFAULTS.as_dict()})
    assert given == CHAT_DEFAULTS
    with pytest.raises(ForgebenchError) as refused:
        sampling_settings({"settings": {"repetition_last_n": -2}})
    assert "repetition_last_n" in str(refused.value)


def test_the_penalty_counts_only_the_last_n_tokens_worked_example():
    logits = np.array([3.0, 2.9, 0.0, -1.0], np.float32)
    history = [0] + [2] * 70            # token 0 was said 70 tokens ago
    window = SamplingSettings(repetition_penalty=1.1, repetition_last_n=64)
    everything = SamplingSettings(repetition_penalty=1.1, repetition_last_n=-1)
    off = SamplingSettings(repetition_penalty=1.1, repetition_last_n=0)
    assert next_token(logits, window, previous=history) == 0        # out of the window
    assert next_token(logits, everything, previous=history) == 1    # 3.0 / 1.1 < 2.9
    assert next_token(logits, off, previous=history) == 0
    assert list(window.recent(history)) == [2] * 64
    assert list(window.recent([5, 6])) == [5, 6]


def llamacpp_penalised(logits: np.ndarray, history: list[int], penalty: float,
                       last_n: int) -> np.ndarray:
    """The logits after llama.cpp's penalties sampler has seen `history` (frequency and
    presence penalties off)."""
    import llama_cpp as L

    return llamacpp_sampled(L.llama_sampler_init_penalties(len(logits), last_n, penalty, 0.0,
                                                           0.0), logits, history)


def llamacpp_sampled(sampler, logits: np.ndarray, history: list[int]) -> np.ndarray:
    """The logits after a llama.cpp sampler that accepted `history` (freed after)."""
    import llama_cpp as L

    n = len(logits)
    try:
        for token in history:
            L.llama_sampler_accept(sampler, token)
        data = (L.llama_token_data * n)(*[L.llama_token_data(i, float(v), 0.0)
                                          for i, v in enumerate(logits)])
        candidates = L.llama_token_data_array(data, n, -1, False)
        L.llama_sampler_apply(sampler, ctypes.byref(candidates))
        out = np.empty(n, np.float32)
        for k in range(candidates.size):
            out[data[k].id] = data[k].logit
        return out
    finally:
        L.llama_sampler_free(sampler)


@pytest.mark.llamacpp
@pytest.mark.parametrize("last_n", [1, 7, 64, -1])
@pytest.mark.parametrize("penalty", [1.1, 1.5])
def test_the_penalty_window_matches_llama_cpps_penalties_sampler(last_n, penalty):
    rng = np.random.default_rng(last_n + 100)
    logits = rng.normal(0, 3, 200).astype(np.float32)
    logits[:5] = 0.0                                    # llama.cpp scales a zero logit too
    history = rng.integers(0, 200, 150).tolist()
    settings = SamplingSettings(repetition_penalty=penalty, repetition_last_n=last_n)
    # llama.cpp's -1 is "the context size": every token it has seen
    want = llamacpp_penalised(logits, history, penalty, len(history) if last_n < 0 else last_n)
    got = apply_repetition_penalty(logits, settings.recent(history), penalty)
    np.testing.assert_array_equal(got, want)
    assert next_token(logits, settings, previous=history) == int(np.argmax(want))
    # twin: the whole history is not the window
    if 0 < last_n < 64:
        assert not np.array_equal(apply_repetition_penalty(logits, history, penalty), want)


def repeated_ngram(text: str, n: int = 5) -> tuple[tuple[str, ...], int]:
    """The most frequent word n-gram of a text and how often it occurs."""
    words = text.split()
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return grams.most_common(1)[0] if grams else ((), 0)


def test_repeated_ngram_finds_a_loop_and_not_a_plain_sentence():
    assert repeated_ngram("I am here. " * 3 + "I am here.", n=3)[1] == 4
    assert repeated_ngram("the cat sat on the mat and then the dog sat on the rug")[1] == 1


@pytest.mark.realmodel
@pytest.mark.slow
def test_the_chat_default_stops_the_base_model_looping(gemma_gguf, tmp_path):
    """Greedy `forgebench chat` on the Gemma 3 270M base: without the penalty the 96-token reply
    says one short sentence ten times; with the chat default (nothing passed) it does not. (A
    longer reply under the penalty alone comes back to a 40-word paragraph, which a 1.1 penalty
    does not outweigh; the chat default's DRY does: tests/test_sampling_dry.py.)"""
    def reply(*options: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "engine", "chat", str(gemma_gguf), "--prompt",
             "Tell me about the history of Rome.", "--max-tokens", "96", *options],
            cwd=tmp_path, capture_output=True, text=True, timeout=600, check=True)
        assert "sampling: greedy" in done.stderr, done.stderr
        return done.stdout

    looping, chatting = reply("--repetition-penalty", "1"), reply()
    gram, count = repeated_ngram(looping)
    print(f"penalty 1.0: {gram} x{count}: {looping!r}")
    assert count >= 3, looping
    gram, count = repeated_ngram(chatting)
    print(f"chat default: {gram} x{count}: {chatting!r}")
    assert count < 3, chatting
