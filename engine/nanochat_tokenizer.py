"""karpathy/nanochat's tokenizer: a GPT-4-style byte-level BPE trained as `rustbpe` trains it and
applied as `tiktoken` applies it, with nanochat's split pattern and its nine special tokens.

Contract (the parity ladder in tests/test_nanochat_tokenizer.py holds it against dumps of
rustbpe 0.1.0 and tiktoken, as nanochat's tokenizer.py at commit 92d63d4 uses them):

- Training splits each text with `SPLIT_PATTERN` (GPT-4's, digits in runs of one or two),
  counts the unique chunks, and starts from the 256 byte tokens. Each merge takes the adjacent
  pair with the highest count over all chunks, ties going to the smaller pair (compared as two
  ids, left first), and gives it the next id. `merges` lists the pairs in id order, so
  `merges[k]` made token 256 + k: the same list rustbpe keeps, byte for byte.
- Encoding is tiktoken's: each chunk that is a whole token is that token; otherwise its bytes
  merge, repeatedly, at the adjacent pair whose concatenated bytes have the lowest id (leftmost
  on ties). Specials are never produced from text; they follow the merged tokens, `<|bos|>`
  first, as nanochat numbers them.
- The split runs on the `regex` package; tiktoken and rustbpe run the same pattern on
  fancy-regex. The two agree on letters, digits, contractions and whitespace as the tests
  exercise; they are not proven to agree on every Unicode whitespace code point.

Saved as JSON beside the checkpoints (`to_json`, read back by engine.text_tokenizers).
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from typing import Iterable

from engine.errors import ForgebenchError

SPECIAL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                  "<|assistant_end|>", "<|python_start|>", "<|python_end|>", "<|output_start|>",
                  "<|output_end|>")

# GPT-4's pattern with \p{N}{1,2} instead of {1,3} (nanochat: fewer number tokens at small vocabs)
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}|"""
                 r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")

Pair = tuple[int, int]


def _compile(pattern: str):
    import regex

    return regex.compile(pattern)


def _merge_word(word: list[int], pair: Pair,
                new_id: int) -> tuple[list[int], list[tuple[Pair, int]]]:
    """Replace every non-overlapping `pair` in `word` (left to right) by `new_id`; also return the
    pair-count changes this makes inside the word (-1 per pair destroyed, +1 per pair made)."""
    a, b = pair
    out: list[int] = []
    deltas: list[tuple[Pair, int]] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            if out:
                deltas.append(((out[-1], a), -1))
                deltas.append(((out[-1], new_id), 1))
            deltas.append((pair, -1))
            if i + 2 < n:
                deltas.append(((b, word[i + 2]), -1))
                deltas.append(((new_id, word[i + 2]), 1))
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out, deltas


def _apply_merge(pair: Pair, new_id: int, words: list[list[int]], weight: list[int],
                 pair_counts: dict[Pair, int], where: dict[Pair, set[int]], heap: list) -> None:
    """Merges `pair` into `new_id` in every word holding it, updating the pair counts and
    their words, and pushes the pairs the merge created onto the heap."""
    made: set[Pair] = set()
    for w in where.pop(pair):
        words[w], deltas = _merge_word(words[w], pair, new_id)
        for changed, delta in deltas:
            pair_counts[changed] += delta * weight[w]
            if delta > 0:
                where[changed].add(w)
                made.add(changed)
    for changed in made:
        if pair_counts[changed] > 0:
            heapq.heappush(heap, (-pair_counts[changed], changed))


def train_merges(texts: Iterable[str], n_merges: int, pattern: str = SPLIT_PATTERN) -> list[Pair]:
    """Up to `n_merges` merges in id order (fewer when the corpus runs out of pairs)."""
    split = _compile(pattern)
    chunks: Counter[str] = Counter()
    for text in texts:
        chunks.update(split.findall(text))
    words = [list(chunk.encode("utf-8")) for chunk in chunks]
    weight = list(chunks.values())

    pair_counts: dict[Pair, int] = defaultdict(int)
    where: dict[Pair, set[int]] = defaultdict(set)
    for w, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += weight[w]
            where[pair].add(w)
    # max count first, then the smaller pair; stale counts are refreshed when they surface.
    # A pair gains occurrences only in the merge that creates its newer token, so one live
    # entry per pair suffices and the pop order is exactly "highest count, smallest pair".
    heap = [(-c, pair) for pair, c in pair_counts.items() if c > 0]
    heapq.heapify(heap)
    merges: list[Pair] = []
    while len(merges) < n_merges and heap:
        neg, pair = heapq.heappop(heap)
        current = pair_counts.get(pair, 0)
        if current <= 0:
            continue
        if -neg != current:
            heapq.heappush(heap, (-current, pair))
            continue
        new_id = 256 + len(merges)
        merges.append(pair)
        _apply_merge(pair, new_id, words, weight, pair_counts, where, heap)
    return merges


