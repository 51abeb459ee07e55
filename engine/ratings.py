"""Blind A/B rating sessions: planning, append-only storage, and the statistics of the results.

A session file `ratings/<session>.jsonl` starts with one `session` record (systems with their
generation settings, items, seed) followed by one `answer` record per rated pair, each flushed to
disk before the next pair is shown, so a crash loses nothing. The hidden mapping (which system was
left and right) is stored with every answer. No torch, no Qt: the app and the CLI both use this.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from engine.errors import ForgebenchError
from engine.fsutil import append_jsonl, read_jsonl

CHOICES = ("left", "right", "tie", "skip")
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Pair:
    """One blind comparison: the item and which system sits on each side."""

    index: int
    item: str
    left: str
    right: str


@dataclass
class SessionPlan:
    session: str
    systems: dict[str, dict]
    items: list[str]
    pairs: list[Pair]
    seed: int
    recorded_differences: list[str] = field(default_factory=list)
    generation: dict | None = None        # the one settings dict outputs were generated with


def settings_differences(systems: dict[str, dict]) -> list[str]:
    """Setting names whose values differ between systems (e.g. temperature, cfg, steps)."""
    settings = [s.get("settings", {}) for s in systems.values()]
    keys = sorted(set().union(*settings)) if settings else []
    return [k for k in keys if len({repr(s.get(k)) for s in settings}) > 1]


def plan_session(session: str, systems: dict[str, dict], items: Iterable[str], seed: int,
                 allow_differences: Iterable[str] = ()) -> SessionPlan:
    """Every item × every unordered system pair, in random order with random sides.

    Systems must share their generation settings; a difference is allowed only when it is the
    point of the comparison and named in `allow_differences` (it is then recorded).
    """
    if len(systems) < 2:
        raise ForgebenchError("a blind comparison needs at least two systems",
                              where="systems", hint="add a second run or checkpoint")
    items = list(items)
    if not items:
        raise ForgebenchError("a blind comparison needs at least one prompt, class or seed",
                              where="items")
    differences = settings_differences(systems)
    unexplained = [d for d in differences if d not in set(allow_differences)]
    if unexplained:
        raise ForgebenchError(
            "the systems were generated with different settings: " + ", ".join(unexplained),
            where="systems.settings",
            hint="regenerate with identical settings, or record the difference as the point "
                 "of the comparison")
    rng = random.Random(seed)
    raw = [(item, a, b) for item in items for a, b in itertools.combinations(sorted(systems), 2)]
    rng.shuffle(raw)
    pairs = []
    for index, (item, a, b) in enumerate(raw):
        left, right = (a, b) if rng.random() < 0.5 else (b, a)
        pairs.append(Pair(index, item, left, right))
    return SessionPlan(session, systems, items, pairs, seed, differences)


class RatingStore:
    """Append-only session file. Every answer is fsynced before `record` returns."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def start(self, plan: SessionPlan, rater: str) -> None:
        if self.path.exists() and self.path.stat().st_size:
            raise ForgebenchError("a rating session with this name exists already",
                                  path=self.path, hint="resume it, or choose another name")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.path, {
            "type": "session", "session": plan.session, "systems": plan.systems,
            "items": plan.items, "seed": plan.seed, "rater": rater, "created": time.time(),
            "recorded_differences": plan.recorded_differences, "generation": plan.generation,
            "pairs": [[p.index, p.item, p.left, p.right] for p in plan.pairs]})

    def record(self, pair: Pair, choice: str, rater: str, rubric: dict | None = None,
               rationale: str | None = None) -> dict:
        if choice not in CHOICES:
            raise ValueError(f"choice must be one of {CHOICES}")
        winner = {"left": pair.left, "right": pair.right}.get(choice)
        answer = {"type": "answer", "pair": pair.index, "item": pair.item, "left": pair.left,
                  "right": pair.right, "choice": choice, "winner": winner, "rater": rater,
                  "rubric": rubric or {}, "time": time.time()}
        if rationale:
            answer["rationale"] = rationale
        append_jsonl(self.path, answer)
        return answer

    def header(self) -> dict:
        records = read_jsonl(self.path)
        if not records or records[0].get("type") != "session":
            raise ForgebenchError("not a rating session file (no session header)", path=self.path)
        return records[0]

    def plan(self) -> SessionPlan:
        head = self.header()
        pairs = [Pair(i, item, left, right) for i, item, left, right in head["pairs"]]
        return SessionPlan(head["session"], head["systems"], head["items"], pairs, head["seed"],
                           head.get("recorded_differences", []), head.get("generation"))

    def answers(self) -> list[dict]:
        return [r for r in read_jsonl(self.path) if r.get("type") == "answer"]

    def remaining(self, rater: str) -> list[Pair]:
        done = {a["pair"] for a in self.answers() if a["rater"] == rater}
        return [p for p in self.plan().pairs if p.index not in done]


# -- statistics ----------------------------------------------------------------------------

