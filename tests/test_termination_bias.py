"""Which advantage estimators are unbiased when the policy decides when to stop
(docs/credit-bias.md): each estimator's exact expected update, enumerated over every group
by experiments/termination_bias.py, against true gradients computed here by finite
differences of objectives this file enumerates itself; and the ``*_unbiased`` variants
against their formulas, written here. About 2 s of CPU.
"""

import math
import random
import statistics

import numpy as np
import pytest

from conftest import load_script
from trainer.advantages import TrajectoryRewards, compute_group_advantages

tb = load_script("experiments/termination_bias.py")

# The MDP, restated from its description (not read from the module): a turn is one action
# of a softmax policy with logits theta[state, action]; search_a earns 0.3 and finds the
# answer, search_b earns 0.1 and changes nothing, answer ends the episode with outcome 1
# if found else 0; the last of H turns must answer; with can_stop, answer is allowed at
# every turn, else only at the last.
H = 4
SEARCHING, FOUND = 0, 1
SEARCH_A, SEARCH_B, ANSWER = 0, 1, 2
TOOL = {SEARCH_A: 0.3, SEARCH_B: 0.1}
THETA = np.array([[0.3, -0.2, 0.0], [0.2, 0.4, 0.1]])
G = 3


def probs(theta, state, k, can_stop):
    allowed = [ANSWER] if k == H - 1 else ([SEARCH_A, SEARCH_B, ANSWER] if can_stop
                                           else [SEARCH_A, SEARCH_B])
    weights = [math.exp(theta[state, a]) for a in allowed]
    return {a: w / sum(weights) for a, w in zip(allowed, weights)}


def expectation(theta, can_stop, what, acting=None):
    """E[outcome] (``what="outcome"``), E[sum of turn rewards] ("return"), or the expected
    immediate intermediate reward with the states visited under ``theta`` and the actions
    taken under ``acting`` ("myopic"; its gradient in ``acting`` is MT-GRPO's turn credit)."""
    acting = theta if acting is None else acting

    def walk(state, k):
        total = 0.0
        act = probs(acting, state, k, can_stop)
        for action, p in probs(theta, state, k, can_stop).items():
            if action == ANSWER:
                outcome = 1.0 if state == FOUND else 0.0
                total += p * (outcome if what in ("outcome", "return") else 0.0)
                continue
            reward = {"outcome": 0.0, "return": TOOL[action],
                      "myopic": TOOL[action] * act[action] / p}[what]
            following = FOUND if action == SEARCH_A else state
            total += p * (reward + walk(following, k + 1))
        return total

    return walk(SEARCHING, 0)


def finite_difference(f, theta, h=1e-6):
    grad = np.zeros(theta.size)
    for j in range(theta.size):
        step = np.zeros(theta.size)
        step[j] = h
        step = step.reshape(theta.shape)
        grad[j] = (f(theta + step) - f(theta - step)) / (2 * h)
    return grad


def true_gradient(target, can_stop, theta=THETA):
    if target in ("outcome", "return"):
        return finite_difference(lambda t: expectation(t, can_stop, target), theta)
    # MT-GRPO's credit rule: the outcome on every turn, each intermediate reward on its own
    # turn = grad E[outcome] + the gradient of the myopic term in the acting policy only.
    myopic = finite_difference(lambda t: expectation(theta, can_stop, "myopic", acting=t), theta)
    return true_gradient("outcome", can_stop, theta) + myopic


@pytest.fixture(scope="module")
def exact():
    """Centred advantages (no std), aggregation constant: every estimator's exact expected
    update per MDP, and the true gradients."""
    out = {}
    for mdp in tb.mdps(H):
        trajs = tb.trajectories(mdp, THETA)
        assert math.fsum(t.prob for t in trajs) == pytest.approx(1.0, abs=1e-12)
        out[mdp.can_stop] = {
            "truth": {t: true_gradient(t, mdp.can_stop) for t in tb.TARGETS},
            "update": {e: tb.expected_update(trajs, e, G, scale=False) for e in (
                "grpo", "grpo_merged", "mt_grpo", "mt_grpo_unbiased", "turn_rtg",
                "turn_rtg_unbiased", "gigpo", "gigpo_unbiased")},
        }
    return out


def errors(exact, estimator, target, can_stop):
    """(relative error, stop-parameter error) at the scale an unbiased estimator of that
    form has: (G-1)/G for centred advantages, twice that for GiGPO (episode + step)."""
    truth = exact[can_stop]["truth"][target]
    scale = (G - 1) / G * (2.0 if estimator.startswith("gigpo") else 1.0)
    error = exact[can_stop]["update"][estimator] / scale - truth
    stop = np.zeros((2, 3))
    stop[:, ANSWER] = 1.0
    stop -= stop.mean(axis=1, keepdims=True)
    stop = stop.ravel() / np.linalg.norm(stop)
    norm = np.linalg.norm(truth)
    return float(np.linalg.norm(error) / norm), float(error @ stop / norm)


