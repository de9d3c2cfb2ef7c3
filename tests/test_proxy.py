"""The interception proxy on the real vLLM server, driven by the real `openai` client:
exact tokens, history edits as new segments, refusals."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from environments.blackbox.proxy import InterceptionProxy, normalize_message
from environments.inference.backends import VLLMBackend
from environments.inference.chat_template import ChatRenderer
from environments.inference.tool_parsers import get_parser
from environments.inference.vllm_client import VLLMServerPool
from environments.trajectory import (
    MASKED,
    ScoredGroup,
    ScoredTrajectory,
    TrajectoryFlags,
)

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
START = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is 12 * 7?"}]


@contextlib.asynccontextmanager
async def running_proxy(vllm_server, **limits):
    """A proxy on the session's vLLM server; ``sampled`` collects vLLM's completions."""
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(vllm_server.model_dir))
    pool = VLLMServerPool([vllm_server.url], vllm_server.model_name)
    await pool.start()
    sampled = []
    complete = pool.complete

    async def spy(prompt_ids, **kwargs):
        completion = await complete(prompt_ids, **kwargs)
        sampled.append((list(prompt_ids), completion))
        return completion

    pool.complete = spy
    backend = VLLMBackend(pool, renderer, {"temperature": 1.0})
    settings = {"max_turns": 4, "max_token_length": 1024, "max_tokens_per_turn": 24, **limits}
    proxy = InterceptionProxy(backend, get_parser("hermes"), model_name=vllm_server.model_name,
                              policy_version=lambda: 7, **settings)
    await proxy.start()
    try:
        yield proxy, renderer, sampled
    finally:
        await proxy.close()
        await pool.close()


def client_for(proxy, rollout, **kwargs):
    return openai.AsyncOpenAI(base_url=proxy.base_url(rollout), api_key=rollout.token,
                              max_retries=0, **kwargs)


def echo(message) -> dict:
    """The assistant message as an agent sends it back."""
    return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


def test_recorded_tokens_are_exactly_what_vllm_sampled_over_turns_and_streaming(vllm_server):
    async def main():
        async with running_proxy(vllm_server) as (proxy, renderer, sampled):
            rollout = proxy.open_rollout()
            client = client_for(proxy, rollout)
            first = (await client.chat.completions.create(
                model="tiny", messages=START, tools=TOOLS)).choices[0].message
            history = START + [echo(first)]
            follow_up = [{"role": "user", "content": "Check it again."}]
            content = ""
            async for chunk in await client.chat.completions.create(
                    model="tiny", messages=history + follow_up, tools=TOOLS, stream=True):
                if chunk.choices:
                    content += chunk.choices[0].delta.content or ""
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return renderer, sampled, first, history, follow_up, content, state

    renderer, sampled, first, history, follow_up, streamed, state = asyncio.run(main())
    assert len(sampled) == len(state.turns) == 2
    (prompt1, c1), (prompt2, c2) = sampled
    # the token sequence is the framework's own: prompt, turn, continuation, turn
    assert prompt1 == renderer.prompt_ids(START, TOOLS)
    # any stop id (the random tiny model samples <|endoftext|> as well as <|im_end|>)
    # ends the turn's text; only the template's end-of-turn token also ends it as the
    # template would, otherwise <|im_end|> follows the sampled stop id as context
    stopped = bool(c1.token_ids) and c1.token_ids[-1] in renderer.stop_token_ids
    ended_with_eos = stopped and c1.token_ids[-1] == renderer.tokenizer.eos_token_id
    continuation = renderer.continuation(
        START + [{"role": "assistant", "content": renderer.decode(
            c1.token_ids[:-1] if stopped else c1.token_ids)}],
        follow_up, TOOLS, ended_with_eos=ended_with_eos)
    assert prompt2 == prompt1 + c1.token_ids + continuation.token_ids
    assert state.tokens == prompt2 + c2.token_ids
    for turn, completion in zip(state.turns, (c1, c2)):
        start, end = turn.span
        assert state.tokens[start:end] == completion.token_ids
        assert state.masks[start:end] == completion.token_ids
        assert state.logprobs[start:end] == completion.logprobs  # exactly, not approximately
        assert turn.policy_version == 7
    trained = {i for t in state.turns for i in range(*t.span)}
    assert all(m == MASKED for i, m in enumerate(state.masks) if i not in trained)
    # what the agent was told is the decoded sampled text (tool calls, if any, parsed out)
    parsed = get_parser("hermes").parse(state.turns[1].text)
    assert streamed == (parsed.content if parsed.calls else state.turns[1].text)
    if not first.tool_calls:
        assert (first.content or "") == state.turns[0].text
    assert state.segment_starts == []


def test_an_edited_history_starts_a_new_segment_instead_of_retokenizing(vllm_server):
    async def main():
        async with running_proxy(vllm_server) as (proxy, renderer, sampled):
            rollout = proxy.open_rollout()
            client = client_for(proxy, rollout)
            first = (await client.chat.completions.create(
                model="tiny", messages=START)).choices[0].message
            # the agent summarises: it drops the system prompt and rewrites the question
            edited = [{"role": "user", "content": "Earlier: asked 12 * 7."}, echo(first),
                      {"role": "user", "content": "Answer now."}]
            await client.chat.completions.create(model="tiny", messages=edited)
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return renderer, sampled, edited, state, rollout

    renderer, sampled, edited, state, rollout = asyncio.run(main())
    [start] = state.segment_starts
    assert start == state.turns[0].span[1]  # right after the first turn
    assert "messages[0]" in state.extra["segments"][1]["reason"]
    # the new segment is the edited conversation rendered afresh, then the sampled turn
    second_prompt = renderer.prompt_ids([normalize_message(m, i).rendered
                                         for i, m in enumerate(edited)])
    assert sampled[1][0] == second_prompt == state.tokens[start:state.turns[1].span[0]]
    assert all(m == MASKED for m in state.masks[start:state.turns[1].span[0]])
    assert state.tokens[state.turns[1].span[0]:] == sampled[1][1].token_ids


def test_requests_are_refused_for_a_wrong_token_unknown_or_finished_rollouts_and_limits(vllm_server):
    async def main():
        async with running_proxy(vllm_server, max_turns=1) as (proxy, renderer, sampled):
            rollout = proxy.open_rollout()
            url = proxy.base_url(rollout) + "/chat/completions"
            body = {"model": "tiny", "messages": START}
            results = {}
            async with aiohttp.ClientSession() as http:
                async def post(target, token, payload):
                    async with http.post(target, json=payload,
                                         headers={"Authorization": f"Bearer {token}"}) as r:
                        return r.status, await r.json()

                results["wrong token"] = await post(url, rollout.token[:-1] + "x", body)
                results["no token"] = await post(url, "", body)
                results["unknown"] = await post(url.replace(rollout.id, "0" * 32),
                                                rollout.token, body)
                results["n=2"] = await post(url, rollout.token, {**body, "n": 2})
                results["image"] = await post(url, rollout.token, {**body, "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
                assert not sampled and not rollout.state.tokens  # nothing recorded
                results["ok"] = await post(url, rollout.token, body)
                results["over max_turns"] = await post(url, rollout.token, body)
                state = await proxy.finish_rollout(rollout)
                results["finished"] = await post(url, rollout.token, body)
            return results, state

    results, state = asyncio.run(main())
    assert results["wrong token"][0] == results["no token"][0] == 401
    assert results["unknown"][0] == results["finished"][0] == 404
    assert results["n=2"][0] == 400 and "n:" in results["n=2"][1]["error"]["message"]
    assert results["image"][0] == 400 and "messages[0].content[0]" in \
        results["image"][1]["error"]["message"]
    assert results["ok"][0] == 200
    assert results["over max_turns"][0] == 400
    assert results["over max_turns"][1]["error"]["code"] == "max_turns_exceeded"
    assert len(state.turns) == 1 and state.truncated and state.stop == "max_turns"
    json.dumps(results)  # the errors are plain JSON bodies


def test_an_agent_that_compacts_after_a_context_length_refusal_goes_on_in_a_new_segment(
        vllm_server):
    async def main():
        async with running_proxy(vllm_server, max_token_length=10_000) as (proxy, renderer, _):
            proxy.max_token_length = len(renderer.prompt_ids(START)) + 40
            rollout = proxy.open_rollout()
            client = client_for(proxy, rollout)
            first = (await client.chat.completions.create(
                model="tiny", messages=START)).choices[0].message
            long = START + [echo(first), {"role": "user", "content": "x" * 300}]
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="tiny", messages=long)
            compact = [{"role": "user", "content": "12 * 7?"}]
            await client.chat.completions.create(model="tiny", messages=compact)
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return refused.value, state

    refused, state = asyncio.run(main())
    assert refused.code == "context_length_exceeded"
    assert len(state.turns) == 2 and len(state.segment_starts) == 1
    assert state.stop == "answer"  # the refusal was not the end of the rollout


def test_a_reply_the_agents_client_gave_up_on_is_kept_aside_not_trained_nor_scored(
        vllm_server):
    """The agent's OpenAI client times out on its second request (the first reply of that
    turn is slow) and sends it again, as the openai library does. The proxy recorded the
    slow reply, which the agent never saw: it leaves the trajectory (its tokens are not
    trained, the retry's context is the first request's), is kept with the reason in the
    metadata, and the turns the reward hook gets are the two the agent saw."""
    async def main():
        async with running_proxy(vllm_server) as (proxy, renderer, sampled):
            pool = proxy.backend.pool
            complete, calls = pool.complete, []

            async def slow_second_call(prompt_ids, **kwargs):
                calls.append(list(prompt_ids))
                completion = await complete(prompt_ids, **kwargs)
                if len(calls) == 2:
                    await asyncio.sleep(3.0)  # past the client's timeout of 2 s
                return completion

            pool.complete = slow_second_call
            rollout = proxy.open_rollout()
            client = client_for(proxy, rollout)
            first = (await client.chat.completions.create(
                model="tiny", messages=START)).choices[0].message
            history = START + [echo(first), {"role": "user", "content": "Check it again."}]
            second = (await client.with_options(timeout=2.0, max_retries=1)
                      .chat.completions.create(model="tiny", messages=history)
                      ).choices[0].message
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return renderer, sampled, second, state, rollout

    renderer, sampled, second, state, rollout = asyncio.run(main())
    (p1, c1), (p2, abandoned), (p3, c3) = sampled
    assert p3 == p2  # the retry's context is exactly the abandoned request's
    assert len(state.turns) == 2 and rollout.requests == 3 and state.segment_starts == []
    assert state.tokens == p3 + c3.token_ids  # the unseen reply's tokens are gone ...
    start, end = state.turns[1].span
    assert state.masks[start:end] == c3.token_ids and state.logprobs[start:end] == c3.logprobs
    parsed = get_parser("hermes").parse(state.turns[1].text)
    assert (second.content or "") == (parsed.content if parsed.calls else state.turns[1].text)
    [kept] = state.extra["abandoned_replies"]  # ... and kept aside, with why
    assert kept["token_ids"] == abandoned.token_ids and kept["turn"] == 1
    assert "sent the request again" in kept["reason"]


# vLLM's structured outputs make the random tiny model emit a well-formed calculator call
# every turn: still vLLM's own sampled tokens and logprobs, only constrained.
CALL_REGEX = (r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": '
              r'"[1-9][0-9]? [+*-] [1-9][0-9]?"\}\}\n</tool_call>')
VALID_CALLS = {"temperature": 1.0, "structured_outputs": {"regex": CALL_REGEX}}


def calculate(arguments: str) -> str:
    """The agent's calculator: ``a op b`` (the only form the regex allows)."""
    a, op, b = json.loads(arguments)["expression"].split()
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


