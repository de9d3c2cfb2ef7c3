"""A trainer that dies and resumes from an older checkpoint: the rollout API rolls back.

What survives: every accepted group is trained exactly once in the run that goes on (the
groups whose update died with the trainer are trained again, the ones its checkpoint
holds never), leases of the dead trainer come back at once, and the accounting adds up.
"""

from conftest import make_group, run, running_api

from environments.api.client import APIRequestError, RolloutAPIClient


def adds_up(accounting: dict) -> bool:
    from lachesis.run.report import accounting_problems

    return not accounting_problems(accounting)


def test_resume_requeues_lost_updates_releases_leases_and_rolls_the_version_back(tmp_path):
    db = tmp_path / "queue.sqlite"

    async def before_crash():
        async with running_api(in_memory=False, db=db) as (url, _), \
                RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=4, max_token_len=64)
            await client.set_policy_version(0)
            for i in range(10):
                await client.push_group(make_group(2, group_id=f"g{i}", policy_version=0,
                                                   seed=i))
            trained = {}
            for step in (1, 2, 3):  # steps 1..3; the checkpoint of step 1 survives
                batch = await client.lease()
                rejected = []
                if step == 3:  # one group of step 3 cannot be trained: set aside
                    from environments.api.client import RejectedGroup
                    rejected = [RejectedGroup.of(batch.groups[0], "token out of vocabulary")]
                await client.ack(batch.lease_id, rejected, step=step)
                trained[step] = [g.group_id for g in batch.groups]
                trained["lease"] = batch.lease_id
                await client.set_policy_version(step)
                if step == 1:
                    await client.checkpoint(oldest_step=0)  # nothing released yet
            held = await client.lease()  # step 4 in progress when the trainer dies
            # sampled by version 3, pushed after the crash: weights that will not exist
            await client.push_group(make_group(2, group_id="late", policy_version=3, seed=50))
            return trained, [g.group_id for g in held.groups]

    trained, held = run(before_crash())

    async def after_restart():  # the API restarted too (same file): everything durable
        async with running_api(in_memory=False, db=db) as (url, api), \
                RolloutAPIClient(url, retries=0) as client:
            # an ack whose answer a crash lost is retried: recognised, not a 409
            await client.ack(trained["lease"], step=3)
            with_old = await client.status()
            assert with_old["active_leases"] == 1 and with_old["policy_version"] == 3
            # the version check stays strict: only /resume goes back
            try:
                await client.set_policy_version(1)
                raise AssertionError("an older version was accepted")
            except APIRequestError as error:
                assert error.status == 409
            out = await client.resume(1)
            assert out == {"policy_version": 1, "released_leases": 1, "released_groups": 2,
                           "requeued_groups": 3, "kept_lost_policy_groups": 1,
                           "dropped_groups": 0}
            status = await client.status()
            assert status["policy_version"] == 1 and status["current_step"] == 1
            assert status["active_leases"] == 0
            # a second /resume to the same step changes nothing more (the supervisor and
            # the trainer both send it)
            again = await client.resume(1)
            assert again["requeued_groups"] == again["released_groups"] == 0
            # late pushes sampled by a lost version are kept, as off-policy data
            await client.push_group(make_group(2, group_id="later", policy_version=2, seed=51))
            drained = []
            for step in (2, 3, 4, 5):
                batch = await client.lease()
                drained += [g.group_id for g in batch.groups]
                await client.ack(batch.lease_id, step=step)
                await client.set_policy_version(step)
            rest = await client.lease(batch_size=2)
            drained += [g.group_id for g in rest.groups]
            await client.ack(rest.lease_id, step=6)
            return drained, await client.accounting(), await client.status()

    drained, accounting, status = run(after_restart())
    # trained exactly once in the run that goes on: step 1's groups never again, those of
    # steps 2 and 3 again (except the dead letter), the held ones once
    trained.pop("lease")
    assert set(trained[1]).isdisjoint(drained)
    assert len(drained) == len(set(drained))
    again = set(trained[2]) | set(trained[3][1:])
    assert again | set(held) <= set(drained)
    assert trained[3][0] not in drained  # a dead letter stays set aside
    assert {"late", "later"} <= set(drained)  # kept as off-policy data
    assert accounting["received"] == 12 and accounting["trained"] == 11
    assert accounting["trained_again_after_resume"] == 3
    assert accounting["set_aside"] == 1
    assert adds_up(accounting), accounting
    assert status["counters"]["kept_lost_policy_groups"] == 2


def test_lost_policy_groups_keep_a_staleness_that_counts_the_way_back_to_the_fork():
    async def scenario():
        async with running_api(max_staleness=2) as (url, api), RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=2, max_token_len=64)
            await client.set_policy_version(12)
            await client.resume(10)
            # sampled by the lost version 12: 2 steps past the fork at 10
            await client.push_group(make_group(2, group_id="lost12", policy_version=12))
            await client.push_group(make_group(2, group_id="lost11", policy_version=11))
            # at 10, both are within max_staleness 2 of the resumed policy
            assert [g.policy_version for g in api.queue.values()] == [8, 9]
            await client.set_policy_version(11)  # lost12 is now 3 steps away: stale
            batch = await client.lease()
            assert [g.group_id for g in batch.groups] == ["lost11"]
            accounting = await client.accounting()
            assert accounting["dropped_reasons"] == {"stale": 1}
            assert adds_up(accounting)

    run(scenario())


