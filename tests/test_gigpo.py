"""GiGPO (arXiv 2505.10978) and Dr. GRPO's unscaled advantages against references written
here from the papers' formulas, on random groups with mixed turn counts and anchors; the
anchor keys through the data contract and the env hook; arithmetic_tool's outcome-only
setting."""

import random
import statistics

import numpy as np
import pytest

from environments.framework.agent_loop import observation_anchors
from environments.trajectory import ScoredData, ScoredGroup, ScoredTrajectory
from trainer.advantages import TrajectoryRewards, compute_group_advantages


def zscore(values, scale=True):
    """(x - mean) / (sample std + 1e-4); 0 for one member or all equal."""
    if len(values) < 2 or max(values) - min(values) < 1e-12:
        return [0.0] * len(values)
    mean = sum(values) / len(values)
    if not scale:
        return [v - mean for v in values]
    return [(v - mean) / (statistics.stdev(values) + 1e-4) for v in values]


def reference_gigpo(group, omega, gamma, scale=True):
    """Per trajectory, per turn: A^E + omega * A^S, from the paper's definitions, with each
    trajectory given as (rewards per turn, anchors per turn or None)."""
    episode = zscore([sum(rewards) for rewards, _ in group], scale)
    step_returns = {}  # anchor -> [(i, k, R_ik)]
    for i, (rewards, anchors) in enumerate(group):
        for k in range(len(rewards)):
            ret = sum(gamma ** (j - k) * rewards[j] for j in range(k, len(rewards)))
            if anchors is not None:
                step_returns.setdefault(anchors[k], []).append((i, k, ret))
    step = {}
    for members in step_returns.values():
        for (i, k, _), z in zip(members, zscore([r for _, _, r in members], scale)):
            step[i, k] = z
    return [[episode[i] + omega * step.get((i, k), 0.0) for k in range(len(rewards))]
            for i, (rewards, _) in enumerate(group)]


def random_group(rng: random.Random, outcome_only: bool):
    """4-8 trajectories of 1-4 turns, random spans, anchors from a small state space (some
    trajectories without anchors); turn rewards or outcome-only."""
    group, trajs = [], []
    for _ in range(rng.randint(4, 8)):
        n_turns = rng.randint(1, 4)
        spans, position = [], rng.randint(1, 4)
        for _ in range(n_turns):
            length = rng.randint(1, 5)
            spans.append((position, position + length))
            position += length + rng.randint(0, 3)
        anchors = None if rng.random() < 0.15 else [
            "start" if k == 0 else f"s{rng.randint(0, 2)}" for k in range(n_turns)]
        if outcome_only:
            score = float(rng.choice([0.0, 0.1, 0.8, 1.0]))
            rewards = [0.0] * (n_turns - 1) + [score]
            traj = TrajectoryRewards(n_tokens=position + 1, turn_spans=spans, score=score,
                                     turn_anchors=anchors)
        else:
            rewards = [float(rng.choice([0.0, 0.5, 1.0])) for _ in range(n_turns)]
            traj = TrajectoryRewards(n_tokens=position + 1, turn_spans=spans,
                                     turn_scores=rewards, turn_anchors=anchors)
        group.append((rewards, anchors))
        trajs.append(traj)
    return group, trajs


@pytest.mark.parametrize("outcome_only", [True, False])
@pytest.mark.parametrize("scale", [True, False])
def test_gigpo_matches_the_paper_on_random_groups(outcome_only, scale):
    rng = random.Random(7)
    for trial in range(40):
        group, trajs = random_group(rng, outcome_only)
        omega, gamma = rng.choice([1.0, 0.5]), rng.choice([0.95, 1.0, 0.8])
        expected = reference_gigpo(group, omega, gamma, scale)
        result = compute_group_advantages(trajs, "gigpo", turn_advantage_coef=omega,
                                          gamma=gamma, scale=scale)
        for traj, values, want in zip(trajs, result.advantages, expected):
            inside = np.zeros(traj.n_tokens, dtype=bool)
            for k, (start, end) in enumerate(traj.spans):
                assert values[start:end] == pytest.approx(want[k], abs=1e-5), trial
                inside[start:end] = True
            assert not values[~inside].any()  # prompt and tool tokens: 0


