"""Advantage estimators against hand-computed groups.

Notation in the comments: z = (x - mean) / (std + 1e-4), std with ddof=1 (sample std).
sqrt(1/3) = 0.577350, so 0.5 / (0.577350 + 0.0001) = 0.865875.
"""

import math

import numpy as np
import pytest
import torch

from environments.trajectory import ScoredTrajectory
from trainer.advantages import (
    ESTIMATORS,
    TrajectoryRewards,
    compute_group_advantages,
    from_scored,
    group_zscore,
    grpo,
    mt_grpo,
    turn_rtg,
)

approx = lambda values: pytest.approx(values, rel=1e-5, abs=1e-6)  # noqa: E731


def turns(scores, *, score=None, **kwargs) -> TrajectoryRewards:
    """A trajectory with a 2-token prompt, then per turn 2 assistant tokens and 1 tool
    token: turn k spans [2 + 3k, 4 + 3k); n_tokens = 3K + 1 (no tool token after the
    last turn)."""
    k = len(scores)
    spans = [(2 + 3 * j, 4 + 3 * j) for j in range(k)]
    return TrajectoryRewards(3 * k + 1, spans, scores, score, **kwargs)


def per_turn(traj: TrajectoryRewards, values: np.ndarray) -> list[float]:
    """The value on each turn's tokens (asserting it is constant over the span)."""
    out = []
    for start, end in traj.spans:
        assert np.all(values[start:end] == values[start]), values
        out.append(float(values[start]))
    return out


def outside_spans(traj: TrajectoryRewards, values: np.ndarray) -> np.ndarray:
    inside = np.zeros(traj.n_tokens, dtype=bool)
    for start, end in traj.spans:
        inside[start:end] = True
    return values[~inside]


# -- group_zscore ------------------------------------------------------------------------

def test_group_zscore_uses_sample_std_like_the_reference():
    # x = [0, 0, 1, 1]: mean 0.5, deviations +-0.5, sum of squares 1.
    # ddof=1: std = sqrt(1/3) = 0.577350 -> 0.5 / 0.577450 = 0.865875
    # ddof=0: std = sqrt(1/4) = 0.5      -> 0.5 / 0.500100 = 0.999800
    x = np.array([0.0, 0.0, 1.0, 1.0])
    assert group_zscore(x) == approx([-0.865875, -0.865875, 0.865875, 0.865875])
    assert group_zscore(x, ddof=0) == approx([-0.999800, -0.999800, 0.999800, 0.999800])
    # The MT-GRPO reference: (r - r.mean()) / (r.std() + 1e-4), torch.std unbiased.
    r = torch.tensor([0.3, 1.7, -2.0, 0.25, 4.0], dtype=torch.float64)
    reference = ((r - r.mean()) / (r.std() + 1e-4)).numpy()
    assert np.allclose(group_zscore(r.numpy()), reference, rtol=1e-12)


def test_group_zscore_degenerate_groups_are_exactly_zero():
    assert group_zscore([3.0]).tolist() == [0.0]  # one member
    # 0.1 * 3 has a mean of 0.10000000000000002: without the guard this would be ~3e-13.
    assert group_zscore([0.1, 0.1, 0.1]).tolist() == [0.0, 0.0, 0.0]
    assert group_zscore([0.3, 0.1 + 0.2]).tolist() == [0.0, 0.0]  # equal up to rounding
    assert group_zscore([]).tolist() == []
    with pytest.raises(ValueError):
        group_zscore(np.zeros((2, 2)))


# -- TrajectoryRewards -------------------------------------------------------------------

