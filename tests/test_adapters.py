"""Environments of other frameworks through Lachesis: a verifiers 0.4.0 taskset
(``verifiers:ID``) and an OpenEnv server built with openenv-core 0.3.0 (``openenv:URL``),
both written here (tests/adapter_envs/), run by ``lachesis env`` against the tiny model on
vLLM CPU; their groups go to a real rollout API and a trainer leases them with their
per-turn scores.

verifiers and openenv-core pin versions that clash with the project's venv, so each runs
from its own venv (tests/third_party.py builds it once, from PyPI): the verifiers env
process runs there with this repository on PYTHONPATH; the OpenEnv server runs there as
a uvicorn process, and Lachesis talks to it over plain WebSocket from this venv.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO, free_port, running_api, train_check
from third_party import openenv_python, verifiers_python

from environments.adapters.openenv_env import OpenEnvConfig, OpenEnvEnv, OpenEnvError
from environments.api.client import RolloutAPIClient
from environments.jsonl_store import read_groups
from trainer.advantages import from_scored

ADAPTER_ENVS = REPO / "tests" / "adapter_envs"

# The tiny model writes noise; vLLM's structured outputs keep it to a calc_add call on
# digits 2-5 (right when they add up to 7) or an answer of 6 or 7.
VF_CALL_OR_ANSWER = (r'(<tool_call>\n\{"name": "calc_add", "arguments": \{"a": [2-5], '
                     r'"b": [2-5]\}\}\n</tool_call>|The answer is [67]\.)')
VF_ALWAYS_CALL = (r'<tool_call>\n\{"name": "calc_add", "arguments": \{"a": [2-5], '
                  r'"b": [2-5]\}\}\n</tool_call>')
# A guess 0-3 (0 is refused by the server's action schema: ge=1).
GUESS = r'<tool_call>\n\{"name": "step", "arguments": \{"guess": [0-3]\}\}\n</tool_call>'


def flags(vllm_server, **settings) -> list[str]:
    settings = {"tokenizer": str(vllm_server.model_dir), "inference_servers": vllm_server.url,
                "max_tokens_per_turn": 100, **settings}
    return [part for name, value in settings.items()
            for part in ("--" + name.replace("_", "-"),
                         value if isinstance(value, str) else json.dumps(value))]


async def serve_and_lease(command: list[str], env: dict[str, str], n_sequences: int):
    """Run ``command`` (a ``lachesis env serve``) against an in-process rollout API, then
    lease its groups as the trainer does."""
    async with running_api() as (url, _api):
        process = await asyncio.create_subprocess_exec(
            *command, "--api-url", url, cwd=REPO, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), 600)
        assert process.returncode == 0, err.decode()[-4000:]
        async with RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=n_sequences, max_token_len=4096)
            batch = await client.lease()
    return json.loads(out), batch


def tool_turns(trajectory) -> list[list[dict]]:
    """The tool results that followed each assistant turn, per turn."""
    turns: list[list[dict]] = []
    for message in trajectory.messages:
        role = message.role if hasattr(message, "role") else message["role"]
        if role == "assistant":
            turns.append([])
        elif role == "tool":
            turns[-1].append(message if isinstance(message, dict) else message.model_dump())
    return turns


# -- verifiers -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verifiers_env_process():
    """(python, environment) to run ``lachesis env`` with verifiers importable."""
    python = verifiers_python()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(ADAPTER_ENVS)])}
    return str(python), env


def test_a_run_checks_a_verifiers_env_with_the_verifiers_venvs_python(verifiers_env_process,
                                                                       tmp_path):
    """`lachesis run` (whose own venv has no verifiers) checks a `verifiers:ID` env by
    asking the env's `python`; its processes run there with this repository on the path."""
    from lachesis.run.config import RunConfig
    from lachesis.run.layout import build_layout

    python, _ = verifiers_env_process

    def run(settings: dict) -> RunConfig:
        return RunConfig.model_validate({
            "name": "vf", "model": "some/model", "runs_dir": str(tmp_path),
            "train": {"batch_size": 8}, "envs": [{
                "name": "verifiers:vf_add", "python": python, "settings": settings,
                "environment": {"PYTHONPATH": str(ADAPTER_ENVS)}}]})

    good = run({"group_size": 4, "per_turn_scores": True})
    good.check_sections()
    [server] = build_layout(good).envs
    assert server.command[:4] == [python, "-m", "lachesis.cli", "env"]
    assert server.env["PYTHONPATH"] == os.pathsep.join([str(ADAPTER_ENVS), str(REPO)])
    with pytest.raises(ValueError, match=r"(?s)checked with .*per_turn_scores"):
        run({"per_turn_scores": "sometimes"}).check_sections()
    with pytest.raises(ValueError, match="group_size 3 does not divide train.batch_size 8"):
        run({"group_size": 3}).check_sections()


