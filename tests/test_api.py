"""The rollout API over real HTTP: Atropos protocol flows, bad input, auth, leases."""

import asyncio
import contextlib
import gzip
import json
import time

import aiohttp
import orjson
import pytest
from conftest import make_group, run, running_api

from environments.api.client import APIRequestError, RolloutAPIClient

TRAINER = {"wandb_group": "g", "wandb_project": "p", "batch_size": 4, "max_token_len": 64,
           "checkpoint_dir": "/tmp/ckpt", "save_checkpoint_interval": 10,
           "starting_step": 0, "num_steps": 100}
ENV = {"max_token_length": 64, "desired_name": "arith", "weight": 1.0, "group_size": 2}


async def call(session, method, url, payload=None, *, data=None, headers=None):
    if payload is not None:
        data = json.dumps(payload).encode()
    async with session.request(method, url, data=data, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def test_env_servers_registering_at_once_get_distinct_ids_that_survive_a_restart(tmp_path):
    """``lachesis run`` starts its env servers together: registrations that arrive at the
    same moment get one env id each (two that shared id 0 had their groups mixed as one
    env's: a 3:1 weighting came out 2:0, 0:2, ...), also after the API restarts."""
    db = tmp_path / "queue.sqlite"
    names = ["heavy", "light", "heavy", "other", "light"]

    async def register_all(url):
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(
                call(s, "POST", url + "/register-env", {**ENV, "desired_name": n})
                for n in names))

    async def scenario():
        async with running_api(db=db, in_memory=False) as (url, api):
            answers = await register_all(url)
        async with running_api(db=db, in_memory=False) as (url, api):
            kept = {i: e.real_name for i, e in api.envs.items()}
        return answers, kept

    answers, kept = run(scenario())
    assert all(status == 200 for status, _ in answers)
    ids = [out["env_id"] for _, out in answers]
    assert sorted(ids) == list(range(len(names)))
    real = {out["env_id"]: out["wandb_name"] for _, out in answers}
    assert sorted(real.values()) == ["heavy_0", "heavy_1", "light_0", "light_1", "other_0"]
    assert kept == real


def test_atropos_flow_env_registers_before_trainer():
    async def scenario():
        async with running_api() as (url, api), aiohttp.ClientSession() as s:
            # An env may register before any trainer exists (Atropos says "wait").
            status, env = await call(s, "POST", url + "/register-env", ENV)
            assert status == 200 and env["status"] == "success" and env["env_id"] == 0
            # atroposlib envs gzip bodies >= 1 KB and send env_id.
            for i in range(3):
                body = make_group(2, seed=i).to_scored_data().model_dump()
                body.update(env_id=0, group_id=None)
                raw = gzip.compress(json.dumps(body).encode())
                status, out = await call(s, "POST", url + "/scored_data", data=raw, headers={
                    "Content-Type": "application/json", "Content-Encoding": "gzip"})
                assert status == 200 and out["status"] == "received"
            # atroposlib sends GET /status-env with a JSON body.
            status, st = await call(s, "GET", url + "/status-env", {"env_id": 0})
            assert st["self_queue_size"] == 3 and st["env_weight"] == 1.0
            status, out = await call(s, "GET", url + "/batch")
            assert status == 409 and out["batch"] == []  # trainer not registered yet
            status, reg = await call(s, "POST", url + "/register", TRAINER)
            assert status == 200 and isinstance(reg["uuid"], int)
            assert (await call(s, "GET", url + "/info"))[1] == {"batch_size": 4, "max_token_len": 64}
            status, out = await call(s, "GET", url + "/batch")
            batch = out["batch"]
            assert sum(len(g["tokens"]) for g in batch) == 4  # exactly batch_size
            assert [g["tokens"] for g in batch] == [
                make_group(2, seed=i).to_scored_data().tokens for i in (0, 1)]  # oldest first
            status, out = await call(s, "GET", url + "/batch")
            assert out["batch"] is None  # 2 sequences left: not a full batch
            status, st = await call(s, "GET", url + "/status")
            assert st["current_step"] == 1 and st["queue_size"] == 1
            c = st["counters"]
            assert c["received_groups"] == 3 and c["served_sequences"] == 4
            # A second env registering under the same name gets its own id and name.
            status, env2 = await call(s, "POST", url + "/register-env", ENV)
            assert env2["env_id"] == 1 and env2["wandb_name"] == "arith_1"
            assert env2["checkpoint_dir"] == "/tmp/ckpt" and env2["starting_step"] == 1
            assert (await call(s, "POST", url + "/disconnect-env", {"env_id": 1}))[0] == 200
    run(scenario())


