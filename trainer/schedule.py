"""The learning rate of each step: a linear warm-up, then constant, linear or cosine decay."""

from __future__ import annotations

import math

from trainer.config import TrainConfig


def learning_rate(step: int, config: TrainConfig) -> float:
    """The learning rate of step ``step`` (0-based) of ``config.steps``.

    Warm-up: ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps. After
    it, ``lr_schedule`` ``constant`` keeps ``lr``; ``linear`` and ``cosine`` go from ``lr``
    (the first step after the warm-up) down to ``lr * final_lr_fraction`` (the last step),
    in a straight line or along half a cosine period."""
    lr, warmup = config.lr, config.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if config.lr_schedule == "constant":
        return lr
    span = config.steps - 1 - warmup
    progress = min(1.0, (step - warmup) / span) if span > 0 else 1.0
    floor = lr * config.final_lr_fraction
    if config.lr_schedule == "linear":
        return lr - (lr - floor) * progress
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
