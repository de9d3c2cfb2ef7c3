"""Where finished groups go: the rollout API (with a local spool), or a JSONL file.

:class:`APIDelivery` pushes each group through :class:`RolloutAPIClient` (which retries
with backoff). When the API stays unreachable, the group is appended to a local spool
file (JSONL, fsynced) instead, and later groups follow it there so order is kept; a
background task replays the spool, oldest first, as soon as the API answers again, then
empties it. A crash between a replayed push and the emptying of the spool only leads to
a second push of the same ``group_id``, which the API ignores. A spool left by an
earlier run is replayed at start. Nothing accepted by the env is lost.

A group the API refuses with a 4xx is not retried (it would be refused again): it is
counted as rejected and logged with the API's reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from environments.api.client import APIRequestError, RolloutAPIClient
from environments.jsonl_store import GroupWriter, read_groups
from environments.trajectory import ScoredGroup

log = logging.getLogger(__name__)


@dataclass
class DeliveryStats:
    sent: int = 0
    spooled: int = 0
    replayed: int = 0
    rejected: int = 0


class JSONLDelivery:
    """Append groups to a JSONL file (``lachesis env process``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.stats = DeliveryStats()
        self._writer = GroupWriter(self.path)

    async def send(self, group: ScoredGroup) -> None:
        await asyncio.to_thread(self._writer.append, group)
        self.stats.sent += 1

    async def close(self) -> None:
        self._writer.close()


class APIDelivery:
    def __init__(self, client: RolloutAPIClient, spool_path: str | Path, *,
                 replay_interval_s: float = 2.0):
        self.client = client
        self.spool_path = Path(spool_path)
        self.replay_interval_s = replay_interval_s
        self.stats = DeliveryStats()
        self._lock = asyncio.Lock()  # one writer of the spool at a time
        self._wakeup = asyncio.Event()  # set when a group was spooled
        self._replayer: asyncio.Task | None = None

    @property
    def spooling(self) -> bool:
        return self.spool_path.exists() and self.spool_path.stat().st_size > 0

    async def start(self) -> None:
        if self.spooling:
            log.info("replaying groups spooled by an earlier run from %s", self.spool_path)
        self._replayer = asyncio.create_task(self._replay_loop())

    async def send(self, group: ScoredGroup) -> dict[str, Any]:
        """Push ``group`` (spool it while the API is unreachable). Returns the API's
        answer (``dropped``, ``duplicate``; a Lachesis API adds the env's queue with the
        group in it), ``{"spooled": True}`` or ``{"rejected": True}``."""
        if not self.spooling:
            try:
                answer = await self.client.push_group(group)
                self.stats.sent += 1
                return answer if isinstance(answer, dict) else {}
            except APIRequestError as error:
                if error.status is not None:  # 4xx: the API read it and said no
                    self.stats.rejected += 1
                    log.error("the rollout API rejected group %s (item %s): %s",
                              group.group_id, group.item_id, error)
                    return {"rejected": True}
                log.warning("rollout API unreachable (%s); spooling to %s", error,
                            self.spool_path)
        async with self._lock:
            await asyncio.to_thread(self._append, group)
        self.stats.spooled += 1
        self._wakeup.set()
        return {"spooled": True}

    def _append(self, group: ScoredGroup) -> None:
        self.spool_path.parent.mkdir(parents=True, exist_ok=True)
        with GroupWriter(self.spool_path) as writer:
            writer.append(group)

    async def _replay_loop(self) -> None:
        while True:
            if not self.spooling:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self.replay()
            except APIRequestError as error:
                log.info("spool replay waits for the API: %s", error)
                await asyncio.sleep(self.replay_interval_s)

    async def replay(self) -> None:
        """Push every spooled group, oldest first, then empty the spool."""
        async with self._lock:
            groups = await asyncio.to_thread(lambda: list(read_groups(self.spool_path)))
            pushed = rejected = 0
            for group in groups:  # an unreachable API raises: the file stays as it is
                try:
                    await self.client.push_group(group)
                    pushed += 1
                except APIRequestError as error:
                    if error.status is None:
                        raise
                    rejected += 1
                    log.error("the rollout API rejected spooled group %s: %s",
                              group.group_id, error)
            # Everything in the file was handled: empty it (atomically).
            empty = self.spool_path.with_suffix(".empty")
            empty.write_bytes(b"")
            os.replace(empty, self.spool_path)
            self.stats.replayed += pushed
            self.stats.rejected += rejected
        log.info("spool replayed: %d groups so far", self.stats.replayed)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Give the spool up to ``timeout_s`` to drain; what remains stays on disk and is
        replayed by the next start."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.spooling and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        if self._replayer is not None:
            self._replayer.cancel()
            await asyncio.gather(self._replayer, return_exceptions=True)
        if self.spooling:
            log.warning("stopping with groups still in %s; they are replayed next start",
                        self.spool_path)


class Mirrored:
    """Send to ``primary``, then also to ``mirror`` when there is one (a JSONL copy)."""

    def __init__(self, primary, mirror=None):
        self.primary, self.mirror = primary, mirror

    async def send(self, group: ScoredGroup) -> Any:
        answer = await self.primary.send(group)
        if self.mirror is not None:
            await self.mirror.send(group)
        return answer