def test_from_scored_per_turn_and_scalar():
    t = ScoredTrajectory(tokens=list(range(1, 11)), masks=[-100, -100, 3, 4, -100, -100, 7,
                                                             8, 9, -100],
                         scores=[0.5, 1.0], turn_spans=[[2, 4], [6, 9]],
                         advantages=[0.0] * 10)
    r = from_scored(t)
    assert (r.n_tokens, r.spans, r.turn_scores, r.score) == (10, [(2, 4), (6, 9)], [0.5, 1.0],
                                                             1.0)
    assert r.merged == 1.5 and r.n_turns == 2 and r.advantages == [0.0] * 10
    s = from_scored(ScoredTrajectory(tokens=[1, 2, 3], masks=[-100, 2, 3], scores=0.25))
    assert (s.spans, s.turn_scores, s.score, s.merged, s.n_turns) == ([], None, 0.25, 0.25, 1)
    assert s.turn_rewards.tolist() == [0.25]


@pytest.mark.parametrize("kwargs, message", [
    ({"n_tokens": 5, "turn_spans": [(0, 2)], "turn_scores": [1.0, 0.0]}, "2 turn scores for 1"),
    ({"n_tokens": 5, "turn_spans": [(0, 6)], "turn_scores": [1.0]}, "outside the 5 tokens"),
    ({"n_tokens": 5, "turn_spans": [(2, 4), (3, 5)], "turn_scores": [1, 0]}, "overlaps"),
    ({"n_tokens": 5, "turn_spans": [(0, 2)], "turn_scores": [1.0], "score": 0.0}, "last turn"),
    ({"n_tokens": 5}, "give score or turn_scores"),
    ({"n_tokens": 5, "score": 1.0, "advantages": [0.0]}, "advantages: length 1"),
    ({"n_tokens": 5, "score": math.nan}, "finite"),
])
def test_trajectory_rewards_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrajectoryRewards(**kwargs)


# -- the estimators on one hand-computed group with mixed turn counts ---------------------

def mixed_group() -> list[TrajectoryRewards]:
    return [
        turns([1.0, 1.0]),        # T0: 2 turns, tool helped, right
        turns([0.0, 0.0]),        # T1: 2 turns, tool failed, wrong
        turns([1.0, 0.0, 1.0]),   # T2: 3 turns, right
        turns([0.0]),             # T3: answered without a tool, wrong
    ]


def test_grpo_outcome_on_every_token():
    # outcomes [1, 0, 1, 0] -> z = +-0.5 / (sqrt(1/3) + 1e-4) = +-0.865875, on all tokens
    # (prompt and tool tokens included: the trajectory-level value).
    out = compute_group_advantages(mixed_group(), "grpo")
    for traj, values, expected in zip(mixed_group(), out.advantages, [1, -1, 1, -1]):
        assert values.dtype == np.float32 and values.shape == (traj.n_tokens,)
        assert values == approx([expected * 0.865875] * traj.n_tokens)
    assert not out.zero_variance and out.overridden == [False] * 4


def test_grpo_merged_sums_turn_scores():
    # merged [2, 0, 2, 0]: mean 1, std = sqrt(4/3) = 1.154701 -> 1 / 1.154801 = 0.865950
    out = compute_group_advantages(mixed_group(), "grpo_merged")
    for traj, values, expected in zip(mixed_group(), out.advantages, [1, -1, 1, -1]):
        assert values == approx([expected * 0.865950] * traj.n_tokens)


def test_mt_grpo_mixed_turn_counts():
    group = mixed_group()
    out = compute_group_advantages(group, "mt_grpo")
    a = out.advantages
    # A^O = z(outcomes [1, 0, 1, 0]) = [+0.865875, -0.865875, +0.865875, -0.865875]
    # Turn 0 (before the final turn for T0, T1, T2; T3 has no such turn): scores [1, 0, 1]
    #   mean 2/3, deviations [1/3, -2/3, 1/3], std = sqrt((1/9 + 4/9 + 1/9) / 2) = 0.577350
    #   A^T_0 = [0.333333 / 0.577450, -0.666667 / 0.577450, 0.333333 / 0.577450]
    #         = [0.577250, -1.154501, 0.577250]
    # Turn 1 (before the final turn: only T2) -> one member -> A^T_1 = 0
    # T3 never reached a tool result: merged z on all its tokens,
    #   merged [2, 0, 2, 0] -> -1 / (sqrt(4/3) + 1e-4) = -0.865950
    assert per_turn(group[0], a[0]) == approx([0.865875 + 0.577250, 0.865875])  # 1.443125
    assert per_turn(group[1], a[1]) == approx([-0.865875 - 1.154501, -0.865875])  # -2.020376
    assert per_turn(group[2], a[2]) == approx([0.865875 + 0.577250, 0.865875 + 0.0, 0.865875])
    assert a[3] == approx([-0.865950] * group[3].n_tokens)
    for traj, values in zip(group[:3], a[:3]):  # turn-level: 0 outside the assistant spans
        assert np.all(outside_spans(traj, values) == 0)


