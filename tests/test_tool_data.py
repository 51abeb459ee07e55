"""Tool-call SFT data (engine/llm/tool_data.py) on a tiny Gemma-3 GGUF's tokenizer: the loss
mask supervises the assistant's calls and answers and never a tool result; the default tool
format when the template has none, the template's own when it has one; bad records refused
with their line and field."""

from __future__ import annotations

import copy
import json

import pytest

from engine.errors import ForgebenchError
from engine.eval.tool_calls import call_text
from engine.llm.chat import ChatTemplate
from engine.llm.sft_data import IGNORE_INDEX, SFTKeys, encode_sft_dataset, load_sft_examples
from engine.llm.tool_data import ToolExample, decisions, render_prompt, renders_tool_calls

LOOKUP = {"type": "function", "function": {
    "name": "lookup_part", "description": "Look up current stock for an exact part ID.",
    "parameters": {"type": "object",
                   "properties": {"part_id": {"type": "string", "pattern": "^P-[0-9]{3}$"}},
                   "required": ["part_id"], "additionalProperties": False}}}
OBSERVATION = '{"part_id": "P-101", "stock": 8, "location": "bin A"}'
RECORD = {"tools": [LOOKUP], "messages": [
    {"role": "user", "content": "How many P-101 parts are available?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup_part",
                                          "arguments": {"part_id": "P-101"}}}]},
    {"role": "tool", "name": "lookup_part", "content": OBSERVATION},
    {"role": "assistant", "content": "P-101 has 8 units in bin A."}]}

# A template with its own tool format (Hermes-like, in Gemma's turn markers): it lists the
# tools and prints structured calls; tool results are `tool` turns.
NATIVE = """{{ bos_token }}{% if tools %}<start_of_turn>tools
{% for t in tools %}{{ t.function.name }}: {{ t.function.description }}
{% endfor %}<end_of_turn>
{% endif %}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} \
{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from fixtures_gguf import write_tiny_gguf

    from engine.gguf.reader import open_gguf
    from engine.llm.tokenizer import GGUFTokenizer

    # no SentencePiece space prefix, as in the real Gemma 3 files
    path = write_tiny_gguf(tmp_path_factory.mktemp("base") / "tiny-gemma3.gguf", arch="gemma3",
                           qtype="Q4_K", n_layers=1,
                           metadata={"tokenizer.ggml.add_space_prefix": False})
    gguf_file = open_gguf(path)
    return GGUFTokenizer.from_gguf(gguf_file), ChatTemplate.from_gguf(gguf_file), gguf_file


def write(tmp_path, *records, name="tools.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def supervised_text(sample, tokenizer) -> str:
    """The text of the tokens the loss predicts (label != IGNORE), decoded independently of
    the encoder: the label at position i is the token at i + 1."""
    return text_of([t for t in sample.labels if t != IGNORE_INDEX], tokenizer)


def text_of(ids, tokenizer) -> str:
    """Every token's bytes, special tokens included (decode() drops those)."""
    return b"".join(tokenizer.token_bytes(t) for t in ids).decode("utf-8")


def context_positions_of(sample, tokenizer, text: str) -> list[int]:
    """Positions (in the sequence) of the tokens that spell `text` inside the sample."""
    pieces = [text_of([t], tokenizer) for t in sample.sequence]
    joined = "".join(pieces)
    start = joined.index(text)
    out, offset = [], 0
    for i, piece in enumerate(pieces):
        if offset + len(piece) > start and offset < start + len(text):
            out.append(i)
        offset += len(piece)
    return out


def test_default_format_supervises_calls_and_answers_never_tool_results(tmp_path, tiny):
    tokenizer, template, _ = tiny
    assert not renders_tool_calls(template)          # Gemma's template has no tool format
    examples = load_sft_examples(write(tmp_path, RECORD))
    assert isinstance(examples[0], ToolExample)
    samples, summary = encode_sft_dataset(examples, tokenizer, template, 2000)
    sample = samples[0]
    # what is supervised is exactly the two assistant turns, each closed by <end_of_turn>
    call = call_text("lookup_part", {"part_id": "P-101"})
    assert supervised_text(sample, tokenizer) == \
        f"{call}<end_of_turn>P-101 has 8 units in bin A.<end_of_turn>"
    # the observation is in the input (the answer depends on it) and none of it is a target
    positions = context_positions_of(sample, tokenizer, OBSERVATION)
    assert positions and all(sample.labels[i - 1] == IGNORE_INDEX for i in positions)
    # twin: the same check flags a mask that supervises the observation
    bad = copy.deepcopy(sample)
    for i in positions:
        bad.labels[i - 1] = bad.sequence[i]
    assert OBSERVATION in supervised_text(bad, tokenizer)
    # the default format lists the tool schema in the prompt and wraps the result
    rendered = text_of(sample.sequence, tokenizer)
    assert json.dumps(LOOKUP["function"]) in rendered
    assert f"<tool_response>\n{OBSERVATION}\n</tool_response>" in rendered
    assert summary.supervised_tokens == sample.n_supervised


