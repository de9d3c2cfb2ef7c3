"""Atropos environments and trainers, unchanged, with Lachesis (atroposlib 0.4.0, real).

* An atroposlib ``BaseEnv`` subclass, written as Atropos envs are (``managed_server`` for
  tokens, masks and logprobs, ``ScoredDataGroup``), runs in ``serve`` mode against
  ``lachesis api``, generating through ``lachesis atropos-generate`` on the tiny model's
  vLLM, and ``lachesis train`` trains on its groups.
* Atropos's own example trainer (``example_trainer``, shipped in the atroposlib wheel:
  ``register_trainer``, ``get_data`` polling ``GET /batch``, ``run_training_step``) trains
  on groups that ``lachesis env serve`` pushed from a Lachesis env with per-turn scores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import requests

from conftest import REPO, free_port, run
from vllm_fixture import restore_weights

ATROPOS_ENV = '''
from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup


class LetterEEnv(BaseEnv):
    """Reward: share of 'e' in the answer, plus a little for length (varies per sample)."""

    name = "letter_e_atropos"

    @classmethod
    def config_init(cls):
        env = BaseEnvConfig(wandb_name=cls.name, group_size=4, use_wandb=False,
                            max_token_length=256, max_num_workers=2, steps_per_eval=0,
                            total_steps=1000)
        server = APIServerConfig(server_type="vllm", model_name="tiny", api_key="x",
                                 num_requests_for_eval=1)
        return env, [server]

    async def setup(self):
        pass

    async def evaluate(self, *args, **kwargs):
        pass

    async def get_next_item(self):
        return {"question": "Write many e letters."}

    async def collect_trajectories(self, item):
        messages = [{"role": "user", "content": item["question"]}]
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.chat_completion(messages=messages, n=self.config.group_size,
                                          max_tokens=24, temperature=1.0)
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for node in nodes:
            answer = self.tokenizer.decode([t for t in node.masked_tokens if t != -100])
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(answer.count("e") / max(1, len(answer)) + 0.01 * len(answer))
        return group, []


if __name__ == "__main__":
    LetterEEnv.cli()
'''

DEFAULTS_ATROPOS_ENV = '''
from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataItem


def tokenize(tokenizer, chat):
    """What atroposlib's ``tokenize_for_trainer`` does (the chat's tokens, all but the
    last message masked); it breaks on transformers 5, whose ``apply_chat_template``
    returns a dict unless told otherwise."""
    tokens = tokenizer.apply_chat_template(chat, return_dict=False)
    prefix = len(tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True,
                                               return_dict=False))
    return tokens, [-100] * prefix + tokens[prefix:]


class LetterEDefaultsEnv(BaseEnv):
    """Written as most Atropos envs are: ``chat_completion`` on an OpenAI-compatible
    server, the chat tokenized after the fact, one ``ScoredDataItem`` per rollout, and
    atroposlib's default ``collect_trajectories`` (which sends no ``inference_logprobs``)."""

    name = "letter_e_defaults"

    @classmethod
    def config_init(cls):
        env = BaseEnvConfig(wandb_name=cls.name, group_size=4, use_wandb=False,
                            max_token_length=256, max_num_workers=4, steps_per_eval=0,
                            total_steps=1000)
        server = APIServerConfig(server_type="openai", model_name="tiny", api_key="x",
                                 num_requests_for_eval=1)
        return env, [server]

    async def setup(self):
        pass

    async def evaluate(self, *args, **kwargs):
        pass

    async def get_next_item(self):
        return {"question": "Write many e letters."}

    async def collect_trajectory(self, item):
        messages = [{"role": "user", "content": item["question"]}]
        completion = await self.server.chat_completion(messages=messages, n=1, max_tokens=24,
                                                       temperature=1.0)
        answer = completion.choices[0].message.content or ""
        tokens, masks = tokenize(self.tokenizer,
                                 messages + [{"role": "assistant", "content": answer}])
        score = answer.count("e") / max(1, len(answer)) + 0.01 * len(answer)
        return ScoredDataItem(tokens=tokens, masks=masks, scores=score), []


if __name__ == "__main__":
    LetterEDefaultsEnv.cli()
