"""nanochat chat with its calculator (engine/llm/nanochat_chat.py) against the reference's
Engine.generate: on a tiny GPT whose lm_head was solved so that greedy decoding calls the
calculator (tests/data/nanochat/make_chat_goldens.py), the tokens, the forced-token masks and
the logits of every step are the reference's; the conversation render is its
render_conversation / render_for_completion, ids and mask. Twins show each comparison fails
when the tool's output, its forcing or the render's mask is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.llm import nanochat_chat
from engine.llm.nanochat_chat import generate_reply, prompt_ids
from engine.models.nanochat import NanochatConfig, NanochatGPT
from engine.nanochat_tokenizer import (
    NanochatTokenizer,
    assistant_parts,
    render_conversation,
    render_for_completion,
)
from engine.sampling import SamplingSettings

DATA = Path(__file__).parent / "data" / "nanochat"
GOLDENS = DATA / "chat_goldens.json"
# fp32 logits of the same ops on the same weights; the soft cap keeps them within ±15
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def goldens():
    if not GOLDENS.is_file():
        pytest.skip(f"no chat goldens at {GOLDENS} (make_chat_goldens.py writes them)")
    from safetensors.torch import load_file

    return json.loads(GOLDENS.read_text("utf-8")), load_file(
        str(DATA / "chat_goldens.safetensors"))


@pytest.fixture(scope="module")
def tokenizer(goldens):
    meta, _ = goldens
    text = (DATA / "tokenizer_train.txt").read_bytes().decode("utf-8")
    tok = NanochatTokenizer.train([text], meta["config"]["vocab_size"])
    assert {k: tok.special_ids[k] for k in meta["special_ids"]} == meta["special_ids"]
    return tok


@pytest.fixture(scope="module")
def model(goldens):
    meta, tensors = goldens
    net = NanochatGPT(NanochatConfig(**meta["config"]))
    net.load_state_dict({k[len("model/"):]: v for k, v in tensors.items()
                         if k.startswith("model/")})
    return net.eval()


def user_turn(case: dict) -> list[dict]:
    return [{"role": "user", "content": case["user"]}]


def run_case(model, tokenizer, meta, case):
    logits = []
    calls = []
    reply = generate_reply(model, tokenizer, prompt_ids(tokenizer, user_turn(case)),
                           max_tokens=meta["max_tokens"], on_logits=logits.append,
                           on_tool=calls.append)
    ender = [tokenizer.special_ids["<|assistant_end|>"]] if reply.stop_reason == "eos" else []
    return reply, reply.ids + ender, torch.stack(logits), calls


def test_render_conversation_ids_and_mask_are_the_reference(goldens, tokenizer):
    meta, _ = goldens
    ids, mask = render_conversation(tokenizer, meta["render"]["conversation"])
    assert ids == meta["render"]["ids"]
    assert mask == meta["render"]["mask"]
    for case in meta["cases"]:
        conversation = {"messages": user_turn(case) + [{"role": "assistant", "content": ""}]}
        assert render_for_completion(tokenizer, conversation) == case["prompt"]
        assert prompt_ids(tokenizer, user_turn(case)) == case["prompt"]


def test_twin_render_supervising_the_tool_output_fails(goldens, tokenizer, monkeypatch):
    import engine.nanochat_tokenizer as nt

    meta, _ = goldens
    monkeypatch.setitem(nt._PART_DELIMITERS, "python_output",
                        ("<|output_start|>", "<|output_end|>", 1))
    _, mask = render_conversation(tokenizer, meta["render"]["conversation"])
    assert mask != meta["render"]["mask"]


def test_engine_tokens_masks_and_logits_are_the_reference(goldens, tokenizer, model):
    meta, tensors = goldens
    assert any(0 in case["masks"] for case in meta["cases"])       # something was forced
    for case in meta["cases"]:
        reply, tokens, logits, _ = run_case(model, tokenizer, meta, case)
        assert tokens == case["tokens"], case["user"]
        assert [0 if f else 1 for f in reply.forced] == case["masks"][:len(reply.ids)]
        ref = tensors[case["logits_key"]]
        assert logits.shape == ref.shape
        assert float((logits - ref).abs().max()) <= LOGIT_ATOL, case["user"]


def test_calls_and_their_results(goldens, tokenizer, model):
    meta, _ = goldens
    found = {case["user"]: [c.as_dict() for c in run_case(model, tokenizer, meta, case)[3]]
             for case in meta["cases"]}
    assert found["What is 6 times 7?"] == [{"expr": "6*7", "result": "42"}]
    assert found["Divide 1 by 0."] == [{"expr": "1/0", "result": None}]       # nothing forced
    assert found["How many r in strawberry?"] == [{"expr": "'strawberry'.count('r')",
                                                    "result": "3"}]
    assert found["Share 1,000 among 8."] == [{"expr": "1,000/8", "result": "125.0"}]


def test_twin_wrong_tool_output_changes_the_forced_tokens(goldens, tokenizer, model,
                                                          monkeypatch):
    meta, _ = goldens
    monkeypatch.setattr(nanochat_chat, "use_calculator", lambda expr: 43)
    case = meta["cases"][0]
    _, tokens, _, _ = run_case(model, tokenizer, meta, case)
    assert tokens != case["tokens"]


def test_twin_forced_queue_ignored_fails(goldens, tokenizer, model, monkeypatch):
    meta, _ = goldens
    monkeypatch.setattr(nanochat_chat.ToolState, "choose",
                        lambda self, sampled: (sampled, False))
    case = meta["cases"][0]
    _, tokens, _, _ = run_case(model, tokenizer, meta, case)
    assert tokens != case["tokens"]


def test_twin_specials_dropped_from_the_expression_change_the_call(tokenizer):
    # the reference decodes an expression with tiktoken, specials as their text: a stray
    # <|user_start|> inside makes it no expression; dropping it would compute "2+3"
    special = tokenizer.special_ids
    expr = [special["<|python_start|>"], *tokenizer.encode("2+"), special["<|user_start|>"],
            *tokenizer.encode("3"), special["<|python_end|>"]]
    state = nanochat_chat.ToolState(tokenizer)
    calls = [state.observe(t) for t in expr]
    assert calls[-1].expr == "2+<|user_start|>3" and calls[-1].result is None
    assert tokenizer.decode(expr[1:-1]) == "2+3"


def test_transcript_text_renders_back_to_the_generated_tokens(goldens, tokenizer, model):
    # the next turn's prompt holds this reply as nanochat's chat_cli keeps it: the generated
    # tokens (forced ones included), then <|assistant_end|>
    meta, _ = goldens
    for case in meta["cases"]:
        reply, tokens, _, _ = run_case(model, tokenizer, meta, case)
        text = tokenizer.decode_with_specials(reply.ids)
        thread = user_turn(case) + [{"role": "assistant", "content": text},
                                    {"role": "user", "content": "ok"}]
        again = prompt_ids(tokenizer, thread)
        assert again[:len(case["prompt"]) + len(tokens)] == case["prompt"] + tokens
    text = "a<|python_start|>1+1<|python_end|><|output_start|>2<|output_end|>b"
    assert assistant_parts(text) == [
        {"type": "text", "text": "a"}, {"type": "python", "text": "1+1"},
        {"type": "python_output", "text": "2"}, {"type": "text", "text": "b"}]


def test_sampled_reply_is_seeded_and_uses_nanochats_sampler(goldens, tokenizer, model):
    meta, _ = goldens
    case = meta["cases"][0]
    settings = SamplingSettings(temperature=0.6, top_k=50)
    runs = [generate_reply(model, tokenizer, case["prompt"], max_tokens=20, settings=settings,
                           seed=seed) for seed in (42, 42)]
    assert runs[0].ids == runs[1].ids and runs[0].sampler == "nanochat"
    penalised = generate_reply(model, tokenizer, case["prompt"], max_tokens=5,
                               settings=SamplingSettings(temperature=0.6,
                                                         repetition_penalty=1.1))
    assert penalised.sampler == "forgebench"


def reference_rows(tensors) -> torch.Tensor:
    return torch.cat([tensors[k] for k in sorted(k for k in tensors if k.startswith("logits/"))])


def test_nanochat_sampler_draws_what_the_reference_draws(goldens):
    # the same fp32 logits rows and the same seeded generator: the reference's
    # sample_next_token draws, one after another (a CPU whose softmax rounded a last bit
    # differently could flip a draw only where the uniform falls within that bit of a bound)
    meta, tensors = goldens
    rows = reference_rows(tensors)
    for setting in meta["sampling"]:
        generator = torch.Generator().manual_seed(setting["seed"])
        draws = [nanochat_chat.nanochat_sample(row, generator, setting["temperature"],
                                               setting["top_k"]) for row in rows]
        assert draws == setting["draws"], setting
        assert len(set(draws)) > 40                                 # the draws do spread


def test_twin_engine_sampler_draws_differently(goldens):
    # llama.cpp's order (engine.sampling: top-k masked over the whole vocabulary, then one
    # draw) is another sampler: the same seed gives other tokens
    from engine.sampling import next_token

    meta, tensors = goldens
    setting = meta["sampling"][0]
    generator = torch.Generator().manual_seed(setting["seed"])
    settings = SamplingSettings(temperature=setting["temperature"], top_k=setting["top_k"])
    draws = [next_token(row, settings, generator) for row in reference_rows(tensors)]
    assert draws != setting["draws"]