def test_odd_group_sizes_still_make_exact_batches():
    async def scenario():
        async with running_api() as (url, api), RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=6, max_token_len=64)
            for n in (3, 5, 3):
                await client.push_group(make_group(n, seed=n))
            batch = await client.lease()
            assert [len(g.trajectories) for g in batch.groups] == [3, 3]
            # a smaller lease skips the group of 5 but does not drop it ...
            await client.push_group(make_group(2, seed=9))
            assert [len(g.trajectories) for g in (await client.lease(batch_size=2)).groups] == [2]
            assert api.status()["queued_sequences"] == 5
            # ... a group bigger than the trainer's batch can never train: dropped, counted
            await client.push_group(make_group(7, seed=7))
            assert await client.lease() is None
            assert api.counters["dropped_groups_larger_than_batch"] == 1
            assert api.status()["queued_sequences"] == 5
    run(scenario())


@pytest.mark.parametrize("body, status, field", [
    (b"{not json", 400, "body"),
    (b'{"tokens": [[1, 2]], "masks": [[1]], "scores": [1.0]}', 422, "masks[0]"),
    (b'{"tokens": [[1, 2]], "masks": [[1, 2]]}', 422, "scores"),
    (b'{"tokens": [[1, "x"]], "masks": [[1, 2]], "scores": [1]}', 422, "tokens[0]"),
    (b'{"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [1], "turn_scores": [[1]], '
     b'"turn_spans": [[[0, 9]]]}', 422, "turn_spans[0][0]"),
    (b'{"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "scores": [1], "turn_scores": [[1]], '
     b'"turn_spans": [[[1, 3]]], "segment_starts": [[2]]}', 422, "segment_starts[0][0]"),
    (b"[1, 2]", 422, "body"),
    # per-turn lists in scores: one per run of trained tokens when turn_spans is absent
    (b'{"tokens": [[1, 2, 3, 4]], "masks": [[-100, 2, -100, 4]], "scores": [[0, 1, 1]]}',
     422, "scores[0]"),
])
def test_bad_input_is_refused_with_the_field_and_nothing_is_stored(body, status, field):
    async def scenario():
        async with running_api() as (url, api), aiohttp.ClientSession() as s:
            code, out = await call(s, "POST", url + "/scored_data", data=body,
                                   headers={"Content-Type": "application/json"})
            assert code == status
            assert out["field"] == field and out["error"]
            # in a list, the group's index is named too; still all-or-nothing
            good = make_group().to_scored_data().model_dump_json().encode()
            code, out = await call(s, "POST", url + "/scored_data_list",
                                   data=b"[" + good + b"," + body + b"]")
            assert code in (400, 422) and (out["field"].startswith("[1].") or code == 400)
            st = api.status()
            assert st["queue_size"] == 0 and "received_groups" not in st["counters"]
            c = st["counters"]
            assert c.get("rejected_invalid", 0) + c.get("rejected_malformed", 0) == 2
    run(scenario())


def test_per_turn_lists_in_scores_become_turn_scores_and_reach_mt_grpo(tmp_path):
    """hermes-agent's TurnLevelRewardMixin sends one list of per-turn scores per sequence
    in ``scores``: accepted, the last entry is the outcome, the turns are the runs of
    trained tokens; Atropos trainers still get one float per sequence; MT-GRPO trains on
    the turn scores where the outcomes are equal."""
    from environments.jsonl_store import parse_group_line
    from trainer.advantages import compute_group_advantages

    tokens = [3, 4, 10, 11, 5, 6, 12, 13]
    masks = [-100, -100, 10, 11, -100, -100, 12, 13]  # two assistant turns
    body = {"tokens": [tokens, tokens], "masks": [masks, masks],
            "scores": [[0.0, 1.0], [1.0, 1.0]]}  # equal outcomes, turn 1 differs

    async def flow():
        async with running_api() as (url, api), aiohttp.ClientSession() as s:
            bad = {**body, "scores": [[0.0, 0.5, 1.0], [1.0, 1.0]]}
            code, out = await call(s, "POST", url + "/scored_data", bad)
            assert code == 422 and out["field"] == "scores[0]"
            assert "3 turn scores" in out["error"] and "2 runs" in out["error"], out
            for _ in range(2):
                code, out = await call(s, "POST", url + "/scored_data", body)
                assert code == 200, out
            code, _ = await call(s, "POST", url + "/register",
                                 {"batch_size": 2, "max_token_len": 64})
            assert code == 200
            code, atropos = await call(s, "GET", url + "/batch")  # an Atropos trainer
            async with RolloutAPIClient(url) as client:
                leased = await client.lease()
            return atropos["batch"], leased

    atropos, leased = run(flow())
    [group] = atropos
    assert group["scores"] == [1.0, 1.0]
    assert group["turn_scores"] == [[0.0, 1.0], [1.0, 1.0]]
    assert group["turn_spans"] == [[[2, 4], [6, 8]]] * 2
    [trained] = leased.groups
    assert [t.scores for t in trained.trajectories] == [[0.0, 1.0], [1.0, 1.0]]
    mt_grpo = compute_group_advantages(trained.trajectories, "mt_grpo")
    outcome_only = compute_group_advantages(trained.trajectories, "grpo")
    assert all(abs(a).max() > 0.5 for a in mt_grpo.advantages)  # the first turn's signal
    assert all(abs(a).max() == 0 for a in outcome_only.advantages)
    # lachesis train --data reads the same shape from a JSONL line
    line = parse_group_line(json.dumps(body).encode())
    assert [t.turn_spans for t in line.trajectories] == [[[2, 4], [6, 8]]] * 2
    assert [t.outcome for t in line.trajectories] == [1.0, 1.0]


