"""Reward functions over per-rollout env state (issue 9), without an inference server.

Rollouts run through the real agent loop (``run_agent_loop``: tool parsing, tool calls in
tasks and worker threads, concurrency slots) with a scripted backend and a stand-in
renderer; a turn's tokens are its text's characters (``ord(c) + 1000``), so a turn span
can be decoded back to the text the turn produced.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from environments import (
    BaseEnv,
    EnvConfig,
    TurnLevelRewardMixin,
    reward_function,
    rollout_state,
    tool,
)
from environments.framework.rewards import (
    RewardFunction,
    combine_rewards,
    env_reward_functions,
)
from environments.inference.chat_template import Continuation
from environments.rollout import GeneratedTurn

EOS = 999


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class ScriptedBackend:
    """Rollout ``i`` (in the order rollouts first ask for a turn) plays ``scripts[i]``,
    one text per assistant turn."""

    trainable = True

    def __init__(self, scripts: list[list[str]]):
        self.scripts = scripts
        self.rollouts: dict[int, tuple[object, int]] = {}

    async def generate(self, state, max_tokens):
        _, index = self.rollouts.setdefault(id(state), (state, len(self.rollouts)))
        text = self.scripts[index][len(state.turns)]
        await asyncio.sleep(0)  # a real backend yields to the event loop
        ids = [ord(c) + 1000 for c in text] + [EOS]
        return GeneratedTurn(ids, [-0.5] * len(ids), text, "stop", True)


class FakeRenderer:
    def prompt_ids(self, messages, tools=None):
        return [1, 2, 3]

    def continuation(self, history, new_messages, tools=None, *, ended_with_eos):
        return Continuation([7] * len(new_messages) + [8], "", True)


def decode(tokens: list[int]) -> str:
    return "".join(chr(t - 1000) for t in tokens if t >= 1000)


def scripted(env_class, scripts, **settings):
    env = env_class(EnvConfig(group_size=len(scripts), **settings))
    env.backend = env.eval_backend = ScriptedBackend(scripts)
    env.renderer = FakeRenderer()
    return env


# -- tools that change per-rollout state ---------------------------------------------------
@tool(state_arg="counter")  # a sync tool: runs in a worker thread with the rollout's context
def increment(by: int, counter: dict) -> str:
    """Add to the counter.

    Args:
        by: how much to add.
    """
    counter["value"] += by
    return str(counter["value"])


@tool(inline=True)
def double() -> str:
    """Double the counter."""
    counter = rollout_state()
    counter["value"] *= 2
    return str(counter["value"])


def test_state_arg_is_not_in_the_schema_and_the_model_cannot_set_it():
    assert increment.schema()["function"]["parameters"] == {
        "type": "object", "required": ["by"],
        "properties": {"by": {"type": "integer", "description": "how much to add."}}}
    from environments.framework.tools import ToolError
    with pytest.raises(ToolError, match="unknown argument 'counter'"):
        asyncio.run(increment.call({"by": 1, "counter": {"value": 5}}))
    with pytest.raises(TypeError, match="state_arg 'missing'"):
        tool(lambda x: x, name="f", state_arg="missing")


# -- the state slot reused across the rollouts of a group -----------------------------------
class SharedSlotEnv(BaseEnv):
    """Keeps ONE state object (think of a pooled sandbox) that every rollout resets and
    reuses. Its reward function is async and only reads the state once every rollout of
    the group has run, i.e. after later rollouts have reset and changed the slot."""

    name = "shared_slot"
    tools = [increment, double]

    def __init__(self, config=None):
        super().__init__(config)
        self.slot = {"value": 0}
        self.finished = 0
        self.group_done = asyncio.Event()

    async def get_next_item(self):
        return {"id": "count"}

    def prompt_messages(self, item):
        return [{"role": "user", "content": "count"}]

    def new_rollout_state(self, item):
        self.slot["value"] = 0  # reset in place, not replaced
        return self.slot

    async def collect_trajectory(self, item, *, evaluation=False):
        rollout = await super().collect_trajectory(item, evaluation=evaluation)
        self.finished += 1
        if self.finished == self.config.group_size:
            self.group_done.set()
        return rollout

    @reward_function
    async def counter_value(self, item, rollout, state):
        await self.group_done.wait()  # by now the slot holds the LAST rollout's count
        return float(state["value"])


SLOT_SCRIPTS = [
    [call("increment", by=1), "<answer>done</answer>"],                     # 1
    [call("increment", by=2), call("double"), "<answer>done</answer>"],     # (0+2)*2 = 4
    [call("increment", by=5), "<answer>done</answer>"],                     # 5
]


@pytest.mark.parametrize("snapshot", ["framework", "removed"])
def test_each_rollout_is_scored_on_its_own_snapshot_of_a_reused_state_slot(snapshot):
    class Env(SharedSlotEnv):
        if snapshot == "removed":  # what scoring would see without the snapshot
            def snapshot_state(self, state):
                return state

    # concurrency 1: the rollouts of the group take the one slot in turn
    env = scripted(Env, SLOT_SCRIPTS, concurrency=1, keep_equal_score_groups=True)
    group = asyncio.run(env.collect_group({"id": "count"}))
    scores = [t.scores for t in group.trajectories]
    # every tool call reached the slot through the rollout's context (thread and inline)
    assert [t.flags.tool_errors for t in group.trajectories] == [0, 0, 0]
    assert env.slot == {"value": 5}
    if snapshot == "framework":
        assert scores == [1.0, 4.0, 5.0]
        assert [t.metadata["rewards"] for t in group.trajectories] == [
            {"counter_value": 1.0}, {"counter_value": 4.0}, {"counter_value": 5.0}]
        assert [t.metadata["metrics"]["reward/counter_value"]
                for t in group.trajectories] == [1.0, 4.0, 5.0]
    else:  # the test is sensitive to the snapshot: without it, all read the last rollout
        assert scores == [5.0, 5.0, 5.0]


def test_rollout_env_state_is_the_snapshot_and_rollout_state_is_scoped_to_the_rollout():
    env = scripted(SharedSlotEnv, SLOT_SCRIPTS[:1], concurrency=1)
    env.group_done.set()
    rollout, score = asyncio.run(env._rollout({"id": "count"}))
    assert score == 1.0 and rollout.env_state == {"value": 1}
    assert rollout.env_state is not env.slot
    with pytest.raises(LookupError):
        rollout_state()
    assert rollout_state("outside") == "outside"


# -- weights, outcome and per-turn functions -------------------------------------------------
def answered(item, rollout, state) -> float:
    return float("<answer>" in rollout.final_text)


class WeightedEnv(BaseEnv):
    name = "weighted"
    tools = [increment]
    reward_functions = [reward_function(answered, weight=0.5)]

    async def get_next_item(self):
        return {"id": "target-3", "target": 3}

    def prompt_messages(self, item):
        return [{"role": "user", "content": "reach 3"}]

    def new_rollout_state(self, item):
        return {"value": 0}

    @reward_function(weight=2.0)
    def reached_target(self, item, rollout, state):
        return float(state["value"] == item["target"])

    @reward_function(per_turn=True)
    def called_tool(self, item, rollout, state):
        return [float(len(t.tool_calls)) for t in rollout.turns]

    @reward_function(weight=-0.5, per_turn=True)
    def tool_errors(self, item, rollout, state):  # ints in a numpy array are fine
        return np.array([len(t.tool_errors) for t in rollout.turns])


WEIGHTED_SCRIPTS = [
    [call("increment", by=3), "<answer>3</answer>"],
    [call("nope") + call("increment", by=1), call("increment", by=1), "no idea"],
    ["<answer>0</answer>"],
]


def test_weighted_combination_and_per_turn_values_aligned_with_turn_spans():
    env = scripted(WeightedEnv, WEIGHTED_SCRIPTS)
    group = asyncio.run(env.collect_group({"id": "target-3", "target": 3}))
    t0, t1, t2 = group.trajectories
    # outcome O = 0.5 answered + 2 reached_target; turn k: T_k = called_tool_k - 0.5
    # tool_errors_k; scores = [T_0, ..., T_{K-1} + O]
    assert t0.scores == [1.0, 0.0 + 2.5]
    assert t1.scores == [2.0 - 0.5, 1.0, 0.0]
    assert t2.scores == [0.5]
    assert t0.metadata["rewards"] == {"answered": 1.0, "reached_target": 1.0,
                                      "called_tool": [1.0, 0.0], "tool_errors": [0.0, 0.0]}
    assert t1.metadata["rewards"] == {"answered": 0.0, "reached_target": 0.0,
                                      "called_tool": [2.0, 1.0, 0.0],
                                      "tool_errors": [1.0, 0.0, 0.0]}
    assert t1.metadata["metrics"] == {"reward/answered": 0.0, "reward/reached_target": 0.0,
                                      "reward/called_tool": 1.0,
                                      "reward/tool_errors": pytest.approx(1 / 3)}
    # per-turn value k belongs to the tokens of turn_spans[k]
    for t in group.trajectories:
        texts = [decode(t.tokens[s:e]) for s, e in t.turn_spans]
        assert texts == [m.content for m in t.messages if m.role == "assistant"]
        assert t.metadata["rewards"]["called_tool"] == [float(x.count("<tool_call>"))
                                                        for x in texts]


def test_combine_rewards_formula():
    fns = [RewardFunction(lambda *a: 0, weight=2.0, name="f"),
           RewardFunction(lambda *a: 0, weight=-1.0, name="g"),
           RewardFunction(lambda *a: 0, weight=0.5, per_turn=True, name="h"),
           RewardFunction(lambda *a: 0, weight=3.0, per_turn=True, name="k")]
    values = {"f": 1.0, "g": 0.5, "h": [1.0, 2.0, 4.0], "k": [0.0, 1.0, -1.0]}
    outcome = 2.0 * 1.0 - 1.0 * 0.5
    assert combine_rewards(values, fns, 3, per_turn_scores=True) == [
        0.5, 1.0 + 3.0, 2.0 - 3.0 + outcome]
    assert combine_rewards(values, fns, 3, per_turn_scores=False) == outcome
    # outcome functions only, per-turn scores (TurnLevelRewardMixin): [0, ..., 0, O]
    assert combine_rewards(values, fns[:2], 2, per_turn_scores=True) == [0.0, outcome]


def test_turn_level_mixin_with_outcome_functions_only_gives_per_turn_scores():
    class Env(TurnLevelRewardMixin, WeightedEnv):
        called_tool = None  # removes the inherited per-turn functions
        tool_errors = None

    env = scripted(Env, WEIGHTED_SCRIPTS)
    group = asyncio.run(env.collect_group({"id": "target-3", "target": 3}))
    assert [t.scores for t in group.trajectories] == [[0.0, 2.5], [0.0, 0.0, 0.0], [0.5]]
    assert list(group.trajectories[0].metadata["rewards"]) == ["answered", "reached_target"]


# -- failures are counted, never scored 0 ----------------------------------------------------
class FragileEnv(WeightedEnv):
    @reward_function
    def fragile(self, item, rollout, state):
        if rollout.turns[-1].text == "no idea":
            raise KeyError("score_of_no_idea")
        return 1.0


def test_a_raising_reward_function_fails_the_rollout_and_is_counted():
    env = scripted(FragileEnv, WEIGHTED_SCRIPTS)
    # rollout 1 makes `fragile` raise: the group is dropped, not sent with a 0 for it
    assert asyncio.run(env.collect_group({"id": "target-3", "target": 3})) is None
    assert env.stats.reward_errors == 1 and env.stats.groups_failed == 0
    assert env.stats.reward_function_errors == {"fragile": 1}
    assert "reward function 'fragile' raised KeyError: 'score_of_no_idea'" in env.last_error
    assert env.describe_stats()["reward_function_errors"] == {"fragile": 1}


@pytest.mark.parametrize("value, per_turn, problem", [
    (float("nan"), False, "returned nan, not a finite number"),
    ("1.0", False, "returned '1.0', not a finite number"),
    (None, False, "returned None, not a finite number"),
    ([1.0], True, "returned 1 values for 2 assistant turns"),
    ([1.0, math.inf], True, "non-finite or non-numeric value"),
    (1.0, True, "returned 1.0 for 2 assistant turns"),
])
def test_unusable_reward_values_fail_the_rollout_naming_the_function(value, per_turn, problem):
    class Env(WeightedEnv):
        @reward_function(per_turn=per_turn)
        def bad(self, item, rollout, state):
            return value

    env = scripted(Env, WEIGHTED_SCRIPTS[:1])
    from environments.framework.base import RewardError
    with pytest.raises(RewardError, match="reward function 'bad' ") as error:
        asyncio.run(env._rollout({"id": "target-3", "target": 3}))
    assert problem in str(error.value)
    assert env.stats.reward_function_errors == {"bad": 1}


def test_declaration_errors():
    class Both(WeightedEnv):
        def compute_reward(self, item, rollout):
            return 0.0

    with pytest.raises(TypeError, match="declares reward functions and overrides compute_reward"):
        Both()

    class Twice(WeightedEnv):
        @reward_function(name="answered")
        def again(self, item, rollout, state):
            return 0.0

    with pytest.raises(TypeError, match="two reward functions are named 'answered'"):
        Twice()
    with pytest.raises(ValueError, match="weight must be a finite number"):
        reward_function(answered, weight=float("nan"))
    # bound methods: callable directly on an instance, e.g. in a unit test
    env = WeightedEnv()
    assert env.reached_target({"target": 3}, None, {"value": 3}) == 1.0
    assert [f.name for f in env_reward_functions(env)] == [
        "answered", "reached_target", "called_tool", "tool_errors"]


def test_a_state_that_cannot_be_deep_copied_names_snapshot_state():
    import threading

    class Env(WeightedEnv):
        def new_rollout_state(self, item):
            return {"value": 0, "lock": threading.Lock()}

    env = scripted(Env, WEIGHTED_SCRIPTS[:1])
    with pytest.raises(RuntimeError, match="override snapshot_state"):
        asyncio.run(env._rollout({"id": "target-3", "target": 3}))


def test_envs_without_reward_functions_still_see_the_snapshot_in_compute_reward():
    class Env(SharedSlotEnv):
        counter_value = None

        def compute_reward(self, item, rollout):
            return float(rollout.env_state["value"])

    env = scripted(Env, SLOT_SCRIPTS, concurrency=1)
    group = asyncio.run(env.collect_group({"id": "count"}))
    assert [t.scores for t in group.trajectories] == [1.0, 4.0, 5.0]
    assert "rewards" not in group.trajectories[0].metadata


def test_the_readme_example_env():
    from pathlib import Path

    from environments.framework.registry import load_env_class

    env_class = load_env_class(str(Path(__file__).parent.parent / "examples/notes_env.py")
                               + ":NotesEnv")
    scripts = [[call("write_note", key="answer", text="loom"), "DONE"],
               [call("write_note", key="answer", text="weave"), "DONE"],
               ["DONE"]]
    env = scripted(env_class, scripts)
    group = asyncio.run(env.collect_group({"id": "loom", "word": "loom"}))
    assert [t.scores for t in group.trajectories] == [[0.5, 1.2], [0.5, 0.2], [0.2]]
    first = group.trajectories[0].metadata
    assert first["rewards"] == {"saved": 1.0, "replied_done": 1.0, "tool_ok": [1.0, 0.0]}
    assert first["metrics"] == {"reward/saved": 1.0, "reward/replied_done": 1.0,
                                "reward/tool_ok": 0.5}
    assert "notes" not in json.dumps(env.tools[0].schema())
