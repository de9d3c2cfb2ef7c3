"""A poison group never stops training: the trainer sets it aside, the API keeps it as a
dead letter (never redelivered), and training goes on with the good groups."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
from conftest import make_group, running_api
from vllm_fixture import tiny_model_dir  # noqa: F401

from environments.api.client import RolloutAPIClient
from trainer.config import TrainConfig
from trainer.train import train


def test_trainer_sets_a_poison_group_aside_and_trains_on_the_rest(tiny_model_dir, tmp_path):
    async def scenario():
        # A lease outlives a training step, also on a loaded machine (CI: a step took over
        # 2 s and the ack found its lease expired); the end waits past it.
        async with running_api(lease_timeout_s=10.0) as (url, api):
            async with RolloutAPIClient(url) as client:
                groups = [make_group(2, seed=s) for s in range(4)]
                for g in groups:
                    g.env, g.item_id = "arith", f"item-{g.group_id[:4]}"
                poison = groups[1]
                # Valid for the data contract (the API takes it), but token 5000 is
                # outside the tiny model's vocabulary: only the trainer can tell.
                t = poison.trajectories[1]
                poison.trajectories[1] = t.model_copy(update={
                    "tokens": t.tokens[:3] + [5000] + t.tokens[4:],
                    "masks": t.masks[:3] + [5000] + t.masks[4:]})
                for g in groups:
                    assert (await client.push_group(g))["duplicate"] is False

            config = TrainConfig(model=str(tiny_model_dir), api_url=url, batch_size=4,
                                 micro_batch_size=4, steps=2, lr=1e-3, check_alignment=False,
                                 run_dir=tmp_path / "run", tensorboard=False,
                                 max_token_length=64, lease_poll_s=0.05)
            summary = await train(config)
            assert summary["last_step"] == 2

            status = api.status()
            assert status["dead_letters"] == 1 and status["queue_size"] == 0
            assert status["active_leases"] == 0  # acknowledged, not left to expire
            assert status["counters"]["acked_groups"] == 3
            await asyncio.sleep(10.5)  # past the lease timeout: nothing is redelivered
            assert api.status()["queue_size"] == 0

            async with aiohttp.ClientSession() as s, s.get(url + "/dead_letters") as r:
                letters = await r.json()
            assert letters["total"] == 1
            (letter,) = letters["dead_letters"]
            assert letter["group_id"] == poison.group_id
            assert "tokens[3] = 5000 is outside the model's vocabulary" in letter["reason"]
            assert "env arith" in letter["reason"] and "sequence 1" in letter["reason"]
            assert letter["group"]["tokens"][1][3] == 5000  # kept, to be inspected

            steps = [json.loads(line) for line in
                     (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
            assert [s["groups"] for s in steps] == [1, 2]
            assert [s["groups_set_aside"] for s in steps] == [1, 0]
            assert all(s["trained_tokens"] > 0 for s in steps)

    asyncio.run(scenario())


def test_inspect_shows_dead_letters_and_saves_them_for_the_report(tmp_path, capsys):
    from environments.jsonl_store import read_groups
    from lachesis.cli import main

    async def scenario():
        async with running_api() as (url, api), RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=4, max_token_len=64)
            good, bad = make_group(2, seed=1), make_group(2, seed=2)
            bad.env, bad.item_id = "arith", "item-7"
            await client.push_group(good)
            await client.push_group(bad)
            leased = await client.lease()
            from environments.api.client import RejectedGroup
            await client.ack(leased.lease_id, [RejectedGroup.of(bad, "tokens[3] = 5000 is "
                                                                "outside the vocabulary")])
            out = tmp_path / "dead.jsonl"
            code = await asyncio.to_thread(main, ["inspect", "--dead-letters", url,
                                                  "--save", str(out)])
            return code, out, bad

    code, out, bad = asyncio.run(scenario())
    printed = capsys.readouterr().out
    assert code == 0
    assert "1 groups set aside" in printed and "item-7" in printed and "arith" in printed
    assert "outside the vocabulary" in printed
    (saved,) = list(read_groups(out))
    assert saved.group_id == bad.group_id and saved.trajectories[0].tokens == bad.trajectories[0].tokens


def test_a_trainer_starved_of_batches_says_why_then_trains_when_groups_come(caplog):
    """A run whose envs deliver nothing does not wait in silence: after
    ``batch_wait_warning_s`` the trainer logs the API's reason (here: too few sequences
    queued for the batch), and the batch is leased as soon as enough arrive."""
    import logging

    from trainer.sources import APIBatches

    async def scenario():
        async with running_api() as (url, api), RolloutAPIClient(url) as env:
            config = TrainConfig(model="unused", api_url=url, batch_size=4,
                                 lease_poll_s=0.05, batch_wait_warning_s=0.3)
            source = APIBatches(config)
            await source.register()
            await env.push_group(make_group(2, seed=1))
            waiting = asyncio.ensure_future(source.next())
            await asyncio.sleep(0.8)
            assert not waiting.done()
            await env.push_group(make_group(2, seed=2))
            batch = await asyncio.wait_for(waiting, 10)
            await source.close()
            return batch

    with caplog.at_level(logging.WARNING, logger="lachesis.train"):
        batch = asyncio.run(scenario())
    assert len(batch.groups) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "lachesis.train"]
    assert 1 <= len(warnings) <= 3, warnings  # at 0.3 s, 0.6 s (and maybe 0.9 s), not per poll
    assert re.match(r"no batch of 4 sequences for 0\.[3-9] s", warnings[0]), warnings[0]
    assert "2 sequences queued (in 1 groups), fewer than batch_size 4" in warnings[0]
