"""Weights into real vLLM CPU servers without a full checkpoint on disk: LoRA adapters
hot-loaded under versioned names, and in-memory transfers through vLLM's weight-transfer
API (the gloo plugin backend); a failed transfer falls back to disk and never leaves a
server serving half-written weights."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from environments.inference import weight_transfer as gloo
from trainer.config import TrainConfig
from trainer.train import train
from trainer.vllm_sync import PolicyServers, served_logprob_gap

pytestmark = pytest.mark.vllm  # the module's server, and one a test launches

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def server(transfer_vllm_server):
    """The session's vLLM CPU server with runtime LoRA loading and shm weight transfer."""
    return transfer_vllm_server


@pytest.fixture(scope="module")
def rollouts(server, tmp_path_factory):
    """4 groups x 4 single-turn trajectories sampled by the server's base model."""
    from test_trainer import collect_rollouts

    return collect_rollouts(server, tmp_path_factory.mktemp("rollouts") / "groups.jsonl",
                            model="tiny")


def train_config(tmp_path, server, **settings) -> TrainConfig:
    return TrainConfig(**{"model": str(server.model_dir), "run_dir": tmp_path / "run",
                          "batch_size": 8, "micro_batch_size": 8, "steps": 2, "lr": 3e-3,
                          "tensorboard": False, "vllm_urls": [server.url], **settings})


def gap(server, name, model) -> float:
    return asyncio.run(served_logprob_gap(server.url, name, model))


def test_lora_trains_only_the_adapter_and_vllm_serves_each_version_as_the_trainer_has_it(
        server, rollouts, tmp_path):
    from peft import PeftModel

    lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    cfg = train_config(tmp_path, server, data=rollouts, lora=lora, checkpoint_every=1)
    summary = asyncio.run(train(cfg))
    assert summary["alignment_mean_abs_diff"] < TOLERANCE  # step 0: base = base + B·A, B = 0

    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").open()]
    assert metrics[0]["sync_check_mean_abs_diff"] < TOLERANCE  # the trainer's own check
    served = requests_json(server.url + "/v1/models")
    assert {"tiny-lora-v000001", "tiny-lora-v000002"} <= {m["id"] for m in served["data"]}

    # Checkpoints hold the adapter only; loaded on the base model, it is what vLLM serves.
    checkpoint = cfg.run_dir / "checkpoints" / "step_000002"
    assert (checkpoint / "adapter_model.safetensors").exists()
    assert not (checkpoint / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(server.model_dir)
    trained = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(server.model_dir), checkpoint)
    served_gap = gap(server, "tiny-lora-v000002", trained)
    assert served_gap < TOLERANCE
    # the adapter matters: the served model is far nearer the trained one than the base
    assert gap(server, "tiny-lora-v000002", base) > max(TOLERANCE, 10 * served_gap)
    assert gap(server, "tiny", base) < TOLERANCE  # the base model is untouched

    # Resuming picks the adapter up again and trains on from it.
    more = asyncio.run(train(cfg.model_copy(update={"steps": 3})))
    assert more["start_step"] == 2 and more["last_step"] == 3


def test_a_replica_without_the_adapter_is_routed_around(server, vllm_server, tmp_path):
    """A replica restarted on the base model answers 404 for the adapter's name until its
    adapter is loaded again: the env's pool retries the request on a replica that serves
    it instead of failing the rollout."""
    from peft import LoraConfig, get_peft_model

    from environments.inference.vllm_client import VLLMServerPool

    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(server.model_dir),
                   LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"])
                   ).save_pretrained(adapter)
    loaded = requests_json_post(server.url + "/v1/load_lora_adapter",
                                {"lora_name": "only-here", "lora_path": str(adapter)})
    assert loaded.status == 200

    async def scenario():
        async with VLLMServerPool([vllm_server.url, server.url], "only-here", retries=2,
                                  backoff_s=0.01) as pool:
            completions = await asyncio.gather(*(pool.complete([1, 2, 3 + i], max_tokens=4)
                                                 for i in range(4)))
            return completions, pool.describe()

    try:
        completions, servers = asyncio.run(scenario())
    finally:
        requests_json_post(server.url + "/v1/unload_lora_adapter", {"lora_name": "only-here"})
    assert all(c.server == server.url for c in completions)
    assert servers[vllm_server.url]["healthy"] is False
    assert "404" in servers[vllm_server.url]["last_error"]