def token_bytes_of(merges: list[Pair]) -> list[bytes]:
    """The bytes of every merged token, id order (0-255 are the bytes themselves)."""
    table = [bytes([i]) for i in range(256)]
    for a, b in merges:
        table.append(table[a] + table[b])
    return table


class NanochatTokenizer:
    """nanochat's tokenizer from its merge list; see the module docstring."""

    kind = "nanochat"

    def __init__(self, merges: list[Pair], pattern: str = SPLIT_PATTERN):
        self.merges = [tuple(m) for m in merges]
        self.pattern = pattern
        self._split = _compile(pattern)
        self.token_bytes = token_bytes_of(self.merges)
        # tiktoken keys ranks by bytes; a later token with the same bytes wins, as in its dict
        self.ranks = {tb: i for i, tb in enumerate(self.token_bytes)}
        n = len(self.token_bytes)
        self.special_ids = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.vocab_size = n + len(SPECIAL_TOKENS)
        self.bos_id = self.special_ids["<|bos|>"]
        self.eos_id = self.bos_id           # a base model ends a document by starting the next
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "NanochatTokenizer":
        """`vocab_size` counts the specials, as nanochat's tok_train --vocab-size does."""
        n_merges = vocab_size - len(SPECIAL_TOKENS) - 256
        if n_merges < 0:
            raise ForgebenchError(
                f"a nanochat tokenizer needs vocab_size >= {256 + len(SPECIAL_TOKENS)} (256 bytes "
                f"and {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}",
                where="field 'tokenizer.vocab_size'", hint="raise tokenizer.vocab_size")
        return cls(train_merges(texts, n_merges))

    def _encode_chunk(self, chunk: str) -> list[int]:
        piece = chunk.encode("utf-8")
        whole = self.ranks.get(piece)
        if whole is not None:
            return [whole]
        parts = [piece[i:i + 1] for i in range(len(piece))]
        big = len(self.token_bytes)
        while len(parts) > 1:
            best, at = big, -1
            for i in range(len(parts) - 1):
                rank = self.ranks.get(parts[i] + parts[i + 1], big)
                if rank < best:
                    best, at = rank, i
            if at < 0:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return [self.ranks[p] for p in parts]

    def encode(self, text: str) -> list[int]:
        """tiktoken's encode_ordinary: special-token text is encoded as plain text."""
        ids: list[int] = []
        for chunk in self._split.findall(text):
            found = self._cache.get(chunk)
            if found is None:
                found = self._encode_chunk(chunk)
                if len(self._cache) < 1 << 16:
                    self._cache[chunk] = found
            ids.extend(found)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        n = len(self.token_bytes)
        return b"".join(self.token_bytes[i] for i in ids if i < n).decode("utf-8",
                                                                          errors="replace")

    def decode_with_specials(self, ids: Iterable[int]) -> str:
        """tiktoken's decode: a special token is its own text ("<|python_start|>"), as the
        reference's Engine decodes a calculator expression."""
        n, names = len(self.token_bytes), {i: s for s, i in self.special_ids.items()}
        out: list[bytes] = []
        for i in ids:
            out.append(self.token_bytes[i] if i < n else names[i].encode("utf-8"))
        return b"".join(out).decode("utf-8", errors="replace")

    def byte_lengths(self) -> list[int]:
        """UTF-8 bytes each id stands for (0 for the specials)."""
        return [len(tb) for tb in self.token_bytes] + [0] * len(SPECIAL_TOKENS)

    def to_json(self) -> str:
        return json.dumps({"forgebench_tokenizer": "nanochat", "version": 1,
                           "pattern": self.pattern, "specials": list(SPECIAL_TOKENS),
                           "merges": [list(m) for m in self.merges]}) + "\n"

    @classmethod
    def from_dict(cls, data: dict, source: object = None) -> "NanochatTokenizer":
        merges = data.get("merges")
        if (data.get("specials") != list(SPECIAL_TOKENS) or not isinstance(merges, list)
                or not all(isinstance(m, list) and len(m) == 2 and all(
                    isinstance(x, int) and 0 <= x < 256 + k for x in m)
                    for k, m in enumerate(merges))):
            raise ForgebenchError("nanochat tokenizer file has malformed merges or specials",
                                  path=source, where="fields 'merges'/'specials'",
                                  hint="the file should come from a lm-pretrain checkpoint")
        return cls(merges, data.get("pattern", SPLIT_PATTERN))


# -- conversations (nanochat/tokenizer.py: render_conversation, render_for_completion) ------
TOOL_MARKERS = {"python": ("<|python_start|>", "<|python_end|>"),
                "python_output": ("<|output_start|>", "<|output_end|>")}