def test_body_size_limit_and_gzip_bombs():
    async def scenario():
        async with running_api(max_body_mb=0.05) as (url, api), aiohttp.ClientSession() as s:
            big = make_group(8, 1000).to_scored_data().model_dump_json().encode()
            code, out = await call(s, "POST", url + "/scored_data", data=big)
            assert code == 413 and "limit" in out["error"]
            # small on the wire, too big once decompressed
            code, out = await call(s, "POST", url + "/scored_data", data=gzip.compress(big),
                                   headers={"Content-Encoding": "gzip"})
            assert code == 413
            code, out = await call(s, "POST", url + "/scored_data", data=b"\x1f\x8b garbage",
                                   headers={"Content-Encoding": "gzip"})
            assert code == 400
            assert api.status()["queue_size"] == 0
            assert api.counters["rejected_too_large"] == 2
    run(scenario())


def test_bearer_token_guards_every_endpoint_but_the_health_check():
    """Every route of the app (read off its router, so a new route is covered too) answers
    401 without the token or with a wrong one, and changes nothing; /health answers."""
    from environments.api.schemas import APIConfig
    from environments.api.routes import build_app

    routes = sorted({(r.method, r.resource.canonical) for r in
                     build_app(APIConfig(in_memory=True)).router.routes()
                     if r.method != "HEAD"})
    assert len(routes) >= 20 and ("POST", "/scored_data") in routes

    async def scenario():
        async with running_api(token="s3cret") as (url, api), aiohttp.ClientSession() as s:
            before = {k: v for k, v in api.status().items() if k != "counters"}
            for method, path in routes:
                for headers in ({}, {"Authorization": "Bearer wrong"},
                                {"Authorization": "s3cret"}):
                    code, out = await call(s, method, url + path, data=orjson.dumps(
                        make_group().model_dump(mode="json")), headers=headers)
                    assert code == (200 if path == "/health" else 401), (method, path, out)
            assert {k: v for k, v in api.status().items() if k != "counters"} == before
            assert api.trainer is None and not api.envs
            assert api.counters["rejected_unauthorized"] == 3 * (len(routes) - 1)
            async with RolloutAPIClient(url, token="s3cret") as client:
                out = await client.push_group(make_group())
                assert out["status"] == "received"
            async with RolloutAPIClient(url, token="nope", retries=0) as client:
                with pytest.raises(APIRequestError) as error:
                    await client.push_group(make_group())
                assert error.value.status == 401
            assert api.status()["queue_size"] == 1
    run(scenario())


def test_retried_push_with_the_same_group_id_is_a_no_op():
    async def scenario():
        async with running_api() as (url, api), RolloutAPIClient(url) as client:
            group = make_group(group_id="item-1-try-0")
            first = await client.push_group(group)
            again = await client.push_group(group)
            assert (first["duplicate"], again["duplicate"]) == (False, True)
            out = await client.push_groups([group, make_group(group_id="other")])
            assert [g["duplicate"] for g in out["groups"]] == [True, False]
            st = api.status()
            assert st["queue_size"] == 2 and st["counters"]["duplicate_pushes"] == 2
    run(scenario())