def requests_json_post(url: str, body: dict):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as error:
        return error


def requests_json(url: str):
    import requests

    return requests.get(url, timeout=30).json()


async def _complete(session, url, n_tokens=48):
    async with session.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": n_tokens,
            "ignore_eos": True, "temperature": 1.0}) as response:
        body = await response.json()
        assert response.status == 200, body
        return body["usage"]["completion_tokens"]


def perturbed(model_dir, seed: int):
    """The model after a (pretend) optimizer step: every weight moved a little."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model


def test_in_memory_transfer_serves_the_trainer_weights_and_loses_no_request_in_flight(
        server, tmp_path):
    servers = PolicyServers(train_config(tmp_path, server, weight_sync="transfer"),
                            tmp_path / "run")
    model = perturbed(server.model_dir, seed=1)

    async def sync_under_load():
        await servers.start()
        async with aiohttp.ClientSession() as session:
            requests_ = [asyncio.ensure_future(_complete(session, server.url))
                         for _ in range(8)]
            await asyncio.sleep(0.3)  # the requests are running
            values = await servers.publish(model, None, 1, None)
            late = [asyncio.ensure_future(_complete(session, server.url)) for _ in range(4)]
            return values, await asyncio.gather(*requests_, *late)

    try:
        values, done = asyncio.run(sync_under_load())
    finally:
        asyncio.run(servers.stop())
    assert done == [48] * 12  # every request finished, none aborted
    assert values["sync_check_mean_abs_diff"] < TOLERANCE and "sync_fallbacks" not in values
    assert not (tmp_path / "run" / "weights").exists()  # nothing went through the disk
    assert gap(server, "tiny", model) < TOLERANCE
    assert gap(server, "tiny", AutoModelForCausalLM.from_pretrained(server.model_dir)) \
        > 10 * TOLERANCE


def test_a_transfer_failing_midway_falls_back_to_disk_before_the_server_resumes(
        server, tmp_path, monkeypatch):
    """The trainer's side of the stream breaks after 5 tensors: the paused server holds part
    of the new weights, is reloaded from a disk copy, and only then serves again; the next
    sync goes through a new transfer group."""
    servers = PolicyServers(train_config(tmp_path, server, weight_sync="transfer"),
                            tmp_path / "run", check_sync=False)
    whole = gloo.StateDictSource.__iter__

    def breaks(self):
        for i, item in enumerate(whole(self)):
            if i == 5:
                raise ConnectionResetError("lost the trainer's stream")
            yield item

    async def go():
        await servers.start()
        try:
            monkeypatch.setattr(gloo.StateDictSource, "__iter__", breaks)
            first_model = perturbed(server.model_dir, seed=2)
            first = await servers.publish(first_model, None, 1, None)
            first_gap = await served_logprob_gap(server.url, "tiny", first_model)
            monkeypatch.setattr(gloo.StateDictSource, "__iter__", whole)
            second_model = perturbed(server.model_dir, seed=3)
            second = await servers.publish(second_model, None, 2, None)
            second_gap = await served_logprob_gap(server.url, "tiny", second_model)
            return first, first_gap, second, second_gap
        finally:
            await servers.stop()

    first, first_gap, second, second_gap = asyncio.run(go())
    assert first["sync_fallbacks"] == 1 and first_gap < TOLERANCE
    assert (tmp_path / "run" / "weights" / "v000001" / "model.safetensors").exists()
    assert "sync_fallbacks" not in second and second_gap < TOLERANCE
    assert not (tmp_path / "run" / "weights" / "v000002").exists()


def test_a_server_killed_mid_transfer_is_restarted_on_the_new_weights(tiny_model_dir, tmp_path,
                                                                      monkeypatch):
    """The launched server dies halfway through a gloo stream: the trainer reports it,
    saves the weights, and restarts the server on them (it never served the half-written
    ones); the next sync streams into the new server through a new group."""
    cfg = TrainConfig(model=str(tiny_model_dir), run_dir=tmp_path / "run", vllm_launch=True,
                      vllm_max_model_len=512, weight_sync="transfer",
                      transfer_backend="gloo", tensorboard=False)
    servers = PolicyServers(cfg, tmp_path / "run")
    whole = gloo.StateDictSource.__iter__

    def killed_midway(self):
        for i, item in enumerate(whole(self)):
            if i == 5:
                os.killpg(servers.managed.process.proc.pid, signal.SIGKILL)
            yield item

    model = perturbed(tiny_model_dir, seed=4)

    async def go():
        await servers.start()
        try:
            monkeypatch.setattr(gloo.StateDictSource, "__iter__", killed_midway)
            values = await servers.publish(model, None, 1, None)
            after = await served_logprob_gap(servers.managed.url, "tiny", model)
            monkeypatch.setattr(gloo.StateDictSource, "__iter__", whole)
            nudged = perturbed(tiny_model_dir, seed=5)
            model.load_state_dict(nudged.state_dict())
            again = await servers.publish(model, None, 2, None)
            return values, after, again, await served_logprob_gap(servers.managed.url,
                                                                  "tiny", model)
        finally:
            await servers.stop()

    values, after, again, after_again = asyncio.run(go())
    assert values["vllm_restarts"] == 1
    assert values["sync_check_mean_abs_diff"] < TOLERANCE and after < TOLERANCE
    assert "vllm_restarts" not in again and "sync_fallbacks" not in again
    assert after_again < TOLERANCE
    assert not (tmp_path / "run" / "weights" / "v000002").exists()  # streamed, not saved


def test_fsdp_ranks_stream_the_tied_model_in_memory_and_check_the_sync(server, rollouts,
                                                                      tmp_path):
    """torchrun, two FSDP2 ranks (gloo) of the tied model: the gathered state dict streams
    into the server through the shm transfer (the tied head included, nothing on disk),
    and the post-sync check runs on both ranks and passes."""
    import subprocess
    import sys

    from conftest import REPO
    from vllm_fixture import restore_weights

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", "-m", "lachesis.cli", "train",
               "--model", str(server.model_dir), "--data", str(rollouts), "--batch-size", "8",
               "--steps", "1", "--lr", "3e-3", "--sharding", "fsdp", "--tensorboard", "false",
               "--vllm-urls", server.url, "--weight-sync", "transfer",
               "--transfer-backend", "shm", "--run-dir", str(tmp_path / "run"),
               "--log-level", "WARNING"]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        restore_weights(server)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert metrics["sync_check_mean_abs_diff"] < TOLERANCE and "sync_fallbacks" not in metrics
    assert not (tmp_path / "run" / "weights").exists()  # streamed, not saved


def test_a_tied_checkpoint_needs_its_head_for_an_in_place_reload(server, tmp_path):
    """Why the trainer's checkpoints carry the tied ``lm_head.weight``: vLLM 0.32 (CPU)
    reloads a plain ``save_pretrained`` checkpoint of a tied model without refreshing the
    output head it serves from, and the sync check sees it; the trainer's checkpoint of
    the same weights is served exactly."""
    from environments.inference.tied_weights import TIED_WEIGHTS_FILE
    from trainer.vllm_sync import VLLMWeightSync
    from vllm_fixture import restore_weights

    model = perturbed(server.model_dir, seed=6)
    sync = VLLMWeightSync([server.url], tmp_path / "weights")
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    try:
        asyncio.run(sync.reload(plain))
        stale = gap(server, "tiny", model)
        path = sync.save(model, None, 1)
        asyncio.run(sync.reload(path))
        fresh = gap(server, "tiny", model)
    finally:
        restore_weights(server)
    assert (path / TIED_WEIGHTS_FILE).exists()
    assert stale > 100 * TOLERANCE and fresh < TOLERANCE
