"""Black-box rollouts for real: agent processes in bubblewrap sandboxes, their model calls
through the interception proxy to the real vLLM server, the result checked by the trainer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import pytest
from conftest import REPO, train_check
from sandbox_fixtures import docker_image, host_processes_mentioning  # noqa: F401

from environments import BaseEnv, TurnLevelRewardMixin
from environments.blackbox import BlackBoxEnvConfig, BlackBoxEnvMixin
from environments.blackbox.agents.reference_agent import SYSTEM
from environments.jsonl_store import read_groups
from environments.trajectory import MASKED

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap is Linux-only")

EDITING_AGENT = """
import openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
reply = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
# like an agent that compacts its context: the system prompt goes, the question is reworded
messages = [{"role": "user", "content": "You said something. Say it again."},
            {"role": "assistant", "content": reply.content or ""},
            {"role": "user", "content": "Once more."}]
client.chat.completions.create(model="tiny", messages=messages)
"""


RETRYING_AGENT = """
import openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "Say hi."}]
client.chat.completions.create(model="tiny", messages=messages)  # as if it timed out ...
reply = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
messages += [{"role": "assistant", "content": reply.content or ""},  # ... and was retried
             {"role": "user", "content": "Once more."}]
client.chat.completions.create(model="tiny", messages=messages)
"""


class NoteEnv(BlackBoxEnvMixin, TurnLevelRewardMixin, BaseEnv):
    """The agent's turns scored by their length (varies between samples)."""

    name = "note"
    config_class = BlackBoxEnvConfig

    def __init__(self, config, command=None):
        super().__init__(config)
        self.command = command

    async def get_next_item(self):
        return {"id": "note"}

    def agent_task(self, item):
        return "Write the number 84 to answer.txt."

    def agent_command(self, item):
        return self.command or super().agent_command(item)

    async def prepare_sandbox(self, item, sandbox):
        await sandbox.write_file("agent_edits.py", EDITING_AGENT)
        await sandbox.write_file("agent_retries.py", RETRYING_AGENT)

    def compute_turn_rewards(self, item, rollout):
        return [len(t.text) / 100 for t in rollout.turns]


def make_env(vllm_server, tmp_path, command=None, **settings):
    settings = {"tokenizer": str(vllm_server.model_dir), "inference_servers": [vllm_server.url],
                "group_size": 2, "max_turns": 3, "max_tokens_per_turn": 24,
                "max_token_length": 3072, "agent_timeout_s": 120,
                "keep_equal_score_groups": True,
                "spool_path": tmp_path / "spool.jsonl", **settings}
    return NoteEnv(BlackBoxEnvConfig(**settings), command)


def one_group(env):
    """Start ``env``, collect one group (None if it failed), close."""
    async def main():
        await env.start()
        try:
            return await env.collect_group(await env.get_next_item())
        finally:
            await env.close()

    return asyncio.run(main())


@pytest.mark.needs("bubblewrap")  # its sandboxes are bwrap's
def test_agent_runs_in_the_sandbox_and_its_trajectories_pass_the_trainer_alignment_check(
        vllm_server, tmp_path):
    out = tmp_path / "groups.jsonl"

    async def collect(env, n):
        await env.start()
        try:
            return await env.process(out, n)
        finally:
            await env.close()

    # the reference agent (streaming replies), then an agent that rewrites its history
    stats = asyncio.run(collect(make_env(vllm_server, tmp_path,
                                         agent_env={"AGENT_STREAM": "1"}), 2))
    assert stats["agent"]["runs"] == 4 and stats["groups_failed"] == 0, stats
    edited = asyncio.run(collect(make_env(vllm_server, tmp_path,
                                          command=["python3", "agent_edits.py"]), 1))
    assert edited["agent"]["new_segments"] == 2, edited
    retried = asyncio.run(collect(make_env(vllm_server, tmp_path,
                                           command=["python3", "agent_retries.py"]), 1))
    assert retried["agent"]["abandoned_replies"] == 2, retried

    groups = list(read_groups(out))
    assert len(groups) == 4
    for group in groups[:2]:
        for t in group.trajectories:
            assert t.messages[0].content == SYSTEM  # the agent's own prompt, as it sent it
            assert t.segment_starts is None
            assert t.metadata["agent"]["exit_code"] in (0, 3)  # answered, or hit max_turns
            for start, end in t.turn_spans:
                assert t.masks[start:end] == t.tokens[start:end]
    for t in groups[2].trajectories:
        [start] = t.segment_starts
        assert t.masks[start] == MASKED and len(t.turn_spans) == 2
        assert "messages[0]" in t.metadata["segments"][1]["reason"]
    for t in groups[3].trajectories:  # the reply it sent again for: not trained, nor scored
        assert len(t.turn_spans) == len(t.scores) == 2 and t.segment_starts is None
        [kept] = t.metadata["abandoned_replies"]
        assert kept["turn"] == 0 and "sent the request again" in kept["reason"]

    # the trainer recomputes every sampled token's logprob, each segment as its own context
    check = train_check(vllm_server.model_dir, out, tmp_path / "run", batch_size=8)
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout)["alignment_mean_abs_diff"] < 1e-3


