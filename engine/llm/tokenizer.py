"""Tokenizers read from GGUF metadata, token-ID-exact with llama.cpp (its `llama-vocab.cpp`).

Two models cover the supported families:

- `llama` (SentencePiece style, Gemma-3 and Llama-2 style vocabularies): spaces become U+2581,
  adjacent symbols merge by the *score* of the merged piece (highest first, leftmost on ties),
  characters with no piece fall back to `<0xXX>` byte tokens.
- `gpt2` (byte-level BPE, Llama-3 / SmolLM / Qwen2 / Qwen3): the text is split into words by the
  regexes named by `tokenizer.ggml.pre`, each word's UTF-8 bytes are mapped to printable
  characters (GPT-2's byte table) and merged by *rank* (lowest first, leftmost on ties).

Before either runs, special tokens are cut out of the text exactly as llama.cpp's
`tokenizer_st_partition` does: longest token first, every occurrence, control tokens only when
`parse_special` is set, user-defined tokens always.

Token strings are kept as Python `str`; bytes that are not UTF-8 survive as surrogate escapes, so
lookups compare the same byte strings llama.cpp compares.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import IntFlag
from pathlib import Path
from typing import Any, Iterable, Mapping

import regex
from gguf import Keys, TokenType

from engine.errors import ForgebenchError

K = Keys.Tokenizer
SPACE_MARK = "\u2581"  # "▁": SentencePiece's visible space


class Attr(IntFlag):
    """llama.cpp's per-token attributes (llama_token_attr), derived from `token_type`."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


_ATTR_OF_TYPE = {TokenType.NORMAL: Attr.NORMAL, TokenType.UNKNOWN: Attr.UNKNOWN,
                 TokenType.CONTROL: Attr.CONTROL, TokenType.USER_DEFINED: Attr.USER_DEFINED,
                 TokenType.UNUSED: Attr.UNUSED, TokenType.BYTE: Attr.BYTE}

# Texts llama.cpp recognises as end-of-generation (and therefore control) tokens, whatever their
# declared type; and the fill-in-the-middle markers it promotes to control tokens.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["})
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
             "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
             "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
# (metadata key, candidate texts, whether the chosen token ends generation)
FIM_TEXTS = (
    (K.FIM_PRE_ID, ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                    "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>", "<|code_prefix|>",
                    "<|prefix|>"), False),
    (K.FIM_SUF_ID, ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                    "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"), False),
    (K.FIM_MID_ID, ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                    "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"), False),
    (K.FIM_PAD_ID, ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"), True),
    (K.FIM_REP_ID, ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"), True),
    (K.FIM_SEP_ID, ("<|file_sep|>",), True),
)

# Pre-tokenizer word-splitting regexes (llama.cpp `llm_tokenizer_bpe`), applied in order; each
# splits every chunk into its matches and the gaps between them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False    # a word that is itself a token skips the merges
    add_bos: bool = False          # default when the file has no add_bos_token key
    clean_spaces: bool = True      # decode drops the space before . , ? ! and some apostrophes


def _named(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


# tokenizer.ggml.pre -> behaviour, as llama.cpp's vocabulary loader assigns it. Names whose
# llama.cpp handling adds per-token quirks (jina and modern-bert strip rules, solar-open and
# gpt-oss end-of-generation rules) are left out.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_named("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_named("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    **_named("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan",
             PreTokenizer((_QWEN2,), clean_spaces=False)),
    **_named("stablelm2 megrez", PreTokenizer((_QWEN2,))),
    **_named("smollm command-r", PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False)),
    **_named("starcoder refact codeshell exaone minerva-7b mellum2",
             PreTokenizer((r"\p{N}", _GPT2))),
    **_named("gpt-2 phi-2 gigachat a.x-4.0 mellum exaone4 mpt olmo jais", PreTokenizer((_GPT2,))),
    **_named("trillion granite-docling", PreTokenizer((_GPT2,), clean_spaces=False)),
}
SUPPORTED_MODELS = ("llama", "gpt2")


