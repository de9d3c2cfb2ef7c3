"""The env framework against a real vLLM CPU server on the tiny model.

A random tiny model emits noise, so tests that need tool calls constrain its output with
vLLM's structured outputs (a regex): the tokens are still sampled by vLLM from the model,
and their logprobs are the model's own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, running_api
from transformers import AutoModelForCausalLM, AutoTokenizer

from environments import BaseEnv, tool
from environments.api.client import RolloutAPIClient
from environments.envs.arithmetic_tool import ArithmeticToolConfig, ArithmeticToolEnv
from environments.inference.chat_template import ChatRenderer
from environments.inference.vllm_client import InferenceError, VLLMServerPool
from environments.jsonl_store import read_groups
from environments.trajectory import MASKED

# Either a calculator call on a small expression, or an answer.
CALL_OR_ANSWER = (r'(<tool_call>\n\{"name": "calculator", "arguments": \{"expression": '
                  r'"[1-9][0-9]? [+*-] [1-9][0-9]?"\}\}\n</tool_call>|<answer>-?[0-9]{1,3}</answer>)')
ALWAYS_CALL = r'<tool_call>\n\{"name": "(calculator|broken|nosuchtool)", "arguments": \{"expression": "1 \+ [1-9]"\}\}\n</tool_call>'


def structured(regex: str) -> dict:
    return {"structured_outputs": {"regex": regex}}


def arithmetic_env(vllm_server, **settings) -> ArithmeticToolEnv:
    settings.setdefault("group_size", 4)
    settings.setdefault("sampling_extra", structured(CALL_OR_ANSWER))
    config = ArithmeticToolConfig(tokenizer=str(vllm_server.model_dir),
                                  inference_servers=[vllm_server.url], **settings)
    return ArithmeticToolEnv(config)


async def with_env(env: BaseEnv, work):
    await env.start()
    try:
        return await work(env)
    finally:
        await env.close()


def hf_logprobs(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def test_rollout_tokens_masks_logprobs_and_turn_scores(vllm_server):
    """The core contract: tokens are the rendered conversation, masks mark exactly the
    sampled tokens, logprobs are the model's, one turn score per turn span. A group's
    first turns (one prompt) went to vLLM as one request with n = 4."""
    env = arithmetic_env(vllm_server, keep_equal_score_groups=True, max_turns=3)

    async def work(env):
        groups = [await env.collect_group(await env.get_next_item()) for _ in range(2)]
        return groups, env._pool.stats

    groups, stats = asyncio.run(with_env(env, work))
    assert stats.shared == 2 * 3  # per group: 3 of the 4 first turns inside the 4th's
    assert sum(len(t.turn_spans) for g in groups for t in g.trajectories) == stats.requests
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(vllm_server.model_dir))
    tools = [t.schema() for t in env.tools]
    turns_seen, calls_seen = 0, 0
    for group in groups:
        assert group is not None and len(group.trajectories) == 4
        for t in group.trajectories:
            messages = [m.model_dump(exclude_none=True) for m in t.messages]
            if not t.flags.truncated or t.metadata["stop"] == "max_turns":
                # a turn that stopped on <|endoftext|> keeps it (sampled), then <|im_end|>
                decoded = renderer.decode(t.tokens).replace("<|endoftext|><|im_end|>", "<|im_end|>")
                if decoded.endswith("<|endoftext|>"):  # the episode's last turn
                    decoded = decoded.removesuffix("<|endoftext|>") + "<|im_end|>"
                assert decoded + renderer.after_eos == renderer.render(messages, tools)
            sampled = {i for start, end in t.turn_spans for i in range(start, end)}
            assert [i for i, m in enumerate(t.masks) if m != MASKED] == sorted(sampled)
            assert all(t.masks[i] == t.tokens[i] for i in sampled)
            assert all(t.inference_logprobs[i] == 1.0 for i in range(len(t.tokens)) if i not in sampled)
            assert isinstance(t.scores, list) and len(t.scores) == len(t.turn_spans)
            assert t.outcome == t.scores[-1]
            turns_seen += len(t.turn_spans)
            for turn in t.metadata["turns"]:
                calls_seen += len(turn["tool_calls"])
            for m in messages:  # every executed call came back with the right number
                if m["role"] == "tool":
                    expression = json.loads(messages[messages.index(m) - 1]["tool_calls"][0]
                                            ["function"]["arguments"])["expression"]
                    assert m["content"] == str(eval(expression))
    assert calls_seen > 0 and turns_seen > len(groups) * 4


@tool
def broken(expression: str) -> str:
    """Always fails.

    Args:
        expression: ignored.
    """
    raise RuntimeError("the broken tool broke")


class FlakyToolEnv(ArithmeticToolEnv):
    """Calls either the real calculator, a tool that raises, or a tool that does not exist."""

    name = "flaky_tool"
    tools = [*ArithmeticToolEnv.tools, broken]


def test_tool_errors_go_back_to_the_model_and_max_turns_ends_the_episode(vllm_server):
    config = ArithmeticToolConfig(tokenizer=str(vllm_server.model_dir), group_size=6,
                                  inference_servers=[vllm_server.url], max_turns=2,
                                  max_token_length=2048,
                                  keep_equal_score_groups=True,
                                  sampling_extra=structured(ALWAYS_CALL))
    env = FlakyToolEnv(config)

    async def work(env):
        return await env.collect_group(await env.get_next_item())

    group = asyncio.run(with_env(env, work))
    errors = 0
    for t in group.trajectories:
        assert len(t.turn_spans) == 2 and t.metadata["stop"] == "max_turns"
        assert t.flags.truncated
        first_turn = t.metadata["turns"][0]
        tool_message = next(m for m in t.messages if m.role == "tool")
        name = first_turn["tool_calls"][0]["name"]
        if name == "calculator":
            assert first_turn["tool_errors"] == [] and tool_message.content.isdigit()
        else:
            assert tool_message.content.startswith("Error:")
            assert len(first_turn["tool_errors"]) == 1
        errors += t.flags.tool_errors
    assert errors == sum(len(turn["tool_errors"]) for t in group.trajectories
                         for turn in t.metadata["turns"])
    assert env.stats.tool_errors == errors


def test_token_budget_truncates_and_flags(vllm_server):
    # the prompt (system prompt with the tool schema, byte-level tokens) is ~830 tokens
    # and the stop tokens are banned, so every rollout runs into the budget (vLLM reports
    # raw logprobs, from before the bias, so the HF comparison below still holds)
    no_stop = {"logit_bias": {"256": -100, "258": -100}}
    env = arithmetic_env(vllm_server, group_size=2, max_token_length=880,
                         sampling_extra=no_stop, keep_equal_score_groups=True)

    async def work(env):
        return await env.collect_group(await env.get_next_item())

    group = asyncio.run(with_env(env, work))
    for t in group.trajectories:
        assert t.flags.truncated and t.metadata["stop"] == "max_tokens"
        assert len(t.tokens) == 880
        assert t.metadata["turns"][-1]["finish_reason"] == "length"
        assert t.outcome == 0.0

    # logprobs: with no grammar constraining the output, vLLM's logprobs of the sampled
    # tokens are the model's (raw, temperature 1): they match HF's on the same tokens, and
    # an off-by-one in tokens, masks or spans would give O(1) differences.
    t = group.trajectories[0]
    reference = hf_logprobs(vllm_server.model_dir, t.tokens)
    positions = [i for start, end in t.turn_spans for i in range(start, end)]
    ours = torch.tensor([t.inference_logprobs[i] for i in positions])
    theirs = reference[torch.tensor(positions) - 1]
    assert (ours - theirs).abs().mean() < 1e-3


class WrongLengthEnv(ArithmeticToolEnv):
    def compute_turn_rewards(self, item, rollout):
        return [1.0] * (len(rollout.turns) + 1)


def test_wrong_number_of_turn_rewards_drops_the_group_and_counts_it(vllm_server, tmp_path, caplog):
    config = ArithmeticToolConfig(tokenizer=str(vllm_server.model_dir), group_size=2,
                                  inference_servers=[vllm_server.url],
                                  sampling_extra=structured(CALL_OR_ANSWER))
    env = WrongLengthEnv(config)

    async def work(env):
        item = await env.get_next_item()
        return item, await env.collect_group(item)

    item, group = asyncio.run(with_env(env, work))
    assert group is None
    assert env.stats.reward_errors == 1 and env.stats.groups_sent == 0
    assert item["id"] in caplog.text and "compute_turn_rewards returned" in caplog.text


class OneBadItemEnv(ArithmeticToolEnv):
    """The first item's rollouts record a message that breaks the trajectory's data
    contract (tool-call arguments as an object, as the interception proxy once did)."""

    bad_item_id = None

    async def collect_trajectory(self, item, *, evaluation=False):
        rollout = await super().collect_trajectory(item, evaluation=evaluation)
        if self.bad_item_id in (None, item["id"]):
            self.bad_item_id = item["id"]
            rollout.messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator",
                                                  "arguments": {"expression": "1 + 1"}}}]})
        return rollout


def test_a_group_that_breaks_the_data_contract_fails_alone_and_the_run_goes_on(
        vllm_server, tmp_path, caplog):
    out = tmp_path / "groups.jsonl"
    env = OneBadItemEnv(ArithmeticToolConfig(
        tokenizer=str(vllm_server.model_dir), inference_servers=[vllm_server.url],
        group_size=2, concurrency=2, sampling_extra=structured(CALL_OR_ANSWER),
        keep_equal_score_groups=True))

    stats = asyncio.run(with_env(env, lambda env: env.process(out, 2)))
    assert stats["groups_sent"] == 2 and stats["groups_failed"] == 1, stats
    [failure] = stats["recent_failures"]
    assert failure["item_id"] == env.bad_item_id and "arguments" in failure["error"]
    assert f"group for item {env.bad_item_id} dropped" in caplog.text
    groups = list(read_groups(out))  # only the good groups, valid
    assert len(groups) == 2 and env.bad_item_id not in {g.item_id for g in groups}


def test_serve_pushes_groups_that_the_trainer_leases(vllm_server, tmp_path):
    async def scenario():
        async with running_api() as (url, _api):
            async with RolloutAPIClient(url) as client:
                await client.set_policy_version(3)  # the trainer's current weights
            env = arithmetic_env(vllm_server, group_size=2, total_groups=2, api_url=url,
                                 keep_equal_score_groups=True,
                                 spool_path=tmp_path / "spool.jsonl")
            await env.start()
            try:
                result = await env.serve()
            finally:
                await env.close()
            async with RolloutAPIClient(url) as client:
                await client.register_trainer(batch_size=4, max_token_len=1024)
                batch = await client.lease()
            return result, batch

    result, batch = asyncio.run(scenario())
    assert result["groups_sent"] == 2 and result["delivery"]["sent"] == 2
    assert batch is not None and len(batch.groups) == 2
    for group in batch.groups:
        assert group.env == "arithmetic_tool" and group.item_id.startswith("arith-")
        for t in group.trajectories:
            assert isinstance(t.scores, list) and len(t.scores) == len(t.turn_spans)
            assert t.policy_version == 3 and t.turn_policy_versions == [3] * len(t.turn_spans)


def test_serve_spools_while_the_api_is_down_and_replays_when_it_is_back(vllm_server, tmp_path):
    from conftest import APIProcess, free_port

    port = free_port()
    api = APIProcess("--db", str(tmp_path / "queue.sqlite"), port=port)
    spool = tmp_path / "spool.jsonl"
    env = arithmetic_env(vllm_server, group_size=2, total_groups=3, keep_equal_score_groups=True,
                         api_url=api.url, spool_path=spool)

    async def scenario():
        # No group is handed over before the API is down (on an idle machine the env
        # delivered all three between its registration and the kill, and nothing spooled)
        api_down = asyncio.Event()
        collect = env.collect_group

        async def collect_group_once_the_api_is_down(item):
            group = await collect(item)
            await api_down.wait()
            return group

        env.collect_group = collect_group_once_the_api_is_down
        await env.start()
        try:
            # The env registers first, so the API must be up then; it goes down after.
            api.start()
            serving = asyncio.create_task(env.serve())
            while getattr(env, "env_id", None) is None:
                await asyncio.sleep(0.1)
            api.kill()
            api_down.set()
            deadline = time.monotonic() + 120
            while not (spool.exists() and spool.stat().st_size > 0):
                assert time.monotonic() < deadline, "nothing was spooled in 120 s"
                assert not serving.done(), serving.result()
                await asyncio.sleep(0.2)
            api.start()  # the API comes back (same database)
            result = await asyncio.wait_for(serving, 300)
        finally:
            await env.close()
        async with RolloutAPIClient(api.url) as client:
            status = await client.status()
        return result, status

    try:
        result, status = asyncio.run(scenario())
    finally:
        api.stop()
    assert result["delivery"]["spooled"] >= 1, result
    assert result["delivery"]["sent"] + result["delivery"]["replayed"] == 3, result
    assert not result["spooled_left"] and spool.stat().st_size == 0
    # every group delivered (directly or replayed) is queued, once: 3 groups x 2 sequences
    assert status["queue_size"] == 3 and status["queued_sequences"] == 6


def test_process_writes_jsonl_for_a_user_env_file(vllm_server, tmp_path):
    out = tmp_path / "reverse.jsonl"
    command = [sys.executable, "-m", "lachesis.cli", "env", "process",
               "examples/reverse_word_env.py:ReverseWordEnv", "--out", str(out),
               "--groups", "2", "--group-size", "2", "--tokenizer", str(vllm_server.model_dir),
               "--inference-servers", vllm_server.url, "--max-token-length", "1536",
               "--max-tokens-per-turn", "48",
               "--keep-equal-score-groups", "true"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["groups_sent"] == 2
    groups = list(read_groups(out))
    assert len(groups) == 2
    for group in groups:
        assert group.env == "reverse_word" and len(group.trajectories) == 2
        for t in group.trajectories:
            assert len(t.scores) == len(t.turn_spans)


def test_openai_mode_marks_trajectories_not_trainable(vllm_server):
    env = arithmetic_env(vllm_server, group_size=2, inference="openai",
                         openai_base_url=vllm_server.url + "/v1", model=vllm_server.model_name,
                         openai_api_key="unused", sampling_extra={}, max_tokens_per_turn=24,
                         keep_equal_score_groups=True)

    async def work(env):
        return await env.collect_group(await env.get_next_item())

    group = asyncio.run(with_env(env, work))
    for t in group.trajectories:
        assert not t.flags.trainable and t.inference_logprobs is None
        assert t.messages[-1].role == "assistant"


def test_identical_requests_go_as_one_and_each_gets_its_own_sample(vllm_server):
    """Four identical requests made together (a group's first turn) are one request with
    n = 4 to vLLM: four different samples, each with the model's logprobs of its own
    tokens; a seeded request and a different prompt go on their own."""
    prompt = [5, 6, 7, 8, 9]

    async def work():
        async with VLLMServerPool([vllm_server.url], vllm_server.model_name) as pool:
            server = pool.servers[0]
            sent = server.requests
            outs = await asyncio.gather(
                *(pool.complete(prompt, max_tokens=12) for _ in range(4)),
                pool.complete(prompt, max_tokens=12, sampling={"seed": 3}),
                pool.complete(prompt[:-1], max_tokens=12))
            return outs, server.requests - sent, pool.stats.shared

    outs, sent, shared = asyncio.run(work())
    assert (sent, shared) == (3, 3)
    assert len({tuple(o.token_ids) for o in outs[:4]}) == 4
    for out, context in zip(outs, [prompt] * 5 + [prompt[:-1]]):
        tokens = context + out.token_ids
        model = hf_logprobs(vllm_server.model_dir, tokens)[len(context) - 1:]
        assert (model - torch.tensor(out.logprobs)).abs().max() < 1e-3


def test_pool_routes_around_a_dead_server(vllm_server):
    from conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        async with VLLMServerPool([dead, vllm_server.url], vllm_server.model_name,
                                  retries=2, backoff_s=0.01) as pool:
            completions = await asyncio.gather(*(pool.complete([1, 2, 3 + i], max_tokens=4)
                                                 for i in range(4)))
            return completions, pool.describe()

    completions, servers = asyncio.run(scenario())
    assert all(c.server == vllm_server.url and len(c.token_ids) == len(c.logprobs)
               for c in completions)
    assert servers[dead]["healthy"] is False and servers[vllm_server.url]["requests"] == 4

    async def all_dead():
        pool = VLLMServerPool([dead], "m", retries=1, backoff_s=0.01, outage_wait_s=1.5)
        try:
            await pool.complete([1], max_tokens=1)
        finally:
            await pool.close()

    with pytest.raises(InferenceError, match="no inference server answered for 2 s"):
        asyncio.run(all_dead())


def test_a_request_waits_for_the_only_server_to_come_back(vllm_server):
    """One server (a run's only vLLM, being restarted): while it is down, requests wait
    for it to answer ``/health`` again instead of failing their retries, and then go
    through. The server is the session's vLLM behind a TCP forwarder the test stops and
    starts again on the same port."""
    from urllib.parse import urlsplit

    from conftest import free_port

    target = urlsplit(vllm_server.url)
    port = free_port()
    connections: set[asyncio.StreamWriter] = set()

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def forward(reader, writer):
        upstream_reader, upstream_writer = await asyncio.open_connection(
            target.hostname, target.port)
        connections.update({writer, upstream_writer})
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    async def up():
        return await asyncio.start_server(forward, "127.0.0.1", port)

    async def down(server):
        server.close()
        for writer in connections:  # the pool's keep-alive connections too
            writer.close()
        connections.clear()
        await server.wait_closed()

    async def scenario():
        server = await up()
        pool = VLLMServerPool([f"http://127.0.0.1:{port}"], vllm_server.model_name,
                              retries=1, backoff_s=0.01, outage_wait_s=60)
        await pool.start()
        try:
            await down(server)
            requests = [asyncio.create_task(pool.complete([1, 2, 3], max_tokens=4))
                        for _ in range(3)]
            await asyncio.sleep(3.0)
            waiting = not any(r.done() for r in requests)
            server = await up()
            completions = await asyncio.wait_for(asyncio.gather(*requests), 60)
            await down(server)
            return waiting, completions, pool.stats
        finally:
            await pool.close()

    waiting, completions, stats = asyncio.run(scenario())
    assert waiting
    assert all(1 <= len(c.token_ids) == len(c.logprobs) <= 4 for c in completions)
    assert stats.failures == 0


def test_lockstep_serve_waits_for_each_policy_version_and_seeded_runs_repeat(vllm_server,
                                                                            tmp_path):
    """``groups_per_policy_version: 2`` with ``seeded_sampling``: the env delivers 2 groups,
    in item order, and starts no more until the policy version moves; a second run of
    the same settings samples exactly the same tokens (temperature 1, 4 rollouts in
    flight at once, so vLLM batches them differently each time; few enough that no
    prefill is chunked: vLLM's CPU build crashes on a seeded request's chunked prefill,
    which a deterministic run turns off)."""
    async def one_run(name: str):
        async with running_api() as (url, _api):
            async with RolloutAPIClient(url) as client:
                await client.set_policy_version(0)
                env = arithmetic_env(vllm_server, group_size=4, total_groups=4, api_url=url,
                                     seeded_sampling=True, groups_per_policy_version=2,
                                     concurrency=4, max_turns=2, seed=5,
                                     spool_path=tmp_path / f"{name}.jsonl")
                await env.start()
                try:
                    serving = asyncio.create_task(env.serve())
                    while (await client.status())["queue_size"] < 2:
                        assert not serving.done(), serving.exception()
                        await asyncio.sleep(0.1)
                    await asyncio.sleep(2.0)  # lockstep: nothing more under version 0
                    held = (await client.status())["queue_size"]
                    await client.set_policy_version(1)
                    await asyncio.wait_for(serving, 300)
                finally:
                    await env.close()
                await client.register_trainer(batch_size=16, max_token_len=1024)
                batch = await client.lease()
        return held, batch.groups

    held, first = asyncio.run(one_run("a"))
    _, second = asyncio.run(one_run("b"))
    assert held == 2 and len(first) == 4
    assert [g.trajectories[0].policy_version for g in first] == [0, 0, 1, 1]
    # items in the env's order (arith-SEED-INDEX); a dropped group's item is skipped
    indices = [int(g.item_id.rsplit("-", 1)[1]) for g in first]
    assert indices == sorted(indices)
    assert [g.item_id for g in second] == [g.item_id for g in first]
    tokens = [[t.tokens for t in g.trajectories] for g in first]
    assert [[t.tokens for t in g.trajectories] for g in second] == tokens
    # the rollouts of a group differ (each has its own seed stream)
    assert all(len({tuple(t) for t in group}) > 1 for group in tokens)
