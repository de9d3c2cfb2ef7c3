"""The rollout API's durable state: an embedded SQLite database in WAL mode.

Every group the API accepts is a row of ``groups``, committed before the push is
answered. Its ``state`` moves ``queued -> leased -> done`` (or ``dropped``, with a
reason, or ``dead_letter``: a group the trainer could not train on, set aside with the
reason in ``dead_letters``). A trained group records the trainer step that trained it
(``trained_step``) and keeps its JSON body until the trainer reports a checkpoint that
holds that step's update (``release_trained``): a trainer that resumes from an older
checkpoint gets those groups again (``resume``), because the update they went into was
lost with the crash. A dropped group's body is cleared at once, a dead letter keeps it
(to be inspected); the row stays so that a retried push with the same ``group_id``
remains a no-op. Leases, env
registrations, the trainer registration, the policy version and the counters live in the
same file, so a restarted server resumes exactly where it stopped.

This class is synchronous and not thread-safe: the server calls it from one dedicated
worker thread, so SQLite never blocks the event loop. ``path=":memory:"`` keeps
everything in memory (nothing survives a restart).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.api.batching import QueuedGroup
from environments.api.wire import AcceptedGroup

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL UNIQUE,
    env_id INTEGER,
    n_sequences INTEGER NOT NULL,
    policy_version INTEGER,
    state TEXT NOT NULL,
    lease_id TEXT,
    drop_reason TEXT,
    received_at REAL NOT NULL,
    body BLOB,
    trained_step INTEGER,
    requeues INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS groups_live ON groups(state) WHERE state IN ('queued', 'leased');
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    trainer TEXT,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    step INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS envs (
    env_id INTEGER PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS acked_leases (
    lease_id TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS dead_letters (
    seq INTEGER PRIMARY KEY REFERENCES groups(seq),
    reason TEXT NOT NULL,
    trainer TEXT,
    at REAL NOT NULL
);
"""


RECENT_ACKS = 10_000
"""Acknowledged lease ids remembered (for retried acks), also across restarts."""


@dataclass
class DeadLetter:
    """A group the trainer refused, acknowledged and set aside (its body kept)."""

    group_id: str
    env_id: int | None
    reason: str
    trainer: str | None
    at: float
    body: bytes


@dataclass
class ResumeResult:
    released: list[int] = field(default_factory=list)
    """Groups that were leased (by the dead trainer), back in the queue."""
    released_leases: int = 0
    requeued: list[int] = field(default_factory=list)
    """Groups trained after the resumed step (their update was lost), queued again."""
    unrecoverable: list[int] = field(default_factory=list)
    """Groups trained after the resumed step whose body was already released: dropped."""
    reflected: dict[int, int] = field(default_factory=dict)
    """Queued groups sampled by a lost policy version: seq -> the version staleness is
    now measured from."""
    counts: Counter[str] = field(default_factory=Counter)


@dataclass
class LeaseRow:
    lease_id: str
    trainer: str | None
    created_at: float
    expires_at: float
    step: int
    group_seqs: list[int]


@dataclass
class LoadedState:
    queue: list[QueuedGroup]
    leases: list[LeaseRow]
    leased_groups: dict[int, QueuedGroup]
    envs: dict[int, dict[str, Any]]
    kv: dict[str, Any]
    counters: dict[str, int]
    acked: list[str] = field(default_factory=list)


