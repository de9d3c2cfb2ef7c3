"""Batch selection on hand-built queues."""

from environments.api.batching import QueuedGroup, select_batch


def queue(*sizes, env=None):
    return [QueuedGroup(seq=i, group_id=f"g{i}", env_id=(env[i] if env else None),
                        n_sequences=n, policy_version=None) for i, n in enumerate(sizes)]


def seqs(batch):
    return [g.seq for g in batch]


def test_oldest_groups_first_and_never_split():
    assert seqs(select_batch(queue(4, 4, 4, 4), 8)) == [0, 1]
    assert select_batch(queue(4), 8) is None  # not enough data yet


def test_any_group_size_fills_exactly_when_possible():
    # 5 + 5 + 3 + 3 = 16: greedy oldest-first would take 5+5+5 and stop at 15.
    assert seqs(select_batch(queue(5, 5, 5, 3, 3), 16)) == [0, 1, 3, 4]
    # groups of 3 cannot make 8: the largest fill below it, oldest first
    assert seqs(select_batch(queue(3, 3, 3, 3), 8)) == [0, 1]


def test_minimum_share_reserves_sequences_for_an_env():
    q = queue(4, 4, 4, 4, 4, 4, env=[0, 0, 0, 0, 1, 1])
    assert seqs(select_batch(q, 8)) == [0, 1]
    # env 1 must get at least half of each batch: its oldest group goes in
    assert seqs(select_batch(q, 8, {1: 0.5})) == [0, 4]
    # ... and the batch waits while env 1 has queued less than its share
    assert select_batch(queue(4, 4, 4, env=[0, 0, 0]), 8, {1: 0.5}) is None
