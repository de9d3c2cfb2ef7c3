"""Where a trainer step's time goes: ``time/<part>`` metrics in metrics.jsonl (and
TensorBoard / wandb through the same sink).

- ``time/batch_wait``: waiting for a batch (leasing from the rollout API, or reading the
  file; with dynamic sampling, every batch taken);
- ``time/prepare``: checking it, advantages, packing (and, at step 0, the alignment check);
- ``time/train``: forward, backward and optimizer steps;
- ``time/sync``: the weights into vLLM, the post-sync check, the new version to the API;
- ``time/checkpoint``: writing a checkpoint (0 on steps without one);
- ``time/step``: all of the step, the parts above and the rest (acknowledging the batch,
  logging).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PARTS = ("batch_wait", "prepare", "train", "sync", "checkpoint")


class StepClock:
    """Seconds spent in each part of one step, from when it was made."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds = dict.fromkeys(PARTS, 0.0)

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[part] += time.monotonic() - started

    def metrics(self) -> dict[str, float]:
        return {**{f"time/{part}": s for part, s in self.seconds.items()},
                "time/step": time.monotonic() - self.started}


@contextmanager
def untimed(part: str) -> Iterator[None]:
    """A clock that measures nothing (callers without a step)."""
    yield
