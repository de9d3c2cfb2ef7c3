"""Running an env: collect groups with the configured concurrency and deliver them,
offline to a JSONL file (:func:`process`, ``lachesis env process``) or to the rollout API
(:func:`serve`, ``lachesis env serve``: registration, policy-version and queue polling,
spooling while the API is away). ``BaseEnv.process`` / ``serve`` call these.

``env`` is a started :class:`~environments.framework.base.BaseEnv` (not imported here:
the runner sits beside the env class and only calls its public hooks and stats).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from environments.api.client import APIRequestError, RolloutAPIClient
from environments.heartbeat import from_environment
from environments.framework.delivery import APIDelivery, JSONLDelivery, Mirrored

log = logging.getLogger(__name__)
HELD_WARNING_S = 120.0
"""An env held back by ``max_queued_groups`` this long says so (and again as long after):
the trainer it waits for may be the process that has stopped."""


async def run_groups(env: Any, delivery: Any, n_groups: int | None, *,
                     follows_policy: bool = False) -> None:
    """Collect groups with enough concurrency to keep ``concurrency`` rollouts busy and
    hand each to ``delivery.send``, until ``n_groups`` were delivered. With
    ``groups_per_policy_version`` set: :func:`run_lockstep`."""
    if env.config.groups_per_policy_version is not None:
        return await run_lockstep(env, delivery, n_groups, follows_policy=follows_policy)
    workers = max(1, math.ceil(env.config.rollout_slots() / env.config.group_size)) + 1
    if n_groups is not None:
        workers = min(workers, n_groups)
    reserved = delivered = in_progress = delivering = 0
    held_since: float | None = None
    said_at = 0.0
    done = asyncio.Event()

    async def worker() -> None:
        nonlocal reserved, delivered, in_progress, delivering, held_since, said_at
        while not done.is_set():
            if n_groups is not None and reserved + in_progress >= n_groups:
                await asyncio.sleep(0.05)  # enough groups under way; one may still fail
                continue
            limit = env.config.max_queued_groups
            # a group being delivered holds its place: the queue count has not got it yet
            if limit is not None and \
                    (env.queued_groups or 0) + in_progress + delivering >= limit:
                held_since = held_since or time.monotonic()
                now = time.monotonic()
                if now - held_since >= HELD_WARNING_S and now - said_at >= HELD_WARNING_S:
                    said_at = now
                    log.warning("%d of this env's groups queued in the rollout API at %s "
                                "(max_queued_groups %d) for %.0f s: waiting for the trainer "
                                "to lease them (policy version %s)", env.queued_groups or 0,
                                env.config.api_url, limit, now - held_since,
                                env.policy_version)
                await _status_changes(env, 0.1)  # the trainer is behind: wait for it
                continue
            if held_since is not None:  # (the wall time the limit held groups back)
                env.stats.backpressure_seconds += time.monotonic() - held_since
                held_since = None
            in_progress += 1
            index = None
            try:
                index, item = await _next_item(env)
                group = await _one_group(env, item)
            except Exception as error:  # get_next_item raised: one failed group
                env.group_failed(None, error, "the group could not be collected",
                                 traceback=True)
                group = None
            finally:
                in_progress -= 1
            _check_failures(env)
            if group is None:
                _settle(env, index)
                continue
            if n_groups is not None and reserved >= n_groups:
                return  # enough groups are already being delivered
            reserved += 1
            delivering += 1
            try:
                await _deliver(env, delivery, group)
            finally:
                delivering -= 1
            _settle(env, index)
            delivered += 1
            if n_groups is not None and delivered >= n_groups:
                done.set()

    tasks = [asyncio.create_task(worker()) for _ in range(workers)]
    finished = asyncio.create_task(done.wait())
    try:
        await asyncio.wait([finished, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:  # a worker that raised stops the run with its error
            if task.done() and task.exception() is not None:
                raise task.exception()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        finished.cancel()


async def _next_item(env: Any) -> tuple[int | None, Any]:
    """The env's next item (and its index, with a server's :class:`ItemCursor`)."""
    cursor = getattr(env, "item_cursor", None)
    if cursor is None:
        return None, await env.get_next_item()
    return await cursor.next(env)


def _settle(env: Any, index: int | None) -> None:
    """Item ``index``'s group is delivered or given up: a restart does not draw it again."""
    cursor = getattr(env, "item_cursor", None)
    if cursor is not None and index is not None:
        cursor.settle(index)


async def _one_group(env: Any, item: Any) -> Any:
    """``env.collect_group(item)``; a hook that raises outside the rollouts: one failed
    group (None)."""
    try:
        return await env.collect_group(item)
    except Exception as error:
        env.group_failed(env._item_id_or_none(item), error,
                         "the group could not be collected", traceback=True)
        return None