def test_a_verifiers_taskset_serves_per_turn_scored_groups_that_the_trainer_leases(
        vllm_server, verifiers_env_process):
    python, env = verifiers_env_process
    command = [python, "-m", "lachesis.cli", "env", "serve", "verifiers:vf_add",
               *flags(vllm_server, group_size=4, total_groups=3, max_turns=6,
                      per_turn_scores=True, keep_equal_score_groups=True,
                      sampling_extra={"structured_outputs": {"regex": VF_CALL_OR_ANSWER}})]
    summary, batch = asyncio.run(serve_and_lease(command, env, n_sequences=12))
    assert summary["groups_sent"] == 3 and summary["groups_failed"] == 0, summary
    assert batch is not None and len(batch.groups) == 3
    turn_counts = []
    for group in batch.groups:
        assert group.env == "verifiers-vf_add" and group.item_id.startswith("add-")
        for t in group.trajectories:
            turns = tool_turns(t)
            turn_counts.append(len(turns))
            # the env's own turn cap (agent.max_turns = 3), not Lachesis's --max-turns 6
            assert 1 <= len(turns) <= 3
            assert isinstance(t.scores, list) and len(t.scores) == len(t.turn_spans) == len(turns)
            # the env's tool ran behind its MCP name, and its results reached the model
            for results in turns:
                for result in results:
                    assert result["name"] == "calc_add" and result["content"].isdigit()
            # turn k's score: the env's rewards on the trace cut after turn k
            final = t.messages[-1]
            final_text = final.content if hasattr(final, "content") else final["content"]
            for k, score in enumerate(t.scores):
                seen = [r["content"] for results in turns[:k + 1] for r in results]
                used_tool = 0.5 * ("7" in seen)
                last = k == len(turns) - 1
                correct = 1.0 * (last and not turns[k] and final_text == "The answer is 7.")
                assert score == pytest.approx(used_tool + correct), (k, t.scores, t.messages)
            metrics = t.metadata["metrics"]
            assert metrics["reward/used_tool"] == (1.0 if t.scores[-1] in (0.5, 1.5) else 0.0)
            assert metrics["metric/turns"] == len(turns)
            if len(turns) >= 2:  # the trainer has turn-level credit to use
                assert from_scored(t).has_turn_credit
    assert max(turn_counts) >= 2