@pytest.mark.parametrize("estimator, target", [
    ("grpo", "outcome"), ("grpo_merged", "return"), ("mt_grpo_unbiased", "credit"),
    ("turn_rtg_unbiased", "return"), ("gigpo_unbiased", "return")])
def test_unbiased_when_the_policy_stops(exact, estimator, target):
    # ... and at a fixed horizon. Exact enumeration: the only error is the advantages'
    # float32 rounding (~1e-8).
    for can_stop in (True, False):
        assert errors(exact, estimator, target, can_stop)[0] < 1e-6


def test_variants_are_unbiased_at_another_policy():
    # Not a property of THETA: a policy drawn at random (G = 2 keeps it cheap).
    theta = np.random.default_rng(5).normal(size=(2, 3))
    trajs = tb.trajectories(tb.Mdp("policy stops", H, True), theta)
    for estimator, target, scale in (("mt_grpo_unbiased", "credit", 0.5),
                                     ("turn_rtg_unbiased", "return", 0.5),
                                     ("gigpo_unbiased", "return", 1.0)):
        truth = true_gradient(target, True, theta)
        update = tb.expected_update(trajs, estimator, 2, scale=False)
        assert np.linalg.norm(update / scale - truth) < 1e-6 * np.linalg.norm(truth)
    update = tb.expected_update(trajs, "mt_grpo", 2, scale=False)
    truth = true_gradient("credit", True, theta)
    assert np.linalg.norm(update / 0.5 - truth) > 0.03 * np.linalg.norm(truth)


def test_turn_level_estimators_are_biased_by_termination_control(exact):
    # MT-GRPO against its own credit rule, and turn-RTG against grad E[sum r]: exact at a
    # fixed horizon, biased as soon as the policy decides when to stop -- both towards
    # stopping (positive stop error), by far more than the 1e-6 the enumeration allows.
    for estimator, target, at_least, stop_at_least in (("mt_grpo", "credit", 0.08, 0.04),
                                                       ("turn_rtg", "return", 0.05, 0.04)):
        assert errors(exact, estimator, target, can_stop=False)[0] < 1e-6
        rel, stop = errors(exact, estimator, target, can_stop=True)
        assert rel > at_least and stop > stop_at_least, (estimator, rel, stop)
    # GiGPO's anchor groups hold a trajectory's own repeated states: biased already at a
    # fixed horizon, and still when the policy stops.
    assert errors(exact, "gigpo", "return", can_stop=False)[0] > 0.1
    assert errors(exact, "gigpo", "return", can_stop=True)[0] > 0.015
    # MT-GRPO's credit rule itself is not grad E[sum r] (each intermediate reward is
    # credited to its own turn only), with or without the fix.
    for estimator in ("mt_grpo", "mt_grpo_unbiased"):
        assert errors(exact, estimator, "return", can_stop=False)[0] > 0.05


def test_stop_bias_of_mt_grpo_does_not_vanish_with_the_group_size(exact):
    # The per-index baseline erases the mean intermediate reward of continuing: a bias of
    # the baseline's *form*, not of the finite group (turn-RTG's self-share is): MT-GRPO's
    # stop error is 0.0547 at G = 2 and at G = 3 (0.05465, 0.05462), while turn-RTG's
    # shrinks with G (0.074, 0.051).
    trajs = tb.trajectories(tb.Mdp("policy stops", H, True), THETA)
    stops = {}
    for estimator, target in (("mt_grpo", "credit"), ("turn_rtg", "return")):
        update = tb.expected_update(trajs, estimator, 2, scale=False) * 2  # / ((G-1)/G)
        truth = exact[True]["truth"][target]
        stops[estimator, 2] = tb.compare(update, truth, 1.0, tb.stop_direction())[2]
        stops[estimator, 3] = errors(exact, estimator, target, can_stop=True)[1]
    assert stops["mt_grpo", 2] == pytest.approx(stops["mt_grpo", 3], abs=1e-4)
    assert stops["mt_grpo", 3] > 0.04
    assert stops["turn_rtg", 2] > stops["turn_rtg", 3] + 0.02


# -- the variants against their formulas -------------------------------------------------

def zscore(values, scale):
    """(x - mean) / (sample std + 1e-4); 0 for one member or all equal."""
    if len(values) < 2 or max(values) - min(values) < 1e-12:
        return [0.0] * len(values)
    mean = sum(values) / len(values)
    return [v - mean if not scale else (v - mean) / (statistics.stdev(values) + 1e-4)
            for v in values]


def reference_mt_grpo_unbiased(group, lam, scale):
    """Every member in every turn column; its intermediate reward 0 from its stopping turn on."""
    n, width = len(group), max(len(r) for r, _ in group)
    outcome = zscore([r[-1] for r, _ in group], scale)
    u = [[r[k] if k < len(r) - 1 else 0.0 for k in range(width)] for r, _ in group]
    columns = [zscore([u[i][k] for i in range(n)], scale) for k in range(width)]
    return [[outcome[i] + lam * columns[k][i] for k in range(len(r))]
            for i, (r, _) in enumerate(group)]