def test_an_openai_agent_making_valid_tool_calls_for_several_turns_gives_a_valid_trajectory(
        vllm_server):
    """The official client's tool-call loop, three turns of well-formed calls: the recorded
    trajectory follows the data contract (arguments as JSON strings, the call ids the
    agent got) and still holds exactly vLLM's tokens."""
    async def main():
        async with running_proxy(vllm_server, max_tokens_per_turn=128,
                                 max_token_length=4000) as (proxy, renderer, sampled):
            proxy.backend.sampling = VALID_CALLS
            rollout = proxy.open_rollout()
            client = client_for(proxy, rollout)
            messages, received = list(START), []
            for _ in range(3):
                reply = (await client.chat.completions.create(
                    model="tiny", messages=messages, tools=TOOLS)).choices[0]
                assert reply.finish_reason == "tool_calls", reply
                messages.append(echo(reply.message))
                for call in reply.message.tool_calls:
                    received.append((call.id, call.function.name, call.function.arguments))
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": calculate(call.function.arguments)})
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return renderer, sampled, messages, received, state

    renderer, sampled, messages, received, state = asyncio.run(main())
    assert len(state.turns) == len(sampled) == 3 and state.segment_starts == []
    assert all(len(t.tool_calls) == 1 and not t.tool_errors for t in state.turns)
    # the trajectory, as an env sends it (and as the JSONL file and the API read it back)
    trajectory = ScoredTrajectory(
        tokens=state.tokens, masks=state.masks, inference_logprobs=state.logprobs,
        scores=[0.0, 0.5, 1.0], turn_spans=[list(t.span) for t in state.turns],
        messages=state.messages, flags=TrajectoryFlags(tool_errors=state.tool_errors))
    group = ScoredGroup.model_validate_json(ScoredGroup(
        env="proxy", item_id="12*7", trajectories=[trajectory, trajectory]).model_dump_json())
    recorded = group.trajectories[0].messages
    # the proxy saw everything up to the last reply (the last tool result was never sent)
    assert [m.role for m in recorded] == [m["role"] for m in messages[:-1]]
    calls = [(c.id, c.function.name, c.function.arguments)
             for m in recorded if m.tool_calls for c in m.tool_calls]
    assert calls == received  # what the agent was given, arguments as JSON strings
    assert [m.tool_call_id for m in recorded if m.role == "tool"] == [c[0] for c in received[:-1]]
    for turn, (_, completion) in zip(state.turns, sampled):
        start, end = turn.span
        assert state.tokens[start:end] == state.masks[start:end] == completion.token_ids
        assert state.logprobs[start:end] == completion.logprobs
    # each recorded assistant message is the turn's sampled text, after the agent's prompt
    assert state.tokens[:state.turns[0].span[0]] == renderer.prompt_ids(START, TOOLS)
    assert [m.content for m in recorded if m.role == "assistant"] == \
        [t.text for t in state.turns]


