"""Chat templates: built-in family templates against hand-written renderings and llama.cpp's own
built-in formats; GGUF templates against llama-cpp-python's Jinja2 formatter; the sandbox."""

from __future__ import annotations

import ctypes

import pytest
from gguf import Keys

from engine.errors import ForgebenchError
from engine.llm.chat import ChatTemplate, encode_prompt, render_chat
from engine.llm.tokenizer import GGUFTokenizer

K = Keys.Tokenizer
ARCH = Keys.General.ARCHITECTURE

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]


def meta(arch: str, tokens=("<pad>", "<eos>", "<bos>"), **extra) -> dict:
    return {ARCH: arch, K.LIST: list(tokens), K.BOS_ID: 2, K.EOS_ID: 1, **extra}


def test_gemma_builtin_worked_example():
    text = render_chat(meta("gemma3"), CONVERSATION)
    assert text == ("<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    # without a generation prompt the text ends with the last turn; replies are trimmed
    assert render_chat(meta("gemma3"), [{"role": "user", "content": "  x \n"}],
                       add_generation_prompt=False) == "<bos><start_of_turn>user\nx<end_of_turn>\n"


def test_family_detection():
    assert ChatTemplate.from_gguf(meta("gemma3")).origin == "built-in gemma template"
    assert ChatTemplate.from_gguf(meta("qwen2")).origin == "built-in chatml template"
    assert ChatTemplate.from_gguf(meta("qwen3")).origin == "built-in qwen3 template"
    llama3 = meta("llama", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"))
    assert ChatTemplate.from_gguf(llama3).origin == "built-in llama3 template"
    smollm = meta("llama", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert ChatTemplate.from_gguf(smollm).origin == "built-in chatml template"
    own = ChatTemplate.from_gguf(meta("gemma3", **{K.CHAT_TEMPLATE: "{{ messages[0].content }}"}))
    assert own.origin == K.CHAT_TEMPLATE and own(CONVERSATION) == "You are terse."
    given = ChatTemplate.from_gguf(meta("gemma3"), template="{{ bos_token }}{{ eos_token }}")
    assert given.origin == "given template" and given(CONVERSATION) == "<bos><eos>"


def test_qwen3_thinking_switch():
    qwen3 = ChatTemplate.from_gguf(meta("qwen3"))
    history = CONVERSATION + [{"role": "assistant", "content": "4"}]
    on = qwen3(CONVERSATION)
    off = qwen3(CONVERSATION, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"
    assert ChatTemplate.from_gguf(meta("qwen3"), enable_thinking=False)(CONVERSATION) == off
    # the last reply carries its (empty) think block, an earlier one does not: training text
    # of the last turn is the think-off prompt followed by the reply
    full = qwen3(history, add_generation_prompt=False)
    assert full == off + "4<|im_end|>\n"
    assert "<|im_start|>assistant\nHello.<|im_end|>" in full


def test_chatml_groups_tool_results():
    chat = [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "21C"}]
    assert render_chat(meta("qwen2"), chat) == (
        "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n"
        "</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_template_environment_like_transformers():
    """trim_blocks/lstrip_blocks, loop controls, namespace, tojson keeping non-ASCII,
    strftime_now, {% generation %}: rendered by hand."""
    source = """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ ns.n }}] {{ m.role }}: {% generation %}{{ m.content }}{% endgeneration %}
{% endfor %}
{{ messages[-1] | tojson }}{{ strftime_now('%Y') | length }}"""
    text = ChatTemplate(source)([{"role": "system", "content": "s"},
                                 {"role": "user", "content": "héllo"}])
    # trim_blocks eats the newline after {% endgeneration %} as after any block tag
    assert text == '[1] user: héllo{"role": "user", "content": "héllo"}4'


def test_untrusted_template_is_sandboxed():
    for source in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.append(1) }}"):
        with pytest.raises(ForgebenchError, match="unsafe"):
            ChatTemplate(source)(CONVERSATION)


def test_template_errors_are_forgebench_errors():
    with pytest.raises(ForgebenchError, match="alternate") as err:
        render_chat(meta("gemma3"), [{"role": "user", "content": "a"},
                                     {"role": "user", "content": "b"}])
    assert err.value.where == "built-in gemma template line 12"   # the raise_exception line
    with pytest.raises(ForgebenchError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ForgebenchError) as err:
        ChatTemplate.from_gguf(meta("phi3"))
    assert err.value.where == K.CHAT_TEMPLATE and "phi3" in err.value.message


def test_encode_prompt_adds_bos_once():
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "\u2581", "x"]
    tok = GGUFTokenizer.from_metadata({K.MODEL: "llama", K.LIST: tokens, K.ADD_PREFIX: False,
                                       K.TOKEN_TYPE: [2, 3, 3, 3, 1, 1]})
    assert encode_prompt(tok, "<s><start_of_turn>x") == [1, 3, 5]
    assert encode_prompt(tok, "<start_of_turn>x") == [1, 3, 5]


# --------------------------------------------------------------------------------------------
# llama.cpp's own renderers as references

def llamacpp_builtin(name: str, messages: list[dict], add_ass: bool) -> str:
    import llama_cpp
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode())
          for m in messages])
    buf = ctypes.create_string_buffer(8192)
    n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages), add_ass, buf,
                                            len(buf))
    assert 0 < n <= len(buf)
    return buf.raw[:n].decode()


@pytest.mark.llamacpp
@pytest.mark.parametrize("family,arch,prefix", [("gemma", "gemma3", "<bos>"),
                                                ("chatml", "qwen2", ""),
                                                ("llama3", "llama", "<bos>")])
def test_builtins_match_llamacpp_formats(family, arch, prefix):
    """llama.cpp's built-in formats leave BOS to the tokenizer; ours print it like the
    templates shipped with these models do."""
    tokens = ("<pad>", "<eos>", "<bos>", "<|start_header_id|>") if family == "llama3" else \
        ("<pad>", "<eos>", "<bos>")
    template = ChatTemplate.from_gguf(meta(arch, tokens))
    assert template.origin == f"built-in {family} template"
    chats = [CONVERSATION, CONVERSATION[1:], CONVERSATION + [{"role": "assistant", "content": "4"}]]
    for chat in chats:
        for add_ass in (True, False):
            assert template(chat, add_generation_prompt=add_ass) == \
                prefix + llamacpp_builtin(family, chat, add_ass)


@pytest.mark.llamacpp
def test_gguf_template_matches_llama_cpp_python_formatter():
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    source = ("{{ bos_token }}{% for message in messages %}\n"
              "  {% if message['role'] == 'user' %}\n"
              "<|user|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
              "  {% elif message['role'] == 'assistant' %}\n"
              "<|assistant|>\n{{ message['content'] }}{{ eos_token }}\n"
              "  {% else %}\n<|{{ message['role'] }}|>\n{{ message['content'] }}\n  {% endif %}\n"
              "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    ours = ChatTemplate.from_gguf(meta("llama", ("<unk>", "</s>", "<s>"),
                                       **{K.CHAT_TEMPLATE: source}))
    reference = Jinja2ChatFormatter(template=source, eos_token="</s>", bos_token="<s>")
    for chat in (CONVERSATION, CONVERSATION[:3]):
        assert ours(chat) == reference(messages=chat).prompt
