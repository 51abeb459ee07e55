"""SFT data pipeline: the seed's worked examples (next-token shift with prompt masking; the BPE
merge that concatenating texts would make across the prompt/reply boundary), multi-turn masking
through the chat template, truncation policies with counts, malformed lines, `inspect-sft`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import Keys
from test_tokenizer import bpe_vocab, spm_vocab, write_vocab_gguf

from engine.errors import ForgebenchError
from engine.llm.chat import ChatTemplate
from engine.llm.sft_data import (
    IGNORE_INDEX,
    SFTExample,
    SFTKeys,
    encode_sft,
    encode_sft_dataset,
    load_sft_examples,
    mark_supervised,
    split_rendered,
)
from engine.llm.tokenizer import BYTE_TO_CHAR, GGUFTokenizer

K = Keys.Tokenizer
ARCH = Keys.General.ARCHITECTURE
ROOT = Path(__file__).resolve().parents[1]
I = IGNORE_INDEX
PLAIN = ChatTemplate("{{ messages[0].content }}{{ messages[1].content }}<|im_end|>")


def example(*turns: tuple[str, str], line: int = 1) -> SFTExample:
    return SFTExample([{"role": r, "content": c} for r, c in turns], line, "data.jsonl")


def test_seed_worked_example_shift_and_mask():
    """Seed 000 §15.5: prompt [10, 11, 12], response [20] + stop marker [21] ->
    inputs [10, 11, 12, 20], labels [ignore, ignore, 20, 21]."""
    tokens = [f"<unused{i}>" for i in range(22)]
    tokens[10:13] = ["p", "q", "r"]
    tokens[20:22] = ["X", "<|im_end|>"]
    types = [3] * 22
    types[10:13] = [1, 1, 1]
    types[20] = 1
    tok = GGUFTokenizer.from_metadata({K.MODEL: "llama", K.LIST: tokens, K.TOKEN_TYPE: types,
                                       K.ADD_PREFIX: False, K.ADD_BOS: False})
    sample = encode_sft(example(("user", "pqr"), ("assistant", "X")), tok, PLAIN, max_len=16)
    assert sample.input_ids == [10, 11, 12, 20]
    assert sample.labels == [I, I, 20, 21]
    assert sample.n_supervised == 2 and not sample.truncated


def test_reply_is_encoded_apart_from_the_prompt():
    """Seed 000 §15.5's toy vocabulary: "a", "b", "ab" with the merge "a b". The prompt ends in
    "a", the reply starts with "b": encoding the joined text fuses them into "ab" and there is
    no token where the reply starts; encoding the parts keeps the boundary."""
    chars = [BYTE_TO_CHAR[b] for b in range(256)]
    tokens = chars + ["ab", "<|im_end|>"]
    tok = GGUFTokenizer.from_metadata({
        K.MODEL: "gpt2", K.PRE: "qwen2", K.LIST: tokens, K.MERGES: ["a b"],
        K.TOKEN_TYPE: [1] * 257 + [3], K.ADD_BOS: False, K.EOS_ID: 257})
    a, b, x, ab, end = ord("a"), ord("b"), ord("x"), 256, 257
    assert tok.encode("xab<|im_end|>") == [x, ab, end]           # the merge eats the boundary
    sample = encode_sft(example(("user", "xa"), ("assistant", "b")), tok, PLAIN, max_len=16)
    assert sample.sequence == [x, a, b, end]
    assert sample.labels == [I, b, end]


@pytest.fixture(scope="module")
def gemma_like():
    """SentencePiece fixture vocabulary rendered with the built-in Gemma template."""
    meta = {**spm_vocab(add_space_prefix=False), ARCH: "gemma3"}
    return meta, GGUFTokenizer.from_metadata(meta), ChatTemplate.from_gguf(meta)


def test_multi_turn_supervises_assistant_turns_and_end_of_turn(gemma_like):
    _, tok, template = gemma_like
    ex = example(("system", "Be brief."), ("user", "Who are you?"), ("assistant", "The fox."),
                 ("user", "And the dog?"), ("assistant", "It sleeps."))
    sample = encode_sft(ex, tok, template, max_len=512)
    # every token together is the rendered conversation
    rendered = template(ex.messages, add_generation_prompt=False)
    assert tok.decode(sample.sequence, special=True) == rendered
    # supervised: each reply and the <end_of_turn> closing it; nothing else
    end = tok.token_to_id["<end_of_turn>"]
    spans, span = [], []
    for token, label in zip(sample.sequence[1:], sample.labels):
        if label != I:
            assert label == token
            span.append(token)
        elif span:
            spans.append(span)
            span = []
    assert [tok.decode(s, special=True) for s in spans] == ["The fox.<end_of_turn>",
                                                             "It sleeps.<end_of_turn>"]
    assert all(s[-1] == end for s in spans)
    # the prompt is what generation will be prompted with
    texts, replies = split_rendered(ex, template)
    assert texts[0] == template(ex.messages[:2], add_generation_prompt=True)
    assert replies == ["The fox.", "It sleeps."]


def test_marked_text_shows_whole_characters(gemma_like):
    _, tok, template = gemma_like
    sample = encode_sft(example(("user", "Ünï?"), ("assistant", "日 ok")), tok, template, 64)
    assert [tok.tokens[t] for t in sample.sequence if tok.tokens[t].startswith("<0x")]
    assert mark_supervised(sample, tok) == ("<s><start_of_turn>user\nÜnï?<end_of_turn>\n"
                                            "<start_of_turn>model\n⟦日 ok<end_of_turn>⟧\n")


def test_qwen3_think_off_prompt_matches_inference(tmp_path):
    meta = {**bpe_vocab("qwen2")[0], ARCH: "qwen3"}
    tok = GGUFTokenizer.from_metadata(meta)
    template = ChatTemplate.from_gguf(meta, enable_thinking=False)
    ex = example(("user", "Say hi"), ("assistant", "hi"))
    texts, _ = split_rendered(ex, template)
    assert texts[0] == template(ex.messages[:1]) and texts[0].endswith("<think>\n\n</think>\n\n")
    sample = encode_sft(ex, tok, template, max_len=64)
    supervised = [label for label in sample.labels if label != I]
    assert tok.decode(supervised, special=True) == "hi<|im_end|>"


def test_truncation_policies_and_counts(gemma_like):
    _, tok, template = gemma_like
    short = example(("user", "Hi"), ("assistant", "Yes."), line=1)
    long = example(("user", "Hi"), ("assistant", "The quick brown fox jumps over the lazy dog."),
                   line=2)
    full = encode_sft(long, tok, template, max_len=1000)
    limit = len(full.input_ids) - 5
    with pytest.raises(ForgebenchError, match="longer than max_len") as err:
        encode_sft(long, tok, template, max_len=limit)
    assert err.value.where == "line 2" and err.value.path == "data.jsonl"
    cut = encode_sft(long, tok, template, max_len=limit, truncation="truncate_response")
    assert cut.truncated and len(cut.input_ids) == len(cut.labels) == limit
    assert cut.input_ids == full.input_ids[:limit] and cut.labels == full.labels[:limit]
    assert encode_sft(long, tok, template, max_len=limit, truncation="drop") is None

    samples, summary = encode_sft_dataset([short, long], tok, template, limit, "drop")
    assert [s.line for s in samples] == [1]
    assert (summary.examples, summary.kept, summary.dropped, summary.truncated) == (2, 1, 1, 0)
    assert summary.dropped_lines == [2] and summary.supervised_tokens == samples[0].n_supervised
    samples, summary = encode_sft_dataset([short, long], tok, template, limit, "truncate_response")
    assert (summary.kept, summary.truncated) == (2, 1)
    assert summary.input_tokens == sum(len(s.input_ids) for s in samples)

    prompt_only = len(encode_sft(short, tok, template, 1000).input_ids) - 4
    with pytest.raises(ForgebenchError, match="leaves nothing to learn"):
        encode_sft(short, tok, template, max_len=prompt_only - 1, truncation="truncate_response")


def test_conversation_the_template_refuses_names_the_line(gemma_like):
    _, tok, template = gemma_like
    ex = example(("user", "a"), ("tool", "x"), ("assistant", "b"), line=7)
    with pytest.raises(ForgebenchError, match="alternate") as err:
        encode_sft(ex, tok, template, 64)
    assert err.value.where == "line 7" and err.value.path == "data.jsonl"


def test_template_that_rewrites_replies_is_refused(gemma_like):
    _, tok, _ = gemma_like
    rewriting = ChatTemplate("{% for m in messages %}{{ m.content | replace('x', 'y') }}"
                             "{% endfor %}")
    with pytest.raises(ForgebenchError, match="rewrites assistant replies"):
        encode_sft(example(("user", "a"), ("assistant", "box")), tok, rewriting, 64)
    hiding = ChatTemplate("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(ForgebenchError, match="does not print each assistant reply"):
        encode_sft(example(("user", "a"), ("assistant", "b")), tok, hiding, 64)


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
                    encoding="utf-8")
    return path


def test_loading_pairs_and_messages(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [
        {"instruction": "Hi", "response": "Ahoy"},
        "",
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                      {"role": "tool", "content": "t"}, {"role": "assistant", "content": "b"}]},
        {"instruction": "x", "response": "y", "system": "Talk like a pirate."},
    ])
    examples = load_sft_examples(path, system="Default.")
    assert [e.line for e in examples] == [1, 3, 4]
    assert examples[0].messages == [{"role": "system", "content": "Default."},
                                    {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Ahoy"}]
    assert examples[2].messages[0] == {"role": "system", "content": "Talk like a pirate."}
    assert [m["role"] for m in examples[1].messages] == ["system", "user", "assistant", "tool",
                                                         "assistant"]
    custom = write_lines(tmp_path / "c.jsonl", [{"prompt": "p", "completion": "c"}])
    keys = SFTKeys(instruction_key="prompt", response_key="completion")
    assert load_sft_examples(custom, keys)[0].messages[1] == {"role": "assistant", "content": "c"}


@pytest.mark.parametrize("bad,line,message", [
    ('{"instruction": "a", "response": ', 2, "malformed JSON"),
    ('["a", "b"]', 2, "expected a JSON object"),
    ({"instruction": "a"}, 2, "missing field 'response'"),
    ({"instruction": "a", "response": 3}, 2, "field 'response' must be a string"),
    ({"messages": []}, 2, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 2, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}]}, 2, "no assistant turn"),
])
def test_malformed_lines_are_refused_with_their_number(tmp_path, bad, line, message):
    path = write_lines(tmp_path / "d.jsonl", [{"instruction": "ok", "response": "fine"}, bad])
    with pytest.raises(ForgebenchError) as err:
        load_sft_examples(path)
    assert err.value.where == f"line {line}" and err.value.path == str(path)
    assert message in err.value.message


def test_text_sft_dataset_folder(tmp_path):
    from engine.data.generators.text import generate_pirate

    root = generate_pirate(tmp_path / "pirate")
    examples = load_sft_examples(root, split="train")
    assert len(examples) == 5 and examples[0].where.startswith("record ")
    assert examples[0].messages[0]["role"] == "user"


def test_inspect_sft_cli(tmp_path, gemma_like, capsys):
    meta, tok, _ = gemma_like
    write_vocab_gguf(tmp_path / "model.gguf", meta)   # the config names it relatively
    data = write_lines(tmp_path / "data.jsonl", [
        {"instruction": "Who are you?", "response": "The fox."},
        {"instruction": "Hi", "response": "The quick brown fox jumps over the lazy dog. " * 4}])
    config = tmp_path / "sft.toml"
    config.write_text('recipe = "lm-sft"\n[model]\ngguf = "model.gguf"\n'
                      '[data]\npath = "data.jsonl"\nmax_len = 40\n'
                      'truncation = "truncate_response"\n')
    run = [sys.executable, "-m", "engine", "inspect-sft", str(config)]
    out = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "⟦The fox.<end_of_turn>⟧" in out.stdout
    assert "2 examples: 2 kept, 1 truncated, 0 dropped" in out.stdout
    # the same command in-process: JSON output, and a bad line's exit code and message
    from engine.cli import main
    assert main(["inspect-sft", str(config), "--json", "-n", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["template"] == "built-in gemma template" and len(report["samples"]) == 1
    first = report["samples"][0]
    ex = load_sft_examples(data)[0]
    expected = encode_sft(ex, tok, ChatTemplate.from_gguf(meta, enable_thinking=False), 40)
    assert first["input_ids"] == expected.input_ids and first["labels"] == expected.labels

    write_lines(data, [{"instruction": "Hi", "response": "ok"}, '{"instruction": 1}'])
    assert main(["inspect-sft", str(config)]) == 2
    assert "data.jsonl: line 2" in capsys.readouterr().err

@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma3_270m_samples_are_llamacpp_tokens(tmp_path):
    """On the real Gemma-3-270m file (which has no chat template): every sample of the pirate
    set is llama.cpp's tokens of the rendered prompt, then of the reply, then of the closing
    template text; the supervised tokens are the reply and <end_of_turn>."""
    from llama_cpp import Llama
    from test_tokenizer import gemma_gguf_path

    from engine.data.generators.text import generate_pirate
    from engine.gguf.reader import open_gguf

    gguf_file = open_gguf(gemma_gguf_path())
    tok = GGUFTokenizer.from_gguf(gguf_file)
    template = ChatTemplate.from_gguf(gguf_file, enable_thinking=False)
    assert template.origin == "built-in gemma template"
    llm = Llama(model_path=str(gguf_file.path), vocab_only=True, verbose=False)
    examples = load_sft_examples(generate_pirate(tmp_path / "pirate"), split="train")
    samples, summary = encode_sft_dataset(examples, tok, template, max_len=256)
    assert summary.kept == len(examples) == 5
    for ex, sample in zip(examples, samples):
        (prompt, after), (reply,) = split_rendered(ex, template)
        assert prompt.startswith("<bos><start_of_turn>user\n") and after == "<end_of_turn>\n"
        expected = (llm.tokenize(prompt.encode(), add_bos=False, special=True)
                    + llm.tokenize(reply.encode(), add_bos=False, special=False)
                    + llm.tokenize(after.encode(), add_bos=False, special=True))
        assert sample.sequence == expected
        supervised = [label for label in sample.labels if label != I]
        assert tok.decode(supervised, special=True) == reply + "<end_of_turn>"
