"""Black-box rollouts for real: agent processes in bubblewrap sandboxes, their model calls
through the interception proxy to the real vLLM server, the result checked by the trainer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import pytest

from environments import BaseEnv, TurnLevelRewardMixin
from environments.agents.reference_agent import SYSTEM
from environments.blackbox import BlackBoxEnvConfig, BlackBoxEnvMixin
from environments.jsonl_store import read_groups
from environments.trajectory import MASKED

from conftest import REPO
from sandbox_fixtures import docker_image, host_processes_mentioning  # noqa: F401

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

    groups = list(read_groups(out))
    assert len(groups) == 3
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

    # the trainer recomputes every sampled token's logprob, each segment as its own context
    check = subprocess.run(
        [sys.executable, "-m", "lachesis.cli", "train", "--check", "--model",
         str(vllm_server.model_dir), "--data", str(out), "--batch-size", "6",
         "--run-dir", str(tmp_path / "run"), "--tensorboard", "false",
         "--log-level", "WARNING"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout)["alignment_mean_abs_diff"] < 1e-3


def test_an_agent_that_hangs_is_killed_at_the_timeout_and_its_group_fails(vllm_server, tmp_path):
    marker = f"lachesis-hang-{uuid.uuid4().hex[:8]}"
    env = make_env(vllm_server, tmp_path, agent_timeout_s=3,
                   command=["python3", "-c", "import time; time.sleep(600)", marker])

    assert one_group(env) is None  # dropped, not scored 0
    assert env.stats.groups_failed == 1 and env.stats.groups_sent == 0
    assert env.agent_stats.timeouts == 2
    assert "agent_timeout_s" in env.last_error
    assert not host_processes_mentioning(marker)


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
