"""Where the trainer's batches come from: one interface, three sources.

* :class:`APIBatches`: leased from the rollout API (RL). Rank 0 leases and acknowledges
  after the step (naming the groups set aside as dead letters); other ranks receive the
  batch from it.
* :class:`JSONLBatches`: whole groups from a JSONL file, cycling (offline RL); every rank
  reads the same batches.
* :class:`SFTBatches`: supervised examples (messages or groups), already as tensors.

The loop calls ``next(since)`` for a batch (``since``: when it began waiting for a
trainable one; with ``max_batch_wait_s`` the rollout API's source raises
:class:`BatchWaitExceeded` on every rank once that wait is too long), ``finish(batch)``
on rank 0 once the step is done,
``publish_version(v)`` after new weights reach vLLM, ``resume(v)`` when it (re)started
from the checkpoint of step ``v`` (before the first step), ``checkpointed(oldest)``
after a checkpoint, and ``close()`` at the end.
``position`` is what a checkpoint records to resume the data where it stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import torch.distributed as dist

from environments.api.client import RejectedGroup, RolloutAPIClient
from environments.jsonl_store import read_groups
from environments.trajectory import ScoredGroup
from trainer.batch import BatchError, TrainBatch, pack
from trainer.config import TrainConfig
from trainer.timing import unanswered

log = logging.getLogger("lachesis.train")
VLLM_PROBE_AFTER_S = 10.0
"""A batch wait this long health-checks the vLLM servers, to name one that does not
answer (and count the wait as ``time/hang_wait``)..."""
VLLM_PROBE_EVERY_S = 10.0
"""...at most this often."""


@dataclass
class Batch:
    groups: list[ScoredGroup]
    lease_id: str | None = None
    rejected: list[RejectedGroup] = field(default_factory=list)
    """Groups set aside (they cannot be trained on); acknowledged as dead letters."""
    dropped: list[RejectedGroup] = field(default_factory=list)
    """Groups the step used up without training on them (every reward equal, dropped
    or left out); acknowledged as dropped, with the reason."""
    tensors: TrainBatch | None = None
    """Ready-made training tensors (SFT), instead of groups."""
    stats: dict[str, float] = field(default_factory=dict)
    """Metrics of how the batch was made (e.g. dynamic sampling), logged with the step."""


class BatchWaitExceeded(Exception):
    """No batch came within ``max_batch_wait_s``; raised on every rank together."""

    def __init__(self, waited_s: float, reason: str | None = None):
        super().__init__(waited_s, reason)
        self.waited_s = waited_s
        self.reason = reason
        """The rollout API's last word on why it had no batch."""


class BatchSource(Protocol):
    position: int

    async def next(self, since: float | None = None) -> Batch: ...

    async def finish(self, batch: Batch, step: int | None = None) -> None: ...

    async def publish_version(self, version: int, model: str | None = None) -> None: ...

    async def resume(self, version: int, model: str | None = None) -> dict[str, Any]: ...

    async def policy_version(self) -> int | None: ...

    async def checkpointed(self, oldest_step: int) -> None: ...

    async def close(self) -> None: ...


class _Offline:
    """Shared by the file sources: no one to acknowledge or tell about versions."""

    position = 0

    async def finish(self, batch: Batch, step: int | None = None) -> None:
        pass

    async def publish_version(self, version: int, model: str | None = None) -> None:
        pass

    async def resume(self, version: int, model: str | None = None) -> dict[str, Any]:
        return {}

    async def policy_version(self) -> int | None:
        return None

    async def checkpointed(self, oldest_step: int) -> None:
        pass

    async def close(self) -> None:
        pass


class JSONLBatches(_Offline):
    """Whole groups from a JSONL file, ``batch_size`` sequences per batch, cycling."""

    def __init__(self, path: Path, batch_size: int):
        self.groups = list(read_groups(path))
        if not self.groups:
            raise BatchError(f"{path}: no groups")
        too_big = [g.group_id for g in self.groups if len(g.trajectories) > batch_size]
        if too_big:
            raise BatchError(f"{path}: group {too_big[0]} has more sequences than batch_size "
                             f"({batch_size})")
        self.batch_size = batch_size
        self.position = 0

    async def next(self, since: float | None = None) -> Batch:
        groups, n = [], 0
        while True:
            group = self.groups[self.position % len(self.groups)]
            if n + len(group.trajectories) > self.batch_size:
                break
            groups.append(group)
            n += len(group.trajectories)
            self.position += 1
        return Batch(groups)


