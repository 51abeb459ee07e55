"""The search box of a retrieval run (Qt-free): which runs can be searched, the engine command
that answers (`forgebench search RUN QUERY --json`, which checks the run's index contract and
loads the selected system in its own process: the app never imports torch), and its answer
parsed into ranked hits. `search_run` blocks; the view calls it off the GUI thread."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from app.viewmodels.jobs import engine_environment, forgebench_argv
from app.viewmodels.workspace import REPO_ROOT
from engine.errors import ForgebenchError
from engine.fsutil import read_json
from engine.recipe_registry import recipes_with
from engine.rundir import RunDir

SEARCH_RECIPES = recipes_with("search")
CONTRACT = Path("index") / "contract.json"   # engine/recipes/embed_retrieval.py writes it


@dataclass(frozen=True)
class Hit:
    rank: int
    doc_id: str
    score: float
    text: str


@dataclass(frozen=True)
class SearchAnswer:
    query: str
    selected: str          # "encoder" or "tfidf": the system the run shipped
    checkpoint: str
    hits: list[Hit]

    @property
    def summary(self) -> str:
        system = "fine-tuned encoder" if self.selected == "encoder" else "TF-IDF baseline"
        return (f"{len(self.hits)} documents from the {system} ({self.checkpoint}); "
                "scores are similarities, not probabilities")


def searchable(path: Path | None) -> tuple[bool, str]:
    """(can search, why not) for a run folder."""
    if path is None:
        return False, "Select one embed-retrieval run in the ledger to search its corpus."
    run = RunDir(path)
    try:
        recipe = run.manifest().get("recipe")
    except ForgebenchError:
        return False, f"{path.name}: not a readable run."
    if recipe not in SEARCH_RECIPES:
        return False, f"{path.name} is a {recipe} run; search needs an embed-retrieval run."
    if not (run.path / CONTRACT).is_file():
        return False, f"{path.name} has no index yet: it is written when training completes."
    contract = read_json(run.path / CONTRACT)
    return True, f"{path.name}: searching with {contract.get('selected')} " \
                 f"({contract.get('checkpoint')})."


def search_argv(path: Path, query: str, k: int) -> list[str]:
    return forgebench_argv() + ["search", str(path), query, "--k", str(k), "--json"]


def parse_answer(stdout: str, stderr: str, code: int) -> SearchAnswer:
    """The engine's JSON answer, or its one-line error as a ForgebenchError."""
    if code != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        message = next((line for line in lines if line.startswith("error:")),
                       lines[-1] if lines else f"search exited with status {code}")
        raise ForgebenchError(message.removeprefix("error:").strip())
    data = json.loads(stdout)
    return SearchAnswer(data["query"], data["selected"], data["checkpoint"],
                        [Hit(h["rank"], h["doc_id"], float(h["score"]), h["text"])
                         for h in data["results"]])


def search_run(path: Path, query: str, k: int = 5) -> SearchAnswer:
    if not query.strip():
        raise ForgebenchError("type a question to search for")
    done = subprocess.run(search_argv(path, query, k), capture_output=True, text=True,
                          cwd=REPO_ROOT, env=engine_environment(os.environ), timeout=600)
    return parse_answer(done.stdout, done.stderr, done.returncode)