def test_unacknowledged_lease_is_redelivered_after_the_timeout():
    async def scenario():
        # (3 s: the redelivered lease must still be live when it is handed back below,
        # which a loaded 2-core machine took longer than 0.5 s to get to)
        async with running_api(lease_timeout_s=3.0) as (url, api), RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=4, max_token_len=64)
            ids = [f"g{i}" for i in range(4)]
            for gid in ids:
                await client.push_group(make_group(group_id=gid))
            first = await client.lease()
            second = await client.lease()
            assert [g.group_id for g in first.groups] == ids[:2]
            await client.ack(second.lease_id)
            await client.ack(second.lease_id)  # a retried ack is fine
            assert await client.lease() is None
            # the first trainer died: its lease expires; a lease asked for while the
            # periodic sweep is returning it (out of the lease, its write not done) gets
            # its groups, in order
            await asyncio.sleep(api.leases[first.lease_id].expires_at - time.time() + 0.02)
            sweep = asyncio.create_task(api._expire_leases())
            await asyncio.sleep(0)
            again, bodies = await api.lease_batch(4, None)
            await sweep
            assert [orjson.loads(b)["group_id"] for b in bodies] == ids[:2]
            with pytest.raises(APIRequestError) as error:
                await client.ack(first.lease_id)  # too late: it was redelivered
            assert error.value.status == 409
            await client.nack(again.lease_id)  # handed back at once
            final = await client.lease()
            await client.ack(final.lease_id)
            c = api.counters
            assert c["leases_expired"] == 1 and c["redelivered_groups"] == 4
            assert c["acked_groups"] == 4 and api.status()["queue_size"] == 0
            assert api.step == 2
    run(scenario())


def test_stale_groups_are_dropped_and_counted():
    async def scenario():
        async with running_api(max_staleness=1) as (url, api), RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=2, max_token_len=64)
            await client.push_group(make_group(policy_version=0, group_id="v0"))
            await client.push_group(make_group(policy_version=1, group_id="v1"))
            await client.set_policy_version(2)
            out = await client.push_group(make_group(policy_version=0, group_id="v0-late"))
            assert out["dropped"] == "stale"
            batch = await client.lease()
            assert [g.group_id for g in batch.groups] == ["v1"]
            c = api.counters
            assert c["dropped_groups_stale"] == 2 and c["dropped_sequences_stale"] == 4
            with pytest.raises(APIRequestError) as error:
                await client.set_policy_version(1)
            assert error.value.status == 409
    run(scenario())


def test_nothing_mutates_on_get():
    async def scenario():
        async with running_api() as (url, api), aiohttp.ClientSession() as s:
            await call(s, "POST", url + "/scored_data",
                       data=make_group().to_scored_data().model_dump_json().encode())
            code, out = await call(s, "GET", url + "/reset_data")
            assert code == 405
            assert api.status()["queue_size"] == 1
            code, out = await call(s, "POST", url + "/reset_data")
            assert code == 200 and api.status()["queue_size"] == 0
    run(scenario())


def test_config_file_layering_and_bad_settings(tmp_path):
    from conftest import REPO

    from environments.api.schemas import APIConfig
    from lachesis.cli import main

    config = APIConfig.load(REPO / "configs" / "api.yaml", port=9001)
    assert config.port == 9001 and config.lease_timeout_s == 600  # flag > file > default
    bad = tmp_path / "bad.yaml"
    bad.write_text("api:\n  lease_timeout: 5\n")
    assert main(["api", "--config", str(bad)]) == 2  # unknown key: refused, named


def test_atropos_batch_has_every_scored_data_key_and_empty_lease_says_why():
    """atroposlib's run-api returns every ScoredData key (null where absent); its example
    trainer indexes them (``item["overrides"]``)."""
    from environments.api.wire import ATROPOS_OPTIONAL_KEYS

    async def scenario():
        async with running_api() as (url, api), aiohttp.ClientSession() as s:
            await call(s, "POST", url + "/register", TRAINER)
            status, out = await call(s, "GET", url + "/batch")
            assert out["batch"] is None and out["reason"] == "no groups queued"
            plain = {"tokens": [[1, 2, 3], [1, 2, 4]], "masks": [[-100, 2, 3], [-100, 2, 4]],
                     "scores": [1.0, 0.0], "env_id": 0}
            for _ in range(3):
                assert (await call(s, "POST", url + "/scored_data", plain))[0] == 200
            status, out = await call(s, "POST", url + "/lease", {"batch_size": 8})
            assert out["batch"] is None and out["lease_id"] is None
            assert out["reason"] == ("6 sequences queued (in 3 groups), fewer than "
                                     "batch_size 8: waiting for more")
            status, out = await call(s, "GET", url + "/batch")
            for item in out["batch"]:
                assert [item[k] for k in ATROPOS_OPTIONAL_KEYS if k != "env_id"] == \
                    [None] * (len(ATROPOS_OPTIONAL_KEYS) - 1)
                assert item["env_id"] == 0 and item["tokens"] == plain["tokens"]
            # and the Lachesis trainer still reads such a group
            (await call(s, "POST", url + "/scored_data", plain))
            async with RolloutAPIClient(url) as client:
                leased = await client.lease(batch_size=2)
            assert not leased.rejected and leased.groups[0].trajectories[0].tokens == [1, 2, 3]
    run(scenario())


