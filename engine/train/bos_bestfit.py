"""nanochat's pretraining rows: BOS-aligned best-fit packing (nanochat/dataloader.py,
`tokenizing_distributed_data_loader_with_state_bos_bestfit`, commit 92d63d4), row for row.

Each document is its token ids with <bos> first. A row holds T + 1 tokens (inputs row[:-1],
targets row[1:]) and is filled left to right: while a buffered document fits in the space left,
the largest one that fits goes in (the first of equals, in buffer order); when none fits, the
shortest buffered document (the first of equals) is cropped to fill the row exactly, and its
rest is dropped. Before every placement the buffer is topped up, one document batch at a time,
until it holds at least `buffer_size` documents; the batches cycle over the corpus forever, as
the reference cycles its parquet files (epochs). No padding: every token is trained on.

tests/test_nanochat_dataloader.py holds these rows against the reference's on the same
documents (integers, exact).
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

import torch


def text_documents(text: str) -> list[str]:
    """A plain-text corpus's documents: its non-blank lines (one record, article or paragraph
    per line, as the corpora lm-pretrain reads are written)."""
    return [line for line in text.split("\n") if line.strip()]


def document_batches(documents: list[list[int]], batch_size: int) -> Iterator[list[list[int]]]:
    """The documents in order, `batch_size` at a time (the last batch of a pass may be short),
    pass after pass: the reference's parquet row groups read by tokenizer_batch_size."""
    if not documents:
        raise ValueError("no documents to pack")
    for _ in itertools.count():
        for i in range(0, len(documents), batch_size):
            yield documents[i:i + batch_size]


def bos_bestfit_rows(batches: Iterable[list[list[int]]], batch_size: int, context: int,
                     buffer_size: int) -> Iterator[torch.Tensor]:
    """Batches of packed rows [batch_size, context + 1] (int64), forever."""
    source = iter(batches)
    buffer: list[list[int]] = []
    capacity = context + 1
    while True:
        rows = torch.empty(batch_size, capacity, dtype=torch.long)
        for r in range(batch_size):
            pos = 0
            while pos < capacity:
                while len(buffer) < buffer_size:
                    buffer.extend(next(source))
                remaining = capacity - pos
                best, best_len = -1, 0
                for i, doc in enumerate(buffer):
                    if best_len < len(doc) <= remaining:
                        best, best_len = i, len(doc)
                if best >= 0:
                    doc = buffer.pop(best)
                    rows[r, pos:pos + len(doc)] = torch.tensor(doc, dtype=torch.long)
                    pos += len(doc)
                else:
                    shortest = min(range(len(buffer)), key=lambda i: len(buffer[i]))
                    doc = buffer.pop(shortest)
                    rows[r, pos:capacity] = torch.tensor(doc[:remaining], dtype=torch.long)
                    pos = capacity
        yield rows
