"""Blind A/B planning, storage and statistics against hand computations and known cases."""

import math

import pytest

from engine.errors import ForgebenchError
from engine.ratings import (
    RatingStore,
    bradley_terry,
    head_to_head,
    plan_session,
    preference_records,
    rater_agreement,
    wilson_interval,
)

SYSTEMS = {"base": {"settings": {"temperature": 0.0, "max_tokens": 32}},
           "tuned": {"settings": {"temperature": 0.0, "max_tokens": 32}}}


def _answers(games):
    """games: list of (left, right, choice)"""
    out = []
    for i, (left, right, choice) in enumerate(games):
        winner = {"left": left, "right": right}.get(choice)
        out.append({"pair": i, "item": f"p{i}", "left": left, "right": right, "choice": choice,
                    "winner": winner, "rater": "r1"})
    return out


def test_wilson_interval_matches_published_values():
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=5e-5) and hi == pytest.approx(0.9433, abs=5e-5)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=5e-5)


def test_bradley_terry_two_systems_is_the_win_fraction():
    s = bradley_terry(_answers([("a", "b", "left")] * 3 + [("a", "b", "right")]))
    assert s["a"] / (s["a"] + s["b"]) == pytest.approx(0.75, abs=1e-9)


def test_bradley_terry_recovers_strengths_from_expected_counts():
    # True strengths 4:2:1 -> P(a>b)=2/3, P(a>c)=4/5, P(b>c)=2/3; 15 games per pair with the
    # expected outcome counts make the true strengths the exact maximum-likelihood estimate.
    games = ([("a", "b", "left")] * 10 + [("a", "b", "right")] * 5
             + [("a", "c", "left")] * 12 + [("a", "c", "right")] * 3
             + [("b", "c", "left")] * 10 + [("b", "c", "right")] * 5)
    s = bradley_terry(_answers(games))
    assert s["a"] / s["c"] == pytest.approx(4.0, rel=1e-6)
    assert s["b"] / s["c"] == pytest.approx(2.0, rel=1e-6)
    assert sum(s.values()) == pytest.approx(1.0)


def test_bradley_terry_satisfies_the_score_equations_with_ties():
    games = ([("x", "y", "left")] * 4 + [("x", "y", "tie")] * 2 + [("y", "z", "left")] * 3
             + [("z", "y", "left")] * 2 + [("x", "z", "right")] * 1 + [("x", "z", "left")] * 3)
    answers = _answers(games)
    s = bradley_terry(answers)
    table = head_to_head(answers)
    for i in s:  # observed wins (ties as halves) == expected wins under the fitted model
        observed = expected = 0.0
        for (a, b), g in table.items():
            if i in (a, b):
                j = b if i == a else a
                observed += (g.wins_a if i == a else g.wins_b) + 0.5 * g.ties
                expected += g.n * s[i] / (s[i] + s[j])
        assert observed == pytest.approx(expected, abs=1e-8)


def test_plan_covers_every_item_and_pair_with_random_sides():
    systems = {k: {"settings": {"cfg": 2.0}} for k in ("s1", "s2", "s3")}
    plan = plan_session("sess", systems, [f"i{n}" for n in range(20)], seed=7)
    assert len(plan.pairs) == 20 * 3
    seen = {(p.item, frozenset((p.left, p.right))) for p in plan.pairs}
    assert len(seen) == 60
    lefts = [p.left for p in plan.pairs if {p.left, p.right} == {"s1", "s2"}]
    assert 0 < lefts.count("s1") < len(lefts)  # both placements occur
    again = plan_session("sess", systems, [f"i{n}" for n in range(20)], seed=7)
    assert again.pairs == plan.pairs


def test_plan_refuses_unexplained_setting_differences():
    systems = {"a": {"settings": {"temperature": 0.0}}, "b": {"settings": {"temperature": 0.7}}}
    with pytest.raises(ForgebenchError, match="temperature"):
        plan_session("s", systems, ["p"], seed=0)
    plan = plan_session("s", systems, ["p"], seed=0, allow_differences=["temperature"])
    assert plan.recorded_differences == ["temperature"]


def test_store_flushes_each_answer_and_win_rate_matches_hand_count(tmp_path):
    plan = plan_session("s", SYSTEMS, [f"prompt-{i}" for i in range(10)], seed=3)
    store = RatingStore(tmp_path / "ratings" / "s.jsonl")
    store.start(plan, rater="ana")
    # The rater prefers "tuned" on the first 7 pairs, ties one, prefers base on the rest.
    for k, pair in enumerate(plan.pairs):
        if k < 7:
            choice = "left" if pair.left == "tuned" else "right"
        elif k == 7:
            choice = "tie"
        else:
            choice = "left" if pair.left == "base" else "right"
        store.record(pair, choice, rater="ana")
        # a crash now would lose nothing: a fresh reader sees every answer so far
        assert len(RatingStore(store.path).answers()) == k + 1
    answers = RatingStore(store.path).answers()
    assert {(a["left"], a["right"]) for a in answers} == {(p.left, p.right) for p in plan.pairs}
    h2h = head_to_head(answers)[("base", "tuned")]
    assert (h2h.wins_a, h2h.wins_b, h2h.ties) == (2, 7, 1)
    assert 1 - h2h.win_rate_a == pytest.approx(7.5 / 10)
    assert store.remaining("ana") == []
    with pytest.raises(ForgebenchError):
        store.start(plan, rater="ana")


def test_rater_agreement_fleiss_kappa_hand_case():
    base = {"item": "i", "left": "a", "right": "b"}
    answers = []
    # pair 0: both raters pick a; pair 1: both pick b; pair 2: one a, one b
    for pair, picks in enumerate([("a", "a"), ("b", "b"), ("a", "b")]):
        for rater, pick in zip(("r1", "r2"), picks):
            answers.append(dict(base, pair=pair, rater=rater, winner=pick,
                                choice="left" if pick == "a" else "right"))
    result = rater_agreement(answers)
    # P_bar = (1 + 1 + 0) / 3; p_a = p_b = 0.5 -> P_e = 0.5; kappa = (2/3 - 1/2) / (1/2) = 1/3
    assert result["pairs"] == 3
    assert result["agreement"] == pytest.approx(2 / 3)
    assert result["fleiss_kappa"] == pytest.approx(1 / 3)


def test_preference_records_drop_ties_and_keep_the_winner():
    answers = _answers([("a", "b", "left"), ("b", "a", "left"), ("a", "b", "tie")])
    outputs = {(s, f"p{i}"): f"{s}-out-{i}" for s in "ab" for i in range(3)}
    recs = preference_records(answers, outputs, prompts={"p0": "Q0", "p1": "Q1"})
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in recs] == [
        ("Q0", "a-out-0", "b-out-0"), ("Q1", "b-out-1", "a-out-1")]
    assert not math.isnan(head_to_head(answers)[("a", "b")].win_rate_a)
