"""Every wait has a bound and a name: a process that answers nothing (here a socket that
listens and never answers) makes the waiting side say, after its bound, which process
by name and address, and the time goes to ``time/hang_wait``. No model, no vLLM: about
4 s wall, 1 s CPU."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
from conftest import make_group, running_api

import trainer.sources
from environments.api.client import APIRequestError, RolloutAPIClient
from trainer.config import TrainConfig
from trainer.sources import APIBatches
from trainer.timing import PARTS, StepClock
from trainer.vllm_sync import sync_error_text


@pytest.fixture
def silent_url():
    """A server that accepts connections (the kernel's backlog) and never answers: a
    SIGSTOPped process's port looks like this."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_a_batch_wait_names_the_silent_env_server_and_the_vllm_that_does_not_answer(
        silent_url, caplog, monkeypatch):
    monkeypatch.setattr(trainer.sources, "VLLM_PROBE_AFTER_S", 0.0)
    monkeypatch.setattr(trainer.sources, "VLLM_PROBE_EVERY_S", 0.0)

    async def scenario():
        async with running_api() as (url, api), RolloutAPIClient(url) as env:
            await env.register_env("arithmetic_tool", group_size=2, max_token_length=64)
            await env.register_env("code_debug", group_size=2, max_token_length=64)
            await env.push_group(make_group(2, seed=1, env_id=0))
            api.envs[0].last_seen = time.time() - 60  # arithmetic_tool_0 went silent
            config = TrainConfig(model="unused", api_url=url, batch_size=4,
                                 lease_wait_s=0.1, batch_wait_warning_s=0.5,
                                 vllm_urls=[silent_url], vllm_health_timeout_s=0.2)
            source = APIBatches(config)
            await source.register()
            clock = StepClock()
            with clock("batch_wait"):
                waiting = asyncio.ensure_future(source.next())
                await asyncio.sleep(1.2)
                status = api.status()
                # a restarted env registers again under the same name: the old record
                # is not named any more
                await env.register_env("arithmetic_tool", group_size=2, max_token_length=64)
                assert [e["name"] for e in api.status()["silent_envs"]] == []
                await env.push_group(make_group(2, seed=2, env_id=2))
                batch = await asyncio.wait_for(waiting, 10)
            await source.close()
            return batch, status, clock.metrics()

    with caplog.at_level(logging.WARNING, logger="lachesis.train"):
        batch, status, seconds = asyncio.run(scenario())
    assert len(batch.groups) == 2
    assert [e["name"] for e in status["silent_envs"]] == ["arithmetic_tool_0"]
    warning = next(r.getMessage() for r in caplog.records if r.name == "lachesis.train")
    assert warning.startswith("no batch of 4 sequences for 0.")
    assert "the rollout API has not heard from env server arithmetic_tool_0 for 6" in warning
    assert (f"vLLM at {silent_url} did not answer /health within 0.2 s "
            "(train.vllm_health_timeout_s)") in warning
    assert "code_debug" not in warning  # it polls: it is not silent
    # the wait on silent processes is hang_wait, taken out of batch_wait: the parts
    # still add up to the step
    assert seconds["time/hang_wait"] > 0.8
    assert sum(seconds[f"time/{p}"] for p in PARTS) == pytest.approx(seconds["time/step"],
                                                                    abs=0.05)


def test_a_request_the_rollout_api_does_not_answer_is_logged_with_its_bound_and_counted(
        silent_url, caplog):
    async def scenario():
        async with RolloutAPIClient(silent_url, retries=1, timeout_s=0.3,
                                    backoff_s=0.05) as client:
            carved = []
            client.on_unanswered = carved.append
            started = time.monotonic()
            with pytest.raises(APIRequestError) as error:
                await client.lease(4, wait_s=0.2)
            return error.value, time.monotonic() - started, client.unanswered_s, carved

    with caplog.at_level(logging.WARNING, logger="lachesis.api.client"):
        error, took, unanswered_s, carved = asyncio.run(scenario())
    assert 0.9 < took < 3.0  # two attempts of 0.3 + 0.2 s, and a backoff
    assert str(error) == (f"POST /lease to the rollout API at {silent_url} failed after 2 "
                          "attempts; last error: TimeoutError: no answer within 0.5 s "
                          "(timeout_s 0.3 + wait 0.2)")
    [retry] = [r.getMessage() for r in caplog.records]
    assert retry.startswith(f"rollout API at {silent_url}: POST /lease unanswered "
                            "(TimeoutError: no answer within 0.5 s")
    assert retry.endswith("attempt 1 of 2); retrying")
    assert unanswered_s == pytest.approx(took, abs=0.05)
    assert sum(carved) == pytest.approx(unanswered_s)


def test_a_sync_that_timed_out_says_so_and_its_bound():
    assert sync_error_text(asyncio.TimeoutError(), 300.0) == (
        "TimeoutError: no answer within 300 s (train.sync_timeout_s)")
    assert sync_error_text(OSError("connection refused"), 300.0) == (
        "OSError: connection refused")
