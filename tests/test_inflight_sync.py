"""In-flight weight updates (``sync_pause: keep`` and ``abort``) on the real vLLM CPU
server: a long generation that runs across a weight sync is not waited for, it goes on
under the new weights (``keep``: frozen in the scheduler and resumed; ``abort``: ended by
the server and continued by the env's client), and every token keeps the logprob of the
weights that sampled it, as the trainer recomputes it from each checkpoint; the
trajectory says where the new weights took over, and ``lachesis train --check`` passes
on it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest
import torch
from test_trainer import LetterEEnv, hf_logprobs
from transformers import AutoModelForCausalLM

from environments import EnvConfig
from environments.inference.vllm_client import FORCED_EXTRA_ARG
from environments.jsonl_store import read_groups
from trainer.versions import token_versions
from trainer.vllm_busy import BusySampler, running_requests
from trainer.vllm_sync import VLLMWeightSync
from vllm_fixture import reload_original

LONG = 1000
FORCED = [10 + (7 * i) % 200 for i in range(400)]  # a forced turn's ids
"""Tokens of the long turn: several seconds of generation on the tiny model here."""


def perturbed(model_dir, scale=0.05):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return model


def stale_logprobs(model_a, model_b, tokens: list[int], switch: int) -> torch.Tensor:
    """The logprobs of ``tokens[switch:]`` sampled by B over the keys/values A computed
    before the update (those of ``tokens[:switch - 1]``; the forward that sampled token
    ``switch`` was B's, and computed the keys/values of token ``switch - 1``)."""
    with torch.no_grad():
        cache = model_a(torch.tensor([tokens[:switch - 1]]), use_cache=True).past_key_values
        logits = model_b(torch.tensor([tokens[switch - 1:-1]]), past_key_values=cache).logits[0]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[switch:])[:, None])[:, 0]


