"""Where a trainer step's time goes: ``time/<part>`` metrics in metrics.jsonl (and
TensorBoard / wandb through the same sink).

- ``time/batch_wait``: waiting for a batch (leasing from the rollout API, or reading the
  file; with dynamic sampling, every batch taken);
- ``time/prepare``: checking it, advantages, packing (and, at step 0, the alignment check);
- ``time/train``: forward, backward and optimizer steps;
- ``time/sync``: the weights into vLLM, the post-sync check, the new version to the API;
- ``time/checkpoint``: writing a checkpoint (0 on steps without one);
- ``time/hang_wait``: waiting on a process that did not answer: requests to the rollout
  API that went unanswered (timed out, refused) and their retries, a batch wait while the
  API had not heard from an env server or a vLLM server did not answer its health check,
  a weight sync to a server that failed (timed out, or was killed for hanging) beyond
  what the servers that answered took. Taken out of the part it happened in, so the
  parts and the rest still add up to the step;
- ``time/step``: all of the step, the parts above and the rest (acknowledging the batch,
  logging).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PARTS = ("batch_wait", "prepare", "train", "sync", "checkpoint", "hang_wait")

_current: list[StepClock] = []
"""The clock of the step under way (:func:`unanswered` carves from it)."""


class StepClock:
    """Seconds spent in each part of one step, from when it was made."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.open: list[str] = []
        _current[:] = [self]

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        started = time.monotonic()
        self.open.append(part)
        try:
            yield
        finally:
            self.open.pop()
            self.seconds[part] += time.monotonic() - started

    def carve(self, seconds: float) -> None:
        """``seconds`` of the part under way (or of the rest) were spent waiting on a
        process that did not answer: count them as ``hang_wait`` instead."""
        if seconds <= 0:
            return
        self.seconds["hang_wait"] += seconds
        if self.open and self.open[-1] != "hang_wait":
            self.seconds[self.open[-1]] -= seconds

    def metrics(self) -> dict[str, float]:
        return {**{f"time/{part}": s for part, s in self.seconds.items()},
                "time/step": time.monotonic() - self.started}


def unanswered(seconds: float) -> None:
    """Count ``seconds`` of the step under way as waiting on a process that did not
    answer (nothing when no step is under way)."""
    if _current:
        _current[0].carve(seconds)


@contextmanager
def untimed(part: str) -> Iterator[None]:
    """A clock that measures nothing (callers without a step)."""
    yield