def assistant_parts(text: str) -> str | list[dict]:
    """An assistant turn's text, tool parts kept as their special tokens' text (a chat
    transcript's form), as nanochat's content: the string itself without tool markers, else
    its parts (text, python, python_output) in order; a block the token budget cut off runs
    to the end of the text."""
    if not any(start in text for start, _ in TOOL_MARKERS.values()):
        return text
    found: list[dict] = []
    rest = text
    while rest:
        starts = [(rest.find(start), kind, start, end)
                  for kind, (start, end) in TOOL_MARKERS.items() if start in rest]
        if not starts:
            found.append({"type": "text", "text": rest})
            break
        at, kind, start, end = min(starts)
        if at:
            found.append({"type": "text", "text": rest[:at]})
        rest = rest[at + len(start):]
        stop = rest.find(end)
        body, rest = (rest, "") if stop < 0 else (rest[:stop], rest[stop + len(end):])
        found.append({"type": kind, "text": body})
    return found


def _conversation_error(message: str, hint: str | None = None) -> ForgebenchError:
    return ForgebenchError(message, where="conversation", hint=hint or
                           "nanochat's format: an optional system message, then user and "
                           "assistant turns alternating, the user first")


def render_conversation(tokenizer: NanochatTokenizer, conversation: dict,
                        max_tokens: int | None = 2048) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation as nanochat renders it for SFT: <|bos|>, then each user
    turn as <|user_start|> text <|user_end|> and each assistant turn as <|assistant_start|>
    ... <|assistant_end|>; a first system message is merged into the first user message
    (system + "\\n\\n" + user). An assistant's content is a string or a list of parts: "text",
    "python" (inside <|python_start|> <|python_end|>) and "python_output" (inside
    <|output_start|> <|output_end|>). mask is 1 on what the assistant is trained to say: its
    text, its python parts with their delimiters, and <|assistant_end|>; 0 on the rest,
    including the tool's output, which comes from Python at test time. Cut to `max_tokens`
    (None: not cut), as the reference cuts at 2048."""
    messages = list(conversation.get("messages") or [])
    if messages and messages[0].get("role") == "system":
        if len(messages) < 2 or messages[1].get("role") != "user":
            raise _conversation_error("a system message must be followed by a user message")
        messages = [{**messages[1], "content": messages[0]["content"] + "\n\n"
                     + messages[1]["content"]}] + messages[2:]
    if not messages:
        raise _conversation_error("the conversation has no message")
    special = tokenizer.special_ids
    ids: list[int] = [tokenizer.bos_id]
    mask: list[int] = [0]

    def add(tokens: list[int], value: int) -> None:
        ids.extend(tokens)
        mask.extend([value] * len(tokens))

    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            raise _conversation_error(f"message {i} is from {role!r} but should be from "
                                      f"{expected!r}")
        if role == "user":
            if not isinstance(content, str):
                raise _conversation_error(f"message {i}: a user message is a string")
            add([special["<|user_start|>"], *tokenizer.encode(content),
                 special["<|user_end|>"]], 0)
            continue
        add([special["<|assistant_start|>"]], 0)
        for part in ([{"type": "text", "text": content}] if isinstance(content, str)
                     else content if isinstance(content, list) else None) or []:
            _add_part(tokenizer, part, add, i)
        if not isinstance(content, (str, list)):
            raise _conversation_error(f"message {i}: an assistant message is a string or a "
                                      "list of parts")
        add([special["<|assistant_end|>"]], 1)
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return ids, mask


_PART_DELIMITERS = {"text": (None, None, 1), "python": ("<|python_start|>", "<|python_end|>", 1),
                    "python_output": ("<|output_start|>", "<|output_end|>", 0)}


def _add_part(tokenizer: NanochatTokenizer, part: dict, add, index: int) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _PART_DELIMITERS or not isinstance(part.get("text"), str):
        raise _conversation_error(f"message {index}: unknown part {part!r}",
                                  hint="parts are {'type': 'text' | 'python' | "
                                       "'python_output', 'text': str}")
    start, end, value = _PART_DELIMITERS[kind]
    body = tokenizer.encode(part["text"])
    if start is None:
        add(body, value)
    else:
        add([tokenizer.special_ids[start], *body, tokenizer.special_ids[end]], value)


def render_for_completion(tokenizer: NanochatTokenizer, conversation: dict,
                          max_tokens: int | None = 2048) -> list[int]:
    """nanochat's render_for_completion: the conversation without its last (assistant)
    message, then <|assistant_start|>."""
    messages = list(conversation.get("messages") or [])
    if not messages or messages[-1].get("role") != "assistant":
        raise _conversation_error("the last message must be the assistant's")
    ids, _ = render_conversation(tokenizer, {"messages": messages[:-1]}, max_tokens)
    return ids + [tokenizer.special_ids["<|assistant_start|>"]]
