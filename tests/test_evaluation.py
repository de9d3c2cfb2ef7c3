"""``BaseEnv.evaluate()`` with ``eval_samples``: every item played K times, each metric the
mean over items of the item's mean, its 95 % interval over the item means."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from environments.framework.base import BaseEnv
from environments.inference.backends import next_sampling_seed, seed_stream
from environments.jsonl_store import read_groups
from environments.rollout import AssistantTurn, Rollout

K = 4
SCRIPT = {  # item -> the outcome of sample i (the seed key's last part); "x": it fails
    "a": [1, 1, 1, 1],
    "b": [1, 0, 0, 0],    # its samples disagree: item mean 0.25
    "c": [0, 0, 0, 0],
    "d": [1, 1, 0, "x"],  # one rollout fails: the item keeps its three other samples
    "e": [0, 1, 0, 1],
}


class ScriptedEnv(BaseEnv):
    """No inference: sample i of an item (found from its seed stream) plays ``SCRIPT``,
    with i + 1 turns."""

    name = "scripted_eval"

    async def eval_items(self):
        return [{"id": name} for name in SCRIPT]

    async def collect_trajectory(self, item, *, evaluation=False):
        seed = next_sampling_seed()
        keys = [f"{self.config.seed}/eval/{item['id']}/0/{i}" for i in range(K)]
        i = next(i for i, key in enumerate(keys) if next(seed_stream(key)) == seed)
        if SCRIPT[item["id"]][i] == "x":
            raise RuntimeError("the rollout broke")
        rollout = Rollout(messages=[{"role": "user", "content": "hi"}], tools=None)
        rollout.append([1, 2], sampled=False)
        for k in range(i + 1):
            start = len(rollout.tokens)
            rollout.append([10, 11], sampled=True, logprobs=[-0.5, -0.5])
            rollout.turns.append(AssistantTurn((start, start + 2), "stop", [], [], None, "t"))
        rollout.extra["sample"] = i
        return rollout

    def compute_reward(self, item, rollout):
        return float(SCRIPT[item["id"]][rollout.extra["sample"]])

    def rollout_metrics(self, item, rollout, scores):
        return {"correct": scores, "half": scores / 2}


def expected_interval(means: list[float]) -> list[float]:
    """Written out here: Wilson when every item mean is 0 or 1, else mean ± 1.96 sd/√n
    within [0, 1]."""
    n, p, z = len(means), sum(means) / len(means), 1.959963984540054
    if all(m in (0, 1) for m in means):
        centre, scale = p + z * z / (2 * n), 1 + z * z / n
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return [(centre - half) / scale, (centre + half) / scale]
    half = z * statistics.stdev(means) / math.sqrt(n)
    return [max(0.0, p - half), min(1.0, p + half)]


@pytest.mark.parametrize("samples", [1, K])
def test_evaluate_reports_item_means_with_intervals_over_items(samples, tmp_path):
    out = tmp_path / "eval.jsonl"
    env = ScriptedEnv(ScriptedEnv.config_class(eval_samples=samples, seeded_sampling=True,
                                               eval_out=out))
    found = asyncio.run(env.evaluate())
    played = {name: [o for o in outcomes[:samples] if o != "x"]
              for name, outcomes in SCRIPT.items()}
    means = [sum(o) / len(o) for o in played.values()]
    assert (found["items"], found["episodes"], found["failed"]) == (
        5, sum(map(len, played.values())), 1 if samples == K else 0)
    assert found["correct"] == pytest.approx(sum(means) / 5)
    assert found["mean_outcome"] == found["correct"]
    assert found["correct_ci95"] == pytest.approx(expected_interval(means))
    # a metric that is no rate: its interval is the normal one, unclipped
    half = [m / 2 for m in means]
    spread = 1.959963984540054 * statistics.stdev(half) / math.sqrt(5)
    assert found["half_ci95"] == pytest.approx([sum(half) / 5 - spread, sum(half) / 5 + spread])
    turns = [sum(i + 1 for i, o in enumerate(SCRIPT[name][:samples]) if o != "x")
             / len(played[name]) for name in SCRIPT]
    assert found["mean_turns"] == pytest.approx(sum(turns) / 5)
    if samples == K:  # the item means that are not 0/1 get the normal interval, not Wilson
        assert found["correct"] == pytest.approx((1 + 0.25 + 0 + 2 / 3 + 0.5) / 5)
        assert found["correct_ci95"][0] > 0.05 and found["correct_ci95"][1] < 0.95
    # eval_out: one group per item, holding its finished samples
    groups = list(read_groups(out))
    assert [g.item_id for g in groups] == list(SCRIPT)
    assert {g.item_id: sorted(t.outcome for t in g.trajectories) for g in groups} == {
        name: sorted(map(float, o)) for name, o in played.items()}