def test_a_restart_with_a_shorter_lease_timeout_applies_it_to_resumed_leases(
        api_process, tmp_path):
    db = str(tmp_path / "q.sqlite")

    async def lease(url):
        async with RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=2, max_token_len=64)
            await client.push_group(make_group(group_id="g"))
            return await client.lease()

    async def lease_again(url):
        async with RolloutAPIClient(url) as client:
            return await client.lease()

    api = api_process("--db", db, "--lease-timeout-s", "3600")
    assert run(lease(api.url)) is not None
    api.stop()
    api = api_process("--db", db, "--lease-timeout-s", "0.5", port=api.port)
    assert run(lease_again(api.url)) is None  # still leased ...
    import time
    time.sleep(1.5)  # ... until this run's timeout, not the hour granted before
    again = run(lease_again(api.url))
    assert again is not None and again.groups[0].group_id == "g"


def test_the_wire_declares_the_same_fields_as_the_data_model():
    from environments.api.wire import _Group
    from environments.trajectory import ScoredData

    wire = set(_Group.__struct_fields__) - {"distill_token_ids", "distill_logprobs"}
    assert wire == set(ScoredData.model_fields)


def test_the_policy_model_name_travels_with_the_version_to_the_envs_requests():
    """With LoRA, each version is served under its own name: the trainer posts it with the
    version, ``/status`` carries it, and an env's next requests go to it."""
    from environments import BaseEnv, EnvConfig
    from environments.framework.runner import poll_status
    from environments.inference.vllm_client import VLLMServerPool

    async def scenario():
        async with running_api() as (url, api), RolloutAPIClient(url) as client:
            env = BaseEnv(EnvConfig())
            env._pool = VLLMServerPool(["http://127.0.0.1:1"], "policy")
            await client.set_policy_version(1)
            await poll_status(env, client)
            assert (env.policy_version, env._pool.model) == (1, "policy")
            await client.set_policy_version(2, "policy-lora-v000002")
            await poll_status(env, client)
            assert (env.policy_version, env._pool.model) == (2, "policy-lora-v000002")
            assert (await client.status())["policy_model"] == "policy-lora-v000002"
    run(scenario())



def test_a_group_delivered_while_a_status_poll_is_in_flight_still_counts(tmp_path):
    """Pacing (``max_queued_groups``): the API answers a status poll, then a group of the
    env is delivered before the answer is read. The env's count must include that group;
    taking the API's older answer as it is would let the env run a group further ahead
    than its limit."""
    from environments import BaseEnv, EnvConfig
    from environments.framework.delivery import APIDelivery
    from environments.framework.runner import _deliver, poll_status

    env = BaseEnv(EnvConfig(max_queued_groups=2, group_size=2))

    class DeliversDuringThePoll(RolloutAPIClient):
        async def env_status(self, env_id, **wait):
            answer = await super().env_status(env_id, **wait)  # the API's count, before ...
            await _deliver(env, APIDelivery(self, tmp_path / "spool.jsonl"),
                           make_group(env_id=env_id, seed=env.stats.groups_sent))  # ... this
            return answer

    async def scenario():
        async with running_api() as (url, _), DeliversDuringThePoll(url) as client, \
                RolloutAPIClient(url) as plain:
            env.env_id = (await plain.register_env("e", group_size=2,
                                                   max_token_length=64))["env_id"]
            for held in (1, 2):
                await poll_status(env, client)  # the answer misses the push made meanwhile
                assert (await plain.env_status(env.env_id))["self_queue_size"] == held
                assert env.queued_groups == held

    run(scenario())


def endless_env(config, make, delay_s: float = 0.0):
    """An env whose items never run out and whose groups are ``make(env)``, after
    ``delay_s``: pacing without rollouts."""
    from environments import BaseEnv

    class Endless(BaseEnv):
        async def get_next_item(self):
            return {"id": "x"}

        async def collect_group(self, item):
            await asyncio.sleep(delay_s)
            return make(self)

    return Endless(config)