class SFTBatches(_Offline):
    """SFT examples (messages or groups, see :mod:`trainer.sft_data`), cycling."""

    def __init__(self, path: Path, batch_size: int, tokenizer: Any, pad_id: int):
        from environments.inference.chat_template import ChatRenderer
        from trainer.sft_data import read_sft_examples

        self.examples = read_sft_examples(path, ChatRenderer(tokenizer))
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.position = 0

    async def next(self, since: float | None = None) -> Batch:
        chosen = [self.examples[(self.position + i) % len(self.examples)]
                  for i in range(self.batch_size)]
        self.position += self.batch_size
        return Batch([], tensors=pack(chosen, [[0.0] * len(t.tokens) for t in chosen],
                                      pad_id=self.pad_id, with_logprobs=False))


class APIBatches:
    """Leased batches from the rollout API; rank 0 leases, the other ranks receive them."""

    position = 0

    def __init__(self, config: TrainConfig, rank: int = 0, world: int = 1):
        # A restarted API is back in seconds: retries span ~30-60 s before the trainer
        # gives up (and is restarted from its checkpoint).
        self.client = RolloutAPIClient(config.api_url, config.api_token, retries=10,
                                       timeout_s=config.api_timeout_s)
        self.client.on_unanswered = unanswered  # time/hang_wait of the step under way
        self.vllm_silent: dict[str, str] = {}
        """vLLM servers that did not answer their last health check: url -> why."""
        self._vllm_asked = float("-inf")
        self.config = config
        self.rank, self.world = rank, world
        self.envs_since: float | None = None
        """When this trainer first saw an env server registered with the API (the
        ``max_batch_wait_s`` clock runs from then at the earliest)."""
        self._envs_asked = float("-inf")

    async def register(self) -> None:
        if self.rank == 0:
            await self.client.register_trainer(batch_size=self.config.batch_size,
                                               max_token_len=self.config.max_token_length)

    async def _counted_from(self, since: float, now: float) -> float:
        """Where the ``max_batch_wait_s`` clock starts: ``since``, or later while no env
        server has registered with the API yet (asked at most once a second)."""
        if self.envs_since is None and now - self._envs_asked >= 1.0:
            self._envs_asked = now
            counters = (await self.client.status()).get("counters") or {}
            if counters.get("env_registrations", 0) > 0:
                self.envs_since = now
        return max(since, now if self.envs_since is None else self.envs_since)

    async def _lease(self, since: float | None = None) -> Batch:
        start = time.monotonic()
        since = start if since is None else since
        limit = self.config.max_batch_wait_s
        warn_at = start + self.config.batch_wait_warning_s
        self.vllm_silent = {}
        while True:
            asked = time.monotonic()
            wait_s = min(self.config.lease_wait_s, max(0.0, warn_at - asked))
            if limit is not None:  # back in time to give up
                wait_s = min(wait_s, max(0.0, limit - (asked - since)))
            unanswered_before = self.client.unanswered_s
            leased = await self.client.lease(self.config.batch_size, wait_s=round(wait_s, 3))
            if leased is not None:
                for rejected in leased.rejected:
                    log.error("setting aside %s", rejected)
                return Batch(leased.groups, leased.lease_id, leased.rejected)
            now = time.monotonic()
            if now - start >= VLLM_PROBE_AFTER_S:
                await self._probe_vllm(now)
                now = time.monotonic()
            if self.client.no_batch_silent or self.vllm_silent:
                # waiting on a process that does not answer (the API's own silence is
                # counted by the client)
                unanswered(now - asked - (self.client.unanswered_s - unanswered_before))
            if limit is not None:
                waited = now - await self._counted_from(since, now)
                if waited >= limit:
                    raise BatchWaitExceeded(waited, self.client.no_batch_reason)
            if now >= warn_at:
                log.warning("no batch of %d sequences for %.1f s (the rollout API at %s: "
                            "%s); %s", self.config.batch_size, now - start, self.client.url,
                            self.client.no_batch_reason or "no reason given", self.silent())
                warn_at += self.config.batch_wait_warning_s
            if time.monotonic() - asked < wait_s / 2 or not wait_s:
                await asyncio.sleep(self.config.lease_poll_s)  # an API that did not wait

    def silent(self) -> str:
        """Which process has not answered, as far as the trainer can tell (the API's
        silent env servers, vLLM servers that failed a health check)."""
        parts = [f"the rollout API has not heard from env server {e.get('name')} for "
                 f"{e.get('silent_s', 0):.0f} s" for e in self.client.no_batch_silent]
        parts += [f"vLLM at {url} {why}" for url, why in sorted(self.vllm_silent.items())]
        if parts:
            return "not answering: " + "; ".join(parts)
        return ("every env server talks to the API and every vLLM server answers: if that "
                "lasts, the env servers deliver nothing: see their logs")

    async def _probe_vllm(self, now: float) -> None:
        """Health-check the vLLM servers (every ``VLLM_PROBE_EVERY_S`` at most)."""
        if not self.config.vllm_urls or now - self._vllm_asked < VLLM_PROBE_EVERY_S:
            return
        self._vllm_asked = now
        bound = self.config.vllm_health_timeout_s
        timeout = aiohttp.ClientTimeout(total=bound)

        async def ask(url: str) -> tuple[str, str | None]:
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session, \
                        session.get(url.rstrip("/") + "/health") as response:
                    return url, None if response.status < 400 else \
                        f"answered /health with {response.status}"
            except asyncio.TimeoutError:
                return url, (f"did not answer /health within {bound:g} s "
                             "(train.vllm_health_timeout_s)")
            except aiohttp.ClientError as error:
                return url, f"refused /health ({type(error).__name__}: {error})"

        answers = await asyncio.gather(*(ask(u) for u in self.config.vllm_urls))
        self.vllm_silent = {url: why for url, why in answers if why is not None}

    async def next(self, since: float | None = None) -> Batch:
        """Rank 0 leases (or gives up after ``max_batch_wait_s``) and tells the others."""
        batch: Batch | BatchWaitExceeded | None = None
        if self.rank == 0:
            try:
                batch = await self._lease(since)
            except BatchWaitExceeded as error:
                batch = error
        if self.world > 1:
            shared = [batch]
            dist.broadcast_object_list(shared, src=0)
            batch = shared[0]
        if isinstance(batch, BatchWaitExceeded):
            raise batch
        return batch

    async def finish(self, batch: Batch, step: int | None = None) -> None:
        """Acknowledge the batch's lease; ``step``: the step that trained it (the API
        keeps its groups until a checkpoint covers it)."""
        if batch.lease_id is not None:
            await self.client.ack(batch.lease_id, batch.rejected, step=step,
                                  dropped=batch.dropped)

    async def publish_version(self, version: int, model: str | None = None) -> None:
        await self.client.set_policy_version(version, model)

    async def policy_version(self) -> int | None:
        return (await self.client.status()).get("policy_version")

    async def resume(self, version: int, model: str | None = None) -> dict[str, Any]:
        return await self.client.resume(version, model)

    async def checkpointed(self, oldest_step: int) -> None:
        await self.client.checkpoint(oldest_step)

    async def close(self) -> None:
        await self.client.close()


async def open_source(config: TrainConfig, tokenizer: Any, pad_id: int, *, rank: int = 0,
                      world: int = 1, position: int = 0) -> BatchSource:
    """The source the config names: SFT data, an offline JSONL, or the rollout API."""
    if config.mode == "sft":
        if config.data is None:
            raise ValueError("mode sft needs --data (a messages or groups JSONL)")
        source: BatchSource = SFTBatches(config.data, config.batch_size, tokenizer, pad_id)
    elif config.data is not None:
        source = JSONLBatches(config.data, config.batch_size)
    else:
        source = APIBatches(config, rank, world)
        await source.register()
    source.position = position
    return source
