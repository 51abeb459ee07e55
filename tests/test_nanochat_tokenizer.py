"""The tokenizer rung of the nanochat parity ladder: engine/nanochat_tokenizer.py against dumps of
nanochat's own tokenizer (commit 92d63d4: rustbpe 0.1.0 trains, tiktoken encodes), made by
`tests/data/nanochat/make_goldens.py --part tokenizer`. Merges must be byte-identical and token
ids exact (tolerance zero); each comparison has a twin that breaks one documented detail of the
reference and shows the comparison failing. Integers only: no CPU dependence.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import pytest

from engine import nanochat_tokenizer as nt
from engine.errors import ForgebenchError
from engine.nanochat_tokenizer import SPECIAL_TOKENS, NanochatTokenizer
from engine.text_tokenizers import tokenizer_from_json

DATA = Path(__file__).parent / "data" / "nanochat"
GOLDENS = DATA / "tokenizer_goldens.json"
# GPT-4's own pattern: digits in runs of up to three (nanochat uses two)
GPT4_PATTERN = nt.SPLIT_PATTERN.replace(r"\p{N}{1,2}", r"\p{N}{1,3}")


def read(name: str) -> str:
    return (DATA / name).read_bytes().decode("utf-8")      # as written: keeps its CRLF lines


@pytest.fixture(scope="module")
def goldens():
    if not GOLDENS.is_file():
        pytest.skip(f"nanochat tokenizer goldens absent ({GOLDENS}): run tests/data/nanochat/"
                    "make_goldens.py --nanochat <nanochat git dir> --part tokenizer "
                    "(needs rustbpe and tiktoken)")
    return json.loads(GOLDENS.read_text())


@pytest.fixture(scope="module")
def trained(goldens):
    return NanochatTokenizer.train([read("tokenizer_train.txt")], goldens["vocab_size"])


def merged_hex(tokenizer: NanochatTokenizer) -> list[str]:
    return [b.hex() for b in tokenizer.token_bytes[256:]]


def first_mismatch(ours: list, ref: list) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def test_merges_byte_identical_to_rustbpe(trained, goldens):
    assert len(goldens["merged_token_bytes_hex"]) == goldens["vocab_size"] - 256 - len(
        SPECIAL_TOKENS)
    assert first_mismatch(merged_hex(trained), goldens["merged_token_bytes_hex"]) is None
    assert trained.vocab_size == goldens["n_vocab"]


class LargerPairFirst:
    """heapq with ties between equal counts going to the larger pair (rustbpe: the smaller)."""

    @staticmethod
    def flip(entry):
        return entry[0], (-entry[1][0], -entry[1][1])

    @classmethod
    def heapify(cls, heap):
        heap[:] = [cls.flip(e) for e in heap]
        heapq.heapify(heap)

    @classmethod
    def heappush(cls, heap, entry):
        heapq.heappush(heap, cls.flip(entry))

    @classmethod
    def heappop(cls, heap):
        return cls.flip(heapq.heappop(heap))


def test_twin_merges_tie_break_changed_fails(goldens, monkeypatch):
    monkeypatch.setattr(nt, "heapq", LargerPairFirst)
    broken = NanochatTokenizer.train([read("tokenizer_train.txt")], goldens["vocab_size"])
    assert first_mismatch(merged_hex(broken), goldens["merged_token_bytes_hex"]) is not None


def test_twin_merges_gpt4_digit_runs_fail(goldens):
    """Trained on GPT-4's \\p{N}{1,3} split: the corpus's 4-digit item numbers pair otherwise."""
    merges = nt.train_merges([read("tokenizer_train.txt")], len(goldens["merged_token_bytes_hex"]),
                             pattern=GPT4_PATTERN)
    broken = NanochatTokenizer(merges)
    assert first_mismatch(merged_hex(broken), goldens["merged_token_bytes_hex"]) is not None


def test_token_ids_exact_to_tiktoken(trained, goldens):
    held = read("tokenizer_heldout.txt")
    assert trained.bos_id == goldens["bos_id"]
    assert trained.special_ids == goldens["special_ids"]
    assert first_mismatch([trained.bos_id] + trained.encode(held), goldens["heldout_ids"]) is None
    assert first_mismatch(trained.encode(read("tokenizer_train.txt")[:3000]),
                          goldens["train_head_ids"]) is None


def test_twin_token_ids_gpt4_digit_runs_fail(trained, goldens):
    """GPT-4's \\p{N}{1,3} split instead of nanochat's {1,2}: the held-out text's 5-digit numbers
    tokenise differently."""
    broken = NanochatTokenizer(trained.merges, pattern=GPT4_PATTERN)
    held = read("tokenizer_heldout.txt")
    assert first_mismatch([broken.bos_id] + broken.encode(held), goldens["heldout_ids"]) is not None


def test_twin_token_ids_rightmost_tie_fails(trained, goldens, monkeypatch):
    """Merging the rightmost of equally ranked pairs (tiktoken takes the leftmost) changes ids
    wherever a chunk repeats a pair (e.g. '🙂🙂', '!!!')."""
    def rightmost(self, chunk):
        parts = [bytes([b]) for b in chunk.encode("utf-8")]
        while len(parts) > 1:
            ranks = [self.ranks.get(a + b, 1 << 30) for a, b in zip(parts, parts[1:])]
            best = min(ranks)
            if best == 1 << 30:
                break
            at = len(ranks) - 1 - ranks[::-1].index(best)
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return [self.ranks[p] for p in parts]

    monkeypatch.setattr(NanochatTokenizer, "_encode_chunk", rightmost)
    broken = NanochatTokenizer(trained.merges)
    held = read("tokenizer_heldout.txt")
    assert first_mismatch([broken.bos_id] + broken.encode(held), goldens["heldout_ids"]) is not None


def test_round_trip_through_json_and_bytes(trained):
    held = read("tokenizer_heldout.txt")
    loaded = tokenizer_from_json(trained.to_json())
    assert isinstance(loaded, NanochatTokenizer)
    ids = loaded.encode(held)
    assert ids == trained.encode(held)
    assert loaded.decode(ids) == held
    # bits per byte divide by these: they must add up to the text's UTF-8 length
    lengths = loaded.byte_lengths()
    assert sum(lengths[i] for i in [loaded.bos_id] + ids) == len(held.encode("utf-8"))


def test_bad_vocab_and_bad_file_say_what_to_do():
    with pytest.raises(ForgebenchError, match="vocab_size >= 265"):
        NanochatTokenizer.train(["abc"], 264)
    bad = json.dumps({"forgebench_tokenizer": "nanochat", "version": 1,
                      "specials": list(SPECIAL_TOKENS), "merges": [[0, 999]]})
    with pytest.raises(ForgebenchError, match="malformed merges"):
        tokenizer_from_json(bad, "tok.json")


@pytest.mark.slow
def test_live_rustbpe_and_tiktoken_at_a_larger_vocabulary():
    """Beyond the stored goldens: rustbpe and tiktoken themselves (the nanochat-tokenizer extra),
    called as nanochat's RustBPETokenizer calls them, on this repository's engine sources
    (about 2 MB of code and prose) at vocabulary 8192."""
    why = "the live oracle needs the nanochat-tokenizer extra (rustbpe, tiktoken)"
    rustbpe = pytest.importorskip("rustbpe", reason=why)
    tiktoken = pytest.importorskip("tiktoken", reason=why)
    root = Path(__file__).resolve().parents[1]
    docs = [p.read_text(encoding="utf-8") for p in sorted((root / "engine").rglob("*.py"))]
    vocab = 8192
    ref = rustbpe.Tokenizer()
    ref.train_from_iterator(iter(docs), vocab - len(SPECIAL_TOKENS), pattern=nt.SPLIT_PATTERN)
    ranks = {bytes(k): v for k, v in ref.get_mergeable_ranks()}
    enc = tiktoken.Encoding(name="rustbpe", pat_str=ref.get_pattern(), mergeable_ranks=ranks,
                            special_tokens={s: len(ranks) + i
                                            for i, s in enumerate(SPECIAL_TOKENS)})
    ours = NanochatTokenizer.train(docs, vocab)
    assert sorted(ranks, key=ranks.get) == ours.token_bytes
    held = (root / "README.md").read_text(encoding="utf-8") + read("tokenizer_heldout.txt")
    assert ours.encode(held) == enc.encode_ordinary(held)


def test_gguf_export_refuses_the_nanochat_tokenizer(trained):
    from engine.export.from_pretrain import tokenizer_metadata

    with pytest.raises(ForgebenchError, match="no pre-tokenizer for nanochat's split"):
        tokenizer_metadata(trained)
    assert tokenizer_metadata(tokenizer_from_json('{"forgebench_tokenizer": "byte"}'))  # twin
