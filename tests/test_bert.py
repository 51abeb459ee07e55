"""Our BERT sentence encoder on a tiny random BERT written by the test (no real model needed):
the pooling ignores padding, vectors are unit length, folder and zip read the same encoder,
and the pooling comes from the encoder's own config. Parity with sentence-transformers and
transformers is tests/test_bert_parity.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.errors import ForgebenchError
from engine.models.bert import SentenceEncoder, model_identity, resolve_source, source_files
from tests.retrieval_support import write_tiny_bert

TEXTS = ["Aster: Cancel a subscription.", "how do i stop future renewals in aster ?",
         "Birchwell: Change the password. Open Account then Security."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny", TEXTS)


def test_a_texts_vector_does_not_depend_on_its_batch(tiny):
    encoder = SentenceEncoder(source_files(tiny))
    together = encoder.encode(TEXTS)
    alone = torch.cat([encoder.encode([t]) for t in TEXTS])
    assert torch.allclose(together, alone, atol=1e-6)
    assert torch.allclose(together.norm(dim=1), torch.ones(3), atol=1e-6)
    # twin: pooling over the padding too would change the short text's vector
    ids, mask = encoder.tokenize(TEXTS)
    hidden = encoder.bert(ids, mask)
    padded_mean = torch.nn.functional.normalize(hidden[0].mean(0), dim=0)
    assert not torch.allclose(padded_mean, together[0], atol=1e-3)


def test_mean_pooling_is_the_mean_of_the_real_tokens(tiny):
    encoder = SentenceEncoder(source_files(tiny))
    ids, mask = encoder.tokenize(TEXTS[:1])
    with torch.no_grad():
        hidden = encoder.bert(ids, mask)[0]
    expected = torch.nn.functional.normalize(hidden.mean(0), dim=0)
    assert torch.allclose(encoder.encode(TEXTS[:1])[0], expected, atol=1e-6)


def test_a_zip_and_a_folder_are_the_same_encoder(tiny, tmp_path):
    archive = shutil.make_archive(str(tmp_path / "tiny"), "zip", tiny)
    folder_files = source_files(resolve_source(str(tiny)))
    zip_files = source_files(resolve_source(archive))
    assert model_identity(folder_files) == model_identity(zip_files)
    assert torch.equal(SentenceEncoder(folder_files).encode(TEXTS),
                       SentenceEncoder(zip_files).encode(TEXTS))


def test_pooling_follows_the_encoder_config(tmp_path):
    cls = SentenceEncoder(source_files(write_tiny_bert(tmp_path / "cls", TEXTS, pooling="cls")))
    assert cls.pooling == "cls"
    ids, mask = cls.tokenize(TEXTS[:1])
    with torch.no_grad():
        first = torch.nn.functional.normalize(cls.bert(ids, mask)[0, 0], dim=0)
    assert torch.allclose(cls.encode(TEXTS[:1])[0], first, atol=1e-6)


def test_a_missing_encoder_or_file_is_one_clear_error(tiny, tmp_path):
    with pytest.raises(ForgebenchError, match="not installed"):
        resolve_source("package:no_such_encoder_package")
    broken = shutil.copytree(tiny, tmp_path / "broken")
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ForgebenchError, match="lacks tokenizer.json"):
        source_files(broken)
