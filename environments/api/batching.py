"""Choosing which queued groups make up the next training batch.

Rules, in order:

1. Groups are never split; the oldest data goes first.
2. Minimum shares: an env registered with ``min_batch_allocation = m`` gets at least
   ``floor(m * batch_size)`` sequences of every batch (its oldest groups). If it has
   queued less than that, the batch waits for it (as Atropos does). Shares that add up
   to more than the batch are scaled down proportionally.
3. The rest of the batch is filled with the oldest groups of any env that fit; with env
   weights, by deficit round robin instead: every env with queued groups (or that the
   batch may wait for, below) earns its weight's share of the batch as credit
   (``credit_e += w_e / sum of those w * batch_size``), and each next group is the
   oldest one that fits of the env with the most credit, which pays its size. When that
   env has nothing queued and is one the batch may wait for (``waiting``: the API passes
   the envs it heard from lately, until the batch has waited ``mix_wait_s``), no batch is
   made yet: taking another env's group instead would give the other env the owed env's
   share, which is how a fast env crowds a slower one out of a run. Credit carries over
   to the next batch (bounded by one batch either way), so over a run each env's share of
   the trained sequences stays within a group of its weight's share even when one batch
   cannot split exactly; an env with nothing queued that is not waited for earns nothing
   meanwhile.
4. A batch holds exactly ``batch_size`` sequences whenever the queued groups can make
   that number (a subset-sum search that prefers older groups fills gaps greedy filling
   leaves); when no combination can, for example groups of 3 with a batch of 64, it
   holds the largest number below ``batch_size`` they can make. Group sizes need not be
   powers of two (Atropos's packing assumes they are).

Pure functions over small records, so they are tested on hand-built queues.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedGroup:
    seq: int
    """Arrival order (the SQLite row id); smaller is older."""
    group_id: str
    env_id: int | None
    n_sequences: int
    policy_version: int | None


def min_share_quotas(
    min_shares: dict[int, float], batch_size: int
) -> dict[int, int]:
    """Sequences reserved per env: ``floor(share * batch_size)``, scaled to fit."""
    quotas = {env: int(share * batch_size) for env, share in min_shares.items() if share > 0}
    total = sum(quotas.values())
    if total > batch_size:
        quotas = {env: math.floor(q * batch_size / total) for env, q in quotas.items()}
    return {env: q for env, q in quotas.items() if q > 0}


def _exact_fill(sizes: Sequence[int], capacity: int) -> list[int] | None:
    """Indices of a subset of ``sizes`` summing to ``capacity``, preferring early ones.

    Each reachable sum keeps the combination found first while scanning in order, so
    the answer uses the oldest groups that can make the sum.
    """
    parent: list[tuple[int, int] | None] = [None] * (capacity + 1)
    reached = [False] * (capacity + 1)
    reached[0] = True
    for i, size in enumerate(sizes):
        if size > capacity:
            continue
        for total in range(capacity, size - 1, -1):
            if not reached[total] and reached[total - size]:
                reached[total] = True
                parent[total] = (i, total - size)
        if reached[capacity]:
            break
    if not reached[capacity]:
        return None
    chosen, total = [], capacity
    while total:
        i, total = parent[total]  # type: ignore[misc]
        chosen.append(i)
    return sorted(chosen)


def _weighted_fill(rest: list[QueuedGroup], room: int, weights: dict[int | None, float],
                   credit: dict[int | None, float], batch_size: int,
                   waiting: dict[int | None, int], held: set[int | None]
                   ) -> list[QueuedGroup] | None:
    """Rule 3 with weights: groups of ``rest`` (oldest first) for ``room`` sequences,
    by deficit round robin over the envs, or ``None`` to wait for an env of ``waiting``
    (env id -> its group size) that the weights owe the next group (added to ``held``);
    ``credit`` is updated in place. An env missing from ``weights`` (or a group without env) weighs 1."""
    by_env: dict[int | None, list[QueuedGroup]] = {env: [] for env in waiting}
    for g in rest:
        by_env.setdefault(g.env_id, []).append(g)
    weight = {env: max(0.0, weights.get(env, 1.0)) for env in by_env}
    total = sum(weight.values())
    for env in by_env:
        credit[env] = credit.get(env, 0.0) + (weight[env] / total * room if total else 0.0)
    chosen: list[QueuedGroup] = []
    while room > 0:
        fitting = {env: next((g for g in groups if g.n_sequences <= room), None)
                   for env, groups in by_env.items()}
        owed = [env for env, groups in by_env.items()
                if not groups and weight[env] > 0 and waiting.get(env, room + 1) <= room]
        candidates = [(env, g) for env, g in fitting.items() if g is not None]
        top = max(owed, key=lambda e: credit[e], default=None)
        if top is not None and (not candidates or credit[top]
                                > max(credit[env] for env, _ in candidates)):
            held.add(top)
            return None  # the env the weights owe has not delivered yet: wait for it
        if not candidates:
            break
        env, g = max(candidates, key=lambda c: (credit[c[0]], -c[1].seq))
        by_env[env].remove(g)
        chosen.append(g)
        credit[env] -= g.n_sequences
        room -= g.n_sequences
    for env in list(credit):
        credit[env] = min(batch_size, max(-batch_size, credit[env]))
    return chosen


def select_batch(
    queue: Iterable[QueuedGroup],
    batch_size: int,
    min_shares: dict[int, float] | None = None,
    search_window: int = 512,
    weights: dict[int | None, float] | None = None,
    credit: dict[int | None, float] | None = None,
    waiting: dict[int | None, int] | None = None,
    held: set[int | None] | None = None,
) -> list[QueuedGroup] | None:
    """The groups of the next batch (oldest first), or ``None`` to wait for more data.

    ``queue`` is in arrival order and holds only groups of at most ``batch_size``
    sequences. ``search_window`` bounds how many of the oldest groups the exact-fill
    search looks at. ``weights`` (env id -> weight) mix the batch by weight (rule 3);
    ``credit`` is the envs' carried credit, updated in place when a batch is made (give
    the same dict to every call); ``waiting`` (env id -> group size): envs the batch waits
    for when the weights owe them the next group and they have nothing queued; the one
    waited for is added to ``held`` (when given).
    """
    groups = list(queue)
    total = sum(g.n_sequences for g in groups)
    if total < batch_size or not groups:
        return None

    chosen: list[QueuedGroup] = []
    taken = 0
    for env, quota in min_share_quotas(min_shares or {}, batch_size).items():
        own = [g for g in groups if g.env_id == env]
        if sum(g.n_sequences for g in own) < quota:
            return None  # wait for the env's minimum share
        got = 0
        for g in own:
            if got >= quota:
                break
            if taken + g.n_sequences <= batch_size:
                chosen.append(g)
                got += g.n_sequences
                taken += g.n_sequences

    chosen_ids = {g.seq for g in chosen}
    rest = [g for g in groups if g.seq not in chosen_ids]
    if weights is not None:
        earned = dict(credit or {})
        filled = _weighted_fill(rest, batch_size - taken, weights, earned, batch_size,
                                waiting or {}, held if held is not None else set())
        if filled is None:
            return None
        if credit is not None:
            credit.update(earned)
        chosen += filled
        taken += sum(g.n_sequences for g in filled)
    chosen_ids = {g.seq for g in chosen}
    for g in rest:
        if taken == batch_size:
            break
        if g.seq not in chosen_ids and taken + g.n_sequences <= batch_size:
            chosen.append(g)
            taken += g.n_sequences

    if taken < batch_size:
        window = rest[:search_window]
        # Refill the free part exactly, from groups not reserved by minimum shares.
        in_window = {g.seq for g in window}
        reserved = [g for g in chosen if g.seq not in in_window]
        capacity = batch_size - sum(g.n_sequences for g in reserved)
        exact = _exact_fill([g.n_sequences for g in window], capacity)
        if exact is not None:
            chosen = reserved + [window[i] for i in exact]
    return sorted(chosen, key=lambda g: g.seq)
