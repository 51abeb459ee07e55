"""A checkpoint's vocabulary as llama.cpp's converter writes it into GGUF metadata.

Two tokenizer kinds, as `convert_hf_to_gguf.py` (llama.cpp, the copy vendored in
llama-cpp-python 0.3.36) reads them:

- SentencePiece (`tokenizer.model`; Llama 2, Gemma 3, and any Llama/Qwen folder that ships one):
  pieces, scores and piece types from the model via the `sentencepiece` package, then
  `added_tokens.json` and `tokenizer_config.json`'s added_tokens_decoder laid over them, padded
  to the config's vocab_size (`_create_vocab_sentencepiece`).
- Byte-level BPE (`tokenizer.json` only; Llama 3, Qwen2/2.5/3): vocab and added tokens through
  the `tokenizers` package; llama.cpp recognises the pre-tokenizer only by the SHA-256 of the
  ids its check text encodes to (`get_vocab_base_pre`), so an unknown one is refused here too,
  naming the hash.

Special token ids, add_bos/add_eos, merges and the chat template come from gguf-py's
SpecialVocab as llama.cpp vendors it (engine/hf/special_vocab.py), the code its converter calls.
"""

from __future__ import annotations

import json
from enum import IntEnum
from hashlib import sha256
from pathlib import Path

import gguf

from engine.errors import ForgebenchError
from engine.hf.special_vocab import SpecialVocab


class PieceType(IntEnum):   # SentencePiece's piece types, as llama.cpp stores them
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# get_vocab_base_pre's check text and the pre-tokenizers of the families converted here
CHECK_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis '
    'concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 '
    'កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български '
    '\'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? '
    '\'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
KNOWN_PRE = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
}


def looks_special(token: str) -> bool:
    """does_token_look_special: added tokens some models leave unmarked."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def sentencepiece_vocab(folder: Path, vocab_size: int | None,
                        tokenizer_config: dict) -> tuple[list[bytes], list[float], list[int]]:
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise ForgebenchError("reading tokenizer.model needs the sentencepiece package",
                              path=folder / "tokenizer.model",
                              hint="pip install sentencepiece") from None
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(folder / "tokenizer.model"))
    except (OSError, RuntimeError) as exc:
        raise ForgebenchError(f"tokenizer.model cannot be read ({exc})",
                              path=folder / "tokenizer.model",
                              hint="download tokenizer.model again") from None
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [int(PieceType.UNUSED)] * n
    for i in range(min(sp.vocab_size(), n)):
        kind = (PieceType.UNKNOWN if sp.IsUnknown(i) else PieceType.CONTROL if sp.IsControl(i)
                else PieceType.UNUSED if sp.IsUnused(i) else PieceType.BYTE if sp.IsByte(i)
                else PieceType.NORMAL)
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode(), sp.GetScore(i), int(kind)
    added = folder / "added_tokens.json"
    if added.is_file():
        for text, i in json.loads(added.read_text(encoding="utf-8")).items():
            if i < n:
                tokens[i], scores[i], types[i] = text.encode(), -1000.0, int(PieceType.USER_DEFINED)
    for key, data in tokenizer_config.get("added_tokens_decoder", {}).items():
        i, text = int(key), data["content"]
        if i >= n:
            continue
        if data.get("special") or looks_special(text):
            types[i] = int(PieceType.CONTROL)
        else:
            text = text.replace("\u2581", " ")
            types[i] = int(PieceType.USER_DEFINED)
        scores[i], tokens[i] = -1000.0, text.encode()
    return tokens, scores, types


def bpe_vocab(folder: Path, vocab_size: int | None) -> tuple[list[str], list[int], str]:
    """get_vocab_base over the `tokenizers` package: tokens, token types, pre-tokenizer name."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise ForgebenchError(f"tokenizer.json cannot be read ({exc})", path=path,
                              hint="download tokenizer.json again") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    n = vocab_size or len(vocab)
    if vocab and max(vocab.values()) >= n:
        raise ForgebenchError(
            f"the tokenizer has token id {max(vocab.values())}, but config.json's vocab_size "
            f"is {n}", path=path, where="vocab_size",
            hint="use the tokenizer that belongs to these weights")
    ids = tok.encode(CHECK_TEXT).ids
    digest = sha256(str(ids).encode()).hexdigest()
    if digest not in KNOWN_PRE:
        raise ForgebenchError(
            f"llama.cpp does not know this tokenizer's pre-tokenizer (hash {digest[:16]}…)",
            path=path, hint="llama.cpp could not run the converted file; supported BPE "
                            "tokenizers: " + ", ".join(sorted(set(KNOWN_PRE.values()))))
    added = tok.get_added_tokens_decoder()
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        token = reverse[i]
        if i in added:
            if not added[i].normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False).ids,
                                   skip_special_tokens=False)
            if added[i].special or looks_special(token):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                types.append(int(gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(token)
    return tokens, types, KNOWN_PRE[digest]


def write_vocab(writer: gguf.GGUFWriter, folder: Path, arch: str, hparams: dict,
                tokenizer_config: dict) -> int:
    """Record the vocabulary on `writer` (a key recorder) as the converter's set_vocab does for
    `arch`; returns the number of tokens."""
    spm = (folder / "tokenizer.model").is_file()
    if arch == "llama" and (add_prefix := tokenizer_config.get("add_prefix_space")) is not None:
        writer.add_add_space_prefix(add_prefix)
    if spm:
        tokens, scores, types = sentencepiece_vocab(folder, hparams.get("vocab_size"),
                                                    tokenizer_config)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)
        if arch == "gemma3":
            writer.add_add_space_prefix(False)
    else:
        tokens, types, pre = bpe_vocab(folder, hparams.get("vocab_size"))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        SpecialVocab(folder, load_merges=True).add_to_gguf(writer)
    if arch == "llama" and hparams.get("vocab_size", 32000) == 49152:
        writer.add_add_bos_token(False)
    return len(tokens)


def real_vocab_size(folder: Path, hparams: dict, tokenizer_config: dict) -> int:
    """Gemma 3's converter drops embedding rows past the tokenizer's real vocabulary."""
    if (folder / "tokenizer.model").is_file():
        return len(sentencepiece_vocab(folder, hparams.get("vocab_size"), tokenizer_config)[0])
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    return len(data["model"]["vocab"]) + len(data["added_tokens"])