def test_verifiers_evaluate_keeps_the_env_turn_cap_and_refuses_what_it_cannot_run(
        vllm_server, verifiers_env_process):
    python, env = verifiers_env_process
    # a model that only ever calls the tool runs into the env's turn cap (agent.max_turns
    # = 3), not into Lachesis's --max-turns 6; never answering, it is never correct
    done = subprocess.run(
        [python, "-m", "lachesis.cli", "env", "evaluate", "verifiers:vf_add",
         *flags(vllm_server, eval_items=4, eval_temperature=1.0, max_turns=6,
                sampling_extra={"structured_outputs": {"regex": VF_ALWAYS_CALL}})],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(done.stdout)
    assert metrics["items"] == 4 and metrics["failed"] == 0
    assert metrics["mean_turns"] == 3 and metrics["truncated_rate"] == 1.0
    assert metrics["reward/correct"] == 0.0 and metrics["metric/turns"] == 3
    # a task that needs a container and a runtime-scored reward: a clear error, no rollout
    done = subprocess.run(
        [python, "-m", "lachesis.cli", "env", "process", "verifiers:vf_sandboxed",
         "--out", "/dev/null", "--groups", "1", *flags(vllm_server)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "BoxTask cannot run in Lachesis yet: it needs a container" in done.stderr
    assert "passed needs a runtime" in done.stderr
    # an id that names no taskset: verifiers' own message, exit 2
    done = subprocess.run(
        [python, "-m", "lachesis.cli", "env", "serve", "verifiers:no_such_taskset"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "taskset 'no_such_taskset' not found" in done.stderr


# -- OpenEnv -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory):
    """The guess-a-digit server (tests/adapter_envs/openenv_guess_server.py), made with
    openenv-core's create_app, as a real uvicorn process allowing ONE session at a time.
    Its log goes to a file: an unread pipe fills up with access lines and blocks it."""
    port = free_port()
    log = tmp_path_factory.mktemp("openenv") / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(openenv_python()), "-m", "uvicorn", "openenv_guess_server:app", "--port",
             str(port)], cwd=ADAPTER_ENVS, env={**os.environ, "GUESS_MAX_SESSIONS": "1"},
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"OpenEnv server exited: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/schema", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("OpenEnv server did not come up") from None
            time.sleep(0.3)
    yield url
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:  # still closing sessions: it has had its chance
        process.kill()
        process.wait()


def test_an_openenv_server_serves_step_rewards_as_turn_scores_that_the_trainer_leases(
        vllm_server, openenv_server):
    command = [sys.executable, "-m", "lachesis.cli", "env", "serve", f"openenv:{openenv_server}",
               *flags(vllm_server, group_size=3, total_groups=3, max_turns=5,
                      max_token_length=4000, keep_equal_score_groups=True,
                      sampling_extra={"structured_outputs": {"regex": GUESS}})]
    summary, batch = asyncio.run(serve_and_lease(command, dict(os.environ), n_sequences=9))
    assert summary["groups_sent"] == 3 and summary["groups_failed"] == 0, summary
    # 3 concurrent episodes on a server with one session: the others waited, unscored
    assert summary["capacity_retries"] > 0
    assert batch is not None and len(batch.groups) == 3
    refused = done_episodes = 0
    for group in batch.groups:
        assert group.env.startswith("openenv-127.0.0.1_") and group.item_id.startswith("seed-")
        for t in group.trajectories:
            turns = tool_turns(t)
            assert isinstance(t.scores, list) and len(t.scores) == len(t.turn_spans) == len(turns)
            ended = False
            for k, results in enumerate(turns):
                assert not ended, "a step after done"
                expected = 0.0
                for result in results:
                    if result["content"].startswith("Error: the environment refused"):
                        refused += 1  # guess 0: the server's schema says ge=1
                        continue
                    step = json.loads(result["content"])
                    expected += step["reward"]
                    ended = ended or step["done"]
                if k == len(turns) - 1 and t.metadata["stop"] == "max_tokens":
                    break  # the step ran (its reward counts) but its result did not fit
                assert t.scores[k] == pytest.approx(expected), (k, t.scores, t.messages)
            assert (t.metadata["stop"] == "done") == ended
            done_episodes += ended
            if len(turns) >= 2:
                assert from_scored(t).has_turn_credit
    assert refused > 0 and done_episodes > 0


def test_an_unreachable_openenv_server_is_a_clear_error(vllm_server):
    env = OpenEnvEnv(OpenEnvConfig(url=f"http://127.0.0.1:{free_port()}",
                                   tokenizer=str(vllm_server.model_dir),
                                   inference_servers=[vllm_server.url]))

    async def start():
        try:
            await env.start()
        finally:
            await env.close()

    with pytest.raises(OpenEnvError, match="cannot read the action schema at http://127.0.0.1"):
        asyncio.run(start())


# -- exact tokens ----------------------------------------------------------------------------

def test_both_adapters_keep_the_exact_sampled_tokens(vllm_server, verifiers_env_process,
                                                     openenv_server, tmp_path):
    """``lachesis train --check`` recomputes every sampled token's logprob: it matches
    vLLM's only if tokens and masks are exactly what the model saw. No structured outputs
    here: under a grammar vLLM reports the constrained distribution's logprobs (~5.5 nats
    off on the tiny model). A logit bias (vLLM's logprobs are from before it) makes the
    random model open tool calls, malformed ones, which go back to it as tool errors, and
    end its turns: episodes of several turns, tool-result tokens between them."""
    from transformers import AutoTokenizer

    python, env = verifiers_env_process
    out = tmp_path / "both.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    bias = {str(tokenizer.convert_tokens_to_ids(token)): 5 for token in ("<tool_call>", "<|im_end|>")}
    for command, environ in (
            ([python, "-m", "lachesis.cli", "env", "process", "verifiers:vf_add"], env),
            ([sys.executable, "-m", "lachesis.cli", "env", "process",
              f"openenv:{openenv_server}"], dict(os.environ))):
        done = subprocess.run(
            [*command, "--out", str(out), "--append", "--groups", "1",
             *flags(vllm_server, group_size=3, max_turns=3, max_tokens_per_turn=60,
                    keep_equal_score_groups=True,
                    sampling_extra={"logit_bias": bias})],
            cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    groups = list(read_groups(out))
    assert [g.env.split("-")[0] for g in groups] == ["verifiers", "openenv"]
    assert max(len(t.turn_spans) for g in groups for t in g.trajectories) >= 2
    check = train_check(vllm_server.model_dir, out, tmp_path / "check", batch_size=3)
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout)["alignment_mean_abs_diff"] < 1e-3


# -- names ---------------------------------------------------------------------------------

def test_other_frameworks_env_names_resolve_or_say_what_is_wrong():
    import importlib.util

    from environments.framework.registry import EnvNotFoundError
    from lachesis.env_kinds import load_env_class

    cls = load_env_class("openenv:http://127.0.0.1:8000/")
    assert cls.name == "openenv-127.0.0.1_8000"
    assert cls.config_class().url == "http://127.0.0.1:8000/"
    with pytest.raises(EnvNotFoundError, match="needs the server's http"):
        load_env_class("openenv:127.0.0.1:8000")
    with pytest.raises(EnvNotFoundError, match="needs the taskset id"):
        load_env_class("verifiers:")
    if importlib.util.find_spec("verifiers") is None:  # the project's venv: not installed
        with pytest.raises(EnvNotFoundError, match=r"pip install 'lachesis-rl\[verifiers\]'"):
            load_env_class("verifiers:vf_add")


# 99 s, 72 s CPU beside the suite: the run's check of the env with its venv's python and
# the env server's command are test_a_run_checks_a_verifiers_env_with_the_verifiers_venvs_
# python; that env server's per-turn groups reaching a trainer's lease, the taskset test
@pytest.mark.vllm
@pytest.mark.slow
def test_a_verifiers_taskset_trains_under_lachesis_run(tiny_model_dir, verifiers_env_process,
                                                      tmp_path):
    """`verifiers:ID` as an `envs:` entry with the verifiers venv's `python`: the run
    checks it there, starts its env server there, and the trainer trains on its groups."""
    import json

    from test_run import SHORT_RUN, run_id, start_run, write_config

    from lachesis.run.processes import processes_of_run

    python, _ = verifiers_env_process
    config = write_config(
        tmp_path, tiny_model_dir, "vf", warm_start=None, evaluate=False,
        envs=[{"name": "verifiers:vf_add", "python": python,
               "environment": {"PYTHONPATH": str(ADAPTER_ENVS)},
               "settings": {"group_size": 4, "max_turns": 3, "max_tokens_per_turn": 24,
                            "per_turn_scores": True, "keep_equal_score_groups": True}}],
        train={**SHORT_RUN["train"], "steps": 2})
    run = start_run(config)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    run_dir = tmp_path / "runs" / "vf"
    assert processes_of_run(run_id(run_dir)) == []
    command = (run_dir / "logs" / "env-verifiers_vf_add.log").read_text().splitlines()[0]
    assert command.startswith(f"$ {python} -m lachesis.cli env serve verifiers:vf_add")
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    assert [m["groups"] for m in metrics] == [2, 2]
    assert all(m["groups_set_aside"] == 0 and m["mix/verifiers-vf_add"] == 2 for m in metrics)