def _byte_table() -> list[str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR = _byte_table()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def _as_str(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class GGUFTokenizer:
    """The tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata."""

    def __init__(self, metadata: Mapping[str, Any], source: str | Path | None = None):
        self.source = source
        model = metadata.get(K.MODEL)
        if model is None:
            raise ForgebenchError("the file has no tokenizer", path=source, where=K.MODEL,
                                  hint="use a GGUF converted with its tokenizer (llama.cpp's "
                                       "convert_hf_to_gguf.py writes one)")
        if model not in SUPPORTED_MODELS:
            raise ForgebenchError(f"unsupported tokenizer model {model!r}", path=source,
                                  where=K.MODEL, hint="supported: " + ", ".join(SUPPORTED_MODELS)
                                  + " (SentencePiece-style and byte-level BPE)")
        self.model = model
        self.is_spm = model == "llama"
        n = self._load_vocab(metadata, source)
        default_bos, default_eos = (self._spm_defaults() if self.is_spm
                                    else self._bpe_setup(metadata, source))
        self.add_space_prefix = bool(metadata.get(K.ADD_PREFIX, self.add_space_prefix))
        self.add_bos = bool(metadata.get(K.ADD_BOS, self.add_bos))
        self.add_eos = bool(metadata.get(K.ADD_EOS, self.add_eos))

        def special(key: str, default: int | None) -> int | None:
            value = metadata.get(key)
            if value is not None and 0 <= int(value) < n:
                return int(value)
            return default if default is not None and default < n else None

        self.bos_id = special(K.BOS_ID, default_bos)
        self.eos_id = special(K.EOS_ID, default_eos)
        self.unk_id = special(K.UNK_ID, self.unk_id)
        self.pad_id = special(K.PAD_ID, None)
        self.eot_id = special(K.EOT_ID, None)
        self.eom_id = special(K.EOM_ID, None)
        self._mark_control_tokens(special)

        # special-token partition order: longest text first, then id (llama.cpp's std::sort
        # leaves equal lengths in an unspecified order; id order is its usual outcome)
        partitioned = Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN
        special_attrs = {a for a in set(self.attrs) if a & partitioned}
        specials = [i for i, a in enumerate(self.attrs) if a in special_attrs]
        specials.sort(key=lambda i: -len(_utf8(self.tokens[i])))
        self._specials = specials
        self._special_first_chars = {self.tokens[i][0] for i in specials}
        self._piece_cache: dict[int, bytes] = {}
        self._word_cache: dict[str, list[int]] = {}

    def _load_vocab(self, metadata: Mapping[str, Any], source) -> int:
        """The token texts, scores, attributes and text -> id map; returns the vocabulary
        size."""
        tokens = metadata.get(K.LIST)
        if not tokens:
            raise ForgebenchError("the tokenizer has no vocabulary", path=source, where=K.LIST)
        n = len(tokens)
        self.tokens = [t if type(t) is str else _as_str(t) for t in tokens]   # str from the reader
        for i in [i for i, t in enumerate(self.tokens) if not t]:
            self.tokens[i] = f"[EMPTY_{i}]"
        self.scores = list(map(float, metadata.get(K.SCORES, [0.0] * n)))
        types = metadata.get(K.TOKEN_TYPE)
        for key, values in ((K.SCORES, self.scores), (K.TOKEN_TYPE, types)):
            if values is not None and len(values) < n:
                raise ForgebenchError(f"{len(values)} entries for {n} tokens", path=source,
                                      where=key, hint="the file is corrupt; convert it again")
        if types is None:
            self.attrs = [Attr.NORMAL] * n
        else:                       # a handful of distinct types: map each once, not per token
            attr_of = {t: _ATTR_OF_TYPE.get(int(t), Attr.UNDEFINED) for t in set(types[:n])}
            self.attrs = list(map(attr_of.__getitem__, types[:n]))
        self.token_to_id = dict(zip(self.tokens, range(n)))  # last duplicate wins
        return n

    # llama.cpp's defaults per model, each overridden by the file's keys (`__init__`)
    def _spm_defaults(self) -> tuple[int, int]:
        """SentencePiece: a space prefix, <s>=1, </s>=2, <unk>=0; returns (bos, eos)."""
        self.pre = None
        self.pre_name = "default"
        self.add_space_prefix, self.clean_spaces = True, False
        self.unk_id = 0
        self.add_bos, self.add_eos = True, False
        return 1, 2

    def _bpe_setup(self, metadata: Mapping[str, Any], source) -> tuple[int, int]:
        """Byte-level BPE: the pre-tokenizer the file names and the merge ranks; returns the
        default (bos, eos)."""
        self.pre_name = metadata.get(K.PRE, "")
        if self.pre_name not in PRE_TOKENIZERS:
            raise ForgebenchError(
                f"unsupported pre-tokenizer {self.pre_name or '(missing)'!r}", path=source,
                where=K.PRE, hint="supported: the Llama-3, Qwen2/3, SmolLM, GPT-2 and "
                "StarCoder families (engine.llm.tokenizer.PRE_TOKENIZERS lists the names)")
        self.pre = PRE_TOKENIZERS[self.pre_name]
        self._word_res = [regex.compile(r) for r in self.pre.regexes]
        merges = metadata.get(K.MERGES)
        if merges is None:
            raise ForgebenchError("byte-level BPE tokenizer without merges", path=source,
                                  where=K.MERGES, hint="the file is incomplete; convert again")
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            merge = _as_str(merge)
            cut = merge.find(" ", 1)
            pair = (merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", "")
            self.ranks.setdefault(pair, rank)
        self.add_space_prefix, self.clean_spaces = False, self.pre.clean_spaces
        self.unk_id = None
        self.add_bos, self.add_eos = self.pre.add_bos, False
        return 11, 11

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], source=None) -> GGUFTokenizer:
        return cls(metadata, source)

    @classmethod
    def from_gguf(cls, gguf_file) -> GGUFTokenizer:
        """From an open `GGUFFile` (engine.gguf.reader), a path to a .gguf, or a metadata dict."""
        if isinstance(gguf_file, Mapping):
            return cls(gguf_file)
        if isinstance(gguf_file, (str, Path)):
            from engine.gguf.reader import open_gguf
            gguf_file = open_gguf(gguf_file)
        return cls(gguf_file.metadata, gguf_file.path)

    def _mark_control_tokens(self, special) -> None:
        """llama.cpp promotes end-of-generation and fill-in-the-middle markers to control tokens
        by their text, and collects the end-of-generation set."""
        eog: set[int] = set()
        if self.eot_id is None:
            self.eot_id = self._first_of(EOT_TEXTS)
        for key, texts, ends_generation in FIM_TEXTS:
            token = special(key, None)
            if token is None:
                token = self._first_of(texts)
                if token is not None:
                    self.attrs[token] |= Attr.CONTROL
            if token is not None and ends_generation:
                eog.add(token)
        for text in EOG_TEXTS:
            token = self.token_to_id.get(text)
            if token is not None:
                eog.add(token)
                self.attrs[token] |= Attr.CONTROL
        eog.update(t for t in (self.eos_id, self.eot_id, self.eom_id) if t is not None)
        self.eog_ids = frozenset(eog)

    def _first_of(self, texts: Iterable[str]) -> int | None:
        found = [self.token_to_id[t] for t in texts if t in self.token_to_id]
        return min(found) if found else None

    # -- properties -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def eot_ids(self) -> tuple[int, ...]:
        """Tokens that end generation (llama.cpp's EOG set), ascending."""
        return tuple(sorted(self.eog_ids))

    def is_control(self, token: int) -> bool:
        return bool(self.attrs[token] & (Attr.CONTROL | Attr.UNKNOWN))

    # -- encoding -------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        `add_special` adds BOS/EOS where the file's add_bos/add_eos flags ask for them;
        `parse_special` lets control-token texts such as `<start_of_turn>` become those tokens
        (user-defined tokens are always matched).
        """
        fragments = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self._require(self.bos_id, K.BOS_ID))
        if self.is_spm:
            after_special = True
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    after_special = True
                else:
                    if self.add_space_prefix and after_special:
                        fragment = " " + fragment
                    out.extend(self._spm(fragment.replace(" ", SPACE_MARK)))
                    after_special = False
        else:
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                else:
                    out.extend(self._bpe(fragment))
        if add_special and self.add_eos:
            out.append(self._require(self.eos_id, K.EOS_ID))
        return out

    def _require(self, token: int | None, key: str) -> int:
        if token is None:
            raise ForgebenchError("the tokenizer asks for this special token but has none",
                                  path=self.source, where=key)
        return token

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of the text; plain-text fragments stay strings."""
        fragments: list[str | int] = [text]
        present = self._special_first_chars.intersection(text)
        if not present:
            return fragments
        for token in self._specials:
            piece = self.tokens[token]
            if piece[0] not in present or piece not in text:
                continue
            if not parse_special and self.attrs[token] & (Attr.CONTROL | Attr.UNKNOWN):
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or piece not in fragment:
                    split.append(fragment)
                    continue
                parts = fragment.split(piece)
                for k, part in enumerate(parts):
                    if k:
                        split.append(token)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _spm(self, text: str) -> list[int]:
        """SentencePiece-style merging by piece score (llama.cpp `llm_tokenizer_spm_session`)."""
        n = len(text)
        if n == 0:
            return []
        start = list(range(n))      # symbol i covers text[start[i]:start[i] + length[i]]
        length = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        vocab, scores = self.token_to_id, self.scores
        queue: list[tuple[float, int, int, int]] = []   # (-score, left, right, merged length)

        def try_pair(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            piece = text[start[left]:start[left] + length[left] + length[right]]
            token = vocab.get(piece)
            if token is not None:
                heapq.heappush(queue, (-scores[token], left, right, len(piece)))

        for i in range(1, n):
            try_pair(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue
            length[left] += length[right]
            length[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_pair(prev[left], left)
            try_pair(left, nxt[left])

        out: list[int] = []
        i = 0
        while i != -1:
            piece = text[start[i]:start[i] + length[i]]
            token = vocab.get(piece)
            if token is not None:
                out.append(token)
            else:   # a merged piece is always in the vocabulary: this is one unknown character
                out.extend(self._byte_token(b) for b in _utf8(piece))
            i = nxt[i]
        return out

    def _byte_token(self, byte: int) -> int:
        token = self.token_to_id.get(f"<0x{byte:02X}>")
        if token is None:
            token = self.token_to_id.get(bytes([byte]).decode("utf-8", "surrogateescape"))
        if token is None:
            raise ForgebenchError(f"the vocabulary has no byte-fallback token <0x{byte:02X}>",
                                  path=self.source, where=K.LIST,
                                  hint="this text cannot be tokenized with this model")
        return token

    def _bpe(self, text: str) -> list[int]:
        chunks = [text]
        for word_re in self._word_res:
            split = []
            for chunk in chunks:
                pos = 0
                for m in word_re.finditer(chunk):
                    if m.start() > pos:
                        split.append(chunk[pos:m.start()])
                    if m.end() > m.start():
                        split.append(m.group())
                    pos = m.end()
                if pos < len(chunk):
                    split.append(chunk[pos:])
            chunks = split
        out: list[int] = []
        for chunk in chunks:
            word = "".join(BYTE_TO_CHAR[b] for b in _utf8(chunk))
            ids = self._word_cache.get(word)
            if ids is None:
                ids = self._word_cache[word] = self._bpe_word(word)
            out.extend(ids)
        return out

    def _bpe_word(self, word: str) -> list[int]:
        """Merge one byte-mapped word by rank (llama.cpp `llm_tokenizer_bpe_session`)."""
        if self.pre.ignore_merges and word in self.token_to_id:
            return [self.token_to_id[word]]
        ranks = self.ranks
        symbols = list(word)        # "" once merged into its left neighbour
        prev = list(range(-1, len(word) - 1))
        nxt = list(range(1, len(word) + 1))
        nxt[-1] = -1
        queue: list[tuple[int, int, int, str]] = []   # (rank, left, right, merged text)

        def try_pair(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                rank = ranks.get((symbols[left], symbols[right]))
                if rank is not None:
                    heapq.heappush(queue, (rank, left, right, symbols[left] + symbols[right]))

        for i in range(1, len(word)):
            try_pair(i - 1, i)
        while queue:
            _, left, right, merged = heapq.heappop(queue)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
                continue                                 # outdated by an earlier merge
            symbols[left], symbols[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_pair(prev[left], left)
            try_pair(left, nxt[left])
        out = []
        for symbol in filter(None, symbols):
            token = self.token_to_id.get(symbol)
            if token is not None:
                out.append(token)
                continue
            for byte in _utf8(symbol):   # llama.cpp looks each raw byte up; most are not tokens
                token = self.token_to_id.get(bytes([byte]).decode("utf-8", "surrogateescape"))
                if token is not None:
                    out.append(token)
        return out

    # -- decoding -------------------------------------------------------------------------------

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, control tokens rendered as their text."""
        piece = self._piece_cache.get(token)
        if piece is None:
            piece = self._piece_cache[token] = self._render_piece(token)
        return piece

    def _render_piece(self, token: int) -> bytes:
        text, attr = self.tokens[token], self.attrs[token]
        if attr & (Attr.CONTROL | Attr.UNKNOWN | Attr.USER_DEFINED):
            return _utf8(text)
        if attr & Attr.NORMAL:
            if self.is_spm:
                return _utf8(text.replace(SPACE_MARK, " "))
            out = bytearray()
            for ch in text:
                if ch in CHAR_TO_BYTE:
                    out.append(CHAR_TO_BYTE[ch])
                else:   # llama.cpp's marker for a character outside the byte table
                    out += b"[UNK_BYTE_0x" + _utf8(ch).hex().encode() + _utf8(text) + b"]"
            return bytes(out)
        if attr & Attr.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    def token_piece(self, token: int) -> str:
        """Readable text of one token; a partial UTF-8 sequence shows as `\\xNN` escapes."""
        return self.token_bytes(token).decode("utf-8", "backslashreplace")

    def decode_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        """llama.cpp's `llama_detokenize(ids, remove_special=False, unparse_special=special)`."""
        strip_space = self.add_space_prefix
        parts = []
        for token in ids:
            token = int(token)
            piece = b"" if not special and self.is_control(token) else self.token_bytes(token)
            if strip_space and piece.startswith(b" "):
                piece = piece[1:]
            strip_space = False
            parts.append(piece)
        text = b"".join(parts)
        return _clean_spaces(text) if self.clean_spaces else text

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of `ids`; control tokens (BOS, `<end_of_turn>`…) are shown only with `special`."""
        return self.decode_bytes(ids, special).decode("utf-8", "replace")

    def describe(self) -> dict:
        """A summary for reports: model, pre-tokenizer, size, special ids and flags."""
        return {"model": self.model, "pre": self.pre_name, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "eot_ids": list(self.eot_ids),
                "add_bos": self.add_bos, "add_eos": self.add_eos,
                "add_space_prefix": self.add_space_prefix}


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's three `clean_spaces` detokenizer passes, byte for byte: " ?" " !" " ." " ,"
    lose their space; a lone " ' " loses both; " 's" " 'm" " 're" " 've" lose theirs."""
    space, quote = ord(" "), ord("'")
    src, out = text, bytearray(text[:1])
    for i in range(1, len(src)):
        if src[i - 1] == space and src[i] in b"?!.,":
            out.pop()
        out.append(src[i])
    src, out = bytearray(out), bytearray(out[:1])
    i = 1
    while i < len(src):
        x = src[i]
        if x == quote and i + 1 < len(src) and src[i - 1] == space and src[i + 1] == space:
            out.pop()
            i += 1
            src[i] = 0          # the skipped space is what the next step sees as its left side
        out.append(x)
        i += 1
    src, out = bytes(out), bytearray(out[:1])
    for i in range(1, len(src)):
        if src[i - 1] == space and src[i] == quote and i + 1 < len(src):
            after = src[i + 1:i + 3]
            if after[:1] in (b"s", b"m") or after in (b"re", b"ve"):
                out.pop()
        out.append(src[i])
    return bytes(out)
