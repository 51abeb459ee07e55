"""Blind A/B sessions over what runs generated: systems, the session itself, and its results.

A system is one run's checkpoint; its outputs are the samples (images, sounds) or generations
(text) that checkpoint wrote, keyed by item — the class/seed/position of a sample or the prompt
of a generation — so every system answers the same items. Planning, storage (append-only,
fsynced per answer, hidden mapping in every record) and statistics are `engine.ratings`'; this
module only gathers the outputs and shapes the results for the pane. No Qt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from engine.data.dataset import write_manifest
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_text
from engine.ratings import (Pair, RatingStore, bradley_terry, head_to_head, plan_session,
                            preference_records, rater_agreement)
from engine.rundir import RunDir

from app.viewmodels.samples import generation_settings, generations, run_samples, text_file

KEYS = {"A": "left", "B": "right", "T": "tie", "S": "skip"}


def system_name(run_dir: Path, checkpoint: str) -> str:
    return f"{Path(run_dir).name}/{checkpoint}"


def gather_system(run_dir: str | Path, checkpoint: str) -> dict:
    """One system: its kind, the settings its outputs were made with, and item → output."""
    run_dir = Path(run_dir)
    media = [s for s in run_samples(run_dir) if s.checkpoint == checkpoint]
    if media:
        settings = [s.settings for s in media]
        differing = sorted({k for s in settings for k in s
                            if len({repr(x.get(k)) for x in settings}) > 1})
        if differing:
            raise ForgebenchError(
                f"the samples of {checkpoint} were made with different settings: "
                + ", ".join(differing), path=run_dir / "samples" / checkpoint,
                hint="generate a fresh sample set for the comparison with one set of settings")
        return {"run": str(run_dir), "checkpoint": checkpoint, "kind": media[0].kind,
                "settings": settings[0], "outputs": {s.item: str(s.path) for s in media}}
    folder = RunDir(run_dir).samples_dir / checkpoint
    if text_file(folder):
        return {"run": str(run_dir), "checkpoint": checkpoint, "kind": "text",
                "settings": generation_settings(run_dir, checkpoint),
                "outputs": generations(run_dir, checkpoint)}
    raise ForgebenchError("this checkpoint has no samples to compare", path=folder,
                          hint="generate samples for it first (Samples pane → Generate)")


def common_items(systems: dict[str, dict]) -> list[str]:
    """Items every system has an output for, in a stable order."""
    sets = [set(s["outputs"]) for s in systems.values()]
    return sorted(set.intersection(*sets)) if sets else []


def session_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")
    if not name:
        raise ForgebenchError("a session needs a name (letters, digits, . _ -)", where="session")
    return name


@dataclass
class Side:
    """What the rater sees of one side: the output only, never the system."""

    kind: str
    output: str        # a file path (image/audio) or the generated text


class ABSession:
    """One rater working through a session file, one pair at a time."""

    def __init__(self, store: RatingStore, rater: str):
        self.store = store
        self.rater = rater
        self.plan = store.plan()
        self._remaining = store.remaining(rater)

    @classmethod
    def create(cls, ratings_dir: Path, name: str, systems: dict[str, dict], rater: str,
               seed: int = 0, items: list[str] | None = None, limit: int | None = None,
               allow_differences: tuple[str, ...] = ()) -> "ABSession":
        """Plan and start a session. `items` defaults to every common item; `limit` keeps the
        first N pairs of the shuffled plan (a session of a chosen length)."""
        items = common_items(systems) if items is None else items
        if not items:
            raise ForgebenchError("the systems have no item in common to compare",
                                  where="systems",
                                  hint="generate the same classes and seeds for each")
        kinds = {s["kind"] for s in systems.values()}
        if len(kinds) > 1:
            raise ForgebenchError("cannot compare " + " with ".join(sorted(kinds)),
                                  where="systems")
        plan = plan_session(session_name(name), systems, items, seed, allow_differences)
        if limit is not None:
            plan.pairs = plan.pairs[:limit]
            plan.items = sorted({p.item for p in plan.pairs})
        store = RatingStore(Path(ratings_dir) / f"{plan.session}.jsonl")
        store.start(plan, rater)
        return cls(store, rater)

    @classmethod
    def open(cls, path: Path, rater: str) -> "ABSession":
        return cls(RatingStore(path), rater)

    @property
    def kind(self) -> str:
        return next(iter(self.plan.systems.values()))["kind"]

    @property
    def total(self) -> int:
        return len(self.plan.pairs)

    @property
    def done(self) -> int:
        return self.total - len(self._remaining)

    @property
    def finished(self) -> bool:
        return not self._remaining

    def current(self) -> Pair | None:
        return self._remaining[0] if self._remaining else None

    def sides(self, pair: Pair) -> tuple[Side, Side]:
        outputs = {name: s["outputs"][pair.item] for name, s in self.plan.systems.items()}
        return Side(self.kind, str(outputs[pair.left])), Side(self.kind, str(outputs[pair.right]))

    def prompt(self, pair: Pair) -> str:
        """What the rater is told was asked: the prompt (text) or class and seed (media)."""
        if self.kind == "text":
            return pair.item
        label, seed, position = pair.item.rsplit("-", 2)
        return f"class {label}, {seed}, sample {int(position)}"

    def answer(self, choice: str, rubric: dict | None = None) -> dict:
        """Store the answer (fsynced) and move on; only then is the next pair available."""
        pair = self.current()
        if pair is None:
            raise ForgebenchError("the session is finished", path=self.store.path)
        record = self.store.record(pair, choice, self.rater, rubric)
        self._remaining.pop(0)
        return record

    def results(self) -> dict:
        return session_results(self.store)

    def export_preferences(self, out_dir: Path) -> Path:
        """The answered text pairs as a `preferences` dataset (prompt / chosen / rejected)."""
        if self.kind != "text":
            raise ForgebenchError("preference datasets are made from text comparisons; this "
                                  f"session compares {self.kind}", where="export")
        out_dir = Path(out_dir)
        if out_dir.exists():
            raise ForgebenchError("the folder exists already", path=out_dir,
                                  hint="choose a new dataset name")
        outputs = {(name, item): text for name, s in self.plan.systems.items()
                   for item, text in s["outputs"].items()}
        records = preference_records(self.store.answers(), outputs)
        if not records:
            raise ForgebenchError("no answered pair has a winner yet (ties and skips are not "
                                  "preferences)", path=self.store.path)
        lines = []
        for i, record in enumerate(records):
            lines.append({"id": f"pref-{i:05d}", **record,
                          "rights": "generated by the compared models; rated by "
                                    f"{record['source'].split(':')[1]}"})
        out_dir.mkdir(parents=True)
        atomic_write_text(out_dir / "records.jsonl",
                          "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
        write_manifest(out_dir, "preferences", out_dir.name,
                       provenance={"session": str(self.store.path)})
        return out_dir


def session_results(store: RatingStore) -> dict:
    """Win rates with 95% Wilson intervals per system pair, Bradley–Terry strengths when more
    than two systems were compared, the per-item table, and agreement between raters."""
    answers = store.answers()
    plan = store.plan()
    pairs = []
    for (a, b), g in sorted(head_to_head(answers).items()):
        low, high = g.interval_a
        pairs.append({"a": a, "b": b, "wins_a": g.wins_a, "wins_b": g.wins_b, "ties": g.ties,
                      "n": g.n, "win_rate_a": g.win_rate_a, "ci_low": low, "ci_high": high})
    items: dict[str, dict] = {}
    for ans in answers:
        row = items.setdefault(ans["item"], {"item": ans["item"], "answers": 0, "ties": 0,
                                             "skips": 0, "wins": {}})
        row["answers"] += 1
        if ans["choice"] == "tie":
            row["ties"] += 1
        elif ans["choice"] == "skip":
            row["skips"] += 1
        else:
            row["wins"][ans["winner"]] = row["wins"].get(ans["winner"], 0) + 1
    return {"systems": sorted(plan.systems), "answered": len(answers), "planned": len(plan.pairs),
            "pairs": pairs,
            "bradley_terry": bradley_terry(answers) if len(plan.systems) > 2 else None,
            "items": [items[k] for k in sorted(items)],
            "raters": sorted({a["rater"] for a in answers}),
            "agreement": rater_agreement(answers),
            "recorded_differences": plan.recorded_differences}