def test_the_agents_sampling_fields_are_ignored_and_its_max_tokens_only_shortens(vllm_server):
    async def main():
        async with running_proxy(vllm_server) as (proxy, renderer, sampled):
            complete, asked = proxy.backend.pool.complete, []

            async def record(prompt_ids, **kwargs):
                asked.append(kwargs)
                return await complete(prompt_ids, **kwargs)

            proxy.backend.pool.complete = record
            rollout = proxy.open_rollout()
            client = client_for(proxy, rollout)
            replies = []
            for k, limits in enumerate(({"max_tokens": 5}, {"max_completion_tokens": 1000},
                                        {"max_tokens": 7, "max_completion_tokens": 3})):
                # a new question each time (the same one again would be a retry, whose
                # earlier reply is set aside: see the abandoned-reply test)
                messages = [START[0], {"role": "user", "content": f"What is 12 * {7 + k}?"}]
                replies.append(await client.chat.completions.create(
                    model="tiny", messages=messages, temperature=0.0, top_p=0.01, seed=3,
                    stop=["\n"], presence_penalty=1.5, **limits))
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return asked, replies, state

    asked, replies, state = asyncio.run(main())
    # the env's sampling settings, whatever the agent asked for
    assert [a["sampling"] for a in asked] == [{"temperature": 1.0}] * 3
    # max_tokens shortens below the env's max_tokens_per_turn (24), never lengthens
    assert [a["max_tokens"] for a in asked] == [5, 24, 3] and len(state.turns) == 3
    for reply, limit, turn in zip(replies, (5, 24, 3), state.turns):
        assert reply.usage.completion_tokens == turn.span[1] - turn.span[0] <= limit
        if turn.finish_reason == "length":
            assert reply.choices[0].finish_reason == "length" and state.truncated
