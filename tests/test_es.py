"""The evolution-strategies update (engine.train.es) against a worked example, the noise
contract (antithetic pairs, regeneration from (seed, iteration, pair)), centered ranks against a
brute-force reference, exact restore, the anchored decay's resume ordering, and the rule reward's
text scoring (engine.eval.text_reward)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.errors import ForgebenchError
from engine.eval.text_reward import in_envelope, rule_reward, unigram_f1
from engine.train.es import EvolutionStrategy, centered_ranks


class FixedNoise(EvolutionStrategy):
    """The strategy with noise written out by hand, for the worked example."""

    table = {0: [torch.tensor([1.0, 0.0, -2.0])], 1: [torch.tensor([0.5, 1.0, 0.0])]}

    def noise(self, iteration, j):
        return [t.clone() for t in self.table[j]]


def test_update_matches_the_worked_example():
    # θ = [1, 2, 3], σ = 0.1, lr = 0.2, four antithetic members:
    #   m0 = θ+σε0 → 3, m1 = θ−σε0 → 1, m2 = θ+σε1 → 0, m3 = θ−σε1 → 2
    # ranks (ascending): m2 0, m1 1, m3 2, m0 3 → u = rank/3 − ½ = [½, −⅙, −½, ⅙]
    # g = 1/(4·0.1)·[(½+⅙)·ε0 + (−½−⅙)·ε1] = (5/3)·(ε0 − ε1) = (5/3)·[0.5, −1, −2]
    # θ' = θ + 0.2·g = [1 + 1/6, 2 − 1/3, 3 − 2/3]
    theta = torch.tensor([1.0, 2.0, 3.0])
    es = FixedNoise([theta], seed=0, population=4, sigma=0.1, lr=0.2)
    es.perturb(0, 1)
    assert torch.allclose(theta, torch.tensor([0.9, 2.0, 3.2]))      # θ − σ·ε0
    es.restore()
    report = es.step(0, [3.0, 1.0, 0.0, 2.0])
    expected = torch.tensor([1 + 1 / 6, 2 - 1 / 3, 3 - 2 / 3])
    assert torch.allclose(theta, expected, atol=1e-6), theta
    assert report.grad_norm == pytest.approx(5 / 3 * math.sqrt(0.25 + 1 + 4), rel=1e-6)
    assert report.update_norm == pytest.approx(0.2 * report.grad_norm, rel=1e-6)
    assert (report.reward_mean, report.reward_max, report.reward_min) == (1.5, 3.0, 0.0)
    assert report.reward_std == pytest.approx(math.sqrt(1.25))


def test_raw_shaping_and_plain_sampling_follow_the_same_estimator():
    # no shaping, no antithetic pairs: g = 1/(nσ) Σ r_i ε_i = 1/(2·0.5)·(2·ε0 − 1·ε1)
    theta = torch.zeros(3)
    es = FixedNoise([theta], seed=0, population=2, sigma=0.5, lr=1.0, antithetic=False,
                    shaping="none")
    es.step(0, [2.0, -1.0])
    assert torch.allclose(theta, torch.tensor([1.5, -1.0, -4.0]))


def test_anchored_decay_pulls_toward_the_starting_weights():
    theta = torch.tensor([1.0, 2.0, 3.0])
    for kind, pull in (("l2", torch.tensor([0.5, -1.0, 0.0])),
                       ("l1", torch.tensor([1.0, -1.0, 0.0]))):
        es = FixedNoise([theta.clone()], seed=0, population=4, sigma=0.1, lr=0.2,
                        anchor_decay=kind, decay=0.5)
        es.load([torch.tensor([1.5, 1.0, 3.0])])          # θ − θ₀ = [0.5, −1, 0]
        es.step(0, [1.0, 1.0, 1.0, 1.0])                 # ranks of ties: u = [−½, −⅙, ⅙, ½]
        g = (1 / 0.4) * ((-0.5 + 1 / 6) * FixedNoise.table[0][0]
                         + (1 / 6 - 0.5) * FixedNoise.table[1][0])
        expected = torch.tensor([1.5, 1.0, 3.0]) + 0.2 * g - 0.2 * 0.5 * pull
        assert torch.allclose(es.params[0], expected, atol=1e-6), kind


def test_noise_is_regenerated_from_seed_iteration_and_pair():
    shapes = [torch.zeros(4, 3), torch.zeros(5)]
    a = EvolutionStrategy([t.clone() for t in shapes], seed=7, population=6, sigma=0.1, lr=0.1)
    b = EvolutionStrategy([t.clone() for t in shapes], seed=7, population=6, sigma=0.1, lr=0.1)
    for t, j in ((0, 0), (3, 2)):
        assert all(torch.equal(x, y) for x, y in zip(a.noise(t, j), b.noise(t, j)))
    different = [a.noise(0, 1), a.noise(1, 0),
                 EvolutionStrategy([t.clone() for t in shapes], seed=8, population=6,
                                   sigma=0.1, lr=0.1).noise(0, 0)]
    for other in different:   # twin: another pair, iteration or seed draws other noise
        assert not torch.equal(other[0], a.noise(0, 0)[0])


def test_antithetic_members_mirror_each_other_and_restore_is_exact():
    centre = torch.randn(64, generator=torch.Generator().manual_seed(1))
    theta = centre.clone()
    es = EvolutionStrategy([theta], seed=3, population=4, sigma=0.05, lr=0.1)
    points = []
    for member in range(4):
        es.perturb(2, member)
        points.append(theta.clone())
        es.restore()
        assert torch.equal(theta, centre)       # bit for bit: copied back, not subtracted
    (eps,) = es.noise(2, 0)
    assert torch.allclose(points[0] - centre, 0.05 * eps, atol=1e-7)
    assert torch.allclose(points[1] - centre, -0.05 * eps, atol=1e-7)
    assert not torch.allclose(points[2], points[0])      # the second pair has its own draw


def brute_force_ranks(rewards):
    n = len(rewards)
    return [sum((rewards[j], j) < (rewards[i], i) for j in range(n)) / (n - 1) - 0.5
            for i in range(n)]


def test_centered_ranks_match_a_brute_force_reference():
    rng = random.Random(0)
    for n in (2, 3, 8, 31):
        rewards = [rng.choice([0.0, 0.25, 1.0, rng.gauss(0, 1)]) for _ in range(n)]  # ties too
        shaped = centered_ranks(rewards)
        assert shaped == brute_force_ranks(rewards)
        assert sorted(shaped) == [k / (n - 1) - 0.5 for k in range(n)]
        # only the order counts: an outlier or a monotone rescale changes nothing
        assert centered_ranks([math.exp(r) * 1e6 for r in rewards]) == shaped
    assert centered_ranks([5.0]) == [0.0]


def test_non_finite_rewards_skip_the_update():
    theta = torch.ones(3)
    es = EvolutionStrategy([theta], seed=0, population=2, sigma=0.1, lr=1.0)
    report = es.step(0, [1.0, float("nan")])
    assert not report.finite and report.update_norm == 0.0
    assert torch.equal(theta, torch.ones(3))


def run_steps(es, start, stop, reward):
    for t in range(start, stop):
        rewards = []
        for member in range(es.population):
            es.perturb(t, member)
            rewards.append(reward(es.params[0]))
        es.restore()
        es.step(t, rewards)


def test_resume_captures_the_anchor_before_the_checkpoint_loads():
    """The ordering trap of anchored decay: the resumed strategy is built over the starting
    weights and then loads the checkpoint; built over the checkpoint, it would anchor there."""
    start = torch.linspace(-1, 1, 16)
    target = torch.linspace(2, 0, 16)
    reward = lambda p: -float((p - target).square().sum())            # noqa: E731
    settings = dict(seed=4, population=6, sigma=0.1, lr=0.05, anchor_decay="l2", decay=0.5)

    straight = EvolutionStrategy([start.clone()], **settings)
    run_steps(straight, 0, 8, reward)

    first = EvolutionStrategy([start.clone()], **settings)
    run_steps(first, 0, 4, reward)
    saved = [p.clone() for p in first.params]                         # the checkpoint

    resumed = EvolutionStrategy([start.clone()], **settings)          # anchor: the start
    resumed.load(saved)
    run_steps(resumed, 4, 8, reward)
    assert torch.equal(resumed.params[0], straight.params[0])

    trapped = EvolutionStrategy([saved[0].clone()], **settings)       # anchor: the checkpoint
    run_steps(trapped, 4, 8, reward)
    assert not torch.equal(trapped.params[0], straight.params[0])


def test_bad_settings_are_refused():
    with pytest.raises(ForgebenchError, match="odd"):
        EvolutionStrategy([torch.zeros(2)], seed=0, population=5, sigma=0.1, lr=0.1)
    for sigma in (0.0, -0.1, float("inf")):
        with pytest.raises(ForgebenchError, match="sigma"):
            EvolutionStrategy([torch.zeros(2)], seed=0, population=4, sigma=sigma, lr=0.1)
    EvolutionStrategy([torch.zeros(2)], seed=0, population=5, sigma=0.1, lr=0.1,
                      antithetic=False)


def test_rule_reward_scores_words_and_the_envelope():
    reference = "Ahoy! The capital of France be Paris, matey."
    assert unigram_f1(reference, reference) == 1.0
    # candidate words: the capital is paris (4); shared with the 8 reference words: 3
    # precision 3/4, recall 3/8, F1 = 2·(3/4)(3/8)/(3/4 + 3/8) = 1/2
    assert unigram_f1("The capital is Paris.", reference) == pytest.approx(0.5)
    assert unigram_f1("", reference) == 0.0
    assert in_envelope("  Ahoy! Paris, matey. ", "Ahoy!", "matey.")
    assert not in_envelope("Paris, matey.", "Ahoy!", "matey.")
    assert rule_reward("Ahoy! Paris, matey.", reference, prefix="Ahoy!",
                       suffix="matey.") == pytest.approx(2 * (1 * 3 / 8) / (1 + 3 / 8) + 0.1)
