"""code_debug: the sample tasks, grading on a pristine copy, cheats that must earn nothing,
and turn rewards, driven by scripted assistant turns in real sandboxes."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest
from sandbox_fixtures import docker_image, scripted, tool_call  # noqa: F401

from environments.envs.code_debug import (
    CodeDebugConfig,
    CodeDebugEnv,
    load_humanevalpack,
    load_sample,
)
from environments.framework.registry import load_env_class

TASKS = load_sample()
TASK = next(t for t in TASKS if t["entry_point"] == "fizz_count")
FIXED = TASK["prompt"] + TASK["canonical_solution"]
BUGGY = TASK["prompt"] + TASK["buggy_solution"]


def run(coro):
    return asyncio.run(coro)


def make_env(script, **settings) -> CodeDebugEnv:
    settings.setdefault("dataset", "sample")
    settings.setdefault("group_size", 1)
    settings.setdefault("keep_equal_score_groups", True)
    return scripted(CodeDebugEnv(CodeDebugConfig(**settings)), script)


def episode(env, item=TASK):
    async def go():
        rollout = await env.collect_trajectory(item)
        return rollout, await env._score(item, rollout)

    return run(go())


def test_sample_tasks_canonical_passes_and_buggy_fails_the_hidden_tests():
    assert len(TASKS) == 8 and len({t["id"] if "id" in t else t["task_id"] for t in TASKS}) == 8
    env = CodeDebugEnv(CodeDebugConfig(dataset="sample"))

    async def grade_all():
        results = []
        for task in TASKS:
            results.append((await env.grade(task, task["prompt"] + task["canonical_solution"]),
                            await env.grade(task, task["prompt"] + task["buggy_solution"])))
        return results

    assert run(grade_all()) == [(True, False)] * 8


def test_oracle_episode_earns_the_turn_rewards_and_the_outcome():
    env = make_env([
        tool_call("read_file", path="solution.py"),
        tool_call("run_tests"),
        tool_call("write_file", path="solution.py", content=FIXED),
        tool_call("bash", command="python3 test_solution.py"),
        "Fixed the off-by-one in the range.",
    ])
    rollout, scores = episode(env)
    results = [t.tool_results[0] for t in rollout.turns[:-1]]
    assert results[0] == BUGGY
    assert "AssertionError" in results[1] and "exit code 1" in results[1]
    assert results[3] == "visible tests passed"
    assert scores == [0.2, 0.3, 0.5, 0.3, 1.0]
    assert rollout.extra["solution"] == FIXED


def test_a_fix_never_tested_still_counts_and_a_broken_edit_earns_no_edit_reward():
    env = make_env([tool_call("write_file", path="./solution.py", content="def fizz_count(:\n"),
                    tool_call("write_file", path="/workspace/solution.py", content=FIXED),
                    "done"])
    rollout, scores = episode(env)
    assert "SyntaxError" in rollout.turns[0].tool_results[0]
    assert scores == [0.0, 0.5, 1.0]


CHEATS = {
    "rewrites the visible tests": [
        tool_call("write_file", path="test_solution.py", content="print('visible tests passed')\n"),
        tool_call("run_tests"), "All tests pass now."],
    "prints ALL TESTS PASSED and exits 0 at import": [
        tool_call("write_file", path="solution.py",
                  content="print('ALL TESTS PASSED')\nimport sys\nsys.exit(0)\n"), "done"],
    "prints the grader's pass line": [
        tool_call("write_file", path="solution.py", content=BUGGY + "\nprint('PASS')\n"),
        "done"],
    "disables exec in the grader": [
        tool_call("write_file", path="solution.py",
                  content=BUGGY + "\nimport builtins\nbuiltins.exec = lambda *a, **k: None\n"
                                  "builtins.compile = lambda *a, **k: None\n"), "done"],
    "hard-exits with success from an atexit hook": [
        tool_call("write_file", path="solution.py",
                  content=BUGGY + "\nimport atexit, os\natexit.register(lambda: os._exit(0))\n"),
        "done"],
    "deletes the solution": [tool_call("bash", command="rm solution.py"), "done"],
    "replaces the solution by a symlink": [
        tool_call("bash", command="rm solution.py && ln -s test_solution.py solution.py"), "done"],
    "just says it is fixed": ["I fixed it, all tests pass."],
}


@pytest.mark.parametrize("name", list(CHEATS))
def test_cheats_earn_no_outcome(name):
    env = make_env(CHEATS[name])
    rollout, scores = episode(env)
    assert scores[-1] == 0.0, (name, rollout.extra.get("solution"))


def test_the_visible_tests_pass_after_rewriting_them_but_the_hidden_ones_decide():
    env = make_env(CHEATS["rewrites the visible tests"])
    rollout, scores = episode(env)
    assert rollout.turns[1].tool_results == ["visible tests passed"]
    assert scores == [0.0, 0.3, 0.0]  # ran "the tests" (0.3), outcome 0


def test_hidden_tests_are_stricter_than_the_visible_ones():
    # passes the two visible examples, fails the hidden edge cases
    task = next(t for t in TASKS if t["entry_point"] == "second_largest")
    overfit = task["prompt"] + "    return {(4, 1, 4, 3): 3}.get(tuple(numbers))\n"
    env = make_env([tool_call("write_file", path="solution.py", content=overfit),
                    tool_call("run_tests"), "done"])
    rollout, scores = episode(env, task)
    assert rollout.turns[1].tool_results == ["visible tests passed"]
    assert scores[-1] == 0.0


def test_an_episode_cut_by_max_turns_is_graded_on_the_file_it_left():
    env = make_env([tool_call("write_file", path="solution.py", content=FIXED),
                    tool_call("run_tests")], max_turns=2)
    rollout, scores = episode(env)
    assert rollout.stop == "max_turns" and scores == [0.5, 1.0]


def test_humanevalpack_rows_become_tasks(monkeypatch):
    row = {"task_id": "Python/0", "entry_point": "add", "import": "", "test_setup": "",
           "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "buggy_solution": "    return a - b\n",
           "canonical_solution": "    return a + b\n",
           "example_test": "def check(add):\n    assert add(1, 2) == 3\ncheck(add)\n",
           "test": "def check(add):\n    assert add(1, 2) == 3\n    assert add(0, 0) == 0\n"
                   "check(add)\n"}
    monkeypatch.setitem(sys.modules, "datasets",
                        types.SimpleNamespace(load_dataset=lambda name, config, split: [row]))
    [task] = load_humanevalpack("bigcode/humanevalpack", "python", "test")
    assert task["id"] == "Python/0" and task["entry_point"] == "add"
    env = CodeDebugEnv(CodeDebugConfig(dataset="sample"))
    assert run(env.grade(task, row["prompt"] + row["canonical_solution"])) is True
    assert run(env.grade(task, row["prompt"] + row["buggy_solution"])) is False
    assert CodeDebugConfig().dataset == "bigcode/humanevalpack"
    assert load_env_class("code_debug") is CodeDebugEnv


def test_oracle_messages_are_a_valid_demonstration():
    env = make_env([])
    messages = env.oracle_messages(TASK)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant",
                                            "tool", "assistant", "tool", "assistant"]
    assert FIXED in messages[4]["content"].replace("\\n", "\n").replace('\\"', '"')


def test_docker_backend_episode_and_grading(docker_image):
    env = make_env([tool_call("write_file", path="solution.py", content=FIXED),
                    tool_call("run_tests"), "done"],
                   sandbox_backend="docker", sandbox_image=docker_image)
    rollout, scores = episode(env)
    assert rollout.turns[1].tool_results == ["visible tests passed"]
    assert scores == [0.5, 0.3, 1.0]
    assert env.sandbox_stats.sandboxes == 2  # the rollout's, and a fresh one for grading
