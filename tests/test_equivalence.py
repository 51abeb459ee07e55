"""The equivalence report's arithmetic against hand computations (top-1 agreement, |Δlogit|,
KL), its greedy-continuation matching, and the stage workers' greedy answers: read off the
scored reference sequence, or off a draft's guesses (speculative scoring), they equal
token-by-token decoding whatever that sequence or draft holds."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures_gguf import write_tiny_gguf
from safetensors.torch import save_file

from engine.export.equivalence import (
    MIN_TOP1_DENSE,
    MIN_TOP1_QUANTIZED,
    Report,
    StageResult,
    _draft_runner,
    _engine_stages_worker,
    _engine_worker,
    _greedy_match,
    _llamacpp_worker,
    _load_engine,
    _Runner,
    _score_stage,
    compare,
    greedy_along,
    render_text,
    verdict,
)
from engine.export.llamacpp import AMX_NOTE
from engine.kernels.native import kernels


def _stage(path, logits: list[torch.Tensor], greedy=None) -> StageResult:
    save_file({f"logits.{i}": t for i, t in enumerate(logits)}, str(path))
    return StageResult(path, [], [], greedy or [[] for _ in logits])


def test_metrics_match_a_worked_example(tmp_path):
    # two positions, three-token vocabulary
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    other = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.5, 3.0]])
    m = compare(_stage(tmp_path / "a.st", [ref]), _stage(tmp_path / "b.st", [other]), 1)
    assert m["positions"] == 2
    assert m["top1_agreement"] == 0.5                      # position 1 flips to token 1
    assert m["max_abs_logit_diff"] == 3.5
    assert math.isclose(m["mean_abs_logit_diff"], 3.5 / 6)
    # KL(p || q) at position 1 by hand; position 0 is identical (KL 0)
    p = [1 / (2 + math.e ** 3)] * 2 + [math.e ** 3 / (2 + math.e ** 3)]
    zq = 1 + math.e ** 3.5 + math.e ** 3
    q = [1 / zq, math.e ** 3.5 / zq, math.e ** 3 / zq]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert math.isclose(m["kl_max"], kl, rel_tol=1e-12)
    assert math.isclose(m["kl_mean"], kl / 2, rel_tol=1e-12)


def test_identical_stages_report_zero_and_full_agreement(tmp_path):
    torch.manual_seed(0)
    logits = [torch.randn(4, 50), torch.randn(7, 50)]
    m = compare(_stage(tmp_path / "a.st", logits), _stage(tmp_path / "b.st", logits), 2)
    assert m == {"positions": 11, "top1_agreement": 1.0, "max_abs_logit_diff": 0.0,
                 "mean_abs_logit_diff": 0.0, "kl_mean": 0.0, "kl_max": 0.0}


def test_greedy_matching_reports_the_common_prefix(tmp_path):
    a = StageResult(tmp_path, [], [], [[1, 2, 3, 4], [5, 6], []])
    b = StageResult(tmp_path, [], [], [[1, 2, 9, 4], [5, 6], []])
    g = _greedy_match(a, b)
    assert g == {"all_match": False, "matches": [False, True, True],
                 "common_prefix_tokens": [2, 2, 0]}


def test_the_text_report_names_every_stage_and_llamacpp_absence():
    metrics = {"top1_agreement": 0.995, "max_abs_logit_diff": 0.25, "mean_abs_logit_diff": 0.01,
               "kl_mean": 1e-4, "kl_max": 2e-3, "positions": 10}
    report = {"prompt_suite": [{"prompt": "hi"}], "stages": [
        {"name": "checkpoint", "description": "reference", "file": None, "positions": 10},
        {"name": "merged", "description": "merged", "file": "model.gguf",
         "vs_checkpoint": metrics, "vs_previous": metrics, "tokenizer_matches": True,
         "greedy_vs_checkpoint": {"matches": [True]}}],
        "llamacpp": {"available": False, "reason": "llama-cpp-python is not installed"}}
    report["stages"][1].update(verdict(report["stages"][1], MIN_TOP1_DENSE))
    text = render_text(report)
    assert "[merged]" in text and "99.50%" in text and "0.25" in text
    assert "stage check: within its bar (top-1 ≥ 99%" in text
    assert "[llama.cpp] not run: llama-cpp-python is not installed" in text


def test_stage_verdicts_use_the_stage_bar_and_the_report_passes_only_if_all_do():
    metrics = {"top1_agreement": 0.95, "max_abs_logit_diff": 1.0, "mean_abs_logit_diff": 0.1,
               "kl_mean": 1e-2, "kl_max": 0.1, "positions": 20}
    stage = {"name": "quantized", "tokenizer_matches": True, "vs_checkpoint": metrics}
    assert verdict(stage, MIN_TOP1_QUANTIZED) == {"min_top1": 0.90, "passed": True}
    assert verdict(stage, MIN_TOP1_DENSE) == {"min_top1": 0.99, "passed": False}
    assert not verdict({**stage, "tokenizer_matches": False}, MIN_TOP1_QUANTIZED)["passed"]
    ok = {**stage, **verdict(stage, MIN_TOP1_QUANTIZED)}
    cpp = {"available": True, **stage, **verdict(stage, MIN_TOP1_DENSE)}
    assert Report([], [ok]).as_dict()["passed"] is True
    assert Report([], [ok], cpp).as_dict()["passed"] is False          # llama.cpp counts too
    assert Report([], [ok], {"available": False}).as_dict()["passed"] is True
    assert Report([], []).as_dict()["passed"] is False                 # nothing checked
    noted = Report([], [], {**cpp, "description": "the file in llama.cpp", "file": "m.gguf",
                            "greedy_vs_checkpoint": {"matches": [True]}, "note": AMX_NOTE})
    assert f"  note: {AMX_NOTE}" in render_text({**noted.as_dict(), "prompt_suite": []})


def _rows(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    """Logit rows whose argmax is `tokens`, in order."""
    rows = torch.zeros(len(tokens), vocab)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return rows


def test_greedy_along_follows_the_answer_until_the_stage_disagrees():
    stops = {0}
    # agrees with every answer token, then picks the stop token: finished, nothing to decode
    assert greedy_along(_rows([4, 5, 6, 0]), [4, 5, 6], 8, stops) == ([4, 5, 6], True)
    # the limit ends the answer before the last row is read
    assert greedy_along(_rows([4, 5, 6, 7]), [4, 5, 6], 3, stops) == ([4, 5, 6], True)
    # disagrees at the second token: its own pick ends an unfinished chain
    assert greedy_along(_rows([4, 9, 6, 0]), [4, 5, 6], 8, stops) == ([4, 9], False)
    # stops early where the reference went on
    assert greedy_along(_rows([4, 0, 6, 0]), [4, 5, 6], 8, stops) == ([4], True)
    # goes on where the reference stopped
    assert greedy_along(_rows([4, 5, 6, 3]), [4, 5, 6], 8, stops) == ([4, 5, 6, 3], False)


def _answers_to_score(prompt: list[int], answer: list[int]) -> list[list[int]]:
    """Sequences a stage may be asked to score: the answer itself, one token changed, cut short,
    and wrong from the first token."""
    def other(token: int) -> int:
        return 5 if token != 5 else 6

    changed = answer[:1] + [other(answer[1])] + answer[2:]
    return [prompt + answer, prompt + changed, prompt + answer[:3], prompt + [other(answer[0])]]


def test_the_engine_worker_reads_the_greedy_answer_it_would_decode(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q8_0")
    model = {"kind": "gguf", "path": str(path), "numerics": "f32"}
    texts = ["the sea and", "ship"]
    ref = _engine_worker({"model": model, "texts": texts, "greedy_tokens": 8})
    assert all(len(g) >= 4 for g in ref["greedy"])         # long enough to cut and change
    for i, (prompt, answer) in enumerate(zip(ref["prompt_ids"], ref["greedy"])):
        sequences = _answers_to_score(prompt, answer)
        got = _engine_worker({"model": model, "texts": [texts[i]] * len(sequences),
                              "sequences": sequences, "scored_from": [len(prompt) - 1] * 4,
                              "greedy_tokens": 8})
        assert got["greedy"] == [answer] * 4
        assert torch.equal(got["logits"][0], ref["logits"][i])


@pytest.mark.llamacpp
def test_the_llamacpp_worker_reads_the_greedy_answer_it_would_decode(tmp_path):
    import numpy as np

    from engine.export.llamacpp import open_llama

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", qtype="Q8_0")
    llm = open_llama(path, n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    prompt = llm.tokenize(b"the sea and", add_bos=True, special=True)
    llm.eval(prompt)
    answer: list[int] = []
    while len(answer) < 8:                        # token by token, as a chat client decodes
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token == llm.token_eos():
            break
        answer.append(token)
        llm.eval([token])
    llm.close()
    assert len(answer) >= 4
    sequences = _answers_to_score(prompt, answer)
    got = _llamacpp_worker({"model": {"kind": "llamacpp", "path": str(path)},
                            "texts": ["the sea and"] * 4, "sequences": sequences,
                            "scored_from": [len(prompt) - 1] * 4, "greedy_tokens": 8})
    assert got["prompt_ids"] == [prompt] * 4
    assert got["greedy"] == [answer] * 4


@pytest.mark.llamacpp
def test_llamacpp_opens_without_its_amx_buffers_exactly_where_the_build_has_them(tmp_path):
    """On a llama.cpp build with AMX_INT8 (ggml's AMX matmul segfaults there) the file opens
    without extra buffer types and the report says so; on any other build, with llama.cpp's
    defaults and no note. Either way it decodes."""
    import re

    import llama_cpp

    from engine.export.llamacpp import AMX_NOTE, amx_build, open_llama, open_note

    info = llama_cpp.llama_print_system_info().decode()
    assert amx_build() == bool(re.search(r"\bAMX_INT8\s*=\s*1\b", info))
    defaults = llama_cpp.llama_model_default_params()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", qtype="Q8_0")
    llm = open_llama(path, n_ctx=64, n_threads=1, verbose=False)
    assert bool(llm.model_params.use_extra_bufts) == (not amx_build())
    assert llama_cpp.llama_model_default_params().use_extra_bufts == defaults.use_extra_bufts
    assert open_note() == (AMX_NOTE if amx_build() else None)
    llm.eval(llm.tokenize(b"the sea and", add_bos=True, special=True))
    llm.close()


class _FixedDraft:
    """A draft that always guesses the same tokens, whatever it is asked."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def decode(self, prefix: list[int], n: int) -> list[int]:
        return self.tokens[:n]


class _EditedDraft:
    """Another draft's guesses with the third token changed: right, then wrong, every time."""

    def __init__(self, draft):
        self.draft = draft

    def decode(self, prefix: list[int], n: int) -> list[int]:
        guess = self.draft.decode(prefix, n)
        if len(guess) > 2:
            guess[2] = guess[2] + 1
        return guess


def _native_draft(path):
    if kernels() is None:
        pytest.skip("no C compiler here: the native kernels (the draft) cannot be built")
    return _draft_runner({"kind": "gguf", "path": str(path), "numerics": "llamacpp"})


@pytest.mark.parametrize("draft_kind", ["same file, native", "edited", "empty", "wrong tokens"])
def test_a_reference_following_a_draft_answers_as_it_decodes(tmp_path, draft_kind):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q8_0")
    model = {"kind": "gguf", "path": str(path), "numerics": "f32"}
    texts = ["the sea and", "ship", "a"]
    decoded = _engine_worker({"model": model, "texts": texts, "greedy_tokens": 8})
    if draft_kind == "same file, native":
        draft = _native_draft(path)
    elif draft_kind == "edited":
        draft = _EditedDraft(_native_draft(path))
    else:
        draft = _FixedDraft([] if draft_kind == "empty" else [7, 7, 7, 7, 7, 7, 7, 7])
    if draft_kind != "same file, native":
        # the twin: these drafts guess otherwise, so agreeing below is the reference's doing
        assert [draft.decode(ids, 8) for ids in decoded["prompt_ids"]] != decoded["greedy"]
    assert draft is not None
    followed = _score_stage(_Runner(*_load_engine(model)), {"texts": texts, "greedy_tokens": 8},
                            draft)
    assert followed["prompt_ids"] == decoded["prompt_ids"]
    assert followed["greedy"] == decoded["greedy"]
    for got, want in zip(followed["logits"], decoded["logits"]):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)