@pytest.mark.needs("bubblewrap")  # its sandboxes are bwrap's
def test_an_agent_that_hangs_is_killed_at_the_timeout_and_its_group_fails(vllm_server, tmp_path):
    marker = f"lachesis-hang-{uuid.uuid4().hex[:8]}"
    env = make_env(vllm_server, tmp_path, agent_timeout_s=3,
                   command=["python3", "-c", "import time; time.sleep(600)", marker])

    assert one_group(env) is None  # dropped, not scored 0
    assert env.stats.groups_failed == 1 and env.stats.groups_sent == 0
    assert env.agent_stats.timeouts == 2
    assert "agent_timeout_s" in env.last_error
    assert not host_processes_mentioning(marker)


LONG_AGENT = """
import sys
import openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "Count on. " + "one two three " * 40}]
for _ in range(40):  # the context grows by ~600 tokens a request, until the proxy refuses
    try:
        reply = client.chat.completions.create(model="tiny", messages=messages)
    except openai.BadRequestError as error:
        print(error.code, file=sys.stderr)
        sys.exit(4)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": "More. " + "four five six " * 40}]
"""


@pytest.mark.needs("bubblewrap")  # its sandboxes are bwrap's
def test_a_long_episode_at_the_servers_limit_ends_truncated_and_its_group_is_kept(
        vllm_server, tmp_path):
    """max_token_length equal to vLLM's max_model_len (the most the start check allows):
    the agent's conversation grows until the proxy refuses it (context_length_exceeded);
    the rollouts end truncated and are scored, and the group is kept: vLLM refused no
    request (a refusal would have failed the rollout and dropped the group)."""
    from vllm_fixture import VLLM_MAX_MODEL_LEN

    env = make_env(vllm_server, tmp_path, command=["python3", "long_agent.py"], max_turns=40,
                   max_token_length=VLLM_MAX_MODEL_LEN, max_tokens_per_turn=16)
    write = env.prepare_sandbox

    async def prepare(item, sandbox):
        await write(item, sandbox)
        await sandbox.write_file("long_agent.py", LONG_AGENT)

    env.prepare_sandbox = prepare
    group = one_group(env)
    assert group is not None and env.stats.groups_failed == 0, env.last_error
    assert env.agent_stats.limit_exits == 2 and env.agent_stats.refused_requests == 2
    for t in group.trajectories:
        # max_tokens: the proxy refused a context past max_token_length (400
        # context_length_exceeded), and the agent exited on it (its code 4)
        assert t.flags.truncated and t.metadata["agent"]["limit"] == "max_tokens"
        assert t.metadata["agent"]["exit_code"] == 4
        assert len(t.turn_spans) >= 3 and len(t.scores) == len(t.turn_spans)
        starts = [0, *(t.segment_starts or [])]
        ends = [*starts[1:], len(t.tokens)]
        assert max(b - a for a, b in zip(starts, ends)) <= VLLM_MAX_MODEL_LEN


@pytest.mark.parametrize("backend", ["docker", "unsafe_subprocess"])
def test_the_reference_agent_reaches_the_model_from_the_other_backends(vllm_server, tmp_path,
                                                                       request, backend):
    """docker: no network in the container, the proxy's socket is mounted in, as with
    bwrap; unsafe_subprocess: the agent calls the proxy's TCP address directly."""
    settings = ({"sandbox_image": request.getfixturevalue("docker_image")}
                if backend == "docker" else {"sandbox_allow_unsafe": True})
    env = make_env(vllm_server, tmp_path, sandbox_backend=backend, group_size=1, **settings)

    group = one_group(env)
    assert group is not None, env.last_error
    [t] = group.trajectories
    assert t.messages[0].content == SYSTEM and t.turn_spans
    assert t.metadata["agent"]["exit_code"] in (0, 3)


GOLD_AGENT = """
import os, shutil, openai
client = openai.OpenAI(max_retries=0)
client.chat.completions.create(model="tiny", messages=[
    {"role": "user", "content": os.environ["LACHESIS_TASK"]}])
for root, _, files in os.walk(".gold"):  # the fix, as a perfect agent would write it
    for name in files:
        source = os.path.join(root, name)
        shutil.copyfile(source, os.path.relpath(source, ".gold"))
"""


