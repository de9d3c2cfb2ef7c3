"""DAPO's batch shaping (arXiv 2503.14476): overlong reward shaping, and dynamic sampling
(groups whose rewards are all equal set aside, more leased until the batch is full).

Overlong shaping adds a soft length penalty to each trajectory's outcome before the
advantages are computed, with ``|y|`` its sampled (trained) tokens, ``L_max`` the limit
and ``L_cache`` the buffer before it::

    R_length(y) = 0                                   |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                = -1                                  |y| > L_max

Truncated trajectories (``flags.truncated``) can also be left out of the loss (their
rewards still count in their group's statistics): DAPO's overlong filtering.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from environments.trajectory import MASKED, ScoredTrajectory, equal_scores
from trainer.config import TrainConfig
from trainer.sources import Batch, BatchSource, BatchWaitExceeded

log = logging.getLogger("lachesis.train")


def overlong_penalty(n_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment ``R_length`` (module docstring)."""
    if n_tokens <= max_tokens - buffer:
        return 0.0
    if n_tokens <= max_tokens:
        return ((max_tokens - buffer) - n_tokens) / buffer
    return -1.0


def shape_rewards(trajectories: list[ScoredTrajectory],
                  config: TrainConfig) -> list[ScoredTrajectory]:
    """The trajectories with ``R_length`` added to their outcome (the score, or the last
    turn's score), when ``overlong_buffer`` is set; else as they are."""
    if config.overlong_buffer is None:
        return trajectories
    limit = config.overlong_max_tokens or config.max_token_length
    shaped = []
    for t in trajectories:
        sampled = sum(m != MASKED for m in t.masks)
        penalty = overlong_penalty(sampled, limit, config.overlong_buffer)
        if penalty == 0.0:
            shaped.append(t)
            continue
        scores = ([*t.scores[:-1], t.scores[-1] + penalty] if isinstance(t.scores, list)
                  else t.scores + penalty)
        shaped.append(t.model_copy(update={"scores": scores}))
    return shaped


def trains_on(trajectory: ScoredTrajectory, config: TrainConfig) -> bool:
    """False for a truncated trajectory when ``overlong_mask_truncated`` is on."""
    return not (config.overlong_mask_truncated and trajectory.flags.truncated)


@dataclass
class DynamicSampling:
    """A :class:`~trainer.sources.BatchSource` that sets aside the groups whose rewards
    are all equal (:func:`~environments.trajectory.equal_scores`: no signal for any
    estimator) and takes further batches from ``source`` until ``batch_size`` sequences
    have signal, at most ``dynamic_sampling_max_batches`` batches per step (then the
    step trains on what it has). Whole groups beyond ``batch_size`` are left out, as DAPO
    does. Every batch taken is finished (acknowledged) together after the step; the
    batch's ``stats`` say how many groups were set aside, left out, and batches taken."""

    source: BatchSource
    config: TrainConfig
    parts: dict[int, list[Batch]] = field(default_factory=dict)

    @property
    def position(self) -> int:
        return self.source.position

    @position.setter
    def position(self, value: int) -> None:
        self.source.position = value

    async def next(self, since: float | None = None) -> Batch:
        kept, parts, n, equal, surplus = [], [], 0, 0, 0
        limit = "dynamic_sampling_max_batches"
        while n < self.config.batch_size and len(parts) < self.config.dynamic_sampling_max_batches:
            try:
                part = await self.source.next(since)
            except BatchWaitExceeded:  # max_batch_wait_s: train on what it has, if any
                if not parts:
                    raise
                limit = "max_batch_wait_s"
                break
            parts.append(part)
            for group in part.groups:
                if equal_scores(group.trajectories):
                    equal += 1
                elif n + len(group.trajectories) > self.config.batch_size:
                    surplus += 1
                else:
                    kept.append(group)
                    n += len(group.trajectories)
        batch = Batch(kept, rejected=[r for p in parts for r in p.rejected])
        batch.stats = {"dynamic_sampling_batches": float(len(parts)),
                       "dynamic_sampling_groups_equal": float(equal),
                       "dynamic_sampling_groups_left_out": float(surplus),
                       "dynamic_sampling_full": float(n >= self.config.batch_size)}
        if n < self.config.batch_size:
            log.warning("dynamic sampling: %d of %d sequences with signal after %d batches "
                        "(%s); training on them", n, self.config.batch_size, len(parts),
                        limit)
        self.parts[id(batch)] = parts
        return batch

    async def finish(self, batch: Batch) -> None:
        """Finish every batch taken for ``batch``, each with the groups of it that the
        step set aside (dead letters)."""
        parts = self.parts.pop(id(batch), [])
        for part in parts:
            ids = {g.group_id for g in part.groups}
            extra = [r for r in batch.rejected if r.group_id in ids and r not in part.rejected]
            part.rejected = [*part.rejected, *extra]
            await self.source.finish(part)

    async def publish_version(self, version: int, model: str | None = None) -> None:
        await self.source.publish_version(version, model)

    async def close(self) -> None:
        await self.source.close()


def with_dynamic_sampling(source: Any, config: TrainConfig) -> Any:
    """``source`` wrapped in :class:`DynamicSampling` when the config asks for it (RL)."""
    if config.dynamic_sampling and config.mode == "rl":
        return DynamicSampling(source, config)
    return source
