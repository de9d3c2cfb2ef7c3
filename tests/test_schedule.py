"""The learning-rate schedule (trainer/schedule.py), against the formulas written here."""

import math

import pytest

from trainer.config import TrainConfig
from trainer.schedule import learning_rate


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_warm_up_then_decay_to_the_final_fraction_on_the_last_step(schedule):
    config = TrainConfig(model="m", lr=1e-3, steps=12, warmup_steps=2, lr_schedule=schedule,
                         final_lr_fraction=0.1)
    rates = [learning_rate(step, config) for step in range(12)]
    assert rates[:2] == pytest.approx([5e-4, 1e-3])  # warm-up: lr * (step + 1) / 2
    # after it, t = (step - 2) / 9 runs from 0 (step 2) to 1 (step 11, the last)
    for step in range(2, 12):
        t = (step - 2) / 9
        expected = {"constant": 1e-3,
                    "linear": 1e-3 * (1 - t) + 1e-4 * t,
                    "cosine": 1e-4 + 0.45e-3 * (1 + math.cos(math.pi * t))}[schedule]
        assert rates[step] == pytest.approx(expected, rel=1e-12), (schedule, step)
    if schedule != "constant":
        assert rates[2] == pytest.approx(1e-3) and rates[11] == pytest.approx(1e-4)
        assert all(a > b for a, b in zip(rates[2:], rates[3:]))  # strictly down