@pytest.mark.needs("bubblewrap")  # its sandboxes are bwrap's
def test_swe_fix_end_to_end_a_fixing_agent_is_resolved_and_a_random_policy_is_not(
        vllm_server, tmp_path):
    """The whole path: agent process in the sandbox, proxy, copy-out, grading in a fresh
    sandbox with pristine tests, turn rewards, metrics."""
    from environments.envs.swe_fix import SweFixConfig, SweFixEnv

    class GoldSweFix(SweFixEnv):
        async def prepare_sandbox(self, item, sandbox):
            await super().prepare_sandbox(item, sandbox)
            for path, text in item["fixed_files"].items():
                await sandbox.write_file(f".gold/{path}", text)
            await sandbox.write_file("gold_agent.py", GOLD_AGENT)

        def agent_command(self, item):
            return ["python3", "gold_agent.py"]

    settings = {"tokenizer": str(vllm_server.model_dir), "inference_servers": [vllm_server.url],
                "dataset": "sample", "group_size": 2, "max_turns": 3,
                "max_tokens_per_turn": 24, "max_token_length": 3072,
                "keep_equal_score_groups": True, "spool_path": tmp_path / "spool.jsonl"}

    gold = one_group(GoldSweFix(SweFixConfig(**settings)))
    assert gold is not None
    for t in gold.trajectories:
        assert t.scores == [1.0] and t.metadata["metrics"]["resolved"] == 1.0
    reference = SweFixEnv(SweFixConfig(**settings))
    group = one_group(reference)
    assert group is not None, reference.last_error
    assert reference.agent_stats.runs == 2
    for t in group.trajectories:
        assert t.outcome == 0.0 and t.metadata["metrics"]["resolved"] == 0.0
        assert t.messages[0].content == SYSTEM


def process_cli(vllm_server, tmp_path, env: str, settings: dict, groups: int):
    """``lachesis env process ENV`` with ``settings`` as its --config file."""
    import yaml

    config = tmp_path / "env.yaml"
    config.write_text(yaml.safe_dump({
        "tokenizer": str(vllm_server.model_dir), "inference_servers": [vllm_server.url],
        "keep_equal_score_groups": True, "spool_path": str(tmp_path / "spool.jsonl"),
        **settings}))
    out = tmp_path / "groups.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "lachesis.cli", "env", "process", env, "--config",
         str(config), "--out", str(out), "--groups", str(groups), "--log-level", "WARNING"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    return done, out


def assert_clean_exit(stderr: str) -> None:
    """Nothing left running when the event loop closed: no tracebacks at exit."""
    for symptom in ("Traceback", "Event loop is closed", "was never retrieved",
                    "Task was destroyed"):
        assert symptom not in stderr, stderr[-3000:]


# The tiny random model makes no valid tool calls on its own: vLLM's structured outputs
# constrain it to a calculator call on two numbers or a final answer (still vLLM's sampled
# tokens and logprobs).
CALCULATOR_CALL_OR_ANSWER = (
    r'(<tool_call>\n\{"name": "calculator", "arguments": \{"expression": '
    r'"[1-9][0-9]? [+] [1-9][0-9]?"\}\}\n</tool_call>|The answer is [1-9][0-9]{0,2}\.)')