def test_gigpo_shared_state_hand_computed():
    # Outcome only, gamma 0.5. Both trajectories call a tool from the same start; a and b
    # reach state "x", c reaches "y". Turn-0 anchor group {a, b, c}: returns 0.5*1, 0.5*0,
    # and c answers at once (1 turn) with 1. State "x": a answers 1, b answers 0.
    a = TrajectoryRewards(n_tokens=10, turn_spans=[(1, 3), (5, 7)], score=1.0,
                          turn_anchors=["s", "x"])
    b = TrajectoryRewards(n_tokens=10, turn_spans=[(1, 3), (5, 7)], score=0.0,
                          turn_anchors=["s", "x"])
    c = TrajectoryRewards(n_tokens=10, turn_spans=[(1, 3)], score=1.0, turn_anchors=["s"])
    out = compute_group_advantages([a, b, c], "gigpo", gamma=0.5).advantages
    episode = zscore([1.0, 0.0, 1.0])
    turn0 = zscore([0.5, 0.0, 1.0])
    turn1 = zscore([1.0, 0.0])
    assert out[0][1] == pytest.approx(episode[0] + turn0[0], abs=1e-5)
    assert out[0][5] == pytest.approx(episode[0] + turn1[0], abs=1e-5)
    assert out[1][5] == pytest.approx(episode[1] + turn1[1], abs=1e-5)
    assert out[2][1] == pytest.approx(episode[2] + turn0[2], abs=1e-5)


def test_gigpo_without_anchors_is_the_episode_advantage():
    # An Atropos group: no anchors; every turn gets z(sum of rewards).
    trajs = [TrajectoryRewards(n_tokens=6, turn_spans=[(1, 3), (4, 6)], turn_scores=[s, o])
             for s, o in ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0))]
    out = compute_group_advantages(trajs, "gigpo").advantages
    for values, z in zip(out, zscore([1.0, 1.0, 2.0])):
        assert values[1] == pytest.approx(z, abs=1e-5) and values[4] == pytest.approx(z, abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_merged"])
def test_unscaled_advantages_are_centred_rewards(estimator):
    rng = random.Random(3)
    group, trajs = random_group(rng, outcome_only=False)
    result = compute_group_advantages(trajs, estimator, scale=False).advantages
    rewards = [r[-1] if estimator == "grpo" else sum(r) for r, _ in group]
    mean = sum(rewards) / len(rewards)
    for values, reward in zip(result, rewards):
        assert values[trajs[0].spans[0][0]] == pytest.approx(reward - mean, abs=1e-6)


def test_turn_anchors_travel_in_the_data_contract():
    t = ScoredTrajectory(tokens=[1, 2, 3, 4], masks=[-100, 2, -100, 4], scores=1.0,
                         turn_spans=[[1, 2], [3, 4]], turn_anchors=["a", "b"])
    group = ScoredGroup(trajectories=[t, t.model_copy(update={"turn_anchors": None})])
    data = group.to_scored_data()
    assert data.turn_anchors == [["a", "b"], None]
    assert ScoredGroup.from_scored_data(data.model_dump()).trajectories[0].turn_anchors \
        == ["a", "b"]
    # An Atropos body has no such key: it still parses, with no anchors.
    plain = ScoredData(tokens=[[1, 2]], masks=[[-100, 2]], scores=[1.0])
    assert ScoredGroup.from_scored_data(plain).trajectories[0].turn_anchors is None
    with pytest.raises(ValueError, match=r"turn_anchors: 1 anchors for 2 turn spans"):
        ScoredTrajectory(tokens=[1, 2, 3, 4], masks=[-100, 2, -100, 4], scores=1.0,
                         turn_spans=[[1, 2], [3, 4]], turn_anchors=["a"])


def test_observation_anchors_hash_the_observation_before_each_turn():
    def chat(result):
        return [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "call"},
                {"role": "tool", "name": "calculator", "content": result},
                {"role": "assistant", "content": "answer"}]
    a, b, c = (observation_anchors(chat(r), 2) for r in ("387", "387", "388"))
    assert a == b and a[0] == c[0] and a[1] != c[1] and a[0] != a[1]
    assert observation_anchors(chat("387"), 3) is None  # not one assistant message per turn


def test_arithmetic_tool_outcome_only_scores_a_float():
    from environments.envs.arithmetic_tool import ArithmeticToolConfig, ArithmeticToolEnv
    env = ArithmeticToolEnv(ArithmeticToolConfig(outcome_only=True))
    assert not env.scores_each_turn()
    assert ArithmeticToolEnv(ArithmeticToolConfig()).scores_each_turn()