def test_a_paced_env_starts_its_next_groups_when_the_trainer_leases_not_at_its_next_poll(
        tmp_path):
    """An env held by ``max_queued_groups`` learns of the trainer's lease from its long
    poll of ``/status-env`` the moment it happens: its next groups are pushed at once,
    although the env would otherwise poll only every 30 s here."""
    from environments import EnvConfig
    from environments.framework.delivery import APIDelivery
    from environments.framework.runner import follow_status, poll_status, run_groups

    env = endless_env(EnvConfig(max_queued_groups=2, group_size=2, concurrency=4),
                      lambda e: make_group(env_id=e.env_id, seed=e.stats.groups_sent))

    async def scenario():
        async with running_api() as (url, _), RolloutAPIClient(url) as client, \
                RolloutAPIClient(url) as trainer:
            env.env_id = (await client.register_env("e", group_size=2,
                                                    max_token_length=64))["env_id"]
            await trainer.register_trainer(batch_size=4, max_token_len=64)
            await poll_status(env, client)
            poller = asyncio.create_task(follow_status(env, client, interval_s=30.0))
            groups = asyncio.create_task(run_groups(env, APIDelivery(client, tmp_path / "s"),
                                                    None))
            while env.stats.groups_sent < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            held = env.stats.groups_sent  # the limit holds the env at 2 queued groups
            leased = await trainer.lease()
            started = time.monotonic()
            while env.stats.groups_sent < 4 and time.monotonic() - started < 10:
                await asyncio.sleep(0.01)
            refilled_after = time.monotonic() - started
            groups.cancel()
            poller.cancel()
            return held, len(leased.groups), env.stats.groups_sent, refilled_after

    held, leased, sent, refilled_after = run(scenario())
    assert (held, leased) == (2, 2)
    # at once: not at the 30 s poll, nor when the long poll would time out (2 s)
    assert sent == 4 and refilled_after < 1.0


def test_a_paced_env_is_not_held_by_a_count_above_the_apis_until_its_long_poll_ends(tmp_path):
    """Three ways the env's count of its queued groups could run above the API's and hold
    the env until its long poll times out (2 s), none of which may: a group pushed just
    before a status poll is answered (counted by the answer and again by the push), a
    group the API drops as stale, a group of fewer sequences than the group size (it
    counts less than one in the API's queue). The API numbers its snapshots of the env's
    queue (in push and poll answers) and the env keeps the newest; the long poll
    compares sequences."""
    from environments import BaseEnv, EnvConfig
    from environments.framework.delivery import APIDelivery
    from environments.framework.runner import follow_status, poll_status, run_groups

    counted_twice = BaseEnv(EnvConfig(max_queued_groups=2, group_size=2))
    stale = endless_env(  # groups sampled 2 versions ago: the API drops them
        EnvConfig(max_queued_groups=2, group_size=2, concurrency=4),
        lambda e: make_group(env_id=e.env_id, seed=e.stats.groups_sent, policy_version=3),
        delay_s=0.01)
    partial = endless_env(  # groups of 1 sequence where the group size is 2
        EnvConfig(max_queued_groups=2, group_size=2, concurrency=4),
        lambda e: make_group(n=1, env_id=e.env_id, seed=e.stats.groups_sent), delay_s=0.01)

    class PushesBeforeAnswering(RolloutAPIClient):
        pushes = 1

        async def env_status(self, env_id, **wait):
            if self.pushes:  # the push lands before the answer, counted after the poll began
                self.pushes -= 1
                await _deliver(counted_twice, APIDelivery(self, tmp_path / "spool"),
                               make_group(env_id=env_id, seed=99))
            return await super().env_status(env_id, **wait)

    from environments.framework.runner import _deliver

    async def scenario():
        async with running_api(max_staleness=0) as (url, _), \
                PushesBeforeAnswering(url) as client, RolloutAPIClient(url) as plain:
            counted_twice.env_id = (await plain.register_env(
                "a", group_size=2, max_token_length=64))["env_id"]
            counted_twice.queued_groups = 0
            long_polls = await poll_status(counted_twice, client)
            counted = counted_twice.queued_groups  # 1 queued: counted once

            await plain.set_policy_version(5)
            stale.env_id = (await plain.register_env("b", group_size=2,
                                                     max_token_length=64))["env_id"]
            await poll_status(stale, plain)
            poller = asyncio.create_task(follow_status(stale, plain))
            groups = asyncio.create_task(run_groups(stale, APIDelivery(plain, tmp_path / "s"),
                                                    None))
            await asyncio.sleep(1.0)
            groups.cancel()
            poller.cancel()
            counters = (await plain.status())["counters"]

        async with running_api() as (url, _), RolloutAPIClient(url) as plain:
            partial.env_id = (await plain.register_env("c", group_size=2,
                                                       max_token_length=64))["env_id"]
            await plain.register_trainer(batch_size=4, max_token_len=64)
            await poll_status(partial, plain)
            poller = asyncio.create_task(follow_status(partial, plain))
            groups = asyncio.create_task(run_groups(partial,
                                                    APIDelivery(plain, tmp_path / "p"), None))
            started = time.monotonic()
            for _ in range(3):  # each batch: 4 groups of 1, 2 "groups" of the queue
                while (batch := await plain.lease(wait_s=5)) is None:
                    pass
                await plain.ack(batch.lease_id)
            three_batches_s = time.monotonic() - started
            groups.cancel()
            poller.cancel()
            return (long_polls, counted, stale.stats.groups_sent,
                    stale.queued_groups, counters.get("dropped_groups_stale", 0),
                    three_batches_s)

    long_polls, counted, sent, queued, dropped, three_batches_s = run(scenario())
    assert (long_polls, counted) == (True, 1)
    assert queued == 0 and sent >= 6 and dropped >= sent  # never held at 2
    assert three_batches_s < 1.5  # no batch waits for a long poll to end (2 s)


