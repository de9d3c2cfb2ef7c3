"""gsm8k_code: answer checking, the sample data, turn rewards, sandbox failures and the
isolation of a group's rollouts, driven by scripted assistant turns (real sandboxes, no
model), plus one short group against the tiny model on vLLM."""

from __future__ import annotations

import asyncio
import re
import sys
import types

import pytest
from sandbox_fixtures import docker_image, scripted, tool_call  # noqa: F401

from environments.envs.gsm8k_code import (
    GSM8KCodeConfig,
    GSM8KCodeEnv,
    answers_match,
    extract_answer,
    load_gsm8k,
    load_sample,
    parse_gsm8k_answer,
    parse_number,
)
from environments.framework.registry import load_env_class
from environments.sandbox import SandboxError, create_sandbox
from environments.sandbox.bwrap import BwrapSandbox


def run(coro):
    return asyncio.run(coro)


def make_env(script, **settings) -> GSM8KCodeEnv:
    settings.setdefault("dataset", "sample")
    settings.setdefault("group_size", 1)
    settings.setdefault("keep_equal_score_groups", True)
    env = GSM8KCodeEnv(GSM8KCodeConfig(**settings))
    return scripted(env, script)


def test_numbers_and_answers():
    assert parse_number("1,200") == 1200 and parse_number("$48.60") == 48.6
    assert parse_number("3/4") == 0.75 and parse_number("-3") == -3 and parse_number("12%") == 12
    assert parse_number("about 3") is None and parse_number("") is None
    assert extract_answer("so <answer> 42 </answer>") == "42"
    assert extract_answer("first <answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer(r"thus \boxed{7.5}") == "7.5" and extract_answer("42") is None
    assert answers_match("48.6", 48.6) and answers_match("48.600000001", 48.6)
    assert answers_match("66", 66) and not answers_match("65", 66)
    assert not answers_match("sixty-six", 66)
    assert parse_gsm8k_answer("She pays 3 + 4 = <<3+4=7>>7.\n#### 1,007") == 1007


def test_the_sample_ships_20_problems_whose_reference_code_gives_the_answer():
    items = load_sample()
    assert len(items) == 20 and len({i["id"] for i in items}) == 20

    async def check_all():
        async with await create_sandbox() as box:
            outputs = []
            for item in items:
                await box.write_file("ref.py", item["solution_code"])
                outputs.append((await box.exec("python3 ref.py")).stdout)
            return outputs

    for item, output in zip(items, run(check_all())):
        assert answers_match(output.split()[-1], item["answer"]), (item["id"], output)


def test_the_hub_loader_reads_gsm8k_rows(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"question": "Two plus two?", "answer": "2+2=<<2+2=4>>4\n#### 4"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_gsm8k("openai/gsm8k", "main", "train") == [
        {"id": "gsm8k-train-0", "question": "Two plus two?", "answer": 4}]
    assert calls == [("openai/gsm8k", "main", "train")]
    assert GSM8KCodeConfig().dataset == "openai/gsm8k"  # the real data by default


def test_registered_and_configurable_from_flags():
    cls = load_env_class("gsm8k_code")
    assert cls is GSM8KCodeEnv
    config = GSM8KCodeConfig.load(None, sandbox_backend="docker", sandbox_timeout_s=3)
    assert config.sandbox_config().backend == "docker" and config.sandbox_config().timeout_s == 3


ITEM = next(i for i in load_sample() if i["answer"] == 342)  # the garden fence


def rollout_of(env, item=ITEM):
    async def go():
        rollout = await env.collect_trajectory(item)
        return rollout, await env._score(item, rollout)

    return run(go())


def test_solving_with_code_earns_every_turn_reward():
    env = make_env([tool_call("python", code=ITEM["solution_code"]), "<answer>342</answer>"])
    rollout, scores = rollout_of(env)
    assert rollout.turns[0].tool_results == ["342"]
    assert scores == [1.0, 1.0]
    assert env.sandbox_stats.execs == 1 and env.sandbox_stats.sandboxes == 1
    assert rollout.stop == "answer"


@pytest.mark.parametrize("code, answer, expected, result_has", [
    # runs, prints something else; right final answer
    ("print(12 + 7)", "<answer>342</answer>", [0.5, 1.0], "19"),
    # crashes: no turn reward, and the traceback goes back to the model
    ("print(1 / 0)", "<answer>342</answer>", [0.0, 1.0], "ZeroDivisionError"),
    # infinite loop: killed at the timeout, no turn reward
    ("while True: pass", "<answer>342</answer>", [0.0, 1.0], "timed out"),
    # runs and finds the number, then a wrong answer
    ("print(2 * 19 * 9)", "<answer>340</answer>", [1.0, 0.0], "342"),
    # right number, no tags: not an answer
    ("print(342)", "It is 342.", [1.0, 0.0], "342"),
])
def test_turn_rewards(code, answer, expected, result_has):
    env = make_env([tool_call("python", code=code), answer], sandbox_timeout_s=2)
    rollout, scores = rollout_of(env)
    assert scores == expected
    assert result_has in rollout.turns[0].tool_results[0]


def test_running_out_of_turns_scores_no_outcome():
    env = make_env([tool_call("python", code="print(342)")], max_turns=2)
    rollout, scores = rollout_of(env)
    assert rollout.stop == "max_turns" and scores == [1.0, 0.0]


def test_a_sandbox_failure_fails_the_group_and_is_counted_not_scored(monkeypatch):
    async def crash(self, *args, **kwargs):
        raise SandboxError("simulated crash of the sandbox")

    monkeypatch.setattr(BwrapSandbox, "_exec", crash)
    env = make_env([tool_call("python", code="print(1)"), "<answer>342</answer>"],
                   group_size=2)
    group = run(env.collect_group(ITEM))
    assert group is None  # dropped, never scored
    assert env.stats.groups_failed == 1 and env.stats.trajectories == 0
    assert env.sandbox_stats.sandbox_failures == 2
    assert env.describe_stats()["sandbox"]["sandbox_failures"] == 2


@pytest.mark.parametrize("backend", ["bwrap", "docker"])
def test_a_group_of_8_runs_in_parallel_in_8_sandboxes_that_never_see_each_other(backend, request):
    image = request.getfixturevalue("docker_image") if backend == "docker" else None
    code = ("import os, uuid\n"
            "mine = 'marker_' + uuid.uuid4().hex\n"
            "open(mine, 'w').write('x')\n"
            "open('/tmp/' + mine, 'w').write('x')\n"
            "import time; time.sleep(1)\n"
            "print(mine, sorted(os.listdir('.')), sorted(os.listdir('/tmp')))")
    env = make_env([tool_call("python", code=code), "<answer>342</answer>"], group_size=8,
                   sandbox_backend=backend, sandbox_image=image)
    group = run(env.collect_group(ITEM))
    assert group is not None and len(group.trajectories) == 8
    markers = []
    for trajectory in group.trajectories:
        result = trajectory.messages[3].content
        mine = result.split()[0]
        seen = re.findall(r"marker_[0-9a-f]{32}", result)
        assert set(seen) == {mine}, result  # its own marker only, in the workspace and /tmp
        markers.append(mine)
        assert trajectory.scores == [0.5, 1.0]  # code ran (no 342 in it), right answer
    assert len(set(markers)) == 8
    assert env.sandbox_stats.sandboxes == 8


def test_docker_backend_rollout(docker_image):
    env = make_env([tool_call("python", code=ITEM["solution_code"]), "<answer>342</answer>"],
                   sandbox_backend="docker", sandbox_image=docker_image)
    rollout, scores = rollout_of(env)
    assert scores == [1.0, 1.0] and rollout.turns[0].tool_results == ["342"]


def test_oracle_messages_match_what_the_rollout_produces():
    env = make_env([])
    messages = env.oracle_messages(ITEM)
    assert messages[2]["content"] == tool_call("python", code=ITEM["solution_code"])
    assert messages[-1]["content"] == "<answer>342</answer>"


@pytest.mark.needs("bubblewrap")  # its sandboxes are bwrap's
def test_a_group_against_the_tiny_model(vllm_server):
    """A real group through vLLM: the random model earns nothing, but the rollouts run in
    sandboxes end to end and produce valid trajectories."""
    config = GSM8KCodeConfig(dataset="sample", group_size=4, max_turns=2,
                             max_tokens_per_turn=48, keep_equal_score_groups=True,
                             tokenizer=str(vllm_server.model_dir),
                             inference_servers=[vllm_server.url], seed=1)

    async def go():
        env = GSM8KCodeEnv(config)
        await env.start()
        try:
            return env, await env.collect_group(await env.get_next_item())
        finally:
            await env.close()

    env, group = run(go())
    assert group is not None and len(group.trajectories) == 4
    for trajectory in group.trajectories:
        assert len(trajectory.scores) == len(trajectory.turn_spans) >= 1
    assert env.stats.groups_failed == 0

