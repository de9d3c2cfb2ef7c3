"""DAPO's overlong shaping and dynamic sampling (trainer.shaping) against the paper's
definitions, through the trainer's own batch building and sources."""

from __future__ import annotations

import asyncio
import random

import pytest
from test_turn_prefix import trajectory

from environments.jsonl_store import GroupWriter
from environments.trajectory import MASKED, ScoredGroup, TrajectoryFlags
from trainer.config import TrainConfig
from trainer.shaping import DynamicSampling, overlong_penalty
from trainer.sources import JSONLBatches
from trainer.train import Batch, batch_tensors


def reference_penalty(length, l_max, l_cache):
    """DAPO eq. 13: 0 up to L_max - L_cache, then linear to -1 at L_max, -1 beyond."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return (l_max - l_cache - length) / l_cache
    return -1.0


def test_overlong_penalty_is_dapos_soft_punishment():
    for length in range(0, 40):
        assert overlong_penalty(length, 30, 8) == pytest.approx(reference_penalty(length, 30, 8))
    assert overlong_penalty(26, 30, 8) == pytest.approx(-0.5)


def sampled(t):
    return sum(m != MASKED for m in t.masks)


def test_overlong_shaping_changes_the_advantages_and_truncated_rows_can_be_masked():
    rng = random.Random(1)
    trajs = [trajectory(rng, rng.randint(1, 3), 0.0) for _ in range(6)]
    trajs = [t.model_copy(update={"scores": float(i % 2), "turn_spans": None})
             for i, t in enumerate(trajs)]
    trajs[0] = trajs[0].model_copy(update={"flags": TrajectoryFlags(truncated=True)})
    group = ScoredGroup(trajectories=trajs)
    lengths = [sampled(t) for t in trajs]
    limit, buffer = sorted(lengths)[3], 4
    config = TrainConfig(model="m", estimator="grpo", overlong_buffer=buffer,
                         overlong_max_tokens=limit)
    tensors, _ = batch_tensors(Batch([group]), config, vocab_size=64, pad_id=0)
    shaped = [t.scores + reference_penalty(n, limit, buffer) for t, n in zip(trajs, lengths)]
    assert any(reference_penalty(n, limit, buffer) < 0 for n in lengths)
    mean = sum(shaped) / len(shaped)
    std = (sum((x - mean) ** 2 for x in shaped) / (len(shaped) - 1)) ** 0.5
    for row, value in enumerate(shaped):
        got = tensors.advantages[row][tensors.mask[row]]
        assert got.tolist() == pytest.approx([(value - mean) / (std + 1e-4)] * len(got), abs=1e-5)
    masked = config.model_copy(update={"overlong_mask_truncated": True})
    tensors, stats = batch_tensors(Batch([group]), masked, vocab_size=64, pad_id=0)
    assert stats["rows"] == 5 and tensors.n_tokens == sum(lengths[1:])


def group_of(rng, scores):
    return ScoredGroup(trajectories=[trajectory(rng, 1, [s]) for s in scores])


class Acks(JSONLBatches):
    """The file source, recording which batches the step finished."""

    finished: list[Batch]

    async def finish(self, batch, step=None):
        self.finished = [*getattr(self, "finished", []), batch]


def test_dynamic_sampling_sets_aside_equal_groups_and_fills_the_batch(tmp_path):
    rng = random.Random(0)
    # groups of 4: equal, signal, equal, signal, signal, equal ... (batch_size 8 = 2 groups)
    pattern = [[1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0], [0.2, 0.5, 0.5, 0.5],
               [1, 0, 0, 0], [0.5, 0.5, 0.5, 0.5]]
    GroupWriter(tmp_path / "g.jsonl").append([group_of(rng, s) for s in pattern])
    config = TrainConfig(model="m", batch_size=8, dynamic_sampling=True,
                         dynamic_sampling_max_batches=3)
    source = DynamicSampling(Acks(tmp_path / "g.jsonl", 8), config)
    batch = asyncio.run(source.next())
    # batch 1: [equal, signal] ; batch 2: [equal, signal] -> full after 2 batches
    assert [[t.outcome for t in g.trajectories] for g in batch.groups] == [pattern[1], pattern[3]]
    assert batch.stats == {"dynamic_sampling_batches": 2.0, "dynamic_sampling_groups_equal": 2.0,
                           "dynamic_sampling_groups_left_out": 0.0,
                           "dynamic_sampling_full": 1.0}
    _, stats = batch_tensors(batch, config, vocab_size=64, pad_id=0)
    assert stats["dynamic_sampling_batches"] == 2.0 and stats["rows"] == 8
    asyncio.run(source.finish(batch))
    assert len(source.source.finished) == 2  # every batch taken is finished
    # the equal groups are acknowledged as dropped, with the reason (the accounting)
    assert [[r.reason for r in part.dropped] for part in source.source.finished] == [
        ["no_signal"], ["no_signal"]]
    # batch 3: [signal, equal]; batch 4 (the cap is 3, so 2 more): [equal, signal] ...
    batch = asyncio.run(source.next())
    assert batch.stats["dynamic_sampling_full"] == 1.0 and len(batch.groups) == 2


def test_dynamic_sampling_stops_at_the_cap(tmp_path):
    rng = random.Random(0)
    GroupWriter(tmp_path / "g.jsonl").append([group_of(rng, [1, 1]) for _ in range(3)]
                                              + [group_of(rng, [0, 1])])
    config = TrainConfig(model="m", batch_size=4, dynamic_sampling=True,
                         dynamic_sampling_max_batches=2)
    batch = asyncio.run(DynamicSampling(JSONLBatches(tmp_path / "g.jsonl", 4), config).next())
    # two batches of two groups: three equal groups set aside, one with signal: not full
    assert len(batch.groups) == 1 and batch.stats["dynamic_sampling_full"] == 0.0
    assert batch.stats["dynamic_sampling_groups_equal"] == 3.0


# --- "no signal" is what the configured estimator says (independent formulas below) ---
def reference_rtg_centred(rows, gamma):
    """turn_rtg's centred returns (before the pooled-std scale): G_{i,k} = sum_j
    gamma^(j-k) r_{i,j}, minus the mean of G_{.,k} over the members that reach turn k."""
    returns = [[sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]
               for r in rows]
    out = []
    for g in returns:
        out.append([g[k] - sum(h[k] for h in returns if len(h) > k)
                    / sum(1 for h in returns if len(h) > k) for k in range(len(g))])
    return out


def reference_gigpo_centred(rows, anchors, gamma):
    """GiGPO before scaling: the episode return centred over the group, and each step's
    discounted return R_{i,k} centred within the steps that start from the same anchor."""
    totals = [sum(r) for r in rows]
    episode = [t - sum(totals) / len(totals) for t in totals]
    returns = [[sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]
               for r in rows]
    steps = []
    for i, r in enumerate(returns):
        row = []
        for k, value in enumerate(r):
            peers = [returns[j][m] for j in range(len(rows)) for m in range(len(rows[j]))
                     if anchors[j][m] == anchors[i][k]]
            row.append(value - sum(peers) / len(peers))
        steps.append(row)
    return episode, steps


def equal_outcome_group(rng, n_turns):
    """Scalar outcome 1.0 for every member, members of different lengths whose first turns
    start from the same state (same prompt: the same GiGPO anchor)."""
    trajs = []
    for k in n_turns:
        t = trajectory(rng, k, [0.0] * k)
        trajs.append(t.model_copy(update={
            "scores": 1.0, "turn_anchors": [f"s{j}-{k}" if j else "s0" for j in range(k)]}))
    return ScoredGroup(trajectories=trajs)


@pytest.mark.parametrize("estimator", ["grpo", "mt_grpo", "turn_rtg", "gigpo"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_dynamic_sampling_asks_the_configured_estimator(tmp_path, estimator, gamma):
    from trainer.shaping import has_signal

    rng = random.Random(3)
    n_turns = [1, 2, 3, 2]
    group = equal_outcome_group(rng, n_turns)
    rows = [[0.0] * (k - 1) + [1.0] for k in n_turns]  # a scalar score: [0, ..., 0, outcome]
    anchors = [t.turn_anchors for t in group.trajectories]
    if estimator == "turn_rtg":
        expected = any(abs(c) > 1e-9 for row in reference_rtg_centred(rows, gamma) for c in row)
    elif estimator == "gigpo":
        episode, steps = reference_gigpo_centred(rows, anchors, gamma)
        expected = any(abs(c) > 1e-9 for c in episode + [c for row in steps for c in row])
    else:  # the outcome estimators: equal outcomes, nothing to compare
        expected = False
    # discounting by the turns left is what gives the equal-outcome group a signal
    assert expected == (estimator in ("turn_rtg", "gigpo") and gamma < 1)
    config = TrainConfig(model="m", batch_size=4, estimator=estimator, gamma=gamma,
                         dynamic_sampling=True, dynamic_sampling_max_batches=1)
    assert has_signal(group.trajectories, config) == expected
    GroupWriter(tmp_path / "g.jsonl").append([group])
    batch = asyncio.run(DynamicSampling(JSONLBatches(tmp_path / "g.jsonl", 4), config).next())
    assert len(batch.groups) == int(expected)
    assert batch.stats["dynamic_sampling_groups_equal"] == float(not expected)
    if expected:  # and the step trains on the advantages the check saw
        tensors, stats = batch_tensors(batch, config, vocab_size=64, pad_id=0)
        assert stats["groups_zero_variance"] == 0 and tensors.advantages.abs().sum() > 0


def test_a_group_of_one_has_no_signal_unless_the_env_gives_advantages():
    from trainer.shaping import has_signal

    rng = random.Random(4)
    for estimator in ("grpo", "mt_grpo", "turn_rtg", "gigpo"):
        config = TrainConfig(model="m", estimator=estimator, gamma=0.9)
        lone = trajectory(rng, 2, [1.0, 0.0])
        assert not has_signal([lone], config)
        given = lone.model_copy(update={"advantages": [0.5] * len(lone.tokens)})
        assert has_signal([given], config)
        zero = lone.model_copy(update={"advantages": [0.0] * len(lone.tokens)})
        assert not has_signal([zero], config)


def test_overlong_limit_defaults_to_the_generation_budget():
    """Without overlong_max_tokens, L_max is the room a trajectory had for sampled tokens
    (max_token_length less its prompt and tool tokens), so a rollout cut off at
    max_token_length gets the full -1 and one well inside it none."""
    from trainer.shaping import shape_rewards

    rng = random.Random(5)
    full = trajectory(rng, 3, [0.0, 0.0, 1.0])
    short = trajectory(rng, 1, [1.0])
    limit = len(full.tokens)  # the full one filled the context
    config = TrainConfig(model="m", max_token_length=limit, overlong_buffer=4)
    shaped = shape_rewards([full, short], config)
    for before, after in zip([full, short], shaped):
        budget = limit - sum(m == MASKED for m in before.masks)
        assert after.scores[-1] == pytest.approx(
            before.scores[-1] + reference_penalty(sampled(before), budget, 4))
    assert shaped[0].scores[-1] == pytest.approx(1.0 - 1.0)  # at the budget: the full -1
    assert shaped[1].scores == [1.0]  # far from the limit: untouched
