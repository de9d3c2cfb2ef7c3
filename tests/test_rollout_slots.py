"""How many rollouts an env keeps in flight (issue 44): by default every rollout of every
group it may have under way (``group_size * max_queued_groups``), so the inference
server batches a whole batch's turns instead of a few at a time; ``concurrency`` caps it.
Scripted backend, no inference server."""

from __future__ import annotations

import asyncio

import pytest

from environments import BaseEnv, EnvConfig
from environments.framework.base import DEFAULT_CONCURRENCY
from environments.framework.runner import run_groups
from environments.inference.chat_template import Continuation
from environments.rollout import GeneratedTurn


class GateBackend:
    """Holds every turn until ``release`` or until no new turn arrived for 50 ms, and
    records the most turns it held at once."""

    trainable = True

    def __init__(self) -> None:
        self.waiting = 0
        self.peak = 0
        self.arrived = asyncio.Event()

    async def generate(self, state, max_tokens):
        self.waiting += 1
        self.peak = max(self.peak, self.waiting)
        self.arrived.set()
        while True:  # wait until the arrivals stop: everything that could start has
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), 0.05)
            except asyncio.TimeoutError:
                break
        self.waiting -= 1
        text = f"<answer>{len(state.tokens)}</answer>"
        ids = [1000 + ord(c) for c in text] + [999]
        return GeneratedTurn(ids, [-0.5] * len(ids), text, "stop", True)


class Renderer:
    def prompt_ids(self, messages, tools=None):
        return [1, 2, 3]

    def continuation(self, history, new_messages, tools=None, *, ended_with_eos):
        return Continuation([7, 8], "", True)


class CountingEnv(BaseEnv):
    name = "counting"

    async def get_next_item(self):
        return {"id": "x"}

    def prompt_messages(self, item):
        return [{"role": "user", "content": "go"}]

    def compute_reward(self, item, rollout):
        return float(rollout.tokens[-2] % 2)  # scores differ within a group, mostly


class Collect:
    def __init__(self) -> None:
        self.groups = []

    async def send(self, group) -> None:
        self.groups.append(group)


def peak_in_flight(**settings) -> tuple[int, int]:
    env = CountingEnv(EnvConfig(keep_equal_score_groups=True, **settings))
    env.backend = GateBackend()
    env.renderer = Renderer()
    delivery = Collect()
    asyncio.run(run_groups(env, delivery, 12))
    return env.backend.peak, len(delivery.groups)


@pytest.mark.parametrize("settings, peak", [
    ({"group_size": 8, "max_queued_groups": 3}, 24),   # every rollout of 3 groups at once
    ({"group_size": 4, "max_queued_groups": 3, "concurrency": 5}, 5),  # capped
    ({"group_size": 4}, DEFAULT_CONCURRENCY),          # neither set: the default cap
])
def test_rollouts_in_flight(settings, peak):
    got, delivered = peak_in_flight(**settings)
    assert delivered == 12
    assert got == peak
