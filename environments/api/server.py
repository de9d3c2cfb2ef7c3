"""The rollout API: an Atropos-compatible trajectory queue between envs and the trainer.

Envs push scored groups; the trainer takes batches. Speaks atroposlib 0.4.0's protocol
(``/register``, ``/register-env``, ``/scored_data``, ``/batch``, ``/status-env`` ...) and
adds what Atropos lacks:

* durability: an accepted group is committed to SQLite (WAL) before the push is
  answered, and a restarted server resumes its queue and leases;
* at-least-once delivery: ``POST /lease`` hands out a batch under a lease that the
  trainer acknowledges (``POST /ack``) after its step; an unacknowledged lease is
  redelivered after ``lease_timeout_s``;
* dead letters: a leased group the trainer cannot train on (e.g. token ids outside its
  model's vocabulary) is named in the ack with its reason and set aside, with its body,
  instead of being redelivered forever (``GET /dead_letters``, counted in ``/status``);
* idempotent pushes (client-chosen ``group_id``), policy versions with a staleness bound,
  per-turn scores, counters of everything received, served and dropped (and why);
* envs may register before the trainer; nothing changes state on GET except Atropos's
  own ``GET /batch`` (which is how Atropos trainers take data; native trainers use
  ``/lease``); any group size; oldest data first.

The HTTP layer (routes, handlers, ``serve``) is :mod:`environments.api.routes`.

Concurrency model: one asyncio event loop owns all in-memory state; every SQLite call
runs on one dedicated worker thread, in arrival order. Concurrent pushes are committed
together (group commit), so durability costs one fsync per burst, not per group.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, TypeVar

import orjson
from aiohttp import web

from environments.api.batching import QueuedGroup, select_batch
from environments.api.queue_db import LeaseRow, QueueDB
from environments.api.schemas import APIConfig, Registration
from environments.api.wire import AcceptedGroup

log = logging.getLogger("lachesis.api")
T = TypeVar("T")
MIN_ENV_WEIGHT = 0.01  # as Atropos: no env is starved completely
ENV_SILENT_S = 10.0
"""An env not heard from for this long (no push, no ``/status-env`` poll; env servers
poll every 0.5 s, atroposlib envs more often) is not waited for by the mix: a dead or
restarted env server holds up a batch this long at most."""


class APIError(Exception):
    """An error answered as JSON: ``{"error": message, "field": field?}``."""

    def __init__(self, status: int, message: str, field: str | None = None,
                 counter: str | None = None, close: bool = False, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.field, self.counter = status, message, field, counter
        self.close = close
        """Answer with ``Connection: close``: the rest of the request body was not read,
        so the connection cannot carry another request."""
        self.extra = extra


@dataclass
class EnvRecord:
    env_id: int
    desired_name: str
    real_name: str
    weight: float
    group_size: int
    max_token_length: int
    min_batch_allocation: float | None
    connected: bool = True
    registered_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    """When the API last heard from it (registration, a push, a ``/status-env`` poll)."""


@dataclass
class Lease:
    lease_id: str
    trainer: str | None
    expires_at: float
    step: int
    groups: list[QueuedGroup]


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status,
                        content_type="application/json")


class RolloutAPI:
    def __init__(self, config: APIConfig):
        self.config = config
        self.db = QueueDB(config.db_path, synchronous=config.synchronous)
        self._db_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue-db")
        loaded = self.db.load()
        self.queue: dict[int, QueuedGroup] = {g.seq: g for g in loaded.queue}
        self.mix_credit: dict[int | None, float] = {
            env: credit for env, credit in loaded.kv.get("mix_credit", [])}
        """Each env's carried credit in the weighted mix of batches (batching rule 3),
        saved with every batch served, so a restarted API keeps the mix."""
        self._mix_held_since: float | None = None
        """Since when a batch that the queue could make waits for an owed env."""
        self._mix_waits_for: dict[int, str] = {}
        self._mix_gave_up: set[int] = set()
        """Envs a batch waited ``mix_wait_s`` for in vain: not waited for again until they
        deliver a group (an env whose groups all fail costs one wait, not one a batch)."""
        latest_expiry = time.time() + config.lease_timeout_s  # this run's timeout applies
        self.leases: dict[str, Lease] = {
            row.lease_id: Lease(row.lease_id, row.trainer, min(row.expires_at, latest_expiry),
                                row.step, [loaded.leased_groups[s] for s in row.group_seqs])
            for row in loaded.leases}
        self.envs: dict[int, EnvRecord] = {
            env_id: EnvRecord(**record) for env_id, record in loaded.envs.items()}
        self.trainer: Registration | None = (
            Registration(**loaded.kv["trainer"]) if loaded.kv.get("trainer") else None)
        self.step: int = loaded.kv.get("step", 0)
        self.policy_version: int | None = loaded.kv.get("policy_version")
        self.policy_model: str | None = loaded.kv.get("policy_model")
        self.resumed_from: int | None = loaded.kv.get("resumed_from")
        """The version the trainer last resumed from (None: it never resumed)."""
        self.counters: Counter[str] = Counter(loaded.counters)
        self._unsaved_counts: Counter[str] = Counter()  # rejections, saved with the next write
        self._pending_pushes: list[tuple[list[tuple[AcceptedGroup, str | None]], asyncio.Future]] = []
        self._flushing = False
        self._latest_body: bytes | None = None
        self._expiry_task: asyncio.Task | None = None
        self._recent_acks: dict[str, None] = dict.fromkeys(loaded.acked)  # ordered, bounded
        self._changed = asyncio.Event()
        """Set (and replaced) when the queue, the leases or the policy version may have
        changed: long-polling ``/status-env`` requests look again."""
        self._expiring = asyncio.Lock()
        self._snapshots = time.time_ns()
        """The number of the last env snapshot (``own_queue``), their order for the envs:
        counted from the start's wall clock in ns, so a restarted API's snapshots still
        number above the ones its envs kept from before."""
        if self.queue or self.leases:
            log.info("resumed %d queued groups and %d leases from %s",
                     len(self.queue), len(self.leases), config.db_path)

    # -- plumbing -------------------------------------------------------------------------
    async def _in_db_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._db_thread, lambda: fn(*args, **kwargs))

    async def _write(self, method: Callable[..., T], *args: Any,
                     kv: dict[str, Any] | None = None,
                     counts: dict[str, int] | None = None) -> T:
        """Run a QueueDB write; count it in memory once it is committed."""
        unsaved = self._unsaved_counts  # already in self.counters
        self._unsaved_counts = Counter()
        try:
            result = await self._in_db_thread(method, *args, kv=kv,
                                              counts=unsaved + Counter(counts or {}))
        except BaseException:
            self._unsaved_counts += unsaved
            raise
        self.counters.update(counts or {})
        return result

    def count_rejection(self, reason: str) -> None:
        self.counters[f"rejected_{reason}"] += 1
        self._unsaved_counts[f"rejected_{reason}"] += 1

    async def start(self, app: web.Application) -> None:
        self._expiry_task = asyncio.create_task(self._expire_leases_forever())

    async def stop(self, app: web.Application) -> None:
        if self._expiry_task:
            self._expiry_task.cancel()
        if self._unsaved_counts:
            await self._write(self.db.put)
        await self._in_db_thread(self.db.close)
        self._db_thread.shutdown(wait=True)

    # -- pushes -------------------------------------------------------------------------
    def _is_stale(self, policy_version: int | None) -> bool:
        """Generated more than ``max_staleness`` versions before the current policy."""
        limit = self.config.max_staleness
        return (limit is not None and policy_version is not None
                and self.policy_version is not None
                and self.policy_version - policy_version > limit)

    def _drop_reason(self, group: AcceptedGroup) -> str | None:
        return "stale" if self._is_stale(group.policy_version) else None

    def _from_lost_policy(self, group: AcceptedGroup) -> AcceptedGroup:
        """A group stamped with a version above the current one was sampled (before a
        resume) by weights that no longer exist: kept, its staleness measured from
        ``2 * V - v`` (V: the version the trainer resumed from), its distance in steps
        from the resumed policy (see :meth:`resume`)."""
        resumed = self.resumed_from
        v = group.policy_version
        if resumed is None or v is None or self.policy_version is None \
                or v <= self.policy_version:
            return group
        self.counters["kept_lost_policy_groups"] += 1
        self._unsaved_counts["kept_lost_policy_groups"] += 1
        return replace(group, policy_version=2 * resumed - v)

    async def store_groups(self, groups: list[AcceptedGroup]) -> list[dict[str, Any]]:
        """Commit groups (with concurrent pushes, in one transaction) and queue them."""
        groups = [self._from_lost_policy(g) for g in groups]
        decided = [(g, self._drop_reason(g)) for g in groups]
        future = asyncio.get_running_loop().create_future()
        self._pending_pushes.append((decided, future))
        if not self._flushing:
            self._flushing = True
            asyncio.create_task(self._flush_pushes())
        seqs = await future
        results = []
        for (group, reason), seq in zip(decided, seqs):
            if seq is None:
                results.append({"group_id": group.group_id, "duplicate": True})
                continue
            self.seen(group.env_id)
            self._mix_gave_up.discard(group.env_id)
            if reason is None:
                self.queue[seq] = QueuedGroup(seq, group.group_id, group.env_id,
                                              group.n_sequences, group.policy_version)
                self._latest_body = group.body
            results.append({"group_id": group.group_id, "duplicate": False,
                            **({"dropped": reason} if reason else {})})
        return results

    async def _flush_pushes(self) -> None:
        try:
            while self._pending_pushes:
                batch, self._pending_pushes = self._pending_pushes, []
                rows = [row for decided, _ in batch for row in decided]
                try:
                    seqs, push_counts = await self._write(self.db.insert_groups, rows)
                except Exception as error:  # nothing of this batch was committed
                    log.exception("could not commit %d groups", len(rows))
                    for _, future in batch:
                        future.set_exception(APIError(503, f"storage error: {error}"))
                    continue
                self.counters.update(push_counts)
                start = 0
                for decided, future in batch:
                    future.set_result(seqs[start:start + len(decided)])
                    start += len(decided)
        finally:
            self._flushing = False

    def changed(self) -> None:
        """The state may have changed (a request that writes was answered, a lease
        expired): wake the requests waiting for a change."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def wait_for_change(self, timeout_s: float) -> None:
        """Until :meth:`changed` is next called, or ``timeout_s`` passed."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    # -- batches ------------------------------------------------------------------------
    async def _expire_leases(self) -> None:
        # one at a time: a lease asked for while the sweep is returning an expired one
        # (its groups out of the lease, not yet queued again) waits for them to be queued
        async with self._expiring:
            now = time.time()
            expired = [l for l in self.leases.values() if l.expires_at <= now]
            for lease in expired:
                await self.return_lease(lease, {"leases_expired": 1,
                                                 "redelivered_groups": len(lease.groups)})
        if expired:
            self.changed()

    async def _expire_leases_forever(self) -> None:
        period = min(1.0, self.config.lease_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self._expire_leases()
            except Exception:
                log.exception("lease expiry failed")

    async def return_lease(self, lease: Lease, counts: dict[str, int]) -> None:
        if self.leases.pop(lease.lease_id, None) is None:
            return
        self._refund(lease.groups)
        await self._write(self.db.finish_lease, lease.lease_id, False, counts=counts,
                          kv=self._credit_kv())
        self._requeue(lease.groups)

    async def _drop_unservable(self) -> None:
        """Drop (and count) queued groups that can never be trained: stale ones, and
        groups with more sequences than the registered trainer's batch holds."""
        batch_size = self.trainer.batch_size if self.trainer else None
        reasons: dict[str, list[QueuedGroup]] = {}
        for g in self.queue.values():
            if self._is_stale(g.policy_version):
                reasons.setdefault("stale", []).append(g)
            elif batch_size is not None and g.n_sequences > batch_size:
                reasons.setdefault("larger_than_batch", []).append(g)
        for reason, groups in reasons.items():
            for g in groups:
                del self.queue[g.seq]
            await self._write(self.db.drop, [g.seq for g in groups], reason, counts={
                f"dropped_groups_{reason}": len(groups),
                f"dropped_sequences_{reason}": sum(g.n_sequences for g in groups)})

    async def next_batch(self, batch_size: int) -> list[QueuedGroup] | None:
        await self._expire_leases()
        await self._drop_unservable()
        min_shares = {e.env_id: e.min_batch_allocation for e in self.envs.values()
                      if e.connected and e.min_batch_allocation}
        fitting = [g for g in self.queue.values() if g.n_sequences <= batch_size]
        weights = {e.env_id: e.weight for e in self.envs.values()}
        now, wait_s = time.time(), self.config.mix_wait_s
        if self._mix_held_since is not None and now - self._mix_held_since >= wait_s:
            # waited long enough: the others fill the batch
            self._mix_gave_up.update(self._mix_waits_for)
            self.counters["mix_waits_timed_out"] += 1
            self._unsaved_counts["mix_waits_timed_out"] += 1
            log.warning("a batch waited %g s (mix_wait_s) for %s, which the weights owe the "
                        "next group; filled from the other envs", wait_s,
                        ", ".join(self._mix_waits_for.values()))
            self._mix_held_since, self._mix_waits_for = None, {}
        waiting = {e.env_id: e.group_size for e in self.envs.values()
                   if e.connected and e.weight > 0
                   and now - e.last_seen < min(wait_s, ENV_SILENT_S)
                   and e.env_id not in self._mix_gave_up}
        held: set[int | None] = set()
        chosen = select_batch(fitting, batch_size, min_shares, weights=weights,
                              credit=self.mix_credit, waiting=waiting, held=held)
        if held:  # the queue could make a batch: held for the env the weights owe
            self._mix_held_since = self._mix_held_since or now
            self._mix_waits_for = {e: self.envs[e].real_name for e in held}
            return None
        if chosen:
            self._mix_held_since, self._mix_waits_for = None, {}
            for g in chosen:
                del self.queue[g.seq]
        return chosen

    def seen(self, env_id: int | None) -> None:
        """The env is alive: a batch may wait for its groups (``mix_wait_s``)."""
        env = self.envs.get(env_id) if env_id is not None else None
        if env is not None:
            env.last_seen = time.time()

    def _credit_kv(self) -> dict[str, Any]:
        return {"mix_credit": [[env, round(c, 6)] for env, c in self.mix_credit.items()]}

    def _refund(self, groups: list[QueuedGroup]) -> None:
        """Groups going back to the queue were paid for in the mix: their envs get the
        credit back (they are paid for again when a batch takes them)."""
        for g in groups:
            if g.env_id in self.mix_credit:
                self.mix_credit[g.env_id] += g.n_sequences

    def _requeue(self, groups: list[QueuedGroup]) -> None:
        for g in groups:
            self.queue[g.seq] = g
        self.queue = dict(sorted(self.queue.items()))

    @staticmethod
    def _served_counts(groups: list[QueuedGroup]) -> dict[str, int]:
        return {"served_batches": 1, "served_groups": len(groups),
                "served_sequences": sum(g.n_sequences for g in groups)}

    async def take_batch(self, batch_size: int) -> list[bytes] | None:
        """Atropos ``GET /batch``: the batch leaves the queue for good."""
        chosen = await self.next_batch(batch_size)
        if not chosen:
            return None
        try:
            bodies = await self._write(self.db.take, [g.seq for g in chosen],
                                       kv={"step": self.step + 1, **self._credit_kv()},
                                       counts=self._served_counts(chosen))
        except BaseException:
            self._requeue(chosen)
            raise
        self.step += 1
        return bodies

    async def lease_batch(self, batch_size: int, trainer: str | None
                          ) -> tuple[Lease, list[bytes]] | None:
        chosen = await self.next_batch(batch_size)
        if not chosen:
            return None
        lease = Lease(uuid.uuid4().hex, trainer,
                      time.time() + self.config.lease_timeout_s, self.step, chosen)
        row = LeaseRow(lease.lease_id, trainer, time.time(), lease.expires_at, lease.step,
                       [g.seq for g in chosen])
        try:
            bodies = await self._write(self.db.lease, row, kv=self._credit_kv(),
                                       counts={"leases": 1, **self._served_counts(chosen)})
        except BaseException:
            self._requeue(chosen)
            raise
        self.leases[lease.lease_id] = lease
        return lease, bodies

    async def ack(self, lease_id: str, dead_letters: dict[str, str] | None = None,
                  step: int | None = None, dropped: dict[str, str] | None = None) -> None:
        """Finish a lease: its groups are done, except ``dead_letters`` (group id ->
        reason), which are set aside with their bodies and never redelivered. ``step``:
        the trainer step that trained them (kept until a checkpoint covers it);
        ``dropped`` (group id -> reason): groups the step used up without training on
        them, counted as dropped."""
        if lease_id in self._recent_acks:  # a retried ack whose answer was lost
            return
        lease = self.leases.get(lease_id)
        if lease is None:
            self.count_rejection("unknown_lease")
            raise APIError(409, f"lease {lease_id!r} is not active: it expired (and its "
                                "groups were redelivered), was acknowledged already, or "
                                "never existed", field="lease_id")
        by_id = {g.group_id: g for g in lease.groups}
        dead_letters, dropped = dead_letters or {}, dropped or {}
        for name, named in (("dead_letters", dead_letters), ("dropped", dropped)):
            for i, group_id in enumerate(named):
                if group_id not in by_id:
                    self.count_rejection("invalid")
                    raise APIError(422, f"group {group_id!r} is not part of lease "
                                        f"{lease_id!r}", field=f"{name}[{i}].group_id")
        skipped = {by_id[g].seq: reason for g, reason in dropped.items()
                   if g not in dead_letters}
        drop_counts: Counter[str] = Counter()
        for reason in skipped.values():
            drop_counts[f"dropped_groups_{reason}"] += 1
        dead = {by_id[g].seq: reason for g, reason in dead_letters.items()}
        for group_id, reason in dead_letters.items():
            log.warning("dead letter: group %s (env_id %s) set aside by trainer %s: %s",
                        group_id, by_id[group_id].env_id, lease.trainer, reason)
        del self.leases[lease_id]
        n_dead = sum(by_id[g].n_sequences for g in dead_letters)
        try:
            finish = functools.partial(self.db.finish_lease, dead_letters=dead,
                                       trainer=lease.trainer, trained_step=step,
                                       dropped=skipped)
            await self._write(finish, lease_id, True, kv={"step": self.step + 1},
                              counts={"acked_leases": 1, **drop_counts,
                                      "acked_groups": len(lease.groups) - len(dead)
                                      - len(skipped),
                                      "dead_lettered_groups": len(dead),
                                      "dead_lettered_sequences": n_dead})
        except BaseException:
            self.leases[lease_id] = lease
            raise
        self.step += 1
        self._recent_acks[lease_id] = None
        if len(self._recent_acks) > 10_000:
            self._recent_acks.pop(next(iter(self._recent_acks)))

    async def resume(self, version: int, model: str | None, trainer: str | None
                     ) -> dict[str, Any]:
        """The trainer restarted from its checkpoint of step ``version``; what happened
        after that step is undone here, in one transaction:

        * every lease is released at once (its trainer is dead; one trainer per API),
          its groups queued again, not after ``lease_timeout_s``;
        * groups trained at steps after ``version`` are queued again: the update they
          went into died with the trainer (their bodies are kept until a checkpoint
          covers their step, see ``POST /checkpoint``);
        * the policy version (and step) go back to ``version``;
        * queued groups sampled by versions above ``version`` came from weights that no
          longer exist. They are kept: each trajectory carries the behaviour logprobs
          it was sampled with, so the importance ratio against the trainer's policy is
          exact whichever weights produced it; only how far off-policy it is changes.
          Its staleness is measured from ``2 * version - v``, its distance in optimizer
          steps from the resumed policy (back to the fork at ``version``, then up), so
          ``max_staleness`` bounds it like any other group's.
        """
        kv = {"policy_version": version, "policy_model": model, "step": version,
              "resumed_from": version}
        result = await self._write(self.db.resume, version, kv=kv)
        self.counters.update(result.counts)
        by_seq = {g.seq: g for lease in self.leases.values() for g in lease.groups}
        self.leases = {}
        back = [by_seq[s] for s in result.released if s in by_seq]
        requeued = await self._in_db_thread(self.db.queued_groups, result.requeued)
        self._refund(back + requeued)
        await self._write(self.db.put, kv=self._credit_kv())
        self._requeue(back + requeued)
        for seq, effective in result.reflected.items():
            if seq in self.queue:
                self.queue[seq] = replace(self.queue[seq], policy_version=effective)
        self.policy_version, self.policy_model = version, model
        self.step, self.resumed_from = version, version
        log.warning("trainer %s resumed from step %d: released %d leases (%d groups), "
                    "queued again %d groups trained after it, kept %d groups sampled by "
                    "lost versions%s", trainer, version, result.released_leases,
                    len(result.released), len(result.requeued), len(result.reflected),
                    f", dropped {len(result.unrecoverable)} whose bodies were released"
                    if result.unrecoverable else "")
        return {"policy_version": version, "released_leases": result.released_leases,
                "released_groups": len(result.released),
                "requeued_groups": len(result.requeued),
                "kept_lost_policy_groups": len(result.reflected),
                "dropped_groups": len(result.unrecoverable)}

    async def reset(self) -> None:
        """Forget everything: queue, leases, envs, trainer, step, version, counters."""
        await self._in_db_thread(self.db.reset)
        self.queue, self.leases, self.envs, self.mix_credit = {}, {}, {}, {}
        self._mix_held_since, self._mix_waits_for, self._mix_gave_up = None, {}, set()
        self.trainer, self.step, self.policy_version = None, 0, None
        self.policy_model = self.resumed_from = None
        self.counters, self._unsaved_counts = Counter(), Counter()
        self._latest_body, self._recent_acks = None, {}

    # -- status -------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "current_step": self.step,
            "queue_size": len(self.queue),
            "queued_sequences": sum(g.n_sequences for g in self.queue.values()),
            "leased_groups": sum(len(l.groups) for l in self.leases.values()),
            "active_leases": len(self.leases),
            "policy_version": self.policy_version,
            "policy_model": self.policy_model,
            "trainer_registered": self.trainer is not None,
            "durable": not self.config.in_memory,
            "dead_letters": self.counters.get("dead_lettered_groups", 0),
            "silent_envs": self.silent_envs(),
            "counters": dict(sorted(self.counters.items())),
        }

    def silent_envs(self) -> list[dict[str, Any]]:
        """Env servers the API has not heard from for more than ``ENV_SILENT_S`` (no push,
        no poll; a live one polls every 0.5 s): connected, and not replaced by a later
        registration under the same name (a restarted server's)."""
        now, envs = time.time(), list(self.envs.values())
        return [{"name": e.real_name, "kind": "env", "env_id": e.env_id,
                 "silent_s": round(now - e.last_seen, 1)}
                for e in envs if e.connected and now - e.last_seen > ENV_SILENT_S
                and not any(o.desired_name == e.desired_name and o.env_id > e.env_id
                            for o in envs)]

    def why_no_batch(self, batch_size: int) -> str:
        """Why ``/lease`` or ``/batch`` found no batch of ``batch_size`` sequences."""
        groups = list(self.queue.values())
        queued = sum(g.n_sequences for g in groups)
        if not groups:
            return "no groups queued"
        if queued < batch_size:
            return (f"{queued} sequences queued (in {len(groups)} groups), fewer than "
                    f"batch_size {batch_size}: waiting for more")
        fitting = [g for g in groups if g.n_sequences <= batch_size]
        if sum(g.n_sequences for g in fitting) < batch_size:
            return (f"{queued} sequences queued, but only "
                    f"{sum(g.n_sequences for g in fitting)} in groups that fit in "
                    f"batch_size {batch_size}")
        if self._mix_waits_for:
            return (f"{queued} sequences queued, but the envs' weights owe the next group to "
                    f"{', '.join(self._mix_waits_for.values())}: waiting for it (at most mix_wait_s "
                    f"{self.config.mix_wait_s:g} s)")
        return (f"{queued} sequences queued, but an env's min_batch_allocation is not met "
                "yet: waiting for its groups")

    def own_queue(self, env_id: int) -> dict[str, int]:
        """The env's own queued sequences now, numbered: an env that reads snapshots from
        several answers (pushes, polls) keeps the newest, whatever order they arrive in."""
        self._snapshots += 1
        own = sum(g.n_sequences for g in self.queue.values() if g.env_id == env_id)
        return {"self_queued_sequences": own, "snapshot": self._snapshots}

    def env_status(self, env_id: int) -> dict[str, Any]:
        env = self.envs.get(env_id)
        if env is None:
            raise APIError(404, f"unknown env_id {env_id}", field="env_id")
        self.seen(env_id)
        connected = [e for e in self.envs.values() if e.connected]
        total = sum(e.max_token_length * max(0.0, e.weight) for e in connected)
        weight = env.max_token_length * env.weight / total if total else 1.0
        min_total = sum(e.min_batch_allocation or 0.0 for e in connected)
        snapshot = self.own_queue(env_id)
        own = snapshot["self_queued_sequences"]
        queued = sum(g.n_sequences for g in self.queue.values())
        return {
            "current_step": self.step,
            "policy_version": self.policy_version,
            "policy_model": self.policy_model,
            "queue_size": (own if self.config.status_env_own_queue else queued)
            // env.group_size,
            "self_queue_size": own // env.group_size,
            **snapshot,
            "unallocated_fraction": 1.0 - min(min_total, 1.0),
            "max_group_size": max((g.n_sequences for g in self.queue.values()), default=1),
            "env_weight": max(MIN_ENV_WEIGHT, weight),
        }
