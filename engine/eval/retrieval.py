"""Ranking metrics and the lexical baseline of embed-retrieval.

`rank(scores)` orders every document for every query: higher score first, ties broken by the
document's row in the index (lower first), so a ranking never depends on sort stability or
hardware. On those rankings, for a query with relevant set R and top-k list T:

* Recall@k = |R ∩ T| / |R|
* MRR@k    = 1 / (position of the first relevant document), 0 when none is in T
* nDCG@k   = sum over relevant positions i in T of 1/log2(i + 1), divided by the same sum for
             the ideal list (min(k, |R|) relevant documents first); binary relevance

each averaged over queries. `TfidfRetriever` is the baseline a neural encoder has to beat:
word unigrams and bigrams, fitted on the whole corpus (the index), queries transformed with
the fitted vocabulary, cosine scores.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

DEFAULT_KS = (1, 5, 10)


def rank(scores: np.ndarray) -> np.ndarray:
    """[Q, D] scores -> [Q, D] document rows, best first (ties: lower row first)."""
    rows = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
    return np.lexsort((rows, -scores), axis=1)


def query_metrics(ranking: Sequence[int], relevant: set[int], k: int) -> dict[str, float]:
    """Recall@k, MRR@k and nDCG@k of one query's ranking (document rows, best first)."""
    top = list(ranking[:k])
    hits = [i for i, row in enumerate(top, start=1) if row in relevant]
    ideal = sum(1.0 / np.log2(i + 1) for i in range(1, min(k, len(relevant)) + 1))
    return {f"recall@{k}": len(hits) / len(relevant),
            f"mrr@{k}": 1.0 / hits[0] if hits else 0.0,
            f"ndcg@{k}": sum(1.0 / np.log2(i + 1) for i in hits) / ideal}


def retrieval_metrics(scores: np.ndarray, relevant: Sequence[set[int]],
                      ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """Mean Recall@k, MRR@k and nDCG@k over queries, for every k in `ks`."""
    if len(relevant) == 0:
        raise ValueError("no queries to score")
    rankings = rank(scores)
    totals: dict[str, float] = {}
    for ranking, rel in zip(rankings, relevant):
        for k in ks:
            for name, value in query_metrics(ranking, rel, k).items():
                totals[name] = totals.get(name, 0.0) + value
    return {name: value / len(relevant) for name, value in totals.items()}


def top_k(scores: np.ndarray, doc_ids: Sequence[str], k: int) -> list[list[tuple[str, float]]]:
    """(doc id, score) of each query's best `k` documents."""
    return [[(doc_ids[row], float(row_scores[row])) for row in ranking[:k]]
            for ranking, row_scores in zip(rank(scores), scores)]


class TfidfRetriever:
    """Unigram + bigram TF-IDF over the corpus, cosine-scored (scikit-learn's vectorizer
    L2-normalises each row, so a dot product is the cosine)."""

    def __init__(self, doc_texts: Sequence[str]):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.vectorizer = TfidfVectorizer(ngram_range=(1, 2), lowercase=True)
        self.doc_matrix = self.vectorizer.fit_transform(list(doc_texts))

    def scores(self, queries: Sequence[str]) -> np.ndarray:
        """[Q, D] cosine similarities."""
        return (self.vectorizer.transform(list(queries)) @ self.doc_matrix.T).toarray()
