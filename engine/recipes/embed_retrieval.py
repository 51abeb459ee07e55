"""embed-retrieval: fine-tune a pretrained BERT sentence encoder (all-MiniLM-L6-v2 by default)
for query -> document search with in-batch negatives, and ship it only if it beats TF-IDF.

Reads top to bottom: the retrieval dataset (corpus + judged queries, product-grouped splits)
-> the encoder (our BERT over safetensors + HF tokenizers, its own pooling, L2-normalised)
-> the shared step loop, which scores the unmodified encoder as step 0 ("epoch 0") and then
trains with multiple-negatives ranking loss (MNRL): for B (query, document) pairs, the
B x B matrix of scale x cosine is a B-way classification whose answer is the diagonal. Each
step draws B distinct train documents (the data cursor) and one of each document's queries
(the run's generator), so a positive never meets itself as a negative; should an epoch boundary
repeat a document inside a batch, that copy is masked out rather than punished. The val
figure that picks the best checkpoint is MRR@5 over the whole index (every document of every
split: held-out documents are the database searched at inference time).

At the end the best checkpoint's validation MRR@5 is compared with the TF-IDF baseline's: the
encoder is selected only if it scores strictly higher, otherwise the baseline is (the handbook
ships the baseline when a neural model does not earn its place). The selection is written into
the index contract (`index/contract.json`: the selected system, the checkpoint, the encoder's
identity and weights SHA-256, the pooling, the instruction, and every document's id and text
SHA-256) beside the normalised document vectors; `search` checks all of it before answering.
The test split is read only by `forgebench eval --split test`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.data.retrieval import RetrievalData, retrieval_data
from engine.errors import ForgebenchError
from engine.eval.retrieval import DEFAULT_KS, TfidfRetriever, retrieval_metrics, top_k
from engine.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    load_numeric_array,
    read_json,
    sha256_bytes,
    sha256_file,
)
from engine.jobs import Job, run_config
from engine.models.bert import (
    WEIGHTS,
    SentenceEncoder,
    model_identity,
    resolve_source,
    source_files,
)
from engine.recipes.embed_retrieval_config import EmbedRetrievalConfig
from engine.rundir import Checkpoint, RunDir
from engine.train.checkpoint import MODEL_FILE
from engine.train.loop import Loop, load_weights, meta_for, record_eval, train_loop
from engine.train.media_data import dataset_manifest, open_dataset
from engine.train.optim import adamw_for
from engine.train.precision import autocast

KINDS = ("retrieval",)
SELECT_ON = "mrr@5"
INDEX_DIR = "index"
CONTRACT = "contract.json"
EMBEDDINGS = "embeddings.npy"


def data_manifest(config: EmbedRetrievalConfig) -> dict:
    return dataset_manifest(config, KINDS)


def base_model(config: EmbedRetrievalConfig):
    """The file whose SHA-256 run.json records and resume re-checks (zip, or the weights)."""
    path = resolve_source(config.encoder.source)
    return path if path.is_file() else path / WEIGHTS


def load_data(config: EmbedRetrievalConfig) -> RetrievalData:
    return retrieval_data(open_dataset(config, KINDS))


def load_encoder(config: EmbedRetrievalConfig) -> tuple[SentenceEncoder, str]:
    """The unmodified encoder and its identity (SHA-256 over its files)."""
    files = source_files(resolve_source(config.encoder.source))
    return SentenceEncoder(files, config.encoder.max_length), model_identity(files)


def query_texts(config: EmbedRetrievalConfig, texts) -> list[str]:
    """Queries as the encoder sees them: the instruction added exactly once."""
    return [config.query_instruction + t for t in texts]


def relevant_rows(data: RetrievalData, queries) -> list[set[int]]:
    rows = {doc: i for i, doc in enumerate(data.doc_ids)}
    return [{rows[d] for d in q.relevant} for q in queries]


def split_queries(data: RetrievalData, split: str):
    queries = data.split_queries(split)
    if not queries:
        raise ForgebenchError(f"the dataset has no {split!r} queries", where="field 'split'",
                              hint="give the split its own products (groups) and questions")
    return queries


def scores_report(scores: np.ndarray, data: RetrievalData, queries, scale: float) -> dict:
    """Recall/MRR/nDCG@k, and `loss`: cross-entropy of scale x score against the first
    relevant document over the whole index (the val curve beside the train MNRL)."""
    report = retrieval_metrics(scores, relevant_rows(data, queries), DEFAULT_KS)
    logits = torch.from_numpy(scale * scores).float()
    first = torch.tensor([min(rows) for rows in relevant_rows(data, queries)])
    report["loss"] = float(F.cross_entropy(logits, first))
    return report


def neural_scores(encoder: SentenceEncoder, config, data: RetrievalData, texts) -> np.ndarray:
    docs = encoder.encode(data.doc_texts)
    return (encoder.encode(query_texts(config, texts)) @ docs.T).numpy()


def tfidf_report(config, data: RetrievalData, split: str) -> dict:
    queries = split_queries(data, split)
    scores = TfidfRetriever(data.doc_texts).scores([q.text for q in queries])
    return scores_report(scores, data, queries, config.scale)


def mnrl_loss(queries: torch.Tensor, docs: torch.Tensor, doc_ids: list[str],
              scale: float) -> torch.Tensor:
    """Multiple-negatives ranking loss over unit vectors [B, C]; a repeated document is no
    negative of its own copies."""
    logits = scale * queries @ docs.T                                   # [B, B]
    same = torch.tensor([[a == b for b in doc_ids] for a in doc_ids], device=logits.device)
    logits = logits.masked_fill(same & ~torch.eye(len(doc_ids), dtype=torch.bool,
                                                  device=logits.device), float("-inf"))
    return F.cross_entropy(logits, torch.arange(len(doc_ids), device=logits.device))


def checkpoint_encoder(run: RunDir, checkpoint: Checkpoint) -> SentenceEncoder:
    config = run_config(run)
    encoder, _ = load_encoder(config)
    load_weights(checkpoint, encoder)
    return encoder


def evaluate(run: RunDir, checkpoint: Checkpoint, split: str) -> dict:
    """The checkpoint, the unmodified encoder (epoch 0) and TF-IDF on one split, with the
    selection the index contract records; writes evals/<split>-<checkpoint>.json."""
    config = run_config(run)
    data = load_data(config)
    queries = split_queries(data, split)
    texts = [q.text for q in queries]
    tuned = scores_report(neural_scores(checkpoint_encoder(run, checkpoint), config, data, texts),
                          data, queries, config.scale)
    base, _ = load_encoder(config)
    epoch0 = scores_report(neural_scores(base, config, data, texts), data, queries, config.scale)
    baseline = tfidf_report(config, data, split)
    contract_path = run.path / INDEX_DIR / CONTRACT
    report = {**tuned, "split": split, "checkpoint": checkpoint.name,
              "step": checkpoint.step, "queries": len(queries), "documents": len(data.doc_ids),
              "encoder": tuned, "epoch0": epoch0, "tfidf": baseline,
              "selected": read_json(contract_path)["selected"] if contract_path.exists()
              else None,
              "beats_epoch0": tuned[SELECT_ON] > epoch0[SELECT_ON],
              "beats_tfidf": tuned[SELECT_ON] > baseline[SELECT_ON]}
    return record_eval(run, checkpoint, split, report,
                       ("loss", "recall@5", "mrr@5", "ndcg@5"))


# -- the index contract -------------------------------------------------------------------
def write_index(run: RunDir, config, data: RetrievalData, best: Checkpoint,
                encoder: SentenceEncoder, identity: str, val: dict, baseline: dict) -> dict:
    """index/embeddings.npy (the selected encoder's document vectors, when it is selected) and
    index/contract.json; the baseline wins unless the encoder beats it on val MRR@5."""
    selected = "encoder" if val[SELECT_ON] > baseline[SELECT_ON] else "tfidf"
    contract = {
        "selected": selected, "select_on": f"val {SELECT_ON}",
        "val": {"encoder": {k: val[k] for k in sorted(val)},
                "tfidf": {k: baseline[k] for k in sorted(baseline)}},
        "checkpoint": best.name, "encoder_source": config.encoder.source,
        "encoder_identity": identity,
        "weights_sha256": sha256_file(best.path / MODEL_FILE),
        "pooling": encoder.pooling, "normalized": True, "score": "dot product of unit vectors",
        "max_length": encoder.max_length, "query_instruction": config.query_instruction,
        "documents": [{"doc_id": d, "text_sha256": sha256_bytes(t.encode("utf-8"))}
                      for d, t in zip(data.doc_ids, data.doc_texts)],
    }
    index = run.path / INDEX_DIR
    index.mkdir(exist_ok=True)
    if selected == "encoder":
        vectors = encoder.encode(data.doc_texts).numpy().astype(np.float32)
        buffer = _npy_bytes(vectors)
        atomic_write_bytes(index / EMBEDDINGS, buffer)
        contract.update(dim=int(vectors.shape[1]), embeddings_sha256=sha256_bytes(buffer))
    atomic_write_json(index / CONTRACT, contract)   # last: the contract names what exists
    run.log_event("index_written", selected=selected, checkpoint=best.name)
    return contract


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def check_index(run: RunDir, data: RetrievalData) -> dict:
    """The contract, refused (one clear error) when the corpus, the weights or the vectors
    differ from what it recorded."""
    path = run.path / INDEX_DIR / CONTRACT
    if not path.exists():
        raise ForgebenchError("the run has no index yet", path=path,
                              hint="the index is written when training completes; resume the "
                                   "run to its last step")
    contract = read_json(path)
    recorded = [(d["doc_id"], d["text_sha256"]) for d in contract["documents"]]
    current = [(d, sha256_bytes(t.encode("utf-8"))) for d, t in zip(data.doc_ids,
                                                                     data.doc_texts)]
    if recorded != current:
        changed = next((r[0] for r, c in zip(recorded, current) if r != c), None)
        raise ForgebenchError(
            "the corpus differs from the one indexed" + (f" (first at doc {changed!r})"
                                                         if changed else " (document count)"),
            path=path, where="field 'documents'",
            hint="old document vectors and new ones are incompatible: train a new run")
    if contract["selected"] == "encoder":
        checkpoint = run.checkpoint(contract["checkpoint"])
        if sha256_file(checkpoint.path / MODEL_FILE) != contract["weights_sha256"]:
            raise ForgebenchError("the checkpoint's weights differ from the indexed ones",
                                  path=checkpoint.path / MODEL_FILE,
                                  where="field 'weights_sha256'")
        if sha256_file(run.path / INDEX_DIR / EMBEDDINGS) != contract["embeddings_sha256"]:
            raise ForgebenchError("the document vectors differ from the indexed ones",
                                  path=run.path / INDEX_DIR / EMBEDDINGS,
                                  where="field 'embeddings_sha256'")
    return contract


def search(run: RunDir, query: str, k: int = 5) -> dict:
    """The `k` best documents for `query` from the run's selected system, with scores."""
    config = run_config(run)
    data = load_data(config)
    contract = check_index(run, data)
    if contract["selected"] == "encoder":
        encoder = checkpoint_encoder(run, run.checkpoint(contract["checkpoint"]))
        if encoder.pooling != contract["pooling"]:
            raise ForgebenchError("the encoder's pooling differs from the indexed one",
                                  where="field 'pooling'")
        vectors = torch.from_numpy(load_numeric_array(run.path / INDEX_DIR / EMBEDDINGS))
        scores = (encoder.encode(query_texts(config, [query])) @ vectors.T).numpy()
    else:
        scores = TfidfRetriever(data.doc_texts).scores([query])
    text_of = dict(zip(data.doc_ids, data.doc_texts))
    hits = [{"rank": i + 1, "doc_id": doc, "score": score, "text": text_of[doc]}
            for i, (doc, score) in enumerate(top_k(scores, data.doc_ids, k)[0])]
    return {"query": query, "selected": contract["selected"],
            "checkpoint": contract["checkpoint"], "results": hits}


# -- training -----------------------------------------------------------------------------
def train(job: Job) -> None:
    config: EmbedRetrievalConfig = job.config
    torch.manual_seed(config.seed)
    data = load_data(config)
    pairs = data.train_pairs()
    train_docs = sorted({doc for _, doc in pairs})
    if len(train_docs) < 2:
        raise ForgebenchError("contrastive training needs at least two train documents with "
                              "queries", where="split 'train'",
                              hint="in-batch negatives are the other documents of the batch")
    questions = {doc: [q.text for q, d in pairs if d == doc] for doc in train_docs}
    text_of = dict(zip(data.doc_ids, data.doc_texts))
    val_queries = split_queries(data, "val")

    device = job.device
    encoder, identity = load_encoder(config)
    encoder.to(device)
    opt = config.optim
    optimizer = adamw_for(encoder.named_parameters(), opt)

    def batch_loss(indices: list[int], generator: torch.Generator) -> torch.Tensor:
        docs = [train_docs[i] for i in indices]
        picks = [int(torch.randint(len(questions[d]), (1,), generator=generator)) for d in docs]
        with autocast(config.precision, device.type):
            q = encoder(query_texts(config, [questions[d][p] for d, p in zip(docs, picks)]))
            d = encoder([text_of[doc] for doc in docs])
        return mnrl_loss(q.float(), d.float(), docs, config.scale)

    def validate() -> dict:
        scores = neural_scores(encoder, config, data, [q.text for q in val_queries])
        return scores_report(scores, data, val_queries, config.scale)

    loop = Loop(encoder, optimizer, len(train_docs), batch_loss, validate,
                meta=meta_for(config, [], family="bert", source=config.encoder.source,
                              identity=identity, pooling=encoder.pooling,
                              max_length=encoder.max_length),
                best_key=SELECT_ON, higher_is_better=True, eval_at_start=True)
    train_loop(job, loop)
    if job.stop_requested:
        return
    job.announce("index", f"the best checkpoint by val {SELECT_ON} against TF-IDF")
    best = job.run.checkpoint("best")
    best_encoder = checkpoint_encoder(job.run, best)
    val = scores_report(neural_scores(best_encoder, config, data,
                                      [q.text for q in val_queries]),
                        data, val_queries, config.scale)
    write_index(job.run, config, data, best, best_encoder, identity, val,
                tfidf_report(config, data, "val"))

