"""Retrieval datasets (kind "retrieval"): a search corpus and the queries judged against it.

The folder holds two JSONL files listed in dataset.json::

    corpus.jsonl   {"doc_id": "aster-password", "text": "...", "group": "Aster", "split": "train"}
    queries.jsonl  {"query_id": "aster-password-q0", "text": "How do I ...?",
                    "relevant_doc_ids": ["aster-password"]}

`group` is the unit held together across splits (the product): every document of a group has
one split, and a query takes the split of its relevant documents (a query whose documents sit
in two splits is refused, as is a stated `split` that disagrees). `forgebench data split` can
therefore reassign whole groups without the queries going stale. The whole corpus, held-out
documents included, is the index searched at inference time; only train queries ever update
weights (their (query, positive) pairs are derived here, never stored twice).

`check_queries` adds one finding per bad line and field; `retrieval_data` returns the corpus
and the queries of a loaded dataset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.data import formats as F
from engine.data.dataset import group_of, jsonl_objects, read_listed_text, records_file_of

QUERIES_FILE = "queries.jsonl"
QUERY_FIELDS = ("query_id", "text", "relevant_doc_ids", "split", "source", "rights", "kind")


@dataclass(frozen=True)
class Query:
    query_id: str
    text: str
    relevant: tuple[str, ...]     # doc ids judged relevant (at least one)
    split: str
    kind: str = ""                # the generator's label of how the query was phrased


@dataclass(frozen=True)
class RetrievalData:
    """The corpus in file order (the index rows) and every query."""

    doc_ids: list[str]
    doc_texts: list[str]
    doc_splits: list[str]
    queries: list[Query]

    def split_queries(self, split: str) -> list[Query]:
        return [q for q in self.queries if q.split == split]

    def train_pairs(self) -> list[tuple[Query, str]]:
        """(train query, relevant train doc id) pairs: what contrastive training reads."""
        split_of = dict(zip(self.doc_ids, self.doc_splits))
        return [(q, doc) for q in self.split_queries("train") for doc in q.relevant
                if split_of[doc] == "train"]


def queries_file_of(manifest: dict) -> str:
    value = manifest.get("queries")
    return value if isinstance(value, str) else QUERIES_FILE


def _doc_split(record: dict, assignments: dict[str, str]) -> str | None:
    return record.get("split") or assignments.get(group_of(record))


def check_queries(root: Path, manifest: dict, docs: list[tuple[str, dict]],
                  assignments: dict[str, str], report) -> None:
    """Findings for group purity of the corpus and for every bad query line and field."""
    rel_corpus = records_file_of(manifest, F.KINDS["retrieval"], root)
    split_of: dict[str, str | None] = {}
    group_split: dict[str, tuple[str, str]] = {}
    for where, record in docs:
        split = _doc_split(record, assignments)
        split_of[record["doc_id"]] = split
        if split is None:
            report.add(rel_corpus, where, "split", "document has no split; give it one or run "
                       "`forgebench data split`", record_id=record["doc_id"])
            continue
        first = group_split.setdefault(record["group"], (split, where))
        if first[0] != split:
            report.add(rel_corpus, where, "split",
                       f"group {record['group']!r} is in {first[0]!r} at {first[1]} and in "
                       f"{split!r} here; a group never spans two splits",
                       record_id=record["doc_id"])
    rel = queries_file_of(manifest)
    if rel not in manifest.get("files", {}):
        report.add(F.MANIFEST, None, "queries", f"the queries file {rel!r} is not listed")
        return
    text = read_listed_text(root, rel, report)
    if text is None:
        return
    seen: dict[str, str] = {}
    count = 0
    for number, record, problem in jsonl_objects(text):
        where = f"line {number}"
        if problem:
            report.add(rel, where, None, problem)
            continue
        count += 1
        for name, reason in query_problems(record, split_of, seen, where):
            report.add(rel, where, name, reason, record_id=str(record.get("query_id")))
    if not count:
        report.add(rel, None, None, "holds no queries")


def query_problems(record: dict, split_of: dict[str, str | None], seen: dict[str, str],
                   where: str) -> list[tuple[str | None, str]]:
    """(field, reason) problems of one query line; records first use of its id in `seen`."""
    problems: list[tuple[str | None, str]] = []
    for name in sorted(set(record) - set(QUERY_FIELDS)):
        problems.append((name, "unknown field; a query has " + ", ".join(QUERY_FIELDS)))
    qid = record.get("query_id")
    if not isinstance(qid, str) or not qid.strip():
        problems.append(("query_id", "required: a non-empty string"))
    elif qid in seen:
        problems.append(("query_id", f"duplicate id (first used at {seen[qid]})"))
    else:
        seen[qid] = where
    if not isinstance(record.get("text"), str) or not record["text"].strip():
        problems.append(("text", "required: a non-empty string"))
    relevant = record.get("relevant_doc_ids")
    if not isinstance(relevant, list) or not relevant or not all(
            isinstance(d, str) for d in relevant):
        problems.append(("relevant_doc_ids", "required: a non-empty list of doc ids"))
        return problems
    unknown = [d for d in relevant if d not in split_of]
    if unknown:
        problems.append(("relevant_doc_ids", f"no document has doc_id {unknown[0]!r}"))
        return problems
    if len(set(relevant)) != len(relevant):
        problems.append(("relevant_doc_ids", "lists a document twice"))
    splits = {split_of[d] for d in relevant}
    if len(splits) > 1:
        problems.append(("relevant_doc_ids", f"relevant documents sit in splits "
                         f"{sorted(s or '?' for s in splits)}; a query belongs to one split"))
    elif "split" in record and record["split"] not in splits:
        problems.append(("split", f"is {record['split']!r} but its documents are in "
                         f"{next(iter(splits))!r}; a query takes its documents' split"))
    return problems


def retrieval_data(dataset) -> RetrievalData:
    """Corpus rows and queries of a loaded (validated) retrieval dataset."""
    docs = dataset.records()
    split_of = {d["doc_id"]: dataset.split_of(d) for d in docs}
    text = (dataset.root / queries_file_of(dataset.manifest)).read_text(encoding="utf-8")
    queries = []
    for line in text.splitlines():
        if line.strip():
            q = json.loads(line)
            queries.append(Query(q["query_id"], q["text"], tuple(q["relevant_doc_ids"]),
                                 split_of[q["relevant_doc_ids"][0]], q.get("kind", "")))
    return RetrievalData([d["doc_id"] for d in docs], [d["text"] for d in docs],
                         [split_of[d["doc_id"]] for d in docs], queries)