def test_a_paced_env_takes_a_restarted_apis_count_of_its_queue(tmp_path):
    """The env keeps the newest of the API's numbered snapshots of its queue; an API that
    restarts (losing nothing it had committed) must still number its snapshots above the
    ones the env kept, or the env would go on with its old count."""
    from environments import BaseEnv, EnvConfig
    from environments.framework.runner import poll_status

    env = BaseEnv(EnvConfig(max_queued_groups=4, group_size=2))

    async def scenario(db):
        counts = []
        for pushes in (3, 1):  # the first API, then a restarted one on the same queue
            async with running_api(in_memory=False, db=db) as (url, _), \
                    RolloutAPIClient(url) as client:
                if env.env_id is None:
                    env.env_id = (await client.register_env(
                        "e", group_size=2, max_token_length=64))["env_id"]
                for _ in range(pushes):
                    await client.push_group(make_group(env_id=env.env_id,
                                                       seed=env.stats.groups_sent))
                    env.stats.groups_sent += 1
                if pushes == 1:  # the restarted API leased two of them away
                    await client.register_trainer(batch_size=4, max_token_len=64)
                    await client.lease()
                await poll_status(env, client)
                counts.append(env.queued_groups)
        return counts

    env.env_id = None
    assert run(scenario(str(tmp_path / "q.sqlite"))) == [3, 2]  # 3, then 4 less 2 leased


def test_status_env_long_polls_for_a_lease_or_a_new_version_and_answers_atropos_at_once():
    """``/status-env`` with ``wait_s`` answers when the env's queue is no longer
    ``self_queued_sequences`` or the policy version no longer ``policy_version``; without it,
    at once (an Atropos env's poll); a malformed wait is a 422 naming the field."""
    async def scenario():
        async with running_api() as (url, _), RolloutAPIClient(url) as client, \
                RolloutAPIClient(url) as trainer:
            env_id = (await client.register_env("e", group_size=2,
                                                max_token_length=64))["env_id"]
            await trainer.register_trainer(batch_size=4, max_token_len=64)
            for seed in range(2):
                await client.push_group(make_group(env_id=env_id, seed=seed))
            now = await client.env_status(env_id)
            assert now["self_queue_size"] == 2 and now["policy_version"] is None
            waiting = asyncio.ensure_future(client.env_status(
                env_id, wait_s=30, self_queued_sequences=4, policy_version=None))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # nothing changed: still waiting
            await trainer.push_group(make_group(env_id=7, seed=9))  # another env's: not it
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await trainer.lease()
            after_lease = await asyncio.wait_for(waiting, 5)
            version = asyncio.ensure_future(client.env_status(
                env_id, wait_s=30, self_queued_sequences=after_lease["self_queued_sequences"],
                policy_version=None))
            await asyncio.sleep(0.3)
            assert not version.done()
            await trainer.set_policy_version(1)
            after_version = await asyncio.wait_for(version, 5)
            errors = []
            for query in ("wait_s=-1", "wait_s=2", "wait_s=1&self_queued_sequences=x"):
                with pytest.raises(APIRequestError) as error:
                    await client.request("GET", f"/status-env?env_id={env_id}&{query}")
                errors.append((error.value.status, error.value.body.get("field")))
            return after_lease, after_version, errors

    after_lease, after_version, errors = run(scenario())
    assert after_lease["self_queue_size"] < 2  # the lease took its groups
    assert after_version["policy_version"] == 1
    assert errors == [(422, "wait_s"), (422, "wait_s"), (422, "self_queued_sequences")]


