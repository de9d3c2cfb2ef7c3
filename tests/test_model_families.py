"""The architecture families people start agent RL with, as tiny random models built
locally: Qwen2, Qwen3 (q/k norms, a thinking template) and Llama (Llama-3 specials, a
begin-of-text token). Against a real vLLM CPU server, each trains a LoRA step and a
full-weight step: the trainer's step-0 alignment check passes on tokens vLLM sampled, and
its post-sync check passes after each step.

Tied embeddings are what the popular small sizes have (Qwen2.5 0.5B-3B, Qwen3 0.6B-4B,
Llama-3.2 1B/3B), so Qwen3 and Llama are tested tied; the untied head (the 7B/8B sizes)
is the same plain ``lm_head.weight`` in every family and is tested on Qwen2, over the gloo
transfer. The tied Qwen2 is the suite's own model (tests/vllm_fixture.py): test_trainer.py
and test_weight_sync.py train it through every sync path, FSDP included. (Five variants,
each family tied and untied, ran here before; three keep the suite's time.)
"""

from __future__ import annotations

import asyncio
import json

import pytest
from test_trainer import collect_rollouts

from environments.inference.vllm_process import VLLMProcess
from lachesis.tiny_model import make_tiny_model
from trainer.config import TrainConfig
from trainer.lora import LoraSettings
from trainer.lora import vllm_options as lora_options
from trainer.train import train
from trainer.vllm_transfer import vllm_options as transfer_options

pytestmark = pytest.mark.vllm

VARIANTS = {"qwen2-untied": ("qwen2", False), "qwen3-tied": ("qwen3", True),
            "llama-tied": ("llama", True)}
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def family_servers(tmp_path_factory):
    """One vLLM server per variant, all started at once (their start-ups overlap), each
    hot-loading LoRA adapters and taking in-memory transfers (shm for the tied ones,
    gloo for the others)."""
    root = tmp_path_factory.mktemp("families")
    lora_args, lora_env = lora_options(LoraSettings(rank=8))
    servers = {}
    try:
        for name, (family, tied) in VARIANTS.items():
            model_dir = make_tiny_model(root / name, family=family, tied=tied, seed=1)
            args, env = transfer_options("shm" if tied else "gloo")
            servers[name] = VLLMProcess(
                model_dir, served_model_name=name, max_model_len=2048, dev_mode=True,
                extra_args=[*lora_args, *args], env={**lora_env, **env},
                log_path=root / f"{name}.log").start()
        for server in servers.values():
            server.wait_ready(timeout=600)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize("name", VARIANTS)
def test_family_trains_with_lora_and_full_weights_aligned_and_synced(family_servers, name,
                                                                     tmp_path):
    server = family_servers[name]
    rollouts = collect_rollouts(server, tmp_path / "groups.jsonl", model=name)

    def step(run: str, **settings) -> tuple[dict, dict]:
        cfg = TrainConfig(model=str(server.model_dir), data=rollouts, run_dir=tmp_path / run,
                          batch_size=8, micro_batch_size=8, steps=1, lr=3e-3,
                          tensorboard=False, vllm_urls=[server.url], **settings)
        summary = asyncio.run(train(cfg))
        metrics = json.loads((cfg.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        return summary, metrics

    # LoRA first: it leaves the base weights as they are
    summary, metrics = step("lora", lora={"rank": 8, "alpha": 16})
    assert summary["alignment_mean_abs_diff"] < TOLERANCE
    assert metrics["sync_check_mean_abs_diff"] < TOLERANCE
    # then full weights, streamed in memory (no fallback to disk)
    summary, metrics = step("full", weight_sync="transfer",
                            transfer_backend="shm" if VARIANTS[name][1] else "gloo")
    assert summary["alignment_mean_abs_diff"] < TOLERANCE
    assert metrics["sync_check_mean_abs_diff"] < TOLERANCE
    assert not (tmp_path / "full" / "weights").exists()


# A turn that reasons, then calls the calculator (vLLM samples inside this): every episode
# runs to max_turns.
THINK_THEN_CALL = (r'<think>[a-z]{1,6}</think><tool_call>\n\{"name": "calculator", '
                   r'"arguments": \{"expression": "[1-9] [+*-] [1-9]"\}\}\n</tool_call>')


@pytest.mark.parametrize("reasoning_history", ["keep", "rerender"])
def test_thinking_template_keeps_token_in_token_out_exact(family_servers, reasoning_history):
    """Qwen3's template drops earlier turns' <think> blocks when it re-renders. Either way
    the agent loop handles it, the tokens of turn k are the ones vLLM sampled and the
    context before turn k is exactly what vLLM was given: ``keep`` appends to what the
    model saw (one context, reasoning included); ``rerender`` starts a new segment, the
    conversation as the template renders it (no earlier reasoning)."""
    from transformers import AutoTokenizer

    from environments.envs.arithmetic_tool import ArithmeticToolConfig, ArithmeticToolEnv
    from environments.framework.tools import tool_schemas
    from environments.inference.chat_template import ChatRenderer
    from trainer.batch import segment_samples

    server = family_servers["qwen3-tied"]
    env = ArithmeticToolEnv(ArithmeticToolConfig(
        tokenizer=str(server.model_dir), inference_servers=[server.url], group_size=4,
        max_turns=3, max_token_length=1536, max_tokens_per_turn=160,
        keep_equal_score_groups=True, reasoning_history=reasoning_history,
        sampling_extra={"structured_outputs": {"regex": THINK_THEN_CALL}}))
    sent: list[tuple[list[int], list[int]]] = []  # (prompt ids, sampled ids) per request

    async def collect():
        await env.start()
        complete = env.backend.pool.complete

        async def recording(prompt_ids, **kwargs):
            completion = await complete(prompt_ids, **kwargs)
            sent.append((list(prompt_ids), list(completion.token_ids)))
            return completion

        env.backend.pool.complete = recording
        try:
            return [await env.collect_group(await env.get_next_item()) for _ in range(2)]
        finally:
            await env.close()

    groups = asyncio.run(collect())
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(server.model_dir))
    tools = tool_schemas(env.tools)
    multi_turn = 0
    for t in (t for g in groups for t in g.trajectories):
        starts = [0, *(t.segment_starts or [])]
        for start, end in t.turn_spans:
            context = t.tokens[max(s for s in starts if s <= start):start]
            assert (context, t.tokens[start:end]) in sent  # exactly what vLLM saw and sampled
        assert len(t.turn_spans) == 3  # max_turns
        multi_turn += 1
        assert not t.metadata["prefix_preserving"]  # the template dropped a <think> block
        messages = [m.model_dump(exclude_none=True) for m in t.messages]
        if reasoning_history == "keep":
            assert not t.segment_starts
            assert renderer.decode(t.tokens).count("<think>") == len(t.turn_spans)
        else:  # each later turn's context is the conversation as the template renders it
            assert len(t.segment_starts) == len(t.turn_spans) - 1
            last = t.tokens[t.segment_starts[-1]:t.turn_spans[-1][0]]
            assert renderer.decode(last) == renderer.render(messages[:-1], tools,
                                                            add_generation_prompt=True)
            assert renderer.decode(last).count("<think>") == 0
            # the trainer trains each segment as its own row, on exactly the sampled tokens
            rows, _ = segment_samples(t, [1.0] * len(t.tokens))
            trained = [tok for row in rows for tok, m in zip(row.tokens, row.masks) if m != -100]
            assert trained == [tok for s, e in t.turn_spans for tok in t.tokens[s:e]]
    assert multi_turn > 0