def wilson_interval(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion; ties count as half a success."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class HeadToHead:
    a: str
    b: str
    wins_a: int
    wins_b: int
    ties: int

    @property
    def n(self) -> int:
        return self.wins_a + self.wins_b + self.ties

    @property
    def win_rate_a(self) -> float:
        return (self.wins_a + 0.5 * self.ties) / self.n if self.n else float("nan")

    @property
    def interval_a(self) -> tuple[float, float]:
        return wilson_interval(self.wins_a + 0.5 * self.ties, self.n)


def head_to_head(answers: Iterable[dict]) -> dict[tuple[str, str], HeadToHead]:
    """Wins, losses and ties for every system pair (skips are not counted)."""
    table: dict[tuple[str, str], HeadToHead] = {}
    for ans in answers:
        if ans["choice"] == "skip":
            continue
        a, b = sorted((ans["left"], ans["right"]))
        entry = table.setdefault((a, b), HeadToHead(a, b, 0, 0, 0))
        if ans["choice"] == "tie":
            entry.ties += 1
        elif ans["winner"] == a:
            entry.wins_a += 1
        else:
            entry.wins_b += 1
    return table


def bradley_terry(answers: Iterable[dict], iterations: int = 10_000,
                  tol: float = 1e-12) -> dict[str, float]:
    """Bradley–Terry strengths by Hunter's MM algorithm, ties as half a win to each side.

    Returns strengths normalised to sum to 1; P(i beats j) = s_i / (s_i + s_j). A system that
    never won gets strength 0 (the maximum-likelihood estimate is on the boundary).
    """
    games = head_to_head(answers)
    systems = sorted({s for pair in games for s in pair})
    if not systems:
        return {}
    wins = {s: 0.0 for s in systems}
    count: dict[tuple[str, str], float] = {}
    for (a, b), g in games.items():
        wins[a] += g.wins_a + 0.5 * g.ties
        wins[b] += g.wins_b + 0.5 * g.ties
        count[(a, b)] = count[(b, a)] = g.n
    strength = {s: 1.0 / len(systems) for s in systems}
    for _ in range(iterations):
        updated = {}
        for i in systems:
            denom = sum(n / (strength[i] + strength[j])
                        for (x, j), n in count.items() if x == i and strength[i] + strength[j] > 0)
            updated[i] = wins[i] / denom if denom else 0.0
        total = sum(updated.values()) or 1.0
        updated = {s: v / total for s, v in updated.items()}
        delta = max(abs(updated[s] - strength[s]) for s in systems)
        strength = updated
        if delta < tol:
            break
    return strength


def rater_agreement(answers: Iterable[dict]) -> dict:
    """Agreement between raters on the pairs two or more of them answered.

    Choices are compared by outcome (which system won, or tie); skips are ignored. Reports the
    raw agreement over rater pairs and Fleiss' kappa over the outcome categories.
    """
    by_pair: dict[int, list[str]] = {}
    for ans in answers:
        if ans["choice"] == "skip":
            continue
        outcome = ans["winner"] or "tie"
        by_pair.setdefault(ans["pair"], []).append(outcome)
    shared = {k: v for k, v in by_pair.items() if len(v) >= 2}
    if not shared:
        return {"pairs": 0, "agreement": None, "fleiss_kappa": None}
    categories = sorted({o for v in shared.values() for o in v})
    agree_sum, proportions = 0.0, {c: 0.0 for c in categories}
    total_ratings = 0
    for outcomes in shared.values():
        n = len(outcomes)
        counts = {c: outcomes.count(c) for c in categories}
        agree_sum += sum(k * (k - 1) for k in counts.values()) / (n * (n - 1))
        for c, k in counts.items():
            proportions[c] += k
        total_ratings += n
    p_bar = agree_sum / len(shared)
    p_e = sum((v / total_ratings) ** 2 for v in proportions.values())
    kappa = 1.0 if p_e == 1 else (p_bar - p_e) / (1 - p_e)
    return {"pairs": len(shared), "agreement": p_bar, "fleiss_kappa": kappa}


def judgement_counts(answers: Iterable[dict]) -> dict:
    """How many answers a session holds, how many state a preference, how many are ties and
    skips (no preference: never exported), and the preferences per rater."""
    answers = list(answers)
    raters: dict[str, int] = {}
    for ans in answers:
        if ans["choice"] in ("left", "right"):
            raters[ans["rater"]] = raters.get(ans["rater"], 0) + 1
    return {"answers": len(answers), "preferences": sum(raters.values()),
            "ties": sum(a["choice"] == "tie" for a in answers),
            "skips": sum(a["choice"] == "skip" for a in answers), "raters": raters}


def preference_records(answers: Iterable[dict], outputs: dict[tuple[str, str], str],
                       prompts: dict[str, str] | None = None) -> list[dict]:
    """prompt / chosen / rejected records for preference training; ties and skips are dropped
    (`judgement_counts` counts them). Each record keeps its rater and, when given, the
    rater's rationale, so pairs from several raters keep their provenance.

    `outputs[(system, item)]` is the text a system produced for an item; `prompts[item]` the
    prompt text (defaults to the item id).
    """
    records = []
    for ans in answers:
        if ans["choice"] not in ("left", "right"):
            continue
        loser = ans["right"] if ans["choice"] == "left" else ans["left"]
        item = ans["item"]
        records.append({"prompt": (prompts or {}).get(item, item),
                        "chosen": outputs[(ans["winner"], item)],
                        "rejected": outputs[(loser, item)], "item": item,
                        "rater": ans["rater"], "time": ans.get("time"),
                        "source": f"blind-ab:{ans['rater']}:pair-{ans['pair']}",
                        **({"rationale": ans["rationale"]} if ans.get("rationale") else {})})
    return records