def returns_to_go(rewards, lam, gamma):
    weighted = [lam * x for x in rewards[:-1]] + [rewards[-1]]
    return [sum(gamma ** (j - k) * weighted[j] for j in range(k, len(weighted)))
            for k in range(len(weighted))]


def reference_turn_rtg_unbiased(group, lam, gamma, scale):
    """(1 - 1/G)(G_ik - mean of the others' G_jk at index k, 0 if none), pooled scale."""
    n = len(group)
    rtg = [returns_to_go(r, lam, gamma) for r, _ in group]
    c = [[(1 - 1 / n) * (rtg[i][k] - (statistics.fmean(o) if (o := [
        rtg[j][k] for j in range(n) if j != i and len(rtg[j]) > k]) else 0.0))
        for k in range(len(rtg[i]))] for i in range(n)]
    if not scale:
        return c
    squares = sum(x * x for row in c for x in row)
    dof = sum(len(row) for row in c) - max(len(row) for row in c)
    return [[x / (math.sqrt(squares / dof) + 1e-4) for x in row] for row in c]


def reference_gigpo_unbiased(group, omega, gamma, scale):
    """A^E + omega (1 - 1/G)(R_ik - mean R over other trajectories' turns at the anchor)."""
    n = len(group)
    episode = zscore([sum(r) for r, _ in group], scale)
    rtg = [returns_to_go(r, 1.0, gamma) for r, _ in group]
    c = [[0.0] * len(r) for r, _ in group]
    for i, (r, anchors) in enumerate(group):
        for k in range(len(r)):
            others = [rtg[j][l] for j, (rj, aj) in enumerate(group) if j != i
                      for l in range(len(rj)) if aj[l] == anchors[k]]
            c[i][k] = (1 - 1 / n) * (rtg[i][k] - (statistics.fmean(others) if others else 0))
    if scale:
        squares = sum(x * x for row in c for x in row)
        dof = sum(len(r) for r, _ in group) - len({a for _, anchors in group for a in anchors})
        spread = math.sqrt(squares / dof)
        c = [[x / (spread + 1e-4) for x in row] for row in c]
    return [[episode[i] + omega * x for x in c[i]] for i in range(n)]


def random_group(rng, same_length=False):
    """(turn scores, anchors) per member: 1-4 turns, scores on a coarse grid (ties happen),
    anchors from three states (repeats within and across members)."""
    k = rng.randint(1, 4)
    group = []
    for _ in range(rng.randint(2, 6)):
        turns = k if same_length else rng.randint(1, 4)
        group.append(([rng.choice([-0.5, 0.0, 0.25, 1.0]) for _ in range(turns)],
                      [rng.choice("xyz") for _ in range(turns)]))
    return group


def as_trajectories(group):
    return [TrajectoryRewards(n_tokens=3 * len(r) + 1,
                              turn_spans=[(1 + 3 * k, 3 + 3 * k) for k in range(len(r))],
                              turn_scores=r, turn_anchors=a) for r, a in group]


def per_turn(trajs, advantages):
    return [[float(a[s]) for s, _ in t.spans] for t, a in zip(trajs, advantages)]


@pytest.mark.parametrize("scale", [True, False])
def test_variants_match_their_formulas(scale):
    rng = random.Random(7)
    for _ in range(60):
        group = random_group(rng)
        trajs = as_trajectories(group)
        lam, gamma = rng.choice([1.0, 0.5]), rng.choice([1.0, 0.9])
        for name, reference in (
                ("mt_grpo_unbiased", reference_mt_grpo_unbiased(group, lam, scale)),
                ("turn_rtg_unbiased", reference_turn_rtg_unbiased(group, lam, gamma, scale)),
                ("gigpo_unbiased", reference_gigpo_unbiased(group, lam, gamma, scale))):
            out = compute_group_advantages(trajs, name, turn_advantage_coef=lam, gamma=gamma,
                                           scale=scale).advantages
            got = per_turn(trajs, out)
            for row, want in zip(got, reference):
                assert row == pytest.approx(want, rel=1e-5, abs=1e-5), (name, group)
            for t, a in zip(trajs, out):  # 0 outside the turns, like the originals
                assert a[0] == 0.0


@pytest.mark.parametrize("scale", [True, False])
def test_variants_equal_the_originals_when_every_member_takes_the_same_turns(scale):
    rng = random.Random(11)
    for _ in range(40):
        trajs = as_trajectories(random_group(rng, same_length=True))
        for name in ("mt_grpo", "turn_rtg"):
            original = compute_group_advantages(trajs, name, scale=scale).advantages
            variant = compute_group_advantages(trajs, f"{name}_unbiased", scale=scale).advantages
            # (on the turns: MT-GRPO's single-turn fallback also fills the untrained
            # tokens outside them)
            for a, b in zip(per_turn(trajs, original), per_turn(trajs, variant)):
                assert a == pytest.approx(b, rel=1e-6, abs=1e-7), name