async def _deliver(env: Any, delivery: Any, group: Any) -> None:
    group.env_id = getattr(env, "env_id", None)
    answer = await delivery.send(group)
    env.stats.groups_sent += 1
    if isinstance(answer, dict) and "snapshot" in answer:
        _observe(env, answer)  # the API's count of the env's queue, this group in it
    elif env.queued_groups is not None and not (isinstance(answer, dict) and any(
            answer.get(k) for k in ("dropped", "duplicate", "rejected"))):
        env.queued_groups += 1  # until the next status poll says


def _check_failures(env: Any) -> None:
    if env._failed_in_a_row >= env.config.max_failed_groups_in_a_row:
        s = env.stats
        raise RuntimeError(
            f"{env._failed_in_a_row} groups in a row failed, so the setup looks broken "
            f"({s.groups_sent} groups sent, {s.groups_failed} failed, {s.reward_errors} "
            f"reward errors in all); last error: {env.last_error}")


async def run_lockstep(env: Any, delivery: Any, n_groups: int | None, *,
                       follows_policy: bool, poll_s: float = 0.05) -> None:
    """``groups_per_policy_version`` groups at a time: their items taken in order, the
    groups collected together (within ``concurrency``) and delivered in item order; a
    group that is dropped (equal scores, failed) is replaced by the next items, so each
    round delivers exactly that many. With ``follows_policy`` (``serve``), the next round
    waits for the policy version to move past the one the round started under: every
    group of a round is sampled from one policy, and the trainer's next batch holds
    exactly that round."""
    per_round = env.config.groups_per_policy_version
    delivered = 0
    while n_groups is None or delivered < n_groups:
        version = env.policy_version
        want = per_round if n_groups is None else min(per_round, n_groups - delivered)
        sent = 0
        while sent < want:
            items, indices = [], []
            for _ in range(want - sent):
                try:
                    index, item = await _next_item(env)
                    items.append(item)
                    indices.append(index)
                except Exception as error:  # one failed group
                    env.group_failed(None, error, "the group could not be collected",
                                     traceback=True)
                    _check_failures(env)
            groups = await asyncio.gather(*(_one_group(env, item) for item in items))
            _check_failures(env)
            for group, index in zip(groups, indices):
                if group is None:
                    _settle(env, index)
                    continue
                await _deliver(env, delivery, group)
                _settle(env, index)
                sent += 1
        delivered += sent
        if follows_policy and (n_groups is None or delivered < n_groups):
            while env.policy_version == version:
                await asyncio.sleep(poll_s)


async def process(env: Any, out: str | Path, n_groups: int) -> dict[str, Any]:
    """Offline: write ``n_groups`` groups to the JSONL file ``out``; returns the env's
    stats with ``seconds`` and ``out``. (``lachesis env process`` also writes the file's
    HTML report next to it.)"""
    delivery = JSONLDelivery(out)
    started = time.monotonic()
    try:
        await run_groups(env, delivery, n_groups)
    finally:
        await delivery.close()
    return {**env.describe_stats(), "seconds": round(time.monotonic() - started, 2),
            "out": str(out)}


async def serve(env: Any) -> dict[str, Any]:
    """Push groups to the rollout API until ``total_groups`` (or forever)."""
    from environments.framework.item_cursor import ItemCursor

    config = env.config
    spool = config.spool_path or Path("runs/spool") / f"{env.name}.jsonl"
    if config.state_path is not None:
        env.item_cursor = ItemCursor(config.state_path)
        if env.item_cursor.resumed:
            log.info("continuing the item order after %d items settled by an earlier start "
                     "(%s)", env.item_cursor.resumed, config.state_path)
    # Under `lachesis run`: beats from this event loop, so a frozen env server, or one
    # whose loop a synchronous call blocks, is noticed (environments/heartbeat.py).
    heartbeat = from_environment("env")
    beating = asyncio.create_task(heartbeat.beat_forever()) if heartbeat else None
    try:
        return await _serve(env, config, spool, heartbeat)
    finally:
        if beating is not None:
            beating.cancel()
            heartbeat.stop()


async def _serve(env: Any, config: Any, spool: Path, heartbeat: Any) -> dict[str, Any]:
    async with RolloutAPIClient(config.api_url, config.api_token,
                                timeout_s=config.api_timeout_s) as client:
        if heartbeat is not None:
            heartbeat.doing(f"registering with the rollout API at {config.api_url}")
        registration = await register(env, client)
        env.env_id = registration["env_id"]
        log.info("registered with %s as env %s", config.api_url, env.env_id)
        api = APIDelivery(client, spool)
        copy = JSONLDelivery(config.jsonl_out) if config.jsonl_out else None
        await api.start()
        await poll_status(env, client)
        if heartbeat is not None:
            heartbeat.doing("rollouts")
        # lockstep waits on the version: polled more often where the API cannot long-poll
        poller = asyncio.create_task(follow_status(
            env, client, 0.1 if config.groups_per_policy_version else 0.5))

        try:
            await run_groups(env, Mirrored(api, copy), config.total_groups,
                             follows_policy=True)
        finally:
            poller.cancel()
            await api.close()
            if copy is not None:
                await copy.close()
        return {**env.describe_stats(), "delivery": asdict(api.stats),
                "spooled_left": api.spooling}