'''

LACHESIS_ENV = '''
from environments import BaseEnv, TurnLevelRewardMixin


class LetterETurnsEnv(TurnLevelRewardMixin, BaseEnv):
    """One turn; its score (share of 'e', plus a little for length) is a per-turn list."""

    name = "letter_e_turns"

    async def get_next_item(self):
        return {"id": "e", "question": "Write many e letters."}

    def prompt_messages(self, item):
        return [{"role": "user", "content": item["question"]}]

    def compute_turn_rewards(self, item, rollout):
        return [t.text.count("e") / max(1, len(t.text)) + 0.01 * len(t.text)
                for t in rollout.turns]
'''


def start(command: list[str], log: Path, stdout=None) -> subprocess.Popen:
    """Start ``command``; its stderr (and stdout, unless given) go to ``log``."""
    proc = subprocess.Popen(command, cwd=REPO, stdout=stdout or log.open("w"),
                            stderr=log.open("w") if stdout else subprocess.STDOUT)
    proc.log = log
    return proc


def wait_for(predicate, what: str, timeout: float, procs: list[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: {p.args[:4]} exited with {p.returncode}:\n"
                                     + p.log.read_text()[-3000:])
        try:
            if predicate():
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)




def test_unchanged_atropos_env_serves_to_lachesis_api_and_lachesis_train_trains_on_it(
        vllm_server, api_process, tmp_path):
    api = api_process("--in-memory")
    env_file = tmp_path / "letter_e_atropos.py"
    env_file.write_text(ATROPOS_ENV)
    generate_port = free_port()
    bridge = start([sys.executable, "-m", "lachesis.cli", "atropos-generate",
                    "--vllm-url", vllm_server.url, "--port", str(generate_port)],
                   tmp_path / "generate.log")
    trainer = env = None
    try:
        wait_for(lambda: requests.get(f"http://127.0.0.1:{generate_port}/health",
                                      timeout=2).ok, "atropos-generate", 60, [bridge])
        # Atropos envs read the batch size from /info once, at start: the trainer first.
        trainer = start(
            [sys.executable, "-m", "lachesis.cli", "train", "--model", str(vllm_server.model_dir),
             "--api-url", api.url, "--batch-size", "8", "--micro-batch-size", "4",
             "--steps", "2", "--lr", "1e-3", "--tensorboard", "false",
             "--vllm-urls", vllm_server.url, "--run-dir", str(tmp_path / "run")],
            tmp_path / "train.log", stdout=(tmp_path / "train.out").open("w"))
        wait_for(lambda: requests.get(api.url + "/status", timeout=2).json()["trainer_registered"],
                 "lachesis train to register", 120, [trainer])
        env = start([sys.executable, str(env_file), "serve",
                     "--env.rollout_server_url", api.url,
                     "--env.tokenizer_name", str(vllm_server.model_dir),
                     "--openai.tokenizer_name", str(vllm_server.model_dir),
                     "--openai.base_url", f"http://127.0.0.1:{generate_port}/v1"],
                    tmp_path / "env.log")
        wait_for(lambda: trainer.poll() is not None, "lachesis train's 2 steps", 420, [env])
        assert trainer.returncode == 0, (tmp_path / "train.log").read_text()[-3000:]
        status = requests.get(api.url + "/status", timeout=5).json()
    finally:
        stop(*(p for p in (env, trainer, bridge) if p is not None))
        restore_weights(vllm_server)

    out = (tmp_path / "train.out").read_text()
    summary = json.loads(out[out.index("\n{") + 1:])  # after the per-step lines
    assert summary["last_step"] == 2
    # The Atropos env's tokens and logprobs are exactly what the trainer's model computes.
    assert summary["alignment_mean_abs_diff"] < 1e-3, summary
    assert status["counters"]["acked_groups"] == 4 and status["policy_version"] == 2
    assert status["counters"]["env_registrations"] >= 1  # through Atropos's /register-env


def test_atropos_example_trainer_trains_on_groups_from_lachesis_env_serve(
        vllm_server, api_process, tmp_path):
    import torch
    from example_trainer.api import register_trainer
    from example_trainer.config import TrainingConfig
    from example_trainer.data import get_data
    from example_trainer.trainers import create_optimizer
    from example_trainer.training import _logprob_alignment_stats, run_training_step
    from transformers import AutoModelForCausalLM

    api = api_process("--in-memory")
    env_file = tmp_path / "letter_e_turns.py"
    env_file.write_text(LACHESIS_ENV)
    config = TrainingConfig(model_name=str(vllm_server.model_dir), atropos_url=api.url,
                            batch_size=4, gradient_accumulation_steps=2, seq_len=512,
                            training_steps=1, lr=1e-3, device="cpu", use_wandb=False,
                            save_path=str(tmp_path / "atropos-ckpt"))
    register_trainer(config)
    served = subprocess.run(
        [sys.executable, "-m", "lachesis.cli", "env", "serve", f"{env_file}:LetterETurnsEnv",
         "--api-url", api.url, "--tokenizer", str(vllm_server.model_dir),
         "--inference-servers", vllm_server.url, "--group-size", "4", "--total-groups", "2",
         "--max-turns", "1", "--max-tokens-per-turn", "24", "--max-token-length", "256",
         "--spool-path", str(tmp_path / "spool.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert served.returncode == 0, served.stderr[-3000:]
    assert json.loads(served.stdout)["groups_sent"] == 2

    # What Atropos's trainer reads: its keys, one float score per sequence (the outcome),
    # and Lachesis's per-turn scores alongside, which it ignores.
    peek = requests.get(api.url + "/latest_example", timeout=5).json()
    assert peek["overrides"] is None and len(peek["scores"]) == 4
    assert [turns[-1] for turns in peek["turn_scores"]] == peek["scores"]

    batches, _ = get_data(config.batch_size, config.seq_len, api.url)  # as Atropos's trainers
    assert len(batches) == 1  # 2 groups x 4 = one batch of 8, in 2 micro-batches
    tokens, labels, advantages, temperatures, inference_logprobs = batches[0]
    assert [t.shape[0] for t in tokens] == [4, 4] and inference_logprobs is not None

    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = run_training_step(model.train(), create_optimizer(model, config), tokens,
                                labels, advantages, temperatures, config, 0,
                                inference_logprobs)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    # Lachesis's tokens, masks and vLLM logprobs line up with Atropos's trainer exactly.
    assert _logprob_alignment_stats["alignment/diff_abs_mean"] < 1e-3, _logprob_alignment_stats
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    status = requests.get(api.url + "/status", timeout=5).json()
    assert status["queue_size"] == 0 and status["counters"]["served_groups"] == 2


def idle_env():
    """An atroposlib env class with nothing to set up, evaluate or draw from."""
    from atroposlib.envs.base import BaseEnv

    class IdleEnv(BaseEnv):
        async def setup(self):
            pass

        async def evaluate(self, *args, **kwargs):
            pass

        async def get_next_item(self):
            return 0

    return IdleEnv


def test_groups_from_atroposlibs_default_collect_trajectories_are_accepted(tiny_model_dir,
                                                                           tmp_path):
    """atroposlib's default ``collect_trajectories`` gathers ``ScoredDataItem`` dicts into
    a group with ``[]`` for every optional list no item had; its ``handle_send_to_api``
    posts that (gzipped) and writes it to its JSONL. Lachesis stores those keys as null,
    the group trains, and Lachesis reads the JSONL."""
    from environments.jsonl_store import read_groups
    from atroposlib.envs.base import BaseEnvConfig, ScoredDataItem, ServerBaseline

    from conftest import running_api

    from environments.api.client import RolloutAPIClient

    class ItemsEnv(idle_env()):
        async def collect_trajectory(self, item):
            self.n = getattr(self, "n", 0) + 1
            tokens = [5, 6, 7 + self.n] * 200  # over 1 KB as JSON: atroposlib gzips it
            return ScoredDataItem(tokens=tokens, masks=[-100] + tokens[1:],
                                  scores=float(self.n)), []

    async def scenario():
        async with running_api() as (url, _api):
            config = BaseEnvConfig(tokenizer_name=str(tiny_model_dir), use_wandb=False,
                                   wandb_name="items", group_size=2, rollout_server_url=url,
                                   data_path_to_save_groups=str(tmp_path / "groups.jsonl"))
            env = ItemsEnv(config, ServerBaseline(), testing=True)  # no inference needed
            await env.register_env()
            env.max_token_len = 4096
            group, _ = await env.collect_trajectories(0)
            assert group["advantages"] == [] and group["messages"] == []
            # Per-turn scores ride in Lachesis's extension keys, sent as they are.
            group["turn_scores"] = [[0.5, s] for s in group["scores"]]
            group["turn_spans"] = [[[1, 300], [300, 600]]] * 2
            await env.handle_send_to_api(group)
            env.jsonl_writer.close()
            async with RolloutAPIClient(url) as client:
                await client.register_trainer(batch_size=2, max_token_len=4096)
                return await client.lease()

    batch = run(scenario())
    assert batch is not None and not batch.rejected
    [group] = batch.groups
    assert [t.scores for t in group.trajectories] == [[0.5, 1.0], [0.5, 2.0]]
    assert all(t.advantages is None and t.messages is None for t in group.trajectories)
    assert group.env_id == 0
    [written] = read_groups(tmp_path / "groups.jsonl")
    assert [t.tokens for t in written.trajectories] == [t.tokens for t in group.trajectories]


TOOL_ENV = '''
from atroposlib.envs.base import BaseEnv


