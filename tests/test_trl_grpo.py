"""The TRL benchmark's adapter (benchmarks/trl_grpo.py): the ``arithmetic_tool`` env's own
rollout code, sampling in-process, handed to TRL's ``GRPOTrainer`` as its
``rollout_func`` output: every rollout's turn in one batched ``generate``, each sampled
token with the logprob the model gives it, and TRL training on the env's rewards."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from conftest import load_script
from test_trainer import hf_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="trl is not installed (the `bench` extra)")


def test_trl_trains_on_the_envs_rollouts_sampled_in_process(tiny_model_dir, tmp_path):
    bench = load_script("benchmarks/trl_grpo.py")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    env = bench.make_env(model, tokenizer, {
        "tokenizer": str(tiny_model_dir), "group_size": 2, "max_turns": 2,
        "max_tokens_per_turn": 12, "max_token_length": 4096, "temperature": 1.0},
        concurrency=4)
    loop = asyncio.new_event_loop()
    try:
        items = [loop.run_until_complete(env.get_next_item()) for _ in range(2)]
        by_question = {item["question"]: item for item in items}
        assert len({len(q) for q in by_question}) == 2  # prompts of two lengths: padded
        prompts = [env.prompt_messages(item) for item in items for _ in range(2)]

        out = bench.env_rollouts(env, by_question, loop, prompts)
        assert env.backend.batches[0] == 4  # the four first turns in one generate call
        assert set(out) == {"prompt_ids", "completion_ids", "env_mask", "logprobs",
                            "turn_rewards"}
        model.eval()
        for k in range(4):
            prompt, completion = out["prompt_ids"][k], out["completion_ids"][k]
            mask = out["env_mask"][k]
            assert len(completion) == len(mask) == len(out["logprobs"][k]) > 0
            assert set(mask) <= {0, 1}  # TRL's env_mask: 1 where the policy sampled
            assert prompt == env.renderer.encode(env.renderer.render(
                prompts[k], env.tools and [t.schema() for t in env.tools],
                add_generation_prompt=True))
            # every sampled token carries the logprob the model gives it in context
            recomputed = hf_logprobs(model, prompt + completion)[len(prompt) - 1:]
            sampled = torch.tensor(mask, dtype=torch.bool)
            assert sampled.any()
            assert torch.allclose(torch.tensor(out["logprobs"][k])[sampled],
                                  recomputed[sampled], atol=1e-4)
            assert len(out["turn_rewards"][k]) >= 1
        with pytest.raises(ValueError, match="in a row"):
            bench.env_rollouts(env, by_question, loop, [prompts[0], prompts[2]] * 2)

        # TRL's reward functions: the calculator turns' mean, and the outcome
        rewards = [[1.0, 0.8], [0.1]]
        assert bench.tool_call_reward(None, rewards) == [1.0, 0.0]
        assert bench.outcome_reward(None, rewards) == [0.8, 0.1]

        # one GRPOTrainer step on the env's rollouts: TRL takes the adapter's output
        trainer, signal = bench.grpo_trainer(
            env, items, loop, model, tokenizer, steps=1, batch=4, lr=1e-3,
            warmup_steps=0, output_dir=tmp_path / "trl", seed=0)
        trainer.train()
        assert trainer.state.global_step == 1 and len(signal) == 1
        logged = next(log for log in trainer.state.log_history if "reward" in log)
        assert 0.0 <= logged["reward"] <= 2.0
    finally:
        loop.close()
