"""The retrieval data kind, its generated help-article sets, the ranking metrics (against a
worked example by hand) and the TF-IDF baseline (against TF-IDF written out in numpy)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import numpy as np
import pytest

from engine.data.dataset import load_dataset, validate_dataset, write_manifest
from engine.data.generators.retrieval import generate_help_articles, help_articles
from engine.data.retrieval import retrieval_data
from engine.errors import ForgebenchError
from engine.eval.retrieval import TfidfRetriever, rank, retrieval_metrics


@pytest.fixture(scope="module")
def easy(tmp_path_factory):
    return load_dataset(generate_help_articles(tmp_path_factory.mktemp("r") / "easy", "easy"))


@pytest.fixture(scope="module")
def hard(tmp_path_factory):
    return load_dataset(generate_help_articles(tmp_path_factory.mktemp("r") / "hard", "hard"))


def tfidf_metrics(data, split: str) -> dict:
    rows = {d: i for i, d in enumerate(data.doc_ids)}
    queries = data.split_queries(split)
    scores = TfidfRetriever(data.doc_texts).scores([q.text for q in queries])
    return retrieval_metrics(scores, [{rows[d] for d in q.relevant} for q in queries], (5,))


def test_easy_set_has_the_handbook_shape(easy):
    data = retrieval_data(easy)
    assert len(data.doc_ids) == 60 and len(set(data.doc_ids)) == 60
    products = {r["group"]: r["split"] for r in easy.records()}
    assert len(products) == 10
    assert Counter(products.values()) == {"train": 6, "val": 2, "test": 2}
    pairs = data.train_pairs()
    assert len(pairs) == 108 and len({doc for _, doc in pairs}) == 36


@pytest.mark.parametrize("which", ["easy", "hard"])
def test_a_product_never_lands_in_two_splits(which, request):
    dataset = request.getfixturevalue(which)
    data = retrieval_data(dataset)
    split_of_group: dict[str, set[str]] = {}
    for record in dataset.records():
        split_of_group.setdefault(record["group"], set()).add(record["split"])
    assert all(len(s) == 1 for s in split_of_group.values())
    doc_split = dict(zip(data.doc_ids, data.doc_splits))
    assert all(doc_split[d] == q.split for q in data.queries for d in q.relevant)


def test_hard_set_pairs_every_article_with_a_same_product_distractor(hard):
    records = {r["doc_id"]: r for r in hard.records()}
    articles = [d for d in records if not d.endswith("-near")]
    assert len(records) == 192 and len(articles) == 96
    for doc_id in articles:
        near = records[doc_id + "-near"]
        assert near["group"] == records[doc_id]["group"] and near["text"] != records[doc_id][
            "text"]


def test_tfidf_baseline_on_the_easy_set_is_near_the_handbook_and_the_hard_set_defeats_it(
        easy, hard):
    easy_val = tfidf_metrics(retrieval_data(easy), "val")
    hard_val = tfidf_metrics(retrieval_data(hard), "val")
    # handbook, 60-document fixture: validation Recall@5 1.0, MRR@5 about 0.821
    assert easy_val["recall@5"] == 1.0 and abs(easy_val["mrr@5"] - 0.821) < 0.05
    assert hard_val["mrr@5"] < 0.5 * easy_val["mrr@5"]


def test_generation_is_deterministic_and_seeded():
    assert help_articles("hard", 3) == help_articles("hard", 3)
    assert help_articles("hard", 3) != help_articles("hard", 4)


# -- validation: line and field ---------------------------------------------------------------
def _rewrite(root, name: str, edit) -> None:
    path = root / name
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = json.loads((root / "dataset.json").read_text())
    extra = {k: v for k, v in manifest.items() if k not in
             ("kind", "schema_version", "name", "version", "parent", "files", "created")}
    write_manifest(root, "retrieval", manifest["name"], **extra)


def test_bad_queries_are_reported_with_line_and_field(tmp_path):
    root = generate_help_articles(tmp_path / "d", "easy")

    def edit(rows):
        rows[2]["relevant_doc_ids"] = ["no-such-doc"]
        rows[4]["text"] = "  "
        rows[6]["split"] = next(s for s in ("train", "test") if s != rows[6]["split"])
        rows[7]["query_id"] = rows[0]["query_id"]
        rows[8]["relevnt_doc_ids"] = []
    _rewrite(root, "queries.jsonl", edit)
    report = validate_dataset(root)
    found = {(f.file, f.where, f.field) for f in report.errors}
    assert ("queries.jsonl", "line 3", "relevant_doc_ids") in found
    assert ("queries.jsonl", "line 5", "text") in found
    assert ("queries.jsonl", "line 7", "split") in found
    assert ("queries.jsonl", "line 8", "query_id") in found
    assert ("queries.jsonl", "line 9", "relevnt_doc_ids") in found
    with pytest.raises(ForgebenchError) as err:
        load_dataset(root)
    assert err.value.where == "line 3, field 'relevant_doc_ids'"


def test_a_group_split_across_two_splits_is_refused(tmp_path):
    root = generate_help_articles(tmp_path / "d", "easy")

    def edit(rows):
        rows[1]["split"] = "test" if rows[0]["split"] != "test" else "train"
    _rewrite(root, "corpus.jsonl", edit)
    errors = validate_dataset(root).errors
    assert any(f.file == "corpus.jsonl" and f.where.startswith("line 2") and f.field == "split"
               and "never spans two splits" in f.reason for f in errors)


def test_text_files_that_are_not_utf8_are_reported_by_name(tmp_path):
    """The queries file of a retrieval set and a split file of a text corpus go through the one
    reader of listed text files: each is named, with the reason, not a traceback."""
    from engine.data.generators.records import generate_records

    retrieval = generate_help_articles(tmp_path / "d", "easy")
    corpus = generate_records(tmp_path / "corpus", n=20, seed=1)
    for root, name in ((retrieval, "queries.jsonl"), (corpus, "train.txt")):
        (root / name).write_bytes(b"\xff\xfe not utf-8\n")
        assert any(f.file == name and f.reason.startswith("unreadable as UTF-8 text")
                   for f in validate_dataset(root, check_hashes=False).errors), name


def test_the_untouched_set_validates(tmp_path):
    assert validate_dataset(generate_help_articles(tmp_path / "d", "hard")).ok


# -- metrics: a worked example by hand ---------------------------------------------------------
def test_metrics_match_a_worked_example():
    scores = np.array([[0.1, 0.9, 0.5, 0.5],     # ranking 1, 2, 3, 0 (tie 2/3: lower row first)
                       [0.3, 0.2, 0.1, 0.0]])    # ranking 0, 1, 2, 3
    relevant = [{2, 3}, {0}]
    assert rank(scores).tolist() == [[1, 2, 3, 0], [0, 1, 2, 3]]
    m = retrieval_metrics(scores, relevant, (2, 5))
    # q0 @2: top [1, 2], first hit at 2 -> recall 1/2, RR 1/2, nDCG (1/log2 3) / (1 + 1/log2 3)
    ndcg2 = (1 / math.log2(3)) / (1 + 1 / math.log2(3))
    # q0 @5: both hits at 2 and 3 -> recall 1, RR 1/2, nDCG (1/log2 3 + 1/2) / (1 + 1/log2 3)
    ndcg5 = (1 / math.log2(3) + 0.5) / (1 + 1 / math.log2(3))
    expected = {"recall@2": (0.5 + 1) / 2, "mrr@2": (0.5 + 1) / 2, "ndcg@2": (ndcg2 + 1) / 2,
                "recall@5": 1.0, "mrr@5": (0.5 + 1) / 2, "ndcg@5": (ndcg5 + 1) / 2}
    assert m == pytest.approx(expected, abs=1e-12)
    # twin: had the tie gone the other way (row 3 first) q0 @2 would still hit at 2, but with
    # only row 2 relevant it would miss: the tie rule is what the number depends on
    assert retrieval_metrics(scores[:1], [{2}], (2,))["recall@2"] == 1.0
    assert retrieval_metrics(scores[:1], [{3}], (2,))["recall@2"] == 0.0


def test_tfidf_matches_the_formula_written_out():
    docs = ["cancel the subscription now", "change the password", "the password rules now"]
    queries = ["change password now", "subscription rules"]

    def terms(text):
        words = re.findall(r"\b\w\w+\b", text.lower())
        return words + [f"{a} {b}" for a, b in zip(words, words[1:])]
    vocab = sorted({t for d in docs for t in terms(d)})
    df = np.array([sum(t in terms(d) for d in docs) for t in vocab])
    idf = np.log((1 + len(docs)) / (1 + df)) + 1               # smooth idf

    def vector(text):
        counts = Counter(terms(text))
        v = np.array([counts[t] for t in vocab], float) * idf
        return v / np.linalg.norm(v)
    expected = np.array([[vector(q) @ vector(d) for d in docs] for q in queries])
    assert TfidfRetriever(docs).scores(queries) == pytest.approx(expected, abs=1e-12)


def test_the_sample_workspace_set_is_the_generators_output(hard):
    from pathlib import Path

    sample = Path(__file__).resolve().parents[1] / "resources/sample-workspace/datasets" \
        / "help-articles"
    for name in ("corpus.jsonl", "queries.jsonl"):
        assert (sample / name).read_bytes() == (hard.root / name).read_bytes()