@pytest.mark.needs("bubblewrap")  # its sandboxes are bwrap's
def test_the_custom_agent_example_makes_valid_tool_calls_in_the_sandbox_through_the_proxy(
        vllm_server, tmp_path):
    """examples/calculator_agent: its own openai-client agent, copied into a bwrap sandbox
    and run there; valid tool calls over several turns give valid groups, exit 0. The
    calls are forced with structured outputs, under which vLLM reports the constrained
    distribution's logprobs: the trainer's alignment check refuses those groups, and
    passes the same agent's unconstrained ones (docs/blackbox-agents.md)."""
    done, out = process_cli(
        vllm_server, tmp_path, "examples/calculator_agent/env.py:CalculatorAgentEnv",
        {"group_size": 4, "max_turns": 4, "max_tokens_per_turn": 128,
         "max_token_length": 3500, "agent_timeout_s": 120,
         "sampling_extra": {"structured_outputs": {"regex": CALCULATOR_CALL_OR_ANSWER}}}, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_clean_exit(done.stderr)
    stats = json.loads(done.stdout)
    assert stats["groups_sent"] == 2 and stats["groups_failed"] == 0, stats
    assert stats["agent"]["runs"] == 8 and stats["tool_errors"] == 0
    assert stats["tool_calls"] >= 2, stats  # ~half of the turns are calls; 8 runs make some

    groups = list(read_groups(out))
    assert len(groups) == 2
    multi_turn = 0
    for group in groups:
        assert group.env == "calculator_agent"
        a, b = map(int, group.item_id.split("+"))
        for t in group.trajectories:
            assert t.messages[1].content == f"What is {a} + {b}?"  # the agent's own prompt
            assert len(t.scores) == len(t.turn_spans)
            for start, end in t.turn_spans:
                assert t.masks[start:end] == t.tokens[start:end]
            calls = [m.tool_calls[0] for m in t.messages if m.tool_calls]
            results = [m for m in t.messages if m.role == "tool"]
            multi_turn += len(t.turn_spans) > 1
            # every call the model made was run by the agent in the sandbox: the next
            # request carried its result, under the call's id
            for call, result in zip(calls, results):
                x, _, y = json.loads(call.function.arguments)["expression"].split()
                assert result.tool_call_id == call.id and result.content == str(int(x) + int(y))
            assert t.scores[:-1] == [1.0] * (len(t.scores) - 1)  # valid, executed calls
            answered = t.metadata["agent"]["exit_code"] == 0
            assert t.metadata["metrics"]["answered"] == float(answered)
            if answered:
                assert t.messages[-1].content.startswith("The answer is")
                assert t.scores[-1] == float(t.messages[-1].content == f"The answer is {a + b}.")
    assert multi_turn >= 1

    # forced tokens: vLLM's logprobs are the constrained distribution's, not the model's
    forced = train_check(vllm_server.model_dir, out, tmp_path / "check-forced", batch_size=4)
    assert forced.returncode != 0 and "logprobs differ by" in forced.stderr, forced.stderr[-2000:]
    # the same agent sampled freely: the recorded logprobs are the model's own
    (tmp_path / "free").mkdir()
    done, free = process_cli(
        vllm_server, tmp_path / "free", "examples/calculator_agent/env.py:CalculatorAgentEnv",
        {"group_size": 4, "max_turns": 4, "max_tokens_per_turn": 64, "max_token_length": 3500,
         "agent_timeout_s": 120}, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    check = train_check(vllm_server.model_dir, free, tmp_path / "check-free", batch_size=4)
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout)["alignment_mean_abs_diff"] < 1e-3


HANGS_UNLESS_FIRST = '''
import itertools
from environments import BaseEnv, TurnLevelRewardMixin
from environments.blackbox import BlackBoxEnvConfig, BlackBoxEnvMixin

class FirstFailsEnv(BlackBoxEnvMixin, TurnLevelRewardMixin, BaseEnv):
    """The first item's agent exits at once without calling the model (its group fails);
    the others' agents hang."""
    name = "first_fails"
    config_class = BlackBoxEnvConfig
    items = itertools.count()

    async def get_next_item(self):
        return {"id": str(next(self.items))}

    def agent_task(self, item):
        return "wait"

    def agent_command(self, item):
        if item["id"] == "0":
            return ["python3", "-c", "raise SystemExit(1)"]
        return ["python3", "-c", "import time; time.sleep(300)", "MARKER"]

    def compute_turn_rewards(self, item, rollout):
        return [0.0] * len(rollout.turns)
'''


@pytest.mark.needs("bubblewrap")  # its sandboxes are bwrap's
def test_a_run_stopped_by_failing_groups_kills_the_agents_in_flight_and_exits_cleanly(
        vllm_server, tmp_path):
    """With max_failed_groups_in_a_row reached while other agents still run, the run
    stops with one error line: the agents are killed and reaped, no traceback at exit."""
    marker = f"lachesis-inflight-{uuid.uuid4().hex[:8]}"
    env_file = tmp_path / "first_fails.py"
    env_file.write_text(HANGS_UNLESS_FIRST.replace("MARKER", marker))
    done, _ = process_cli(vllm_server, tmp_path, f"{env_file}:FirstFailsEnv",
                          {"group_size": 1, "concurrency": 3, "agent_timeout_s": 200,
                           "max_failed_groups_in_a_row": 1}, 3)
    assert done.returncode == 1
    assert "1 groups in a row failed" in done.stderr and "without calling the model" in \
        done.stderr, done.stderr[-3000:]
    # the env's stats say what happened before the stop
    stats = json.loads(done.stderr.split("the env's stats when it stopped:\n")[1]
                       .split("\n}\n")[0] + "\n}")
    assert stats["agent"]["no_model_calls"] == 1 and stats["groups_failed"] == 1, stats
    assert_clean_exit(done.stderr)
    assert not host_processes_mentioning(marker)


def test_seeded_sampling_reaches_the_agents_requests_through_the_proxy(vllm_server, tmp_path):
    """``seeded_sampling``: the proxy serves the agent's requests outside the rollout's
    task, with the rollout's seeds: the same group sampled twice is the same, and its two
    rollouts differ."""
    groups = [one_group(make_env(vllm_server, tmp_path, sandbox_backend="unsafe_subprocess",
                                 sandbox_allow_unsafe=True, seeded_sampling=True, seed=3))
              for _ in range(2)]
    assert None not in groups
    first, second = ([t.tokens for t in g.trajectories] for g in groups)
    assert first == second and first[0] != first[1]