async def register(env: Any, client: RolloutAPIClient) -> dict[str, Any]:
    """Register with the rollout API, waiting for it to come up if it is not yet."""

    config = env.config
    while True:
        try:
            return await client.register_env(
                env.name, group_size=config.group_size,
                max_token_length=config.max_token_length, weight=config.env_weight,
                min_batch_allocation=config.min_batch_allocation)
        except APIRequestError as error:
            if error.status is not None:
                raise
            log.warning("rollout API at %s not reachable yet (%s); retrying",
                        config.api_url, error)
            await asyncio.sleep(5)


async def poll_status(env: Any, client: RolloutAPIClient, wait_s: float = 0.0) -> bool:
    """Take the API's policy version and the env's queue; with ``wait_s``, as a long poll
    (``/status-env`` answers when the env's queued sequences or the version are no longer
    what the env last heard: a lease, a push of its own, a new policy). The API numbers
    its snapshots of the env's queue, in these answers and in its answers to pushes, and
    the env keeps the newest, whichever arrives first. From an API that does not (an
    Atropos API) a group delivered while the poll was in flight may be missing from the
    answer, so it is added back: the count errs high by at most the groups delivered
    meanwhile, never low, which would let an env run further ahead than
    ``max_queued_groups``. Returns whether the API long-polls (an Atropos API answers
    ``/status-env`` at once, without the version)."""
    sent_before = env.stats.groups_sent
    env_id = getattr(env, "env_id", None)
    paced = env.config.max_queued_groups is not None  # paced on its own groups
    own = None
    if env_id is not None:  # also tells the API the env is alive (mix_wait_s)
        own = await client.env_status(
            env_id, wait_s=wait_s, policy_version=env.policy_version,
            self_queued_sequences=getattr(env, "_api_queued", None) if paced else None)
    long_polls = own is not None and "policy_version" in own
    status = own if long_polls else await client.status()
    env.policy_version = status.get("policy_version", env.policy_version)
    if status.get("policy_model"):
        env.use_policy_model(status["policy_model"])
    if own is not None and "snapshot" in own:
        _observe(env, own)
        return long_polls
    queued = own.get("self_queue_size") if own is not None and paced \
        else status.get("queue_size")
    if queued is not None:
        _set_queued(env, queued + env.stats.groups_sent - sent_before)
    return long_polls


def _observe(env: Any, answer: dict[str, Any]) -> None:
    """The API's snapshot of the env's queue, if newer than the one the env has."""
    if answer["snapshot"] <= getattr(env, "_snapshot", 0):
        return  # an older answer that arrived late
    env._snapshot, env._api_queued = answer["snapshot"], answer["self_queued_sequences"]
    _set_queued(env, env._api_queued // env.config.group_size)


def _set_queued(env: Any, queued: int) -> None:
    before, env.queued_groups = env.queued_groups, queued
    if before is None or queued < before:  # room for more groups: wake the held workers
        event, env._status_event = _status_event(env), asyncio.Event()
        event.set()


LONG_POLL_S = 2.0
"""How long one ``/status-env`` long poll waits at most (well within ``ENV_SILENT_S``, after
which the API stops waiting for a silent env's groups)."""


async def follow_status(env: Any, client: RolloutAPIClient, interval_s: float = 0.5) -> None:
    """Keep ``policy_version`` (recorded per turn) and ``queued_groups`` in step with
    the API's: long polls, each answered as soon as either moves, or polls every
    ``interval_s`` where the API answers at once."""
    long_polls = True
    while True:
        try:
            long_polls = await poll_status(env, client, LONG_POLL_S if long_polls else 0.0)
        except Exception as error:  # noqa: BLE001 - the API may be down; keep the last
            log.debug("policy version poll failed: %s", error)
            long_polls = False
        if not long_polls:
            await asyncio.sleep(interval_s)


def _status_event(env: Any) -> asyncio.Event:
    event = getattr(env, "_status_event", None)
    if event is None:
        event = env._status_event = asyncio.Event()
    return event


async def _status_changes(env: Any, timeout_s: float) -> None:
    """Until a status poll finds room in the env's queue, or ``timeout_s`` passed."""
    try:
        await asyncio.wait_for(_status_event(env).wait(), timeout_s)
    except asyncio.TimeoutError:
        pass