def test_the_stages_worker_scores_every_stage_and_a_served_stage_decodes_token_by_token(
        tmp_path):
    from engine.models.gguf_model import load_gguf_model
    from engine.sampling import SamplingSettings, generate_tokens

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q8_0")
    f32 = {"kind": "gguf", "path": str(path), "numerics": "f32"}
    served = {"kind": "gguf", "path": str(path), "numerics": "llamacpp"}
    _native_draft(path)
    texts = ["the sea and", "ship"]
    _engine_stages_worker({"reference": f32, "texts": texts, "greedy_tokens": 8,
                           "stages": [f32, served], "draft": served, "outdir": str(tmp_path),
                           "threads": 1})
    ref, same, native = (StageResult.read(tmp_path / f"stage-{k}.safetensors")
                         for k in range(3))
    assert all(r.timing["wall_s"] > 0 and r.timing["cpu_s"] > 0 for r in (ref, same, native))
    assert same.greedy == ref.greedy and same.prompt_ids == ref.prompt_ids
    for i in range(len(texts)):
        assert torch.allclose(same.logits(i), ref.logits(i), atol=1e-4)
    # the served stage's answers are token-by-token decoding on the torch reference path
    net, _ = load_gguf_model(path, numerics="llamacpp")
    net.native = False
    stops = _Runner(net, _load_engine(served)[1]).stops
    for ids, greedy in zip(ref.prompt_ids, native.greedy):
        cache = net.new_cache(1, len(ids) + 8)

        def step(new_ids, start_pos, cache=cache):
            with torch.no_grad():
                h = net.hidden(torch.tensor([new_ids]), start_pos=start_pos, cache=cache)
                return net.logits(h[0, -1]).float()

        assert greedy == generate_tokens(step, ids, max_new_tokens=8,
                                         settings=SamplingSettings(), stop_ids=stops)