@pytest.mark.parametrize("pause", ["keep", "abort", "keep-stale"])
def test_a_generation_spanning_a_sync_continues_on_the_new_weights(vllm_server, tmp_path,
                                                                   pause):
    """The env's rollout (one long turn) is in flight when the trainer syncs version 1
    with ``pause``: the sync returns long before the turn ends; the turn is kept whole
    (``abort``: the client continued the aborted request, once per turn; ``keep``:
    nothing to continue); its first tokens are version 0's and carry model A's
    logprobs, the rest version 1's and carry model B's (recomputed from the whole
    prefix: no key/value of A's survives the update; ``keep-stale``, ``sync_stale_kv``:
    B's over the keys/values A computed before the update, as PipelineRL)."""
    model_a = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir)
    model_b = perturbed(vllm_server.model_dir)
    sync = VLLMWeightSync([vllm_server.url], tmp_path / "weights", pause=pause.split("-")[0],
                          stale_kv=pause == "keep-stale")
    path_b = sync.save(model_b, None, 1)
    out = tmp_path / "groups.jsonl"
    config = EnvConfig(tokenizer=str(vllm_server.model_dir),
                       inference_servers=[vllm_server.url], group_size=2, max_turns=1,
                       max_tokens_per_turn=LONG, max_token_length=LONG + 64,
                       sampling_extra={"ignore_eos": True})

    async def generated_tokens(session) -> float:
        async with session.get(vllm_server.url + "/metrics") as response:
            text = await response.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))

    async def running(n: int, rollouts: asyncio.Future, deadline: float) -> None:
        """Wait until the server runs ``n`` sequences (a request still waiting for its
        first token would be aborted with none: nothing of it would span the sync)."""
        while (await asyncio.to_thread(running_requests, vllm_server.url) or 0) < n:
            assert time.monotonic() < deadline and not rollouts.done()
            await asyncio.sleep(0.02)

    async def scenario():
        env = LetterEEnv(config)
        await env.start()
        try:
            assert all(s.generate for s in env._pool.servers)  # the route that says versions
            await env._pool.complete([5, 6, 7], max_tokens=8)  # (a first request is slow)
            busy = BusySampler([vllm_server.url], interval_s=0.1).start()
            async with aiohttp.ClientSession() as session:
                before = await generated_tokens(session)
                rollouts = asyncio.ensure_future(env.process(out, 1))
                deadline = time.monotonic() + 120
                # (abort: a forced turn in flight too, continued with the ids still to
                # give; sent once the group's two run, so it cannot end before the sync)
                await running(2, rollouts, deadline)
                forced = asyncio.ensure_future(env._pool.complete(
                    [5, 6, 7], max_tokens=len(FORCED), sampling={
                        "ignore_eos": True, "extra_args": {FORCED_EXTRA_ARG: FORCED}})) \
                    if pause == "abort" else None
                await running(3 if forced else 2, rollouts, deadline)
                # all turns are well under way (a few hundred tokens between them)
                while await generated_tokens(session) - before < 300:
                    assert time.monotonic() < deadline and not rollouts.done()
                    await asyncio.sleep(0.05)
                assert not rollouts.done()
                await sync.reload(path_b)
                # the sync returned with the turns still in flight (an order of events,
                # not a count: how many tokens the server makes while the sync and this
                # test's requests run depends on the machine's load; 890 of 2,400 came
                # after it once beside the suite's other sessions)
                in_flight = not rollouts.done()
                synced = await generated_tokens(session)
                await rollouts
                after = await generated_tokens(session) - synced
            if forced is not None:
                assert (await forced).token_ids == FORCED
            generating = busy.take()  # vLLM's busy share while the rollouts ran
            await asyncio.sleep(1.0)
            idle = busy.take()
            busy.stop()
            # (samples before the turns start and while the sync swaps the weights count
            # as idle: 0.75 and above measured)
            assert generating > 0.5 and idle == 0.0, (generating, idle)
            return in_flight, after, env._pool.stats.continued
        finally:
            await env.close()

    try:
        in_flight, generated_after, continued = asyncio.run(scenario())
    finally:
        asyncio.run(reload_original(vllm_server))
    # the sync did not wait for the generations: they were in flight when it returned,
    # and the server generated tokens after that (the spans below say which weights)
    assert in_flight and generated_after > 0, (in_flight, generated_after)
    # each aborted once (abort: the forced request too)
    assert continued == {"keep": 0, "keep-stale": 0, "abort": 3}[pause]

    group = next(iter(read_groups(out)))
    for t in group.trajectories:
        (start, end), = t.turn_spans
        assert end - start == LONG  # kept whole
        spans = t.metadata["turns"][0]["version_spans"]
        assert t.turn_policy_versions == [0] and t.policy_version == 0  # the oldest
        assert [v for _, _, v in spans] == [0, 1]
        (s0, e0, _), (s1, e1, _) = spans
        assert s0 == start and e0 == s1 and e1 == end and start < s1 < end
        versions = token_versions(t)
        assert versions[start:end] == [0] * (s1 - start) + [1] * (end - s1)
        recorded = torch.tensor(t.inference_logprobs)
        with torch.no_grad():
            a = hf_logprobs(model_a, t.tokens)  # a[i] is the logprob of token i + 1
            b = hf_logprobs(model_b, t.tokens)
        before, after = slice(start - 1, s1 - 1), slice(s1 - 1, end - 1)
        assert (a[before] - recorded[start:s1]).abs().mean() < 1e-3
        if pause == "keep-stale":
            stale = stale_logprobs(model_a, model_b, t.tokens, s1)[:end - s1]
            assert (stale - recorded[s1:end]).abs().mean() < 1e-3
            b = torch.cat([b[:s1 - 1], stale])  # (B from scratch would not explain them:)
            assert (hf_logprobs(model_b, t.tokens)[after] - recorded[s1:end]).abs().mean() \
                > 1e-2
        assert (b[after] - recorded[s1:end]).abs().mean() < 1e-3
        # and the other checkpoint would not explain them: the update mattered
        assert (b[before] - recorded[start:s1]).abs().mean() > 1e-2
        assert (a[after] - recorded[s1:end]).abs().mean() > 1e-2

    # the trainer's step-0 check (weights of version 0) compares the version-0 tokens: the
    # same spans in every mode, so once, on abort's (its turns continued), not three times
    # (a trainer process each, 6-8 s beside the suite)
    if pause == "abort":
        run = subprocess.run(
            [sys.executable, "-m", "lachesis.cli", "train", "--check", "--model",
             str(vllm_server.model_dir), "--data", str(out), "--batch-size", "2",
             "--run-dir", str(tmp_path / "run"), "--tensorboard", "false"],
            capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        summary = json.loads(run.stdout[run.stdout.index("{"):])
        compared = sum(spans[0][1] - spans[0][0] for spans in
                       (t.metadata["turns"][0]["version_spans"] for t in group.trajectories))
        assert summary["alignment_mean_abs_diff"] < 1e-3
        assert summary["alignment_compared_tokens"] == compared


def test_a_busy_sample_read_across_a_take_counts_in_neither_window():
    """A ``/metrics`` read that begins while the server runs requests and answers after
    ``take`` closed that window (a loaded machine) is not counted in the next window: the
    requests had ended by then (this made the test above see ``idle`` > 0 once)."""
    in_read, release = threading.Event(), threading.Event()
    running = {"now": 1}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            value = running["now"]
            if value:
                in_read.set()
                release.wait(10)
            body = f"vllm:num_requests_running{{engine=\"0\"}} {value}.0\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    busy = BusySampler([f"http://127.0.0.1:{server.server_address[1]}"], interval_s=0.02)
    try:
        busy.start()
        assert in_read.wait(10)  # a read of "1 running" is under way
        busy.take()  # the requests end; the window closes
        running["now"] = 0
        release.set()
        time.sleep(0.3)  # idle samples
        assert busy.take() == 0.0
    finally:
        busy.stop()
        server.shutdown()
