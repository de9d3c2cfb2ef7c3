"""Token limits that agree before anything runs (environments/framework/limits.py): an env
whose max_token_length or max_tokens_per_turn its vLLM servers cannot serve is refused at
start, for every env kind, and by `lachesis run --plan` across the whole config."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from conftest import REPO, free_port
from third_party import verifiers_python

from environments import tool
from environments.framework.limits import ContextLimitError, context_limit_problems
from environments.inference.vllm_client import VLLMServerPool
from lachesis.run.config import RunConfig
from lachesis.run.plan import format_plan, make_plan

ADAPTER_ENVS = REPO / "tests" / "adapter_envs"


def test_the_message_names_both_numbers_and_what_to_change():
    assert context_limit_problems(4096, 4095, 4096, "vLLM") == []  # the most that fits
    [long] = context_limit_problems(4097, None, 4096, "the server")
    assert long.startswith("max_token_length 4097 does not fit the server")
    assert "max_token_length (--max-token-length) to 4096 or less" in long
    assert "start vLLM with --max-model-len 4097 or more" in long
    [turn] = context_limit_problems(1024, 4096, 4096, "the server")
    assert "max_tokens_per_turn (--max-tokens-per-turn) to 4095 or less" in turn
    assert "--max-model-len 4097 or more" in turn


def test_the_run_plan_refuses_envs_that_do_not_fit_vllm_max_model_len(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)

    def plan(envs, **vllm):
        run = RunConfig.model_validate({
            "name": "limits", "model": "some/model", "runs_dir": str(tmp_path),
            "vllm": {"max_model_len": 2048, **vllm}, "train": {"batch_size": 8}, "envs": envs})
        return make_plan(run, devices_present=0)

    fits = plan([{"name": "arithmetic_tool", "settings": {
        "group_size": 4, "max_token_length": 2048, "max_tokens_per_turn": 2047}}])
    assert fits.problems == []
    wrong = plan([
        {"name": "arithmetic_tool", "settings": {"group_size": 4, "max_token_length": 1024}},
        {"name": "swe_fix", "settings": {"group_size": 4, "dataset": "sample"}},  # default 4096
        {"name": "examples/reverse_word_env.py:ReverseWordEnv",
         "settings": {"group_size": 4, "max_tokens_per_turn": 3000}}])
    assert wrong.problems == [
        "env swe_fix: max_token_length 4096 does not fit vllm.max_model_len 2048: vLLM would "
        "refuse contexts past 2048 tokens mid-episode and drop their groups, instead of "
        "ending them as truncated at max_token_length. Set envs[1].settings.max_token_length "
        "to 2048 or less, or vllm.max_model_len to 4096 or more",
        "env examples/reverse_word_env.py:ReverseWordEnv: max_tokens_per_turn 3000 does not "
        "fit vllm.max_model_len 2048: a turn follows at least one prompt token, so it can "
        "never be longer than 2047. Set envs[2].settings.max_tokens_per_turn to 2047 or "
        "less, or vllm.max_model_len to 3001 or more"]
    assert "problems (2): the run would not start" in format_plan(wrong)
    # vLLM's own flag would override vllm.max_model_len behind the check's back
    assert plan(fits.config.envs[:1], args=["--max-model-len=8192"]).problems == [
        "vllm.args: set vllm.max_model_len instead of --max-model-len (the envs' token "
        "limits are checked against vllm.max_model_len)"]


def test_env_process_refuses_an_existing_out_file_unless_appending(tmp_path, capsys):
    from lachesis.cli import main

    out = tmp_path / "groups.jsonl"
    out.write_text('{"earlier": "run"}\n')
    assert main(["env", "process", "arithmetic_tool", "--out", str(out), "--groups", "1"]) == 2
    assert "already exists and is not empty; pass --append" in capsys.readouterr().err
    assert out.read_text() == '{"earlier": "run"}\n'
    assert main(["env", "process", "--help"]) == 0
    assert "--append" in capsys.readouterr().out


def test_every_env_kind_refuses_limits_its_vllm_server_cannot_serve(vllm_server, tmp_path):
    """`lachesis env process` of each kind (the agent loop's envs, a black-box env, an
    OpenEnv server, a verifiers taskset) against the session's vLLM server (max_model_len
    4096) with max_token_length 8192: one clear line, exit 1, before anything runs (the
    OpenEnv URL is never asked; nothing is written); nothing left open at exit."""
    from vllm_fixture import VLLM_MAX_MODEL_LEN

    async def limits():
        async with VLLMServerPool([vllm_server.url]) as pool:
            return pool.context_limits
    assert asyncio.run(limits()) == {vllm_server.url: VLLM_MAX_MODEL_LEN}

    unreachable = f"openenv:http://127.0.0.1:{free_port()}"
    verifiers = [str(verifiers_python()), {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(ADAPTER_ENVS)])}]
    kinds = {"arithmetic_tool": None, "swe_fix": None, unreachable: None,
             "verifiers:vf_add": verifiers}

    def start(name, runner, **settings):
        python, environ = runner or (sys.executable, None)
        command = [python, "-m", "lachesis.cli", "env", "process", name,
                   "--out", str(tmp_path / f"{len(started)}.jsonl"), "--groups", "1",
                   "--tokenizer", str(vllm_server.model_dir),
                   "--inference-servers", vllm_server.url, "--log-level", "WARNING",
                   *[f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]]
        started.append((name, subprocess.Popen(command, cwd=REPO, env=environ, text=True,
                                               stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE)))

    started: list = []
    for name, runner in kinds.items():
        start(name, runner, max_token_length=8192)
    start("arithmetic_tool", None, max_tokens_per_turn=5000)
    # limits that fit: the unreachable OpenEnv server is the error, and it is one line
    start(unreachable, None, max_token_length=4096)
    results = [(name, *process.communicate(timeout=300), process.returncode)
               for name, process in started]
    for name, stdout, stderr, code in results[:-2]:
        assert code == 1, (name, stderr[-2000:])
        assert "ContextLimitError: max_token_length 8192 does not fit the inference server " \
            f"{vllm_server.url} (model 'tiny', max_model_len 4096)" in stderr, (name, stderr)
        assert "Set max_token_length (--max-token-length) to 4096 or less" in stderr
    name, _, stderr, code = results[-2]
    assert code == 1 and "max_tokens_per_turn 5000 does not fit" in stderr, stderr
    assert "to 4095 or less" in stderr
    name, _, stderr, code = results[-1]
    assert code == 1 and "OpenEnvError: cannot read the action schema" in stderr, stderr
    for name, _, stderr, _ in results:
        assert "Unclosed" not in stderr and "Traceback" not in stderr, (name, stderr)
        assert stderr.strip().splitlines()[-1].startswith("lachesis env process: "), stderr
    assert not any((tmp_path / f"{i}.jsonl").exists() for i in range(len(results)))


def test_the_start_check_is_an_error_an_env_can_catch(vllm_server):
    """In-process, the refusal is a ContextLimitError (a ValueError), and the env's
    connection to vLLM is closed again."""
    from environments.envs.arithmetic_tool import ArithmeticToolConfig, ArithmeticToolEnv

    env = ArithmeticToolEnv(ArithmeticToolConfig(
        tokenizer=str(vllm_server.model_dir), inference_servers=[vllm_server.url],
        max_token_length=4097))
    with pytest.raises(ContextLimitError, match="max_token_length 4097 does not fit"):
        asyncio.run(env.start())
    assert env._pool._session is None


# -- past the server's limit mid-episode (a server whose limit the start check missed) ---

FLOOD_CALL = r'<tool_call>\n\{"name": "flood", "arguments": \{"topic": "x"\}\}\n</tool_call>'


@tool
def flood(topic: str) -> str:
    """Answers at great length: ~3,500 tokens of the tiny model's byte-level tokenizer.

    Args:
        topic: ignored.
    """
    return "word " * 700


def test_a_context_the_server_refuses_mid_episode_ends_it_truncated(vllm_server):
    """The agent loop run with max_token_length above vLLM's max_model_len (what the start
    check refuses; here without an env, as against a server that does not report its
    limit): the tool result pushes the next context past 4096 tokens, vLLM refuses it,
    and the episode ends truncated after its first turn, as when no room is left: not an
    inference failure, nothing of the refused context kept."""
    from transformers import AutoTokenizer

    from environments.framework.agent_loop import run_agent_loop
    from environments.inference.backends import VLLMBackend
    from environments.inference.chat_template import ChatRenderer
    from environments.inference.tool_parsers import get_parser

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(vllm_server.model_dir))

    async def main():
        async with VLLMServerPool([vllm_server.url]) as pool:
            backend = VLLMBackend(pool, renderer, {
                "temperature": 1.0, "structured_outputs": {"regex": FLOOD_CALL}})
            return await run_agent_loop(
                backend, renderer, [{"role": "user", "content": "Tell me everything."}],
                tools=[flood], parser=get_parser("hermes"), max_turns=3,
                max_token_length=10_000, max_tokens_per_turn=128)

    state = asyncio.run(main())
    assert state.truncated and state.stop == "max_tokens"
    [turn] = state.turns
    assert turn.tool_calls[0].name == "flood" and turn.tool_results == ["word " * 700]
    assert len(state.tokens) == len(state.masks) == len(state.logprobs) == turn.span[1]
    assert state.messages[-1]["role"] == "assistant"


def test_the_proxy_answers_a_context_the_server_refuses_as_its_own_limit(vllm_server):
    """The same in the interception proxy: 400 context_length_exceeded, the rollout
    flagged truncated (scored, not failed), and the refused request leaves the recording
    as it was."""
    import openai
    from test_proxy import START, client_for, echo, running_proxy

    async def main():
        async with running_proxy(vllm_server, max_token_length=10_000) as (proxy, _, _):
            rollout = proxy.open_rollout()
            client = client_for(proxy, rollout)
            first = (await client.chat.completions.create(
                model="tiny", messages=START)).choices[0].message
            before = (list(rollout.state.tokens), len(rollout.segments[0].messages))
            long = START + [echo(first), {"role": "user", "content": "word " * 900}]
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="tiny", messages=long)
            after = (list(rollout.state.tokens), len(rollout.segments[0].messages))
            failure = rollout.failure
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return refused.value, before, after, failure, state

    refused, before, after, failure, state = asyncio.run(main())
    assert refused.code == "context_length_exceeded" and "4096" in refused.message
    assert after == before and failure is None
    assert state.truncated and state.stop == "max_tokens" and len(state.turns) == 1
