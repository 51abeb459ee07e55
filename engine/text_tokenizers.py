"""Tokenizers for models trained from scratch: raw UTF-8 bytes, or a byte-level BPE trained on
the training split with HF `tokenizers` (or nanochat's, engine/nanochat_tokenizer.py). Each is
saved as JSON beside the checkpoints.

Both map any text to ids and back without loss, so bits per byte are comparable between them.
"""

from __future__ import annotations

import json
from typing import Iterable

from engine.errors import ForgebenchError

SPECIALS = ("<bos>", "<eos>")


class ByteTokenizer:
    """Ids 0-255 are the bytes of the UTF-8 text; 256 is <bos>, 257 is <eos>."""

    kind = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def byte_lengths(self) -> list[int]:
        """UTF-8 bytes each id stands for (0 for the specials)."""
        return [1] * 256 + [0, 0]

    def to_json(self) -> str:
        return json.dumps({"forgebench_tokenizer": "byte", "version": 1}) + "\n"


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation), trained with HF `tokenizers`."""

    kind = "bpe"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.bos_id = tokenizer.token_to_id("<bos>")
        self.eos_id = tokenizer.token_to_id("<eos>")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in (self.bos_id, self.eos_id)])

    def byte_lengths(self) -> list[int]:
        """UTF-8 bytes each id stands for: byte-level BPE spells every byte as one character."""
        specials = {self.bos_id, self.eos_id}
        return [0 if i in specials else len(self.tokenizer.id_to_token(i))
                for i in range(self.vocab_size)]

    def to_json(self) -> str:
        return self.tokenizer.to_str()


def tokenizer_from_json(text: str, source: object = None):
    """Load what `to_json()` wrote."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ForgebenchError(f"tokenizer file is not valid JSON ({exc.msg})", path=source,
                              where=f"line {exc.lineno}") from None
    if data.get("forgebench_tokenizer") == "byte":
        return ByteTokenizer()
    if data.get("forgebench_tokenizer") == "nanochat":
        from engine.nanochat_tokenizer import NanochatTokenizer

        return NanochatTokenizer.from_dict(data, source)
    if (data.get("model") or {}).get("type") == "BPE":
        from tokenizers import Tokenizer

        return BPETokenizer(Tokenizer.from_str(text))
    raise ForgebenchError("not a Forgebench byte, BPE or nanochat tokenizer", path=source,
                          hint="the file should come from a lm-pretrain checkpoint")
