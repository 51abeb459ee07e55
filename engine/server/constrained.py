"""`response_format` by constrained decoding: at every step only the tokens that keep the
output a valid prefix of a JSON document matching the schema may be chosen, and the end of
generation only once the document is complete, so the reply always parses and validates.

The schema-to-token-mask engine is llguidance (guidance-ai's Rust library, the one llama.cpp
can build with; a dependency-free wheel): it compiles the JSON schema to a grammar and
computes, for the model's vocabulary, the mask of allowed tokens at each position. The
vocabulary it sees is the GGUF tokenizer's own bytes per token (control tokens marked with a
0xFF prefix, as llguidance's llama.cpp binding marks them, so they are never produced inside
the JSON) and its end-of-generation tokens.
"""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import numpy as np
import torch

from engine.server.requests import RequestError

_LOCK = threading.Lock()


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer) -> None:
        # llguidance tokenizes pieces of the output, never a text's start: no SentencePiece
        # space prefix (it would make "{" come out as " {")
        self.tokenizer = copy.copy(tokenizer)
        self.tokenizer.add_space_prefix = False
        eog = sorted({i for i in (tokenizer.eos_id, *tokenizer.eot_ids) if i is not None})
        self.eos_token_id = eog[0] if eog else 0
        self.eog = eog
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [(b"\xff" + tokenizer.token_bytes(i)) if tokenizer.is_control(i)
                       else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size)
                                  if tokenizer.is_control(i)]

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self.tokenizer.encode(text, add_special=False, parse_special=False)


def _lltokenizer(tokenizer):
    """llguidance's tokenizer for a GGUF tokenizer, built once per tokenizer (about a second
    for a 262k vocabulary)."""
    import llguidance

    with _LOCK:
        built = getattr(tokenizer, "_llguidance", None)
        if built is None:
            vocabulary = _Vocabulary(tokenizer)
            built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary),
                                           eos_token=vocabulary.eog or None)
            tokenizer._llguidance = built
        return built


class JsonConstraint:
    """One request's matcher: `mask(logits)` before sampling, `advance(token)` after."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    @classmethod
    def build(cls, tokenizer, schema: dict[str, Any] | None) -> "JsonConstraint":
        """`schema` None: any JSON object (response_format json_object)."""
        try:
            import llguidance
        except ImportError:
            raise RequestError("response_format needs the llguidance package on the server",
                               param="response_format",
                               hint="pip install llguidance") from None
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema if schema is not None else {"type": "object"}),
                defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as exc:
            raise RequestError(f"response_format: the JSON schema is not usable: {exc}",
                               param="response_format.json_schema.schema") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, _lltokenizer(tokenizer))
        if error and not error.startswith("WARNING"):
            raise RequestError(f"response_format: the JSON schema is not supported: {error}",
                               param="response_format.json_schema.schema")
        matcher = llguidance.LLMatcher(_lltokenizer(tokenizer), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError("response_format: the JSON schema is not supported: "
                               f"{matcher.get_error()}",
                               param="response_format.json_schema.schema")
        return cls(matcher, tokenizer.vocab_size)

    @property
    def complete(self) -> bool:
        """No token can follow: the document is complete and nothing may extend it."""
        return self.matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self.matcher.get_error()}")
        return torch.from_numpy(allowed)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed()
        if not bool(allowed.any()):
            raise RuntimeError("constrained decoding reached a state no token continues")
        return logits.masked_fill(~allowed[:logits.shape[-1]], float("-inf"))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding: token {token} was refused "
                               f"({self.matcher.get_error()})")
