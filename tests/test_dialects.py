"""The proxy's Responses, Anthropic Messages and Gemini dialects on the real vLLM server,
driven by the real `openai` and `anthropic` clients (Gemini: requests shaped as Gemini
CLI 0.61 sends them): one recorder under all four wire APIs (the same exact tokens, one
segment when a harness sends back what it was given), their streamed events as the
clients parse them, and their errors."""

from __future__ import annotations

import asyncio
import json

from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from test_proxy import CALL_REGEX, START, TOOLS, running_proxy

from environments.blackbox.proxy import DIALECTS
from environments.blackbox.recorder import InterceptedRollout
from environments.trajectory import MASKED

FIXTURES = Path(__file__).parent / "fixtures" / "harness_requests"

FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses API's form
ANTHROPIC_TOOLS = [{"name": "calculator", "description": TOOLS[0]["function"]["description"],
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
CALL_THEN_FREE = {"temperature": 1.0, "structured_outputs": {"regex": CALL_REGEX}}


def check_exact(state, sampled, n_turns):
    """Every turn's tokens, masks and logprobs are vLLM's; nothing else is trained; and
    each later prompt is the earlier context plus that turn (one segment)."""
    assert len(state.turns) == len(sampled) == n_turns
    for turn, (prompt, completion) in zip(state.turns, sampled):
        start, end = turn.span
        assert state.tokens[:start] == prompt
        assert state.tokens[start:end] == completion.token_ids
        assert state.masks[start:end] == completion.token_ids
        assert state.logprobs[start:end] == completion.logprobs
    trained = {i for t in state.turns for i in range(*t.span)}
    assert all(m == MASKED for i, m in enumerate(state.masks) if i not in trained)
    assert state.segment_starts == []


def test_responses_api_turns_are_recorded_exactly_streamed_or_not(vllm_server):
    async def main():
        async with running_proxy(vllm_server, max_tokens_per_turn=128) as (proxy, renderer,
                                                                         sampled):
            proxy.backend.sampling = CALL_THEN_FREE
            rollout = proxy.open_rollout()
            client = openai.AsyncOpenAI(base_url=proxy.base_url(rollout),
                                        api_key=rollout.token, max_retries=0)
            tools = [*FLAT_TOOLS, {"type": "web_search"},  # left out, as Codex's extras
                     {"type": "namespace", "name": "mcp", "tools": []}]
            first = await client.responses.create(
                model="tiny", instructions=START[0]["content"], tools=tools,
                input=[{"role": "user", "content": [
                    {"type": "input_text", "text": START[1]["content"]}]}],
                reasoning={"effort": "low"}, include=["reasoning.encrypted_content"],
                store=False, extra_body={"prompt_cache_key": "k"})
            [call] = [item for item in first.output if item.type == "function_call"]
            proxy.backend.sampling = {"temperature": 1.0}
            # as Codex sends it back: every output item, then the call's output
            history = [{"role": "user", "content": START[1]["content"]},
                       *[item.model_dump(exclude_none=True) for item in first.output],
                       {"type": "function_call_output", "call_id": call.call_id,
                        "output": "84"}]
            async with client.responses.stream(model="tiny", instructions=START[0]["content"],
                                               tools=tools, input=history) as stream:
                kinds = [event.type async for event in stream]
                second = await stream.get_final_response()
            # and openai-agents' way: only the new items after previous_response_id
            third = await client.responses.create(
                model="tiny", instructions=START[0]["content"], tools=tools,
                previous_response_id=second.id,
                input=[{"role": "user", "content": "Say it once more."}])
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return renderer, sampled, first, call, kinds, second, third, state

    renderer, sampled, first, call, kinds, second, third, state = asyncio.run(main())
    check_exact(state, sampled, 3)
    assert first.status == "completed" and call.name == "calculator"
    assert json.loads(call.arguments) == state.turns[0].tool_calls[0].arguments
    assert sampled[0][0] == renderer.prompt_ids(START, [{"type": "function",
                                                          "function": TOOLS[0]["function"]}])
    assert state.turns[0].tool_results == ["84"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.done" in kinds
    assert second.output_text == state.turns[1].text or second.status == "incomplete"
    assert third.previous_response_id == second.id
    assert sorted(state.extra["dropped_tools"]) == ["mcp", "web_search"]
    assert state.extra["wire_apis"] == ["responses"]


def test_anthropic_messages_turns_are_recorded_exactly_streamed_or_not(vllm_server):
    async def main():
        async with running_proxy(vllm_server, max_tokens_per_turn=128) as (proxy, renderer,
                                                                         sampled):
            proxy.backend.sampling = CALL_THEN_FREE
            rollout = proxy.open_rollout()
            # as Claude Code: ANTHROPIC_BASE_URL without /v1, the key as x-api-key
            client = anthropic.AsyncAnthropic(base_url=f"{proxy.url}/rollout/{rollout.id}",
                                              api_key=rollout.token, max_retries=0)
            system = [{"type": "text", "text": START[0]["content"],
                       "cache_control": {"type": "ephemeral"}}]
            question = {"role": "user", "content": [{"type": "text",
                                                     "text": START[1]["content"]}]}
            counted = await client.messages.count_tokens(
                model="tiny", system=system, messages=[question], tools=ANTHROPIC_TOOLS)
            async with client.messages.stream(
                    model="tiny", max_tokens=32000, system=system, messages=[question],
                    tools=ANTHROPIC_TOOLS, extra_query={"beta": "true"},
                    thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
                first = await stream.get_final_message()
            [use] = [b for b in first.content if b.type == "tool_use"]
            proxy.backend.sampling = {"temperature": 1.0}
            # (not streamed: the SDK refuses a large max_tokens without streaming)
            second = await client.messages.create(
                model="tiny", max_tokens=4096, system=system, tools=ANTHROPIC_TOOLS,
                messages=[question, {"role": "assistant", "content": [
                    b.model_dump(exclude_none=True) for b in first.content]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": "84"},
                        {"type": "text", "text": "<system-reminder>go on</system-reminder>"}]}])
            async with aiohttp.ClientSession() as http:  # a harness's probe and a bad block
                async with http.head(f"{proxy.url}/rollout/{rollout.id}",
                                     headers={"x-api-key": rollout.token}) as r:
                    probe = r.status
                async with http.post(f"{proxy.url}/rollout/{rollout.id}/v1/messages",
                                     headers={"x-api-key": rollout.token}, json={
                                         "model": "tiny", "max_tokens": 5, "messages": [
                                             {"role": "user", "content": [
                                                 {"type": "image", "source": {}}]}]}) as r:
                    bad = r.status, await r.json()
                async with http.post(f"{proxy.url}/rollout/{rollout.id}/v1/files",
                                     headers={"x-api-key": rollout.token}, json={}) as r:
                    unserved = r.status
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return renderer, sampled, counted, first, use, second, probe, bad, unserved, \
                rollout, state

    (renderer, sampled, counted, first, use, second, probe, bad, unserved, rollout,
     state) = asyncio.run(main())
    assert state.segment_starts == [], state.extra["segments"]
    check_exact(state, sampled, 2)
    assert counted.input_tokens == len(sampled[0][0])  # count_tokens recorded nothing
    assert first.stop_reason == "tool_use" and use.name == "calculator"
    assert use.input == state.turns[0].tool_calls[0].arguments
    assert state.turns[0].tool_results == ["84"]
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert probe == 200
    assert bad[0] == 400 and bad[1]["type"] == "error"
    assert "messages[0].content[0].type" in bad[1]["error"]["message"]
    assert unserved == 404 and rollout.unserved == ["POST /v1/files"]
    assert rollout.statuses == [200, 200, 400]
    assert state.extra["wire_apis"] == ["messages"]


def test_scripted_turns_are_forced_and_keep_the_policys_own_logprobs(vllm_server):
    """A forced turn has exactly the script's tokens, and its recorded logprobs are the
    model's own (recomputed here with transformers), not the 0.0 a constrained sampler
    reports for a token it leaves no choice over."""
    import torch
    from transformers import AutoModelForCausalLM

    script = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n'
              '</tool_call>', "The answer is 84."]

    async def main():
        async with running_proxy(vllm_server, max_tokens_per_turn=128,
                                 scripted_turns=script) as (proxy, renderer, sampled):
            rollout = proxy.open_rollout()
            client = openai.AsyncOpenAI(base_url=proxy.base_url(rollout),
                                        api_key=rollout.token, max_retries=0)
            first = (await client.chat.completions.create(
                model="tiny", messages=START, tools=TOOLS)).choices[0].message
            call = first.tool_calls[0]
            second = (await client.chat.completions.create(model="tiny", tools=TOOLS, messages=[
                *START, first.model_dump(exclude_none=True, include={"role", "content",
                                                                      "tool_calls"}),
                {"role": "tool", "tool_call_id": call.id, "content": "84"}])).choices[0]
            state = await proxy.finish_rollout(rollout)
            await client.close()
            return renderer, sampled, call, second, state

    renderer, sampled, call, second, state = asyncio.run(main())
    check_exact(state, sampled, 2)
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12 * 7"}
    assert second.message.content == "The answer is 84." and second.finish_reason == "stop"
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([state.tokens])).logits[0]
    logprobs = torch.log_softmax(logits, -1)
    for turn in state.turns:
        start, end = turn.span
        assert state.tokens[start:end][:-1] == renderer.tokenizer.encode(
            turn.text, add_special_tokens=False)
        mine = [logprobs[i - 1, state.tokens[i]].item() for i in range(start, end)]
        recorded = state.logprobs[start:end]
        assert max(abs(a - b) for a, b in zip(mine, recorded)) < 1e-3, (mine, recorded)
        assert sum(recorded) < -5  # a random model gives the script's tokens little mass


def captured(harness: str) -> list[tuple[str, object, dict]]:
    """A harness's captured model calls, in order: (file name, dialect, body)."""
    calls = []
    for path in sorted((FIXTURES / harness).glob("*.json")):
        request = json.loads(path.read_text())
        dialect = next((d for d in DIALECTS if d.matches(request["path"])), None)
        if request["method"] == "POST" and dialect is not None:
            calls.append((path.name, dialect, request["body"]))
    return calls


# harness capture -> (its shell tool, the wire API)
EPISODES = {"pi": ("bash", "chat"), "opencode": ("bash", "chat"),
            "codex": ("exec_command", "responses"), "codex-default": ("exec_command", "responses"),
            "claude-code": ("Bash", "messages"), "mini-swe-agent": ("bash", "chat"),
            "openai-agents-responses": ("bash", "responses"),
            "openai-agents-responses-stream": ("bash", "responses"),
            "openai-agents-chat": ("bash", "chat"), "openai-agents-chat-stream": ("bash", "chat"),
            "gemini-cli": ("run_shell_command", "gemini"), "hermes": ("terminal", "chat"),
            "hermes-responses": ("terminal", "responses"),
            "hermes-messages": ("terminal", "messages"),
            "qwen-code": ("run_shell_command", "chat"), "kimi-code": ("Bash", "chat"),
            "kilo": ("bash", "chat"), "openclaw": ("exec", "chat")}
TRAILING = {"openclaw": 1}
"""Messages a harness puts after the conversation in every request, moved to the end of
the next (OpenClaw: its runtime context, "Active exec sessions" / "Active Subagents"):
the next request does not extend the one before, so each of its turns is a new segment."""


@pytest.mark.parametrize("harness", sorted(EPISODES))
def test_each_harness_request_as_captured_parses_renders_and_extends(harness):
    """Every model call a shipped harness sent (tests/fixtures/harness_requests) is read
    by its dialect without a refusal, renders through a ChatML template, and the call
    after the tool result extends the first one exactly (so the proxy records one
    segment): the first call's messages, then the assistant turn with the one shell call
    the capture server made, then its result."""
    from environments.inference.chat_template import ChatRenderer
    from lachesis.tiny_model import build_tokenizer

    tool, wire = EPISODES[harness]
    renderer = ChatRenderer(build_tokenizer("qwen2"))
    calls = [(name, dialect, dialect.parse(json.dumps(body).encode(),
                                            InterceptedRollout("r", "t", None)))
             for name, dialect, body in captured(harness)]
    assert {dialect.name for _, dialect, _ in calls} == {wire}
    (_, _, first), (_, _, second) = calls[:2]
    for name, _, turn in calls:
        assert tool in [t["function"]["name"] for t in turn.tools], name
        assert renderer.prompt_ids([m.rendered for m in turn.messages], turn.tools)
    trailing = TRAILING.get(harness, 0)
    n = len(first.messages) - trailing
    assert [m.key for m in second.messages[:n]] == [m.key for m in first.messages[:n]]
    if trailing:  # the same trailing messages, moved to the end
        assert [m.key for m in second.messages[-trailing:]] == \
            [m.key for m in first.messages[-trailing:]]
        assert second.messages[n].key != first.messages[n].key
    assert second.tools == first.tools
    reply, *results = second.messages[n:len(second.messages) - trailing]
    assert reply.rendered["role"] == "assistant"
    [call] = reply.rendered["tool_calls"]
    assert call["function"]["name"] == tool
    assert "echo 42 > answer.txt" in json.dumps(call["function"]["arguments"])
    assert [m.rendered["role"] for m in results][:1] == ["tool"]
    assert results[0].rendered.get("tool_call_id") == call.get("id")


def test_aiders_request_without_tools_parses_and_renders_and_its_script_is_a_file_listing():
    """Aider (tests/fixtures/harness_requests/aider) sends no tools: it edits files through
    its reply's text (the whole edit format), so its scripted episode is one reply, the
    listing of answer.txt, in the format its request asks for."""
    from environments.envs.answer_file import script_for
    from environments.inference.chat_template import ChatRenderer
    from lachesis.tiny_model import build_tokenizer

    [(_, dialect, body)] = captured("aider")
    turn = dialect.parse(json.dumps(body).encode(), InterceptedRollout("r", "t", None))
    assert dialect.name == "chat" and not turn.tools and "tools" not in body
    renderer = ChatRenderer(build_tokenizer("qwen2"))
    assert renderer.prompt_ids([m.rendered for m in turn.messages], turn.tools)
    assert "*file listing*" in turn.messages[-1].rendered["content"]
    assert script_for("aider", 42) == ["answer.txt\n```\n42\n```"]


def test_mutated_harness_requests_are_parsed_or_refused_naming_a_field_never_crash():
    """Each captured request with one value swapped for a value of another type (every
    path of its body, a few swaps each): the dialect reads it or refuses it with a
    RequestError that names where (a 4xx), never any other exception (a 5xx)."""
    import random

    from environments.blackbox.recorder import RequestError

    def paths(value, at=()):
        yield at
        if isinstance(value, dict):
            for key, item in value.items():
                yield from paths(item, (*at, key))
        elif isinstance(value, list):
            for i, item in enumerate(value[:6]):
                yield from paths(item, (*at, i))

    def swapped(body, path, new):
        body = json.loads(json.dumps(body))
        if not path:
            return new
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = new
        return body

    rng = random.Random(0)
    others = [None, 7, -1.5, True, "x", [], [1, "a"], {}, {"type": "image"}]
    tried = refused = 0
    for harness in ("pi", "codex-default", "claude-code", "openai-agents-responses",
                    "gemini-cli"):
        for _, dialect, body in captured(harness):
            for path in paths(body):
                for new in rng.sample(others, 2):
                    raw = json.dumps(swapped(body, path, new)).encode()
                    tried += 1
                    try:
                        dialect.parse(raw, InterceptedRollout("r", "t", None))
                    except RequestError as error:
                        refused += 1
                        assert error.status in (400, 413) and str(error), (path, new)
                        assert error.param, (harness, path, new, str(error))
    assert tried > 1000 and refused > 100, (tried, refused)


# -- Gemini ---------------------------------------------------------------------------------
GEMINI_TOOLS = [{"functionDeclarations": [{
    "name": "calculator", "description": TOOLS[0]["function"]["description"],
    "parametersJsonSchema": TOOLS[0]["function"]["parameters"]}]}, {"googleSearch": {}}]


def gemini_body(contents, **fields):
    """A request as Gemini CLI 0.61 sends it (tests/fixtures/harness_requests/gemini-cli):
    the system instruction as a user-role Content, declarations with
    parametersJsonSchema, its generationConfig."""
    return {"contents": contents,
            "systemInstruction": {"role": "user", "parts": [{"text": START[0]["content"]}]},
            "tools": GEMINI_TOOLS, "generationConfig": {
                "temperature": 1, "topP": 0.95, "topK": 64,
                "thinkingConfig": {"includeThoughts": True}}, **fields}


def test_gemini_turns_are_recorded_exactly_over_sse_json_and_arrays_with_googles_errors(
        vllm_server):
    question = {"role": "user", "parts": [{"text": START[1]["content"]}]}

    async def main():
        async with running_proxy(vllm_server, max_tokens_per_turn=128) as (proxy, renderer,
                                                                         sampled):
            proxy.backend.sampling = CALL_THEN_FREE
            rollout = proxy.open_rollout()
            models = f"{proxy.url}/rollout/{rollout.id}/v1beta/models"
            key = {"x-goog-api-key": rollout.token}
            async with aiohttp.ClientSession() as http:
                async def post(action, body, headers=key, **query):
                    async with http.post(f"{models}/gemini-2.5-pro:{action}", json=body,
                                         headers=headers, params=query) as r:
                        return r.status, r.headers.get("Content-Type"), await r.text()

                counted = await post("countTokens", {"generateContentRequest": gemini_body(
                    [question])})
                status, kind, text = await post("streamGenerateContent",
                                                gemini_body([question]), alt="sse")
                chunks = [json.loads(line[6:]) for line in text.splitlines()
                          if line.startswith("data: ")]
                parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
                [call] = [p["functionCall"] for p in parts if "functionCall" in p]
                proxy.backend.sampling = {"temperature": 1.0}
                # as Gemini CLI sends it back: a thought it never got, the call with its
                # thoughtSignature, the result as {output}; the key in the query this time
                history = [question, {"role": "model", "parts": [
                    {"text": "let me see", "thought": True},
                    *[{**p, "thoughtSignature": "skip_thought_signature_validator"}
                      for p in parts]]},
                    {"role": "user", "parts": [{"functionResponse": {
                        "id": call["id"], "name": call["name"],
                        "response": {"output": "84"}}}]}]
                second = await post("generateContent", gemini_body(history), headers={},
                                    key=rollout.token)
                reply = json.loads(second[2])["candidates"][0]["content"]
                history += [reply, {"role": "user", "parts": [{"text": "Once more."}]}]
                third = await post("streamGenerateContent", gemini_body(history))
                refusals = [await post("generateContent", gemini_body([
                    {"role": "user", "parts": [{"inlineData": {"mimeType": "image/png",
                                                               "data": ""}}]}])),
                    await post("generateContent", gemini_body([question]),
                               headers={"x-goog-api-key": "wrong"}),
                    await post("embedContent", {"content": question})]
            state = await proxy.finish_rollout(rollout)
            return (renderer, sampled, counted, status, kind, chunks, call, second, third,
                    refusals, rollout, state)

    (renderer, sampled, counted, status, kind, chunks, call, second, third, refusals,
     rollout, state) = asyncio.run(main())
    check_exact(state, sampled, 3)
    tools = [{"type": "function", "function": TOOLS[0]["function"]}]
    assert sampled[0][0] == renderer.prompt_ids(START, tools)
    assert json.loads(counted[2]) == {"totalTokens": len(sampled[0][0])}  # nothing recorded
    assert status == 200 and kind.startswith("text/event-stream")
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    assert chunks[-1]["usageMetadata"]["promptTokenCount"] == len(sampled[0][0])
    assert call["name"] == "calculator" and call["args"] == state.turns[0].tool_calls[0].arguments
    assert state.turns[0].tool_results == ["84"]
    assert second[0] == 200 and second[1].startswith("application/json")
    assert third[0] == 200 and isinstance(json.loads(third[2]), list)  # no alt: an array
    inline, wrong_key, embed = refusals
    assert inline[0] == 400
    error = json.loads(inline[2])["error"]
    assert error["code"] == 400 and error["status"] == "INVALID_ARGUMENT"
    assert error["details"][1]["fieldViolations"][0]["field"] == \
        "contents[0].parts[0].inlineData"
    assert wrong_key[0] == 401 and json.loads(wrong_key[2])["error"]["status"] == \
        "UNAUTHENTICATED"
    assert embed[0] == 404 and rollout.unserved == ["POST /v1beta/models/gemini-2.5-pro:"
                                                    "embedContent"]
    assert rollout.statuses == [200, 200, 200, 400]
    assert state.extra["dropped_tools"] == ["googleSearch"]
    assert state.extra["wire_apis"] == ["gemini"]


def test_gemini_fields_are_read_by_their_documented_rules():
    """What the Gemini dialect takes, converts, leaves out and refuses (no server)."""
    from environments.blackbox.dialects.gemini import GeminiDialect
    from environments.blackbox.recorder import RequestError

    dialect = GeminiDialect()

    def parse(body, **options):
        rollout = InterceptedRollout("r", "t", None)
        return dialect.parse(json.dumps(body).encode(), rollout, **options), rollout

    # snake_case names, a function role, OpenAPI-style `parameters`, a string system
    turn, rollout = parse({
        "system_instruction": "Be brief.",
        "contents": [{"role": "user", "parts": [{"text": "a"}, {"text": "b"}]},
                     {"role": "model", "parts": [{"function_call": {
                         "name": "f", "args": {"x": 1}}}]},
                     {"role": "function", "parts": [{"function_response": {
                         "name": "f", "response": {"rows": [1]}}}]}],
        "tools": [{"function_declarations": [{"name": "f", "parameters": {
            "type": "OBJECT", "properties": {"x": {"type": "INTEGER"}}}}]},
                  {"codeExecution": {}}],
        "generation_config": {"max_output_tokens": 9, "stopSequences": ["x"]},
        "safetySettings": [], "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}}},
        action="streamGenerateContent")
    assert [m.rendered for m in turn.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": '{"rows": [1]}', "name": "f"}]
    assert turn.tools == [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    assert turn.max_tokens == 9 and turn.json_stream and not turn.stream
    assert rollout.state.extra["dropped_tools"] == ["codeExecution"]
    question = [{"parts": [{"text": "q"}]}]
    for body, options, where in [
            ({"contents": []}, {}, "contents"),
            ({"contents": question, "cachedContent": "c/1"}, {}, "cachedContent"),
            ({"contents": question, "generationConfig": {"candidateCount": 2}}, {},
             "generationConfig.candidateCount"),
            ({"contents": question, "generationConfig": {"temperature": "hot"}}, {},
             "generationConfig.temperature"),
            ({"contents": question}, {"alt": "proto"}, "alt"),
            ({"contents": [{"role": "system", "parts": []}]}, {}, "contents[0].role"),
            ({"contents": [{"parts": [{"text": "a", "functionCall": {"name": "f"}}]}]}, {},
             "contents[0].parts[0]"),
            ({"contents": [{"parts": [{"functionCall": {"name": "f"}}]}]}, {},
             "contents[0].parts[0].functionCall"),
            ({"contents": [{"role": "model", "parts": [{"functionCall": {
                "name": "f", "args": "x=1"}}]}]}, {}, "contents[0].parts[0].functionCall.args"),
            ({"contents": question, "tools": [{"functionDeclarations": [{
                "name": "f", "parameters": {}, "parametersJsonSchema": {}}]}]}, {},
             "tools[0].functionDeclarations[0].parameters")]:
        with pytest.raises(RequestError) as error:
            parse(body, **options)
        assert error.value.param == where and error.value.status == 400, (body, error.value)