class QueueDB:
    def __init__(self, path: str | Path, synchronous: str = "FULL"):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # Group bodies are ~100 KB: 64 KiB pages cut SQLite's overflow-page work per
        # insert by ~2x (page_size only takes effect on a new database).
        self.conn.execute("PRAGMA page_size=65536")
        if self.path != ":memory:":
            self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={synchronous}")
        self.conn.executescript(SCHEMA)
        columns = {row[1] for row in self.conn.execute("PRAGMA table_info(groups)")}
        for column, kind in (("trained_step", "INTEGER"),
                             ("requeues", "INTEGER NOT NULL DEFAULT 0")):
            if column not in columns:  # a queue written before these columns existed
                self.conn.execute(f"ALTER TABLE groups ADD COLUMN {column} {kind}")
        self.conn.execute("CREATE INDEX IF NOT EXISTS groups_trained ON groups(trained_step) "
                          "WHERE body IS NOT NULL AND state = 'done'")

    def close(self) -> None:
        self.conn.close()

    # -- start-up -------------------------------------------------------------------
    def load(self) -> LoadedState:
        rows = self.conn.execute(
            "SELECT seq, group_id, env_id, n_sequences, policy_version, state, lease_id "
            "FROM groups WHERE state IN ('queued', 'leased') ORDER BY seq").fetchall()
        queue, leased, by_lease = [], {}, {}
        for seq, group_id, env_id, n, version, state, lease_id in rows:
            group = QueuedGroup(seq, group_id, env_id, n, version)
            if state == "queued":
                queue.append(group)
            else:
                leased[seq] = group
                by_lease.setdefault(lease_id, []).append(seq)
        leases = [LeaseRow(lid, trainer, created, expires, step, by_lease.get(lid, []))
                  for lid, trainer, created, expires, step in self.conn.execute(
                      "SELECT lease_id, trainer, created_at, expires_at, step FROM leases")]
        envs = {env_id: json.loads(record)
                for env_id, record in self.conn.execute("SELECT env_id, record FROM envs")}
        kv = {key: json.loads(value)
              for key, value in self.conn.execute("SELECT key, value FROM kv")}
        counters = dict(self.conn.execute("SELECT name, value FROM counters"))
        acked = [lid for (lid,) in self.conn.execute(
            "SELECT lease_id FROM acked_leases ORDER BY rowid")]
        return LoadedState(queue, leases, leased, envs, kv, counters, acked)

    # -- writes (each one transaction) ---------------------------------------------------
    # ``kv``: state values to set; ``counts``: counter increments; both committed with
    # the change they describe.

    def insert_groups(
        self,
        groups: Sequence[tuple[AcceptedGroup, str | None]],
        kv: dict[str, Any] | None = None,
        counts: dict[str, int] | None = None,
    ) -> tuple[list[int | None], Counter[str]]:
        """Insert ``(group, drop_reason)`` pairs, in one transaction.

        Returns each new row's seq (None for a ``group_id`` already known: a retried
        push) and the received/duplicate/dropped counts committed with them.
        """
        now = time.time()
        seqs: list[int | None] = []
        push_counts: Counter[str] = Counter()
        counts = Counter(counts or {})
        with self._transaction(kv, counts) as cur:
            for group, drop_reason in groups:
                cur.execute(
                    "INSERT OR IGNORE INTO groups (group_id, env_id, n_sequences, "
                    "policy_version, state, drop_reason, received_at, body) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (group.group_id, group.env_id, group.n_sequences, group.policy_version,
                     "dropped" if drop_reason else "queued", drop_reason, now,
                     None if drop_reason else group.body))
                new = cur.rowcount == 1
                seqs.append(cur.lastrowid if new else None)
                push_counts.update(_push_counts(group, drop_reason, new))
            counts.update(push_counts)  # committed by _transaction on the way out
        return seqs, push_counts

    def read_bodies(self, seqs: Sequence[int]) -> list[bytes]:
        placeholders = ",".join("?" * len(seqs))
        found = dict(self.conn.execute(
            f"SELECT seq, body FROM groups WHERE seq IN ({placeholders})", list(seqs)))
        return [found[s] for s in seqs]

    def lease(self, lease: LeaseRow, kv=None, counts=None) -> list[bytes]:
        """Record a lease over its groups and return their bodies (oldest first)."""
        with self._transaction(kv, counts) as cur:
            cur.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?)",
                        (lease.lease_id, lease.trainer, lease.created_at, lease.expires_at,
                         lease.step))
            cur.executemany("UPDATE groups SET state='leased', lease_id=? WHERE seq=?",
                            [(lease.lease_id, s) for s in lease.group_seqs])
        return self.read_bodies(lease.group_seqs)

    def take(self, seqs: Sequence[int], kv=None, counts=None) -> list[bytes]:
        """Hand groups out for good (Atropos ``GET /batch``: no acknowledgement)."""
        bodies = self.read_bodies(seqs)
        with self._transaction(kv, counts) as cur:
            cur.executemany("UPDATE groups SET state='done', body=NULL WHERE seq=?",
                            [(s,) for s in seqs])
        return bodies

    def finish_lease(self, lease_id: str, done: bool, kv=None, counts=None,
                     dead_letters: dict[int, str] | None = None,
                     trainer: str | None = None, trained_step: int | None = None,
                     dropped: dict[int, str] | None = None) -> None:
        """Acknowledge a lease (its groups are done, except ``dead_letters``: seq -> reason,
        set aside with their bodies) or give its groups back to the queue. A done group
        keeps its body, with the ``trained_step`` that trained it, until
        :meth:`release_trained` (without a step it is cleared at once). ``dropped``:
        seq -> reason, groups the step used up without training on them."""
        with self._transaction(kv, counts) as cur:
            if done and dead_letters:
                now = time.time()
                cur.executemany("UPDATE groups SET state='dead_letter', drop_reason=?, "
                                "lease_id=NULL WHERE seq=?",
                                [(reason, seq) for seq, reason in dead_letters.items()])
                cur.executemany("INSERT OR REPLACE INTO dead_letters VALUES (?, ?, ?, ?)",
                                [(seq, reason, trainer, now)
                                 for seq, reason in dead_letters.items()])
            if done and dropped:
                cur.executemany("UPDATE groups SET state='dropped', drop_reason=?, "
                                "body=NULL, lease_id=NULL WHERE seq=?",
                                [(reason, seq) for seq, reason in dropped.items()])
            if done and trained_step is None:
                cur.execute("UPDATE groups SET state='done', body=NULL, lease_id=NULL "
                            "WHERE lease_id=?", (lease_id,))
            elif done:
                cur.execute("UPDATE groups SET state='done', trained_step=?, lease_id=NULL "
                            "WHERE lease_id=?", (trained_step, lease_id))
            else:
                cur.execute("UPDATE groups SET state='queued', lease_id=NULL "
                            "WHERE lease_id=?", (lease_id,))
            cur.execute("DELETE FROM leases WHERE lease_id=?", (lease_id,))
            if done:  # a retried ack (its answer lost in a crash) is recognised after it
                cur.execute("INSERT OR IGNORE INTO acked_leases VALUES (?)", (lease_id,))
                cur.execute("DELETE FROM acked_leases WHERE rowid <= "
                            "(SELECT MAX(rowid) FROM acked_leases) - ?", (RECENT_ACKS,))

    def release_trained(self, up_to_step: int, kv=None, counts=None) -> int:
        """Clear the bodies of groups trained at steps ``<= up_to_step`` (a checkpoint the
        trainer can no longer resume from before holds their update); returns how many."""
        with self._transaction(kv, counts) as cur:
            cur.execute("UPDATE groups SET body=NULL WHERE state='done' AND body IS NOT NULL "
                        "AND trained_step <= ?", (up_to_step,))
            return cur.rowcount

    def resume(self, version: int, kv=None, counts=None) -> ResumeResult:
        """The trainer resumed from the checkpoint of step ``version``, in one transaction:
        every lease is given back to the queue (its trainer is dead); groups trained at
        steps after ``version`` go back to the queue (their update was lost), oldest
        first by their original arrival; queued groups sampled by a policy version above
        ``version`` (weights that no longer exist) are kept, their staleness measured
        from ``2 * version - v`` (see :meth:`RolloutAPI.resume`)."""
        result = ResumeResult()
        counts = Counter(counts or {})
        with self._transaction(kv, counts) as cur:
            result.released = [seq for (seq,) in cur.execute(
                "SELECT seq FROM groups WHERE state='leased'")]
            result.released_leases = cur.execute("DELETE FROM leases").rowcount
            cur.execute("UPDATE groups SET state='queued', lease_id=NULL WHERE state='leased'")
            trained_after = cur.execute(
                "SELECT seq, body IS NOT NULL FROM groups WHERE state='done' "
                "AND trained_step > ?", (version,)).fetchall()
            result.requeued = [seq for seq, has_body in trained_after if has_body]
            result.unrecoverable = [seq for seq, has_body in trained_after if not has_body]
            cur.executemany("UPDATE groups SET state='queued', trained_step=NULL, "
                            "requeues=requeues+1 WHERE seq=?",
                            [(s,) for s in result.requeued])
            result.reflected = dict(cur.execute(
                "SELECT seq, 2 * ? - policy_version FROM groups WHERE state='queued' "
                "AND policy_version > ?", (version, version)).fetchall())
            cur.executemany("UPDATE groups SET policy_version=? WHERE seq=?",
                            [(v, s) for s, v in result.reflected.items()])
            if result.unrecoverable:  # trained, then the checkpoint holding it was lost
                cur.executemany("UPDATE groups SET state='dropped', "
                                "drop_reason='update_lost_body_released' WHERE seq=?",
                                [(s,) for s in result.unrecoverable])
            result.counts = Counter({
                "resumes": 1, "released_leases": result.released_leases,
                "released_groups": len(result.released),
                "requeued_lost_update_groups": len(result.requeued),
                "kept_lost_policy_groups": len(result.reflected),
                "dropped_groups_update_lost_body_released": len(result.unrecoverable)})
            counts.update(result.counts)  # committed by _transaction on the way out
        return result

    def queued_groups(self, seqs: Sequence[int]) -> list[QueuedGroup]:
        placeholders = ",".join("?" * len(seqs))
        return [QueuedGroup(*row) for row in self.conn.execute(
            "SELECT seq, group_id, env_id, n_sequences, policy_version FROM groups "
            f"WHERE seq IN ({placeholders}) ORDER BY seq", list(seqs))]

    def accounting(self) -> dict[str, Any]:
        """Every group row by state (and drop reason), with the groups trained again after
        a resume; ``received`` is the sum of the states."""
        by_state = dict(self.conn.execute("SELECT state, COUNT(*) FROM groups GROUP BY state"))
        dropped = dict(self.conn.execute(
            "SELECT drop_reason, COUNT(*) FROM groups WHERE state='dropped' "
            "GROUP BY drop_reason"))
        set_aside = dict(self.conn.execute(
            "SELECT reason, COUNT(*) FROM dead_letters GROUP BY reason"))
        (retrained,) = self.conn.execute(
            "SELECT COUNT(*) FROM groups WHERE state='done' AND requeues > 0").fetchone()
        (requeues,) = self.conn.execute("SELECT COALESCE(SUM(requeues), 0) FROM groups"
                                        ).fetchone()
        counters = dict(self.conn.execute(
            "SELECT name, value FROM counters WHERE name IN ('resumes', 'released_groups', "
            "'kept_lost_policy_groups', 'duplicate_pushes', 'leases_expired')"))
        return {"received": sum(by_state.values()),
                "trained": by_state.get("done", 0),
                "trained_again_after_resume": retrained,
                "lost_updates_requeued": requeues,
                "set_aside": by_state.get("dead_letter", 0),
                "set_aside_reasons": set_aside,
                "dropped": by_state.get("dropped", 0),
                "dropped_reasons": dropped,
                "queued": by_state.get("queued", 0),
                "leased": by_state.get("leased", 0),
                "resumes": counters.get("resumes", 0),
                "released_from_dead_trainers": counters.get("released_groups", 0),
                "kept_lost_policy_groups": counters.get("kept_lost_policy_groups", 0),
                "duplicate_pushes_ignored": counters.get("duplicate_pushes", 0),
                "leases_expired": counters.get("leases_expired", 0)}

    def dead_letters(self, limit: int) -> tuple[int, list[DeadLetter]]:
        """How many groups were set aside, and the newest ``limit`` of them."""
        (total,) = self.conn.execute("SELECT COUNT(*) FROM dead_letters").fetchone()
        rows = self.conn.execute(
            "SELECT g.group_id, g.env_id, d.reason, d.trainer, d.at, g.body "
            "FROM dead_letters d JOIN groups g ON g.seq = d.seq "
            "ORDER BY d.at DESC, d.seq DESC LIMIT ?", (limit,)).fetchall()
        return total, [DeadLetter(*row) for row in rows]

    def drop(self, seqs: Iterable[int], reason: str, kv=None, counts=None) -> None:
        with self._transaction(kv, counts) as cur:
            cur.executemany("UPDATE groups SET state='dropped', drop_reason=?, body=NULL, "
                            "lease_id=NULL WHERE seq=?", [(reason, s) for s in seqs])

    def put_env(self, env_id: int, record: dict[str, Any], kv=None, counts=None) -> None:
        with self._transaction(kv, counts) as cur:
            cur.execute("INSERT OR REPLACE INTO envs VALUES (?, ?)",
                        (env_id, json.dumps(record)))

    def put(self, kv=None, counts=None) -> None:
        with self._transaction(kv, counts):
            pass

    def reset(self) -> None:
        with self._transaction(None, None) as cur:
            for table in ("dead_letters", "groups", "leases", "envs", "kv", "counters",
                          "acked_leases"):
                cur.execute(f"DELETE FROM {table}")

    # -- helpers ----------------------------------------------------------------------
    @contextmanager
    def _transaction(self, kv: dict[str, Any] | None,
                     counts: dict[str, int] | None) -> Iterator[sqlite3.Cursor]:
        """One transaction; ``kv`` values are set and ``counts`` added to the counters
        in it, so state and counters never disagree after a crash."""
        cur = self.conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
            if kv:
                cur.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?)",
                                [(k, json.dumps(v)) for k, v in kv.items()])
            if counts:
                cur.executemany(
                    "INSERT INTO counters VALUES (?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                    [(k, v) for k, v in counts.items() if v])
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")


def _push_counts(group: AcceptedGroup, drop_reason: str | None, new: bool) -> dict[str, int]:
    if not new:
        return {"duplicate_pushes": 1}
    counts = {"received_groups": 1, "received_sequences": group.n_sequences}
    if drop_reason:
        counts[f"dropped_groups_{drop_reason}"] = 1
        counts[f"dropped_sequences_{drop_reason}"] = group.n_sequences
    return counts