def test_a_waiting_lease_is_answered_by_the_push_that_completes_the_batch():
    """``/lease`` with ``wait_s``: the trainer's request waits in the API and gets the
    batch the moment its last group arrives; with nothing coming, an empty answer (and
    the reason) after ``wait_s``."""
    async def scenario():
        async with running_api() as (url, _), RolloutAPIClient(url) as env, \
                RolloutAPIClient(url) as trainer:
            await trainer.register_trainer(batch_size=4, max_token_len=64)
            await env.push_group(make_group(seed=0))
            started = time.monotonic()
            assert await trainer.lease(wait_s=0.3) is None  # half a batch: waits, then no
            waited = time.monotonic() - started
            reason = trainer.no_batch_reason
            lease = asyncio.ensure_future(trainer.lease(wait_s=30))
            await asyncio.sleep(0.3)
            assert not lease.done()
            await env.push_group(make_group(seed=1))
            leased = await asyncio.wait_for(lease, 5)
            return waited, reason, len(leased.groups)

    waited, reason, groups = run(scenario())
    assert waited >= 0.3 and "fewer than batch_size 4" in reason
    assert groups == 2


def test_a_batch_waits_up_to_mix_wait_s_for_the_env_its_weights_owe_and_a_restart_keeps_the_mix(
        tmp_path):
    """Weights 3 and 1, batches of 2 groups of 2. After a heavy + light batch the weights
    owe the heavy env the next group: with only light groups queued the batch waits (and
    says for whom), then after ``mix_wait_s`` the light env fills it, counted; the heavy env
    is not waited for again until it delivers. The envs' credit in the mix is in the
    queue's SQLite: a restarted API goes on with it."""
    db = tmp_path / "q.sqlite"

    async def scenario():
        async with running_api(in_memory=False, db=db, mix_wait_s=1.0) as (url, api), \
                RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=4, max_token_len=64)
            heavy, light = [(await client.register_env(
                name, group_size=2, max_token_length=64, weight=w))["env_id"]
                for name, w in (("heavy", 3.0), ("light", 1.0))]
            seed = iter(range(100))
            push = lambda env: client.push_group(make_group(env_id=env, seed=next(seed)))
            for env in (light, light, heavy):
                await push(env)
            first = await client.lease()
            assert sorted(g.env_id for g in first.groups) == [heavy, light]
            await push(light)
            assert await client.lease() is None  # light has a batch queued: held for heavy
            assert "owe the next group to heavy_0" in api.why_no_batch(4)
            await asyncio.sleep(1.1)
            second = await client.lease()  # waited mix_wait_s: the light env fills it
            assert [g.env_id for g in second.groups] == [light, light]
            assert api.status()["counters"]["mix_waits_timed_out"] == 1
            for env in (light, light):
                await push(env)
            assert await client.lease() is not None  # heavy is not waited for again ...
            for env in (light, light, heavy, heavy):
                await push(env)
            third = await client.lease()  # ... until it delivers: the credit it kept
            assert [g.env_id for g in third.groups] == [heavy, heavy]  # brings it in
            for env in (light, light, heavy):
                await push(env)
            fourth = await client.lease()  # heavy is owed half a group after it
            assert sorted(g.env_id for g in fourth.groups) == [heavy, light]
            return dict(api.mix_credit)

    credit = run(scenario())

    async def restarted():
        async with running_api(in_memory=False, db=db) as (url, api):
            return dict(api.mix_credit)

    assert run(restarted()) == credit == {0: 1.0, 1: -1.0}


def test_a_group_being_delivered_holds_its_place_under_max_queued_groups(tmp_path):
    """Pacing: while a collected group's push is on its way to the API, the queue count
    does not have it yet; if its slot were free meanwhile, another worker would collect
    and push one more group than ``max_queued_groups`` allows (3 queued against 2)."""
    from environments import EnvConfig
    from environments.framework.delivery import APIDelivery
    from environments.framework.runner import follow_status, poll_status, run_groups

    class SlowPush(RolloutAPIClient):
        async def push_group(self, group):
            await asyncio.sleep(0.3)
            return await super().push_group(group)

    # groups are ready at once; only their delivery takes time
    env = endless_env(EnvConfig(max_queued_groups=2, group_size=2, concurrency=8),
                      lambda e: make_group(env_id=e.env_id))

    async def scenario():
        async with running_api() as (url, _), SlowPush(url) as client:
            env.env_id = (await client.register_env("e", group_size=2,
                                                    max_token_length=64))["env_id"]
            await poll_status(env, client)
            poller = asyncio.create_task(follow_status(env, client, 0.05))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run_groups(env, APIDelivery(client, tmp_path / "s"),
                                                  None), timeout=2.0)
            poller.cancel()
            return (await client.env_status(env.env_id))["self_queue_size"]

    assert run(scenario()) == 2 and env.stats.groups_sent == 2
