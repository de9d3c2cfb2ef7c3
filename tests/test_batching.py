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


def test_env_weights_mix_each_batch_and_the_run_by_weight():
    """Weights 3 and 1, both envs with plenty queued: batches of 4 groups take 3 + 1,
    whatever the arrival order; batches of 2 groups alternate so the run is 3:1; an env
    with nothing queued earns no credit meanwhile; without weights, oldest first."""
    def arrivals(n):  # env 1's groups all arrived first
        return [QueuedGroup(i, f"g{i}", 1 if i < n else 0, 4, None) for i in range(2 * n)]

    weights = {0: 3.0, 1: 1.0}
    credit: dict = {}
    picked = select_batch(arrivals(8), 16, weights=weights, credit=credit)
    assert sorted(g.env_id for g in picked) == [0, 0, 0, 1]
    assert [g.seq for g in picked if g.env_id == 0] == [8, 9, 10]  # each env's oldest
    queue = arrivals(40)
    counts = {0: 0, 1: 0}
    for _ in range(20):  # 2 groups per batch: 3:1 only over several batches
        picked = select_batch(queue, 8, weights=weights, credit=credit)
        for g in picked:
            counts[g.env_id] += 1
            queue.remove(g)
    assert counts == {0: 30, 1: 10}
    # env 0 had nothing queued for a while: it comes back with no backlog of credit
    credit = {}
    only_one = [QueuedGroup(i, f"g{i}", 1, 4, None) for i in range(10)]
    for _ in range(3):
        picked = select_batch(only_one, 8, weights=weights, credit=credit)
        only_one = [g for g in only_one if g not in picked]
    both = only_one + [QueuedGroup(100 + i, f"h{i}", 0, 4, None) for i in range(6)]
    mix = [g.env_id for g in select_batch(both, 16, weights=weights, credit=credit)]
    assert sorted(mix) == [0, 0, 0, 1]
    assert seqs(select_batch(arrivals(8), 16)) == [0, 1, 2, 3]


def test_a_batch_waits_for_the_env_its_weights_owe_and_a_slow_env_keeps_its_share():
    """Weights 3 and 1, groups of 4, batches of 2 groups; env 1 always has a batch queued
    and env 0 delivers late. Without waiting, every batch env 0 is late for goes to env 1
    (the run drifts to 1:1); waiting for env 0 while the API hears from it keeps every
    prefix of the run within half a group of 3:1, and a held call leaves the credit as it
    was. An env that is not waited for (gone silent) does not hold the batch."""
    weights, sizes = {0: 3.0, 1: 1.0}, {0: 4, 1: 4}

    def run(waiting):
        credit, held, counts, trained = {}, set(), {0: 0, 1: 0}, []
        seq = 0
        for step in range(12):
            queue = [QueuedGroup(seq + i, f"b{seq + i}", 1, 4, None) for i in range(2)]
            seq += 2
            for attempt in range(3):  # env 0's group arrives after the trainer asked
                before = dict(credit)
                picked = select_batch(queue, 8, weights=weights, credit=credit,
                                      waiting=waiting, held=held)
                if picked is not None:
                    break
                assert held == {0} and credit == before  # held: nothing paid or earned
                held.clear()
                queue.append(QueuedGroup(seq, f"a{seq}", 0, 4, None))
                seq += 1
            for g in picked:
                counts[g.env_id] += 1
            trained.append(dict(counts))
        return trained

    waited = run(sizes)
    assert all(abs(c[0] - 1.5 * (k + 1)) <= 0.5 for k, c in enumerate(waited)), waited
    assert waited[-1] == {0: 18, 1: 6}
    unwaited = run({})  # no env waited for: env 1's queued batch goes every time
    assert unwaited[-1] == {0: 0, 1: 24}
    assert run({1: 4})[-1] == {0: 0, 1: 24}  # env 0 silent: not waited for