class ToolEnv(BaseEnv):
    name = "tool_env"
'''

PARSE_TOOL_CALL = '''
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from lachesis.env_kinds import atropos_env_class
    assert atropos_env_class(sys.argv[1]) is not None
    from atroposlib.envs.server_handling.tool_call_translator import ToolCallTranslator
    from transformers import AutoTokenizer
    translator = ToolCallTranslator(AutoTokenizer.from_pretrained(sys.argv[2]), "hermes")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    content, calls, finish = translator.parse_model_output(
        'Adding. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        tools=tools)
    from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    tokenized = tokenize_for_trainer(translator.tokenizer, chat)
print(json.dumps({"finish": finish, "calls": [[c.function.name, json.loads(c.function.arguments)]
                                              for c in calls or []],
                  "warnings": [str(w.message) for w in caught],
                  "tokens": tokenized["tokens"], "masks": tokenized["masks"]}))
'''


def test_an_atropos_envs_hermes_tool_call_is_parsed_in_the_projects_venv(tiny_model_dir,
                                                                        tmp_path):
    """atroposlib 0.4.0 imports a vLLM module that vLLM 0.32 moved, and its
    ``tokenize_for_trainer`` expects transformers 4; loaded by ``lachesis env ...`` /
    ``lachesis run``, an atroposlib env gets its tool calls parsed by vLLM's hermes
    parser (no "vLLM is not installed" warning) and token ids from
    ``tokenize_for_trainer``."""
    env_file = tmp_path / "tool_env.py"
    env_file.write_text(TOOL_ENV)
    done = subprocess.run([sys.executable, "-c", PARSE_TOOL_CALL, f"{env_file}:ToolEnv",
                           str(tiny_model_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["finish"] == "tool_calls"
    assert result["calls"] == [["add", {"a": 2, "b": 3}]]
    assert not [w for w in result["warnings"] if "not installed" in w], result["warnings"]
    # and its tokenize_for_trainer gives token ids, as before transformers 5
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    tokens = tokenizer.apply_chat_template(chat, return_dict=False)
    prefix = len(tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True,
                                               return_dict=False))
    assert result["tokens"] == tokens and result["masks"] == [-100] * prefix + tokens[prefix:]


def test_an_atroposlib_env_without_logprobs_is_trained_by_lachesis_train(tiny_model_dir,
                                                                         tmp_path):
    """Without a vLLM server: an atroposlib env written with the library's defaults
    (``collect_trajectory`` returning a tokenized chat, the default
    ``collect_trajectories``, ``handle_send_to_api``; no
    ``inference_logprobs``) sends 4 groups to ``lachesis api``; ``lachesis train`` trains
    2 steps on them, none set aside, with its own logprobs at each batch's start as
    pi_old."""
    import asyncio
    import random

    from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataItem, ServerBaseline

    from conftest import running_api

    namespace: dict = {}
    exec(DEFAULTS_ATROPOS_ENV, namespace)  # its tokenize(), as the env file has it
    tokenize = namespace["tokenize"]

    words = ["tree", "eel", "sun", "bee", "cat", "seed", "dog", "green"]

    class WordsEnv(BaseEnv):
        async def setup(self):
            pass

        async def evaluate(self, *args, **kwargs):
            pass

        async def get_next_item(self):
            return {"question": "Write many e letters."}

        async def collect_trajectory(self, item):
            answer = " ".join(self.rng.choice(words) for _ in range(self.rng.randint(1, 6)))
            chat = [{"role": "user", "content": item["question"]},
                    {"role": "assistant", "content": answer}]
            tokens, masks = tokenize(self.tokenizer, chat)
            return ScoredDataItem(tokens=tokens, masks=masks,
                                  scores=answer.count("e") / len(answer)), []

    async def scenario():
        async with running_api() as (url, api):
            config = BaseEnvConfig(tokenizer_name=str(tiny_model_dir), use_wandb=False,
                                   wandb_name="words", group_size=4, rollout_server_url=url)
            env = WordsEnv(config, ServerBaseline(), testing=True)
            env.rng = random.Random(0)
            await env.register_env()
            env.max_token_len = 1024
            for _ in range(4):
                group, _ = await env.collect_trajectories(await env.get_next_item())
                assert "inference_logprobs" not in group or not group["inference_logprobs"]
                await env.handle_send_to_api(group)
            trainer = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "lachesis.cli", "train", "--model", str(tiny_model_dir),
                "--api-url", url, "--batch-size", "8", "--steps", "2", "--lr", "1e-3",
                "--tensorboard", "false", "--run-dir", str(tmp_path / "run"), cwd=REPO,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(trainer.communicate(), 300)
            return trainer.returncode, out.decode(), err.decode(), api.status()

    code, out, err, status = run(scenario())
    assert code == 0, err[-3000:]
    summary = json.loads(out[out.index("\n{") + 1:])
    assert summary["last_step"] == 2 and summary["alignment_skipped_sequences"] == 8
    assert "skipping 8 sequences without inference_logprobs" in err
    steps = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    assert [m["groups"] for m in steps] == [2, 2]
    assert all(m["groups_set_aside"] == 0 and m["sequences_without_behaviour_logprobs"] == 8
               and m["grad_norm"] > 0 and m["mismatch_kl"] == 0.0 for m in steps), steps
    assert status["dead_letters"] == 0 and status["counters"]["acked_groups"] == 4


def test_under_lachesis_run_an_atroposlib_env_paces_on_its_own_groups(tiny_model_dir):
    """atroposlib's env loop stops generating while ``/status-env``'s ``queue_size`` holds
    ``max_batches_offpolicy`` batches, counting every env's groups: beside another env
    with a batch queued it would never generate, and a batch that the weights owe it would
    wait for it in vain. The API of ``lachesis run`` (``status_env_own_queue``) answers
    with the env's own groups, so it paces as a lachesis env does: a batch of its own."""
    from atroposlib.envs.base import BaseEnvConfig, ServerBaseline

    from conftest import make_group, running_api

    from environments.api.client import RolloutAPIClient

    async def queue_sizes(own_queue: bool) -> list[int]:
        async with running_api(status_env_own_queue=own_queue) as (url, _api), \
                RolloutAPIClient(url) as client:
            config = BaseEnvConfig(tokenizer_name=str(tiny_model_dir), use_wandb=False,
                                   wandb_name="paced", group_size=2, rollout_server_url=url,
                                   max_batches_offpolicy=1)
            env = idle_env()(config, ServerBaseline(), testing=True)  # only its polls count
            await env.register_env()
            other = (await client.register_env("other", group_size=2,
                                               max_token_length=64))["env_id"]
            seen = []
            for env_id in (other, other, env.env_id):  # the other env: a batch of 4
                await client.push_group(make_group(env_id=env_id, seed=len(seen)))
                await env.get_status()
                seen.append(env.status_dict["queue_size"])
            return seen

    assert run(queue_sizes(False)) == [1, 2, 3]  # Atropos's own rule: the whole queue
    assert run(queue_sizes(True)) == [0, 0, 1]