def test_a_template_with_its_own_tool_format_renders_the_calls_itself(tmp_path, tiny):
    tokenizer, _, gguf_file = tiny
    template = ChatTemplate.from_gguf(gguf_file, template=NATIVE)
    assert renders_tool_calls(template)
    samples, _ = encode_sft_dataset(load_sft_examples(write(tmp_path, RECORD)), tokenizer,
                                    template, 2000)
    assert supervised_text(samples[0], tokenizer) == \
        'CALL lookup_part {"part_id": "P-101"}<end_of_turn>P-101 has 8 units in bin A.<end_of_turn>'
    rendered = text_of(samples[0].sequence, tokenizer)
    assert "<tool_call>" not in rendered and "lookup_part: Look up current stock" in rendered
    assert f"<start_of_turn>tool\n{OBSERVATION}<end_of_turn>" in rendered


def test_held_out_decisions_and_their_prompts(tmp_path, tiny):
    _, template, _ = tiny
    example = load_sft_examples(write(tmp_path, RECORD))[0]
    first, second = decisions(example)
    assert first.expected == {"name": "lookup_part", "arguments": {"part_id": "P-101"}}
    assert second.expected is None and second.context[-1]["role"] == "tool"
    prompt = render_prompt(template, first.context, example.tools)
    assert prompt.endswith("How many P-101 parts are available?<end_of_turn>\n"
                           "<start_of_turn>model\n")
    # a chat transcript keeps a call as text: the template's own format gets it structured
    native = ChatTemplate(NATIVE, bos_token="<bos>")
    text_call = [first.context[0], {"role": "assistant",
                                    "content": call_text("lookup_part", {"part_id": "P-7"})}]
    assert 'CALL lookup_part {"part_id": "P-7"}' in render_prompt(native, text_call,
                                                                   example.tools)


def _with(path: str, value):
    record = copy.deepcopy(RECORD)
    *parents, last = path.split(".")
    target = record
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    if value is KeyError:
        del target[int(last) if last.isdigit() else last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return record


@pytest.mark.parametrize("record, field", [
    (_with("tools", []), "field 'tools'"),
    (_with("tools.0.function.name", ""), "field 'tools[0].function.name'"),
    (_with("tools.0.function.parameters", {"type": "object", "required": "part_id"}),
     "field 'tools[0].function.parameters' is not a valid JSON Schema"),
    (_with("tools.0.function.parameters", {"type": "string"}),
     "field 'tools[0].function.parameters' must be a JSON Schema with type \"object\""),
    (_with("messages.1.tool_calls.0.function.name", "lookup_price"),
     "field 'messages[1].tool_calls[0].function.name' is 'lookup_price', not a tool"),
    (_with("messages.1.tool_calls.0.function.arguments", {"part_id": "101"}),
     "field 'messages[1].tool_calls[0].function.arguments' does not match the schema"),
    (_with("messages.1.tool_calls.0.function.arguments", "{not json"),
     "field 'messages[1].tool_calls[0].function.arguments' is not JSON"),
    (_with("messages.1.tool_calls", KeyError), "field 'messages[2]' is a tool result that "
                                               "follows no tool call"),
    (_with("messages.2.name", "other"), "field 'messages[2].name' is 'other'"),
    (_with("messages.3.content", 7), "field 'messages[3].content' must be a string"),
    (_with("messages.0.role", "robot"), "field 'messages[0].role' is 'robot'"),
    (_with("messages.0.tool_calls", []), "field 'messages[0].tool_calls' is only for assistant"),
])
def test_malformed_tool_records_are_refused_with_line_and_field(tmp_path, record, field):
    path = write(tmp_path, RECORD, record)
    with pytest.raises(ForgebenchError) as caught:
        load_sft_examples(path)
    assert caught.value.where == "line 2" and field in caught.value.message, caught.value
    assert str(path) in str(caught.value)


def test_format_tools_requires_the_tools_list(tmp_path):
    pairs = write(tmp_path, {"instruction": "hi", "response": "hello"})
    assert not isinstance(load_sft_examples(pairs)[0], ToolExample)
    with pytest.raises(ForgebenchError, match="field 'tools' must be a non-empty list"):
        load_sft_examples(pairs, SFTKeys(format="tools"))