def test_a_damaged_checkpoint_is_skipped_for_the_one_before_and_only_k_are_kept(
        tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.checkpoint import complete_checkpoints, latest_checkpoint, save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (5, 10, 15, 20):
        save_checkpoint(tmp_path, step, model, optimizer.state_dict(), tokenizer, keep=3)
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        "step_000010", "step_000015", "step_000020"]
    # a crash while writing step 25 left a .tmp directory: never loaded
    (tmp_path / "checkpoints" / "step_000025.tmp").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_000020"
    # a truncated weights file (a disk that lost the tail of a write)
    weights = tmp_path / "checkpoints" / "step_000020" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    # and a trainer state that does not load
    state = tmp_path / "checkpoints" / "step_000015" / "trainer_state.pt"
    state.write_bytes(b"\0" * state.stat().st_size)
    assert latest_checkpoint(tmp_path).name == "step_000010"


def test_a_trainer_resumed_from_an_older_checkpoint_trains_the_lost_steps_groups_again(
        tiny_model_dir, tmp_path):
    import asyncio
    import json

    from trainer.config import TrainConfig
    from trainer.train import train

    db = tmp_path / "api" / "queue.sqlite"  # where `lachesis run` keeps it: runs/NAME/api

    async def scenario():
        async with running_api(in_memory=False, db=db) as (url, api), \
                RolloutAPIClient(url) as client:
            for i in range(8):
                await client.push_group(make_group(2, 12, group_id=f"g{i}", seed=i))
            cfg = TrainConfig(model=str(tiny_model_dir), api_url=url, run_dir=tmp_path / "run",
                              batch_size=4, micro_batch_size=4, steps=3, checkpoint_every=2,
                              check_alignment=False, tensorboard=False)
            await train(cfg)
            # the trainer dies while writing the checkpoint of step 3 (acknowledged already)
            checkpoints = tmp_path / "run" / "checkpoints"
            (checkpoints / "step_000003").rename(checkpoints / "step_000003.tmp")
            # and a crash between step 2's checkpoint and its metrics line lost the line
            lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines(True)
            (tmp_path / "run" / "metrics.jsonl").write_text(lines[0] + lines[2])
            summary = await train(cfg.model_copy(update={"steps": 4}))
            return summary, await client.accounting()

    summary, accounting = asyncio.run(scenario())
    assert summary["start_step"] == 2 and summary["resumed_from_step"] == 2
    assert summary["resume_requeued_groups"] == 2  # step 3's groups: their update was lost
    assert summary["last_step"] == 4
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # one line per step, the lost step 3 replaced
    assert accounting["trained"] == 8 and accounting["trained_again_after_resume"] == 2
    assert adds_up(accounting)
    assert not (tmp_path / "run" / "checkpoints" / "step_000003.tmp").exists()
    # the same accounting, from the run's directory
    import subprocess
    import sys

    from conftest import REPO
    shown = subprocess.run([sys.executable, "-m", "lachesis.cli", "inspect", "--run",
                            str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "trained                    8" in shown.stdout and "adds up: yes" in shown.stdout


def test_a_restarted_env_server_samples_its_in_flight_items_again_then_continues(tmp_path):
    import asyncio
    import random

    from environments.framework.item_cursor import ItemCursor

    class Items:  # an env's item order: seeded random draws
        def __init__(self):
            self.rng = random.Random(7)

        async def get_next_item(self):
            return self.rng.randint(0, 10**9)

    async def draw(cursor, env, n):
        return [await cursor.next(env) for _ in range(n)]

    straight = asyncio.run(draw(ItemCursor(), Items(), 8))
    path = tmp_path / "state" / "env.json"
    first = ItemCursor(path)
    drawn = asyncio.run(draw(first, Items(), 5))
    assert drawn == straight[:5]
    for index in (0, 1, 3):  # delivered; items 2 and 4 were in flight when it died
        first.settle(index)
    again = ItemCursor(path)
    assert again.resumed == 3
    assert asyncio.run(draw(again, Items(), 5)) == [straight[i] for i in (2, 4, 5, 6, 7)]


def test_groups_a_step_used_up_without_training_are_counted_as_dropped_with_the_reason():
    from environments.api.client import RejectedGroup

    async def scenario():
        async with running_api() as (url, api), RolloutAPIClient(url) as client:
            await client.register_trainer(batch_size=4, max_token_len=64)
            for i in range(2):
                await client.push_group(make_group(2, group_id=f"g{i}", seed=i))
            batch = await client.lease()
            await client.ack(batch.lease_id, step=1, dropped=[
                RejectedGroup.of(batch.groups[0], "no_signal")])
            return await client.accounting()

    accounting = run(scenario())
    assert accounting["trained"] == 1 and accounting["dropped_reasons"] == {"no_signal": 1}
    assert adds_up(accounting)


def test_a_restarted_replica_starts_from_weights_the_trainer_cannot_delete_under_it(tmp_path):
    from lachesis.run.config import RunConfig
    from lachesis.run.supervisor import Supervisor

    config = RunConfig.model_validate({"name": "pin", "runs_dir": str(tmp_path), "model": "m",
                                       "envs": [{"name": "arithmetic_tool"}]})
    weights = tmp_path / "pin" / "trainer" / "weights"
    for version in (3, 4):
        (weights / f"v{version:06d}").mkdir(parents=True)
        (weights / f"v{version:06d}" / "model.safetensors").write_bytes(b"w" * version)
    pinned = Supervisor(config).pinned_weights("vllm")
    shutil_rmtree = __import__("shutil").rmtree
    shutil_rmtree(weights / "v000004")  # the trainer moved on while the replica starts
    assert (pinned / "model.safetensors").read_bytes() == b"w" * 4
