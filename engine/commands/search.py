"""`forgebench search RUN "query"`: the run's selected retrieval system (its recipe's `search`,
checked against the run's index contract) ranks the corpus; prints the top documents with
their scores, or with --json one JSON object (what the app's search box reads)."""

from __future__ import annotations

import json

from engine.errors import ForgebenchError
from engine.jobs import recipe_hook
from engine.rundir import RunDir


def cmd_search(args) -> int:
    run = RunDir(args.run_dir).require()
    search = recipe_hook(run, "search", "has no search index",
                         "search works on embed-retrieval runs")
    if not args.query.strip():
        raise ForgebenchError("the query is empty", where="QUERY")
    result = search(run, args.query, args.k)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['selected']} ({result['checkpoint']}): {result['query']}")
    for hit in result["results"]:
        print(f"{hit['rank']:>3}  {hit['score']:.4f}  {hit['doc_id']}  {hit['text']}")
    return 0