def test_mt_grpo_turn_advantage_coef_and_forced_fallback():
    group = mixed_group()
    half = mt_grpo(group, turn_advantage_coef=0.5)
    # T0 turn 0: 0.865875 + 0.5 * 0.577250 = 1.154500
    assert per_turn(group[0], half[0]) == approx([1.154500, 0.865875])
    # reached_tool_result=False: T0 is not split, it gets its merged z (+0.865950)
    # everywhere; the turn-0 statistics now cover T1, T2 only: [0, 1] -> -+0.5/0.707207
    group[0] = turns([1.0, 1.0], reached_tool_result=False)
    out = mt_grpo(group)
    assert out[0] == approx([0.865950] * group[0].n_tokens)
    assert per_turn(group[1], out[1]) == approx([-0.865875 - 0.707007, -0.865875])


def test_turn_rtg_hand_computed():
    group = mixed_group()
    a = turn_rtg(group)
    # Returns-to-go (gamma = 1): T0 [2, 1], T1 [0, 0], T2 [2, 1, 1], T3 [0]
    # Index 0 (all four): mean 1 -> centred [1, -1, 1, -1]
    # Index 1 (T0, T1, T2): [1, 0, 1], mean 2/3 -> [1/3, -2/3, 1/3]
    # Index 2 (T2 alone): 0
    # s^2 = (4 * 1 + 1/9 + 4/9 + 1/9) / (N - K) = (14/3) / (8 - 3) = 14/15, s = 0.966092
    # -> 1 / 0.966192 = 1.034991, (1/3) / 0.966192 = 0.344997, (2/3) / 0.966192 = 0.689994
    assert per_turn(group[0], a[0]) == approx([1.034991, 0.344997])
    assert per_turn(group[1], a[1]) == approx([-1.034991, -0.689994])
    assert per_turn(group[2], a[2]) == approx([1.034991, 0.344997, 0.0])
    assert per_turn(group[3], a[3]) == approx([-1.034991])
    assert np.all(outside_spans(group[0], a[0]) == 0)


def test_turn_rtg_discount():
    group = [turns([0.0, 1.0]), turns([0.0, 0.0])]
    a = turn_rtg(group, gamma=0.5)
    # G: A = [0 + 0.5 * 1, 1] = [0.5, 1], B = [0, 0]
    # centred: index 0 +-0.25, index 1 +-0.5; s^2 = (2 * 0.0625 + 2 * 0.25) / (4 - 2) = 0.3125
    # s = 0.559017 -> 0.25 / 0.559117 = 0.447134, 0.5 / 0.559117 = 0.894267
    assert per_turn(group[0], a[0]) == approx([0.447134, 0.894267])
    assert per_turn(group[1], a[1]) == approx([-0.447134, -0.894267])


def test_turn_rtg_single_turn_group_is_grpo():
    group = [TrajectoryRewards(4, score=s) for s in (0.0, 0.3, 1.0, 1.0, -2.0)]
    for got, want in zip(turn_rtg(group), grpo(group)):
        assert np.allclose(got, want, rtol=1e-6)


# -- the length-robustness property ------------------------------------------------------

