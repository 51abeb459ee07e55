"""The dataloader rung of the nanochat parity ladder: engine/train/bos_bestfit.py against the
first batches of nanochat's own BOS-aligned best-fit loader (commit 92d63d4) on the same
documents, made by `tests/data/nanochat/make_goldens.py --part dataloader`. Inputs and targets
must be identical (integers, tolerance zero); the twins break one documented detail each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.nanochat_tokenizer import NanochatTokenizer
from engine.train import bos_bestfit
from engine.train.bos_bestfit import bos_bestfit_rows, document_batches, text_documents

DATA = Path(__file__).parent / "data" / "nanochat"
GOLDENS = DATA / "dataloader_goldens.json"


@pytest.fixture(scope="module")
def goldens():
    if not GOLDENS.is_file():
        pytest.skip(f"nanochat dataloader goldens absent ({GOLDENS}): run tests/data/nanochat/"
                    "make_goldens.py --nanochat <nanochat git dir> --part dataloader")
    return json.loads(GOLDENS.read_text())


@pytest.fixture(scope="module")
def documents(goldens):
    text = (DATA / "tokenizer_train.txt").read_bytes().decode("utf-8")
    tokenizer = NanochatTokenizer.train([text], goldens["vocab_size"])
    docs = [[tokenizer.bos_id] + tokenizer.encode(d) for d in text_documents(text)]
    assert len(docs) == goldens["documents"]
    return docs


def our_batches(goldens, documents, *, buffer_size=None) -> list[dict]:
    spec = goldens["loader"]
    rows = bos_bestfit_rows(document_batches(documents, spec["tokenizer_batch_size"]),
                            spec["B"], spec["T"], buffer_size or spec["buffer_size"])
    out = []
    for _ in goldens["batches"]:
        row = next(rows)
        out.append({"inputs": row[:, :-1].tolist(), "targets": row[:, 1:].tolist()})
    return out


def test_batches_identical_to_nanochat(goldens, documents):
    ours = our_batches(goldens, documents)
    for i, (a, b) in enumerate(zip(ours, goldens["batches"])):
        assert a == b, f"batch {i} differs"
    # the rung exercises what it claims: BOS-aligned rows, several documents per row, crops
    bos = documents[0][0]
    inputs = torch.tensor([b["inputs"] for b in goldens["batches"]])
    assert (inputs[:, :, 0] == bos).all()
    assert (inputs == bos).sum(-1).max() > 1


def test_twin_crop_longest_fails(goldens, documents, monkeypatch):
    """Cropping the longest buffered document (the reference crops the shortest)."""
    monkeypatch.setattr(bos_bestfit, "min", max, raising=False)
    assert our_batches(goldens, documents) != goldens["batches"]


def test_twin_other_buffer_fails(goldens, documents):
    """A buffer of half the size chooses among fewer documents."""
    assert our_batches(goldens, documents,
                       buffer_size=goldens["loader"]["buffer_size"] // 2) != goldens["batches"]


def test_lm_pretrain_packs_nanochat_rows(goldens, documents):
    """lm-pretrain's data.packing = "bos_bestfit" trains on the reference loader's rows (at its
    default buffer and batching) in the reference's order, before the sampler draws them."""
    from types import SimpleNamespace

    from engine.recipes.lm_pretrain import packed_rows

    text = (DATA / "tokenizer_train.txt").read_bytes().decode("utf-8")
    tokenizer = NanochatTokenizer.train([text], goldens["vocab_size"])
    T = goldens["loader"]["T"]
    config = SimpleNamespace(model=SimpleNamespace(context=T),
                             data=SimpleNamespace(packing="bos_bestfit"))
    rows = packed_rows(config, tokenizer, text)
    assert rows.shape == (sum(len(d) for d in documents) // (T + 1), T + 1)
    ref = [row + [tgt[-1]] for b in goldens["default_batches"]
           for row, tgt in zip(b["inputs"], b["targets"])]
    assert rows[:len(ref)].tolist() == ref
