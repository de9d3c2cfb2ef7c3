"""The trainer on the tiny model: alignment with vLLM, real steps, in-place weight sync,
offline JSONL training, resume, bad batches."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import requests
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from environments import BaseEnv, EnvConfig
from environments.jsonl_store import GroupWriter, read_groups
from trainer.batch import BatchError, check_groups
from trainer.config import TrainConfig
from trainer.train import train
from vllm_fixture import reload_original, restore_weights


class LetterEEnv(BaseEnv):
    """One turn, no tools; reward = share of 'e' in the answer (varies between samples)."""

    name = "letter_e"

    async def get_next_item(self):
        return {"id": "e", "question": "Write many e letters."}

    def prompt_messages(self, item):
        return [{"role": "user", "content": item["question"]}]

    def compute_reward(self, item, rollout):
        text = rollout.final_text
        return text.count("e") / max(1, len(text)) + 0.01 * len(text)


def collect_rollouts(server, out, **settings):
    """4 groups x 4 single-turn ``LetterEEnv`` trajectories sampled by ``server``, as JSONL."""
    config = EnvConfig(tokenizer=str(server.model_dir), inference_servers=[server.url],
                       group_size=4, max_turns=1, max_tokens_per_turn=24, max_token_length=256,
                       **settings)

    async def collect():
        env = LetterEEnv(config)
        await env.start()
        try:
            await env.process(out, 4)
        finally:
            await env.close()

    asyncio.run(collect())
    return out


@pytest.fixture(scope="module")
def rollouts(vllm_server, tmp_path_factory):
    """4 groups x 4 trajectories sampled by the real vLLM server, as JSONL."""
    return collect_rollouts(vllm_server, tmp_path_factory.mktemp("rollouts") / "groups.jsonl")


def vllm_logprobs(server, tokens: list[int]) -> torch.Tensor:
    response = requests.post(server.url + "/v1/completions", json={
        "model": server.model_name, "prompt": tokens, "max_tokens": 1, "echo": True,
        "logprobs": 0, "temperature": 0}, timeout=60).json()
    return torch.tensor(response["choices"][0]["logprobs"]["token_logprobs"][1:len(tokens)])


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def config(tmp_path, vllm_server, data, **settings) -> TrainConfig:
    settings = {"batch_size": 8, "micro_batch_size": 4, "steps": 2, "lr": 3e-3,
                "tensorboard": False, **settings}
    return TrainConfig(model=str(vllm_server.model_dir), data=data, run_dir=tmp_path / "run",
                       **settings)


def test_train_step_aligns_with_vllm_changes_weights_and_syncs_into_vllm(vllm_server, rollouts, tmp_path):
    probe = next(iter(read_groups(rollouts))).trajectories[0].tokens
    before = vllm_logprobs(vllm_server, probe)
    cfg = config(tmp_path, vllm_server, rollouts, vllm_urls=[vllm_server.url], sync_every=1)
    try:
        summary = asyncio.run(train(cfg))
        # step 0: the trainer's logprobs of vLLM's sampled tokens are vLLM's
        assert summary["alignment_mean_abs_diff"] < 1e-3
        assert summary["last_step"] == 2 and summary["last_trained_tokens"] > 0
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run/checkpoints/step_000002")
        initial = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir)
        changed = [n for (n, a), (_, b) in zip(trained.named_parameters(),
                                                initial.named_parameters()) if not torch.equal(a, b)]
        # the tied output embedding trained (it is the input one) and vLLM serves it
        assert trained.config.tie_word_embeddings and "model.embed_tokens.weight" in changed
        assert len(changed) > 10
        # after the sync, vLLM serves the trained weights
        after = vllm_logprobs(vllm_server, probe)
        assert (after - before).abs().mean() > 1e-3
        assert (after - hf_logprobs(trained, probe)).abs().mean() < 1e-3
        lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2]
        assert all("sync_seconds" in json.loads(line) for line in lines)
    finally:  # give the session's server its original weights back
        restore_weights(vllm_server)
    assert (vllm_logprobs(vllm_server, probe) - before).abs().max() < 1e-4


def test_resume_and_the_rehearsal_equal_uninterrupted_training(vllm_server, rollouts,
                                                               tmp_path, caplog):
    """Stopped after step 1 and resumed, rehearsing the longest micro-batch at each start
    (``rehearse_longest_micro_batch``), the weights after step 3 are bit for bit those of
    3 steps straight: neither the resume nor the rehearsal changes what is trained."""
    straight = config(tmp_path / "a", vllm_server, rollouts, steps=3, checkpoint_every=1)
    asyncio.run(train(straight))
    first = config(tmp_path / "b", vllm_server, rollouts, steps=1, checkpoint_every=1,
                   rehearse_longest_micro_batch=True)
    caplog.set_level("INFO", logger="trainer.rehearsal")
    asyncio.run(train(first))
    summary = asyncio.run(train(first.model_copy(update={"steps": 3})))
    assert summary["start_step"] == 1
    a = load_file(tmp_path / "a/run/checkpoints/step_000003/model.safetensors")
    b = load_file(tmp_path / "b/run/checkpoints/step_000003/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rehearsed = [r.getMessage() for r in caplog.records if r.name == "trainer.rehearsal"]
    assert len(rehearsed) == 2 and "(8 rows, 16384 tokens)" in rehearsed[0], rehearsed


def test_bad_batches_are_refused_with_the_place_named(rollouts, tmp_path):
    groups = list(read_groups(rollouts))
    group = groups[1]
    group.trajectories[2].tokens[5] = 10_000
    group.trajectories[2].masks[5] = -100
    with pytest.raises(BatchError, match=r"group 1 .* sequence 2: tokens\[5\] = 10000 is outside"):
        check_groups(groups, vocab_size=263)
    groups = list(read_groups(rollouts))
    groups[0].trajectories[1].flags.trainable = False
    with pytest.raises(BatchError, match="sequence 1: marked not trainable"):
        check_groups(groups)
    groups = list(read_groups(rollouts))
    t = groups[0].trajectories[0]
    with pytest.raises(ValidationError, match="first token must be masked"):
        t.masks = [t.tokens[0]] + t.masks[1:]  # the data contract refuses it
    # NaN never gets in: the JSONL reader refuses the line and names it
    bad = tmp_path / "bad.jsonl"
    lines = rollouts.read_text().splitlines()
    bad.write_text(lines[0].replace('"inference_logprobs":[1.0', '"inference_logprobs":[NaN', 1) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        list(read_groups(bad))


def test_masked_tokens_get_no_gradient(vllm_server, rollouts):
    from trainer.batch import pack
    from trainer.losses import policy_loss, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir)
    group = next(iter(read_groups(rollouts)))
    batch = pack(group.trajectories, [[1.0] * len(t.tokens) for t in group.trajectories])
    embeddings = model.get_input_embeddings()(batch.tokens).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings).logits
    logits.retain_grad()
    logprobs = token_logprobs(logits, batch.tokens)
    loss, _ = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.mask)
    loss.backward()
    # logits at t-1 predict token t: only positions before a trained token get a gradient
    predicts_trained = torch.zeros_like(batch.mask)
    predicts_trained[:, :-1] = batch.mask[:, 1:]
    grad = logits.grad.abs().sum(-1)
    assert (grad[~predicts_trained] == 0).all() and (grad[predicts_trained] > 0).all()


@pytest.fixture(scope="module")
def single_process_steps():
    """The one-process step each two-process variant is compared with, run once per kind:
    ``full`` (for the replicas, FSDP and FSDP with checkpointing) and ``lora``."""
    return {}


# FSDP with activation checkpointing covers FSDP's own path (a variant without it, 37 s
# beside the suite, ran here too; FSDP without checkpointing trains in test_weight_sync.py's
# FSDP test and test_two_ranks_end_early_together_when_no_batch_comes). Full replicas (53 s,
# 27 s CPU beside the suite, 7 Dec 2026) are in `make test-all`: the replicas' path is the
# LoRA variant's, full weights over two ranks FSDP's.
@pytest.mark.parametrize("sharding,lora", [
    pytest.param("replicate", False, marks=pytest.mark.slow),
    ("fsdp+checkpointing", False), ("replicate", True)])
def test_two_process_data_parallel_step_equals_single_process(vllm_server, rollouts, tmp_path,
                                                              single_process_steps, sharding,
                                                              lora):
    """torchrun, 2 CPU processes (gloo), full replicas or FSDP2 shards with activation
    checkpointing, or a LoRA adapter: the weights after a step equal one process's (the
    batch of 7 leaves rank 1 a row short; packed micro-batches of at most 100 tokens).
    The FSDP run also syncs its (tied) weights into the vLLM server, and its post-sync
    check runs on both ranks (the forward of a sharded model is a collective)."""
    import subprocess
    import sys

    from conftest import REPO

    groups = [json.loads(line) for line in rollouts.read_text().splitlines()[:2]]
    groups[1]["trajectories"] = groups[1]["trajectories"][:3]  # 7 rows: ranks get 4 and 3
    data = tmp_path / "seven.jsonl"
    data.write_text("".join(json.dumps(g) + "\n" for g in groups))
    common = ["--model", str(vllm_server.model_dir), "--data", str(data), "--batch-size", "7",
              "--max-tokens-per-micro-batch", "100", "--steps", "1", "--lr", "3e-3",
              "--tensorboard", "false",
              "--check-alignment", "false", "--log-level", "WARNING",
              # Adam's first step is ~lr * sign(g): where g ~ 0 it turns float summation-order
              # noise into lr-sized differences. A large eps keeps the step linear in g there.
              "--adam-eps", "1e-3", *(["--lora", "{rank: 8, alpha: 16}"] if lora else [])]
    key = "lora" if lora else "full"  # (the rest of `common` is the same for every variant)
    if key not in single_process_steps:
        single = subprocess.run([sys.executable, "-m", "lachesis.cli", "train", *common,
                                 "--run-dir", str(tmp_path / "single")],
                                cwd=REPO, capture_output=True, text=True, timeout=300)
        assert single.returncode == 0, single.stderr[-2000:]
        single_process_steps[key] = tmp_path / "single"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", "-m", "lachesis.cli", "train"]
    extra = ["--activation-checkpointing", "true"] if "checkpointing" in sharding else []
    syncs = sharding.startswith("fsdp")
    if syncs:
        extra += ["--vllm-urls", json.dumps([vllm_server.url])]
    try:
        double = subprocess.run([*torchrun, *common, "--sharding", sharding.split("+")[0],
                                 *extra, "--run-dir", str(tmp_path / "double")],
                                cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        if syncs:
            restore_weights(vllm_server)
    assert double.returncode == 0, double.stderr[-3000:]
    if syncs:
        metrics = json.loads((tmp_path / "double/metrics.jsonl").read_text().splitlines()[0])
        assert metrics["sync_check_mean_abs_diff"] < 1e-3
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    a = load_file(single_process_steps[key] / "checkpoints/step_000001" / weights)
    b = load_file(tmp_path / "double/checkpoints/step_000001" / weights)
    if lora:  # only the adapter trained; B starts at zero
        assert all("lora_" in k for k in a)
        step = max(float(a[k].abs().max()) for k in a if "lora_B" in k)
    else:
        initial = load_file(vllm_server.model_dir / "model.safetensors")
        step = max(float((a[k] - initial[k]).abs().max()) for k in a)
    assert step > 1e-4  # the step is 100x the tolerance: a mis-weighted rank would show
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_sft_on_oracle_messages_trains_only_assistant_tokens_and_lowers_the_loss(vllm_server, tmp_path):
    from transformers import AutoTokenizer

    from environments.envs.arithmetic_tool import ArithmeticToolEnv
    from environments.inference.chat_template import ChatRenderer
    from trainer.sft_data import read_sft_examples

    env = ArithmeticToolEnv()
    tools = [t.schema() for t in env.tools]
    data = tmp_path / "oracle.jsonl"
    with open(data, "w") as f:
        for _ in range(8):
            item = asyncio.run(env.get_next_item())
            f.write(json.dumps({"messages": env.oracle_messages(item), "tools": tools}) + "\n")
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(vllm_server.model_dir))
    example = read_sft_examples(data, renderer)[0]
    trained = [t for t, m in zip(example.tokens, example.masks) if m != -100]
    assistant = [m.content + "<|im_end|>" for m in example.messages if m.role == "assistant"]
    assert renderer.decode(trained) == "".join(assistant)
    assert len(example.turn_spans) == 2

    cfg = config(tmp_path, vllm_server, data, mode="sft", steps=6, checkpoint_every=100)
    asyncio.run(train(cfg))
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0] * 0.8


def test_train_from_the_rollout_api_acknowledges_leases_and_posts_the_policy_version(
        vllm_server, tmp_path):
    from conftest import running_api

    from environments.api.client import RolloutAPIClient

    env_config = EnvConfig(tokenizer=str(vllm_server.model_dir), group_size=4, max_turns=1,
                           inference_servers=[vllm_server.url],
                           max_tokens_per_turn=16, max_token_length=256, total_groups=4,
                           spool_path=tmp_path / "spool.jsonl")

    async def scenario():
        async with running_api() as (url, api):
            env = LetterEEnv(env_config.model_copy(update={"api_url": url}))
            await env.start()
            try:
                await env.serve()
            finally:
                await env.close()
            cfg = config(tmp_path, vllm_server, None, api_url=url, steps=2,
                         vllm_urls=[vllm_server.url])
            try:
                summary = await train(cfg)
            finally:
                await reload_original(vllm_server)
            async with RolloutAPIClient(url) as client:
                return summary, await client.status()

    summary, status = asyncio.run(scenario())
    assert summary["last_step"] == 2 and summary["alignment_mean_abs_diff"] < 1e-3
    assert status["policy_version"] == 2
    assert status["queue_size"] == 0 and status["active_leases"] == 0
    assert status["counters"]["acked_leases"] == 2 and status["counters"]["acked_groups"] == 4


# 50 s; a launched server killed and restarted on the newest weights is also
# test_weight_sync's killed-mid-transfer test (which kills it mid-stream)
@pytest.mark.slow
def test_launched_vllm_is_restarted_with_the_latest_weights_when_it_dies(vllm_server, rollouts, tmp_path):
    import os
    import signal
    import subprocess
    import threading
    import time

    from conftest import free_port

    port = free_port()
    metrics = tmp_path / "run/metrics.jsonl"
    killed = threading.Event()

    def kill_vllm_after_the_first_step():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed.is_set():
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                pids = subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True,
                                      text=True).stdout.split()
                for pid in pids:
                    os.killpg(os.getpgid(int(pid)), signal.SIGKILL)
                killed.set()
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_vllm_after_the_first_step, daemon=True)
    watcher.start()
    cfg = config(tmp_path, vllm_server, rollouts, steps=4, vllm_launch=True, vllm_port=port)
    summary = asyncio.run(train(cfg))
    killed.set()
    assert summary["last_step"] == 4 and summary["vllm_restarts"] == 1
    assert summary["alignment_mean_abs_diff"] < 1e-3
    # every step's weights reached a live server: before the kill, by the restart, after it
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert all("sync_seconds" in line for line in lines)
    assert sum("vllm_restarts" in line for line in lines) == 1


def test_check_command_passes_on_real_rollouts_and_catches_an_off_by_one(vllm_server, rollouts, tmp_path):
    from conftest import train_check

    def check(data):
        return train_check(vllm_server.model_dir, data, tmp_path / "run", batch_size=8)

    good = check(rollouts)
    assert good.returncode == 0, good.stderr[-2000:]
    assert json.loads(good.stdout)["alignment_mean_abs_diff"] < 1e-3
    # shift every recorded logprob by one position: what an off-by-one would look like
    shifted = tmp_path / "shifted.jsonl"
    with GroupWriter(shifted) as writer:
        for group in read_groups(rollouts):
            for t in group.trajectories:
                t.inference_logprobs = [1.0] + t.inference_logprobs[:-1]
            writer.append(group)
    bad = check(shifted)
    assert bad.returncode == 1 and "AlignmentError" in bad.stderr and "do not line up" in bad.stderr
    assert "constrained decoding" in bad.stderr  # the likely cause, when an env uses it


def test_lora_settings_are_checked_with_the_key_named(tiny_model_dir):
    from trainer.lora import LoraSettings, apply_lora

    with pytest.raises(ValidationError, match="weight_sync: lora needs a `lora` section"):
        TrainConfig(model="m", weight_sync="lora")
    with pytest.raises(ValidationError, match="weight_sync must be lora or auto, not disk"):
        TrainConfig(model="m", lora={"rank": 8}, weight_sync="disk")
    with pytest.raises(ValidationError, match="rank"):
        TrainConfig(model="m", lora={"rank": 0})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match=r"lora.target_modules \['qkv'\]"):
        apply_lora(model, LoraSettings(target_modules=["qkv"]))
    adapted = apply_lora(model, LoraSettings(rank=4, target_modules=["q_proj"]))
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_a_trainer_fed_only_groups_it_must_set_aside_exits_non_zero_with_the_reasons(
        tiny_model_dir, tmp_path):
    """A batch with nothing to train on is not a step (no ``reward nan`` line, no synced
    weights); ``max_untrainable_batches`` of them in a row stop the trainer with exit 1,
    how many groups there were and why."""
    from conftest import REPO, make_group

    data = tmp_path / "groups.jsonl"
    groups = [make_group(2, 8, seed=s) for s in range(2)]
    groups[0].trajectories[1].flags.trainable = False  # e.g. a hosted model's rollout
    groups[1].trajectories[0].tokens[5] = 10_000  # outside the tiny model's vocabulary
    groups[1].trajectories[0].masks[5] = -100
    data.write_text("".join(g.to_scored_data().model_dump_json() + "\n" for g in groups))
    result = subprocess.run(
        [sys.executable, "-m", "lachesis.cli", "train", "--model", str(tiny_model_dir),
         "--data", str(data), "--batch-size", "4", "--steps", "2", "--run-dir",
         str(tmp_path / "run"), "--tensorboard", "false", "--max-untrainable-batches", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lachesis train: NothingToTrain: 3 batches in a row had nothing "
                           "to train on (max_untrainable_batches), 6 groups: "), last
    assert "3 set aside: marked not trainable" in last
    assert "3 set aside: tokens[5] = 10000 is outside the model's vocabulary" in last
    assert "step " not in result.stdout and "nan" not in result.stdout
    assert not (tmp_path / "run/metrics.jsonl").read_text()  # no step was logged


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_sequences_without_behaviour_logprobs_train_against_the_weights_at_the_batch_start(
        tiny_model_dir, mini_batches):
    """A trajectory without ``inference_logprobs`` trains exactly as if the env had sent
    the trainer's own logprobs at the batch's start (classic PPO/GRPO pi_old), with no
    mismatch correction."""
    from conftest import make_group
    from trainer.batch import pack
    from trainer.config import TrainConfig
    from trainer.train import trainer_logprobs, train_steps

    config = TrainConfig(model=str(tiny_model_dir), batch_size=4, mini_batches=mini_batches,
                         lr=1e-2, tis_cap=2.0, max_tokens_per_micro_batch=24)
    group = make_group(4, 12, seed=3)
    advantages = [[float(i) - 1.5] * 12 for i in range(4)]
    for t in group.trajectories:
        t.inference_logprobs = None
    models, results = [], []
    for given in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        batch = pack(group.trajectories, advantages)
        assert batch.behaviour.tolist() == [False] * 4
        if given:  # the independent version: pi_old handed in as if vLLM had sent it
            batch.old_logprobs = trainer_logprobs(model.eval(), batch, config)
            batch.behaviour = None
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        results.append(train_steps(model, optimizer, batch, config))
        models.append(model)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert results[0]["mismatch_kl"] == 0.0 and results[0]["tis_weight_mean"] == 1.0
    assert results[0]["grad_norm"] > 0


def test_each_steps_mix_of_envs_is_in_its_metrics():
    from conftest import make_group
    from trainer.config import TrainConfig
    from trainer.sources import Batch
    from trainer.train import batch_tensors

    groups = [make_group(2, seed=s) for s in range(4)]
    for group, env in zip(groups, ["heavy", "heavy", "heavy", None]):
        group.env, group.env_id = env, 7
    _, stats = batch_tensors(Batch(groups), TrainConfig(model="m", batch_size=8), 263, 0)
    assert (stats["mix/heavy"], stats["mix/env_id_7"]) == (3, 1)


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_no_trainable_batch_for_max_batch_wait_s_ends_training_early_as_a_normal_end(
        tiny_model_dir, tmp_path, dynamic_sampling):
    """The rollout API stops delivering after 2 steps of 5 (as when every group the env
    servers sample scores equal and is dropped there): ``max_batch_wait_s`` later the
    trainer returns normally with step 2's weights checkpointed and the record written
    (a stale one replaced). Its clock starts once an env server has registered: waiting
    longer than the limit before that (a ``lachesis run`` trainer waits through the
    "before" evaluation) ends nothing. With dynamic sampling, a step that has some groups
    with signal trains on them when the wait runs out."""
    import time

    from conftest import make_group, running_api

    from environments.api.client import RolloutAPIClient
    from trainer.checkpoint import latest_checkpoint

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "stopped_early.json").write_text('{"step": 7}')  # an earlier attempt's
    groups = [make_group(2, 8, seed=s) for s in range(4)]
    for t in groups[3].trajectories:  # no signal: dynamic sampling leaves it out
        t.scores = 1.0
    cfg = TrainConfig(model=str(tiny_model_dir), batch_size=4, steps=5, lr=1e-3,
                      checkpoint_every=10, tensorboard=False, run_dir=run_dir,
                      max_batch_wait_s=1.0, dynamic_sampling=dynamic_sampling,
                      check_alignment=False)

    async def scenario():
        async with running_api() as (url, api), RolloutAPIClient(url) as env:
            training = asyncio.ensure_future(train(cfg.model_copy(update={"api_url": url})))
            while not (await env.status())["trainer_registered"]:
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.5)  # no env server yet: the clock has not started
            assert not training.done()
            env_id = (await env.register_env("e", group_size=2,
                                              max_token_length=64))["env_id"]
            pushed = time.monotonic()
            for group in groups:
                group.env_id = env_id
                await env.push_group(group)
            summary = await asyncio.wait_for(training, 300)
            return summary, time.monotonic() - pushed, await env.status()

    summary, seconds, status = asyncio.run(scenario())
    record = summary["stopped_early"]
    assert (record["step"], record["steps"], summary["last_step"]) == (2, 5, 2)
    assert 1.0 <= record["waited_s"] < 10 and seconds < 60
    assert json.loads((run_dir / "stopped_early.json").read_text()) == record
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [1, 2]
    if dynamic_sampling:  # step 2: group 3 left out, no more came: trained on group 2
        assert (metrics[1]["dynamic_sampling_groups_equal"], metrics[1]["rows"]) == (1, 2)
    assert latest_checkpoint(run_dir).name == "step_000002"  # the end's checkpoint
    assert status["counters"]["acked_leases"] == 2 and status["active_leases"] == 0


def test_two_ranks_end_early_together_when_no_batch_comes(tiny_model_dir, tmp_path,
                                                          api_process):
    """torchrun, 2 CPU processes, FSDP: rank 0 decides the wait is over and rank 1 follows
    (no rank is left in a collective): both gather the weights for the end's checkpoint
    and the trainer exits 0."""
    import subprocess
    import sys

    from conftest import REPO, make_group

    from environments.api.client import RolloutAPIClient

    api = api_process("--in-memory")

    async def push():
        async with RolloutAPIClient(api.url) as env:
            env_id = (await env.register_env("e", group_size=2,
                                              max_token_length=64))["env_id"]
            for s in range(2):
                group = make_group(2, 8, seed=s)
                group.env_id = env_id
                await env.push_group(group)

    asyncio.run(push())
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "lachesis.cli", "train", "--model", str(tiny_model_dir),
         "--api-url", api.url, "--batch-size", "4", "--steps", "3", "--sharding", "fsdp",
         "--checkpoint-every", "10", "--max-batch-wait-s", "2", "--check-alignment",
         "false", "--tensorboard", "false", "--run-dir", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training stopped early at step 1 of 3: no trainable batch for 2 s" \
        in result.stderr
    assert json.loads((run_dir / "stopped_early.json").read_text())["step"] == 1
    assert (run_dir / "checkpoints/step_000001/model.safetensors").exists()