def short_and_long(extra_turn_reward: float | tuple[float, float]) -> list[TrajectoryRewards]:
    """Two members call a tool once then answer; two call a second tool first. Every
    answer is right (outcome 1); the first call scores 0; the second call scores
    ``extra_turn_reward`` (one value, or one per long member)."""
    extra = extra_turn_reward if isinstance(extra_turn_reward, tuple) else (extra_turn_reward,) * 2
    return [turns([0.0, 1.0]), turns([0.0, 1.0]),
            turns([0.0, extra[0], 1.0]), turns([0.0, extra[1], 1.0])]


def test_turn_rtg_is_length_neutral_when_extra_turns_are_uninformative():
    # Extra turn scores 0: every member earns 1 whatever its length -> no signal at all.
    out = compute_group_advantages(short_and_long(0.0), "turn_rtg")
    assert out.zero_variance
    # Extra turn scores +0.5 or -0.5 (zero mean). G: S [1, 1], L1 [1.5, 1.5, 1],
    # L2 [0.5, 0.5, 1]. Index 0 and 1: mean 1 -> S 0, L1 +0.5, L2 -0.5; index 2: 0.
    # s = sqrt((4 * 0.25) / (10 - 3)) = 0.377964 -> 0.5 / 0.378064 = 1.322526
    group = short_and_long((0.5, -0.5))
    a = turn_rtg(group)
    assert [per_turn(t, v) for t, v in zip(group, a)] == [
        approx([0.0, 0.0]), approx([0.0, 0.0]),
        approx([1.322526, 1.322526, 0.0]), approx([-1.322526, -1.322526, 0.0])]
    # The mean advantage of the long members equals the short members' (0), turn by turn
    # and over their tokens: no preference for either length.
    assert (a[2] + a[3]).tolist() == [0.0] * group[2].n_tokens
    assert float(np.mean(a[0])) == float(np.mean(a[1])) == 0.0


@pytest.mark.parametrize("cost, sign", [(-0.5, -1), (0.5, 1)])
def test_turn_rtg_passes_a_per_turn_reward_through_where_mt_grpo_erases_it(cost, sign):
    # The second tool call earns `cost`; nothing else differs. True returns: short 1,
    # long 1 + cost. G: S [1, 1], L [1 + cost, 1 + cost, 1].
    # Index 0 and 1: mean 1 + cost/2 -> S -cost/2, L +cost/2 (= -+0.25); index 2: 0.
    # s = sqrt((8 * 0.0625) / (10 - 3)) = 0.267261 -> 0.25 / 0.267361 = 0.935064
    group = short_and_long(cost)
    a = turn_rtg(group)
    assert per_turn(group[0], a[0]) == approx([-sign * 0.935064] * 2)
    assert per_turn(group[2], a[2]) == approx([sign * 0.935064, sign * 0.935064, 0.0])
    # MT-GRPO normalises the second call's score only among the members that made it
    # (both scored `cost`), so it becomes 0: the group is "zero variance" whatever the
    # cost -- the hidden per-turn bonus -E[r_intermediate] of verl issue #7244.
    for c in (cost, 0.0):
        mt = compute_group_advantages(short_and_long(c), "mt_grpo")
        assert mt.zero_variance
        assert compute_group_advantages(short_and_long(c), "mt_grpo", zero_variance="drop") is None


