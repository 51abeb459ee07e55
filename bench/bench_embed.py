"""Sentence-embedding throughput: engine.models.bert against sentence-transformers on the real
all-MiniLM-L6-v2, encoding the bundled help-article corpus (192 documents) and its questions.

Both run in this process on the same threads, interleaved, best of `--repeats`; prints
texts/second of each, their ratio, and the largest cosine distance between the two vectors of
any text. Needs the `minilm` and `retrieval-parity` extras.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.models.bert import SentenceEncoder, resolve_source, source_files  # noqa: E402

SAMPLE = ROOT / "resources/sample-workspace/datasets/help-articles"


def texts() -> list[str]:
    return [json.loads(line)["text"] for name in ("corpus.jsonl", "queries.jsonl")
            for line in (SAMPLE / name).read_text().splitlines()]


def best_rate(fn, items: list[str], repeats: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(items)
        best = min(best, time.perf_counter() - start)
    return len(items) / best, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    items = texts()
    source = resolve_source("package:all_minilm_l6_v2")
    ours = SentenceEncoder(source_files(source))
    with tempfile.TemporaryDirectory() as folder:
        with zipfile.ZipFile(source) as archive:
            archive.extractall(folder)
        peer = SentenceTransformer(folder, device="cpu")
        rates = {"ours": [], "sentence-transformers": []}
        for _ in range(args.repeats):   # interleaved, so load changes hit both alike
            r, a = best_rate(lambda x: ours.encode(x, batch_size=args.batch), items, 1)
            rates["ours"].append(r)
            r, b = best_rate(lambda x: torch.tensor(peer.encode(x, batch_size=args.batch)),
                             items, 1)
            rates["sentence-transformers"].append(r)
    distance = float((1 - torch.nn.functional.cosine_similarity(a, b)).abs().max())
    mine, theirs = max(rates["ours"]), max(rates["sentence-transformers"])
    print(f"{len(items)} texts, batch {args.batch}, threads {torch.get_num_threads()}: ours "
          f"{mine:.1f} texts/s, sentence-transformers {theirs:.1f} texts/s, ratio "
          f"{mine / theirs:.2f}; max cosine distance {distance:.2e}")


if __name__ == "__main__":
    main()