def test_equal_returns_give_zero_turn0_advantage_for_any_turn_counts():
    # Every member earns a total of 1 (gamma = 1) with 1 to 4 turns and arbitrary
    # intermediate scores: the turn-0 decision gets 0 under turn_rtg (returns that differ
    # only by rounding count as equal).
    rng = np.random.default_rng(0)
    for _ in range(20):
        group = []
        for _ in range(6):
            intermediate = rng.normal(size=int(rng.integers(0, 4))).round(2).tolist()
            group.append(turns([*intermediate, 1.0 - math.fsum(intermediate)]))
        a = turn_rtg(group)
        assert all(per_turn(t, v)[0] == 0.0 for t, v in zip(group, a))
    # MT-GRPO on such a group: long members [1, -1, 1], short [0, 1] (all returns 1).
    # Turn-0 scores [1, 1, 0, 0] -> +-0.865875; the long members' -1 at turn 1 is
    # compared only with each other -> 0. So MT-GRPO favours the long path.
    group = [turns([1.0, -1.0, 1.0]), turns([1.0, -1.0, 1.0]), turns([0.0, 1.0]),
             turns([0.0, 1.0])]
    mt = mt_grpo(group)
    assert per_turn(group[0], mt[0]) == approx([0.865875, 0.0, 0.0])
    assert per_turn(group[2], mt[2]) == approx([-0.865875, 0.0])
    assert [per_turn(t, v)[0] for t, v in zip(group, turn_rtg(group))] == [0.0] * 4


# -- group-level behaviour ---------------------------------------------------------------

@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_one_member_group_gets_zero(estimator):
    out = compute_group_advantages([turns([1.0, 0.5, 1.0])], estimator)
    assert out.zero_variance and not out.advantages[0].any()
    assert compute_group_advantages([turns([1.0, 0.5, 1.0])], estimator,
                                    zero_variance="drop") is None


def test_zero_variance_depends_on_the_estimator():
    # Same outcome everywhere, but the tool call succeeded in one member only.
    group = [turns([1.0, 1.0]), turns([0.0, 1.0])]
    out = compute_group_advantages(group, "grpo")
    assert out.zero_variance and all(not a.any() for a in out.advantages)
    assert compute_group_advantages(group, "grpo", zero_variance="drop") is None
    # MT-GRPO sees the turn-0 difference: [1, 0] -> +-0.5 / (0.707107 + 1e-4) = +-0.707007
    out = compute_group_advantages(group, "mt_grpo", zero_variance="drop")
    assert out is not None and not out.zero_variance
    assert per_turn(group[0], out.advantages[0]) == approx([0.707007, 0.0])
    with pytest.raises(ValueError, match="zero_variance"):
        compute_group_advantages(group, "grpo", zero_variance="skip")  # type: ignore[arg-type]


def test_env_advantages_override_the_estimator():
    group = mixed_group()
    custom = [0.25 * j for j in range(group[1].n_tokens)]
    group[1] = turns([0.0, 0.0])
    group[1].advantages = custom
    out = compute_group_advantages(group, "grpo")
    assert out.advantages[1].tolist() == custom and out.overridden == [False, True, False, False]
    # The overridden member's outcome still counts for the others: z([1, 0, 1, 0]).
    assert out.advantages[0] == approx([0.865875] * group[0].n_tokens)
    # A group with no reward variance keeps a non-zero override: it is not zero-variance.
    flat = [TrajectoryRewards(3, score=1.0), TrajectoryRewards(3, score=1.0,
                                                                advantages=[0.0, 0.5, 0.5])]
    out = compute_group_advantages(flat, "mt_grpo", zero_variance="drop")
    assert out is not None and out.advantages[1].tolist() == [0.0, 0.5, 0.5]


def test_accepts_scored_trajectories():
    trajs = [ScoredTrajectory(tokens=[1, 2, 3, 4], masks=[-100, 2, 3, 4], scores=float(s))
             for s in (0, 1)]
    out = compute_group_advantages(trajs, "grpo")
    # [0, 1]: +-0.5 / (sqrt(1/2) + 1e-4) = +-0.707007
    assert out.advantages[1] == approx([0.707007] * 4)


def test_unknown_estimator_lists_the_names():
    with pytest.raises(ValueError) as error:
        compute_group_advantages(mixed_group(), "ppo")
    for name in ("grpo", "grpo_merged", "mt_grpo", "turn_rtg"):
        assert name in str(error.value)
    with pytest.raises(ValueError, match="at least one"):
        compute_group_advantages([], "grpo")
