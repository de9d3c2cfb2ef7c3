"""The interception proxy under a hostile client: malformed, odd and oversized requests
through a real HTTP client, the official `openai` client and raw sockets. Every one gets a
4xx naming the field or the problem (never a 5xx, never a connection closed without an
answer), is counted in the rollout's ``refused``, logs no traceback, and leaves the
recorded trajectory exactly as it was. Bodies that are valid after the mutation (an
ignored field changed, a message dropped) are answered 200 and extend the trajectory.

The proxy runs on the session's real vLLM server (one short generation per accepted
request)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import logging
import random

import aiohttp
import openai
from test_proxy import CALL_REGEX, START, TOOLS, client_for, echo, running_proxy

DEEP = "[" * 100_000 + "]" * 100_000
SPECIAL = {"__INF__": "1e999", "__NEGINF__": "-1e999", "__NAN__": "NaN", "__DEEP__": DEEP,
           "__SURROGATE__": '"\\ud800x"', "__BIG__": str(2**64 + 5), "__HUGE__": "9" * 5000}
BAD_VALUES = [-1, 0, 2**31, 2**63, "__BIG__", "__HUGE__", -(2**63) - 1, "__INF__",
              "__NEGINF__", "__NAN__", "x", "", "__SURROGATE__", None, [], {}, True, 1.5,
              [[]], [None], [5], "__DEEP__", {"a": "__DEEP__"}, {"role": "user"},
              [{"type": "image_url"}]]
MUTATIONS = 420  # the rollout API's fuzz test (tests/test_api_fuzz.py) sends 400


def encode(body) -> bytes:
    raw = json.dumps(body)
    for key, text in SPECIAL.items():
        raw = raw.replace(f'"{key}"', text)
    return raw.encode()


def paths(value, prefix=()):
    """Every path into a JSON value (dict keys and list indices)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


def parent_of(body, path):
    for p in path[:-1]:
        body = body[p]
    return body


def dotted(path) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def mutate(rng: random.Random, base: dict) -> tuple[bytes, str, str | None]:
    """(body, what was done, the field it touched: None for byte-level damage)."""
    body = copy.deepcopy(base)
    kind = rng.choice(["replace"] * 5 + ["delete", "length", "extra", "bytes"])
    if kind == "bytes":
        raw = encode(body)
        how = rng.choice(["truncate", "bad utf-8", "utf-16", "nest", "flip", "empty"])
        if how == "truncate":
            return raw[:rng.randrange(len(raw))], how, None
        if how == "bad utf-8":  # inside a string value
            at = raw.index(b'"content": "') + 12 + rng.randrange(3)
            return raw[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"]) + raw[at:], how, None
        if how == "utf-16":
            return raw.decode().encode("utf-16"), how, None
        if how == "nest":  # the whole body 100,000 deep
            return b"[" * 100_000 + raw + b"]" * 100_000, how, None
        if how == "flip":
            at = rng.randrange(len(raw))
            return raw[:at] + bytes([raw[at] ^ 0x80]) + raw[at + 1:], how, None
        return b"", how, None
    candidates = [p for p in paths(body) if p]
    path = rng.choice(candidates)
    parent = parent_of(body, path)
    if kind == "delete":
        del parent[path[-1]]
        return encode(body), f"delete {dotted(path)}", dotted(path)
    if kind == "extra":
        target = parent if isinstance(parent, dict) else body
        where = path[:-1] if isinstance(parent, dict) else ()
        key = rng.choice(["x", "role", "content", "tool_calls", "name", "stream", "n",
                          "logit_bias", "temperature", "function_call", "refusal"])
        value = rng.choice(BAD_VALUES)
        target[key] = value
        return encode(body), f"{dotted(where + (key,))} = {value!r}", dotted(where + (key,))
    if kind == "length":
        while path and not isinstance(parent_of(body, path + ("x",)), list):
            path = path[:-1]
        value = parent_of(body, path + ("x",)) if path else None
        if isinstance(value, list) and value:
            new = rng.choice([value[:-1], value + value[-1:], [], value * 3])
            parent_of(body, path)[path[-1]] = new
            return encode(body), f"{dotted(path)}: length {len(value)} -> {len(new)}", dotted(path)
        path = rng.choice(candidates)
        parent = parent_of(body, path)
    value = rng.choice(BAD_VALUES)
    parent[path[-1]] = value
    return encode(body), f"{dotted(path)} = {value!r}", dotted(path)


def snapshot(rollout) -> tuple:
    state = rollout.state
    return (list(state.tokens), list(state.masks), list(state.logprobs),
            [t.span for t in state.turns], [(s.start, len(s.messages)) for s in rollout.segments],
            rollout.limit, rollout.failure, state.truncated)


class Restorer:
    """Puts a rollout back to its recorded state after a request that was accepted."""

    def __init__(self, rollout):
        self.rollout = rollout
        self.state = copy.deepcopy(rollout.state)
        self.segments = copy.deepcopy(rollout.segments)

    def __call__(self) -> None:
        self.rollout.state = copy.deepcopy(self.state)
        self.rollout.segments = copy.deepcopy(self.segments)
        self.rollout.limit = self.rollout.failure = None


async def raw_request(port: int, data: bytes, timeout: float = 20) -> tuple[int, bytes]:
    """Send ``data`` on a fresh socket; (status, body) of the answer, (0, b"") if the
    connection closed without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    if not answer.startswith(b"HTTP/1."):
        return 0, answer
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def http(path: str, body: bytes, *headers: str, token: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {token}",
             "Connection: close", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def assert_no_tracebacks(records) -> None:
    bad = [r for r in records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [f"{r.name}: {r.getMessage()}" for r in bad]


@contextlib.asynccontextmanager
async def recorded_rollout(vllm_server):
    """A proxy with one recorded turn that called the calculator, and the request that
    continues it (the call's result as a tool message)."""
    async with running_proxy(vllm_server, max_tokens_per_turn=4, max_token_length=4000,
                             max_request_bytes=1 << 20) as (proxy, renderer, sampled):
        proxy.backend.sampling = {"temperature": 1.0,
                                  "structured_outputs": {"regex": CALL_REGEX}}
        proxy.max_tokens_per_turn = 128
        rollout = proxy.open_rollout()
        client = client_for(proxy, rollout)
        reply = (await client.chat.completions.create(
            model="tiny", messages=START, tools=TOOLS)).choices[0]
        await client.close()
        assert reply.finish_reason == "tool_calls", reply
        # then short unconstrained replies: each accepted request costs little
        proxy.backend.sampling, proxy.max_tokens_per_turn = {"temperature": 1.0}, 4
        call = reply.message.tool_calls[0]
        follow_up = {"model": "tiny", "tools": TOOLS, "max_tokens": 2, "messages": [
            *START, echo(reply.message),
            {"role": "tool", "tool_call_id": call.id, "name": "calculator", "content": "84"}]}
        yield proxy, rollout, follow_up


def test_fuzzed_requests_get_4xx_naming_the_field_and_leave_the_trajectory_unchanged(
        vllm_server, caplog):
    rng = random.Random(20261125)
    caplog.set_level(logging.INFO)

    async def scenario():
        async with recorded_rollout(vllm_server) as (proxy, rollout, follow_up), \
                aiohttp.ClientSession() as http_client:
            url = proxy.base_url(rollout) + "/chat/completions"
            headers = {"Authorization": f"Bearer {rollout.token}",
                       "Content-Type": "application/json"}
            restore = Restorer(rollout)
            accepted = refused = 0
            for case in range(MUTATIONS):
                raw, what, field = mutate(rng, follow_up)
                before, count = snapshot(rollout), rollout.refused
                async with http_client.post(url, data=raw, headers=headers) as r:
                    code, text = r.status, await r.text()
                if text.startswith("data: "):  # "stream": true was set: server-sent events
                    assert text.endswith("data: [DONE]\n\n"), what
                    out = json.loads(text.split("\n\n")[0].removeprefix("data: "))
                    out["choices"][0]["message"] = out["choices"][0]["delta"]
                else:
                    out = json.loads(text)
                where = f"case {case}: {what} -> {code} {str(out)[:300]}"
                assert code < 500, where
                if code == 200:  # valid after all: one more turn, the old tokens kept
                    accepted += 1
                    assert out["choices"][0]["message"]["role"] == "assistant", where
                    after = rollout.state
                    assert after.tokens[:len(before[0])] == before[0], where
                    assert len(after.turns) == len(before[3]) + 1, where
                    restore()
                    continue
                refused += 1
                assert code in (400, 413), where
                error = out["error"]
                assert error["message"] and error["param"], where
                assert snapshot(rollout) == before and rollout.refused == count + 1, where
                if field is not None and error["param"] != "body":
                    # the error is about the field that was damaged (or inside it)
                    assert error["param"].startswith(field) or field.startswith(
                        error["param"]), where
            assert accepted > 20 and refused > 200, (accepted, refused)
            # still serving, and the good request still extends the recording
            async with http_client.post(url, json=follow_up, headers=headers) as r:
                assert r.status == 200
            assert rollout.segments[-1].messages[-2].rendered["role"] == "tool"
            return refused, rollout.refused, proxy

    refused, counted, proxy = asyncio.run(scenario())
    assert counted == refused and proxy.refused_without_rollout == 0
    assert_no_tracebacks(caplog.records)


def test_wrong_types_in_every_message_field_through_the_openai_client(vllm_server, caplog):
    """What a buggy agent sends with the official client: each is a 400 whose ``param``
    names the field (the issue's ``"tool_calls": 5`` gave a 500 and a traceback)."""
    caplog.set_level(logging.INFO)

    async def scenario():
        async with recorded_rollout(vllm_server) as (proxy, rollout, follow_up):
            messages = follow_up["messages"]
            assistant = messages[2]
            call = assistant["tool_calls"][0]
            cases = {
                "messages[2].tool_calls": {**assistant, "tool_calls": 5},
                "messages[2].tool_calls[0]": {**assistant, "tool_calls": ["x"]},
                "messages[2].tool_calls[0].function": {**assistant,
                                                       "tool_calls": [{**call, "function": 7}]},
                "messages[2].tool_calls[0].function.name": {
                    **assistant, "tool_calls": [{**call, "function": {"arguments": "{}"}}]},
                "messages[2].tool_calls[0].function.arguments": {
                    **assistant, "tool_calls": [{**call, "function": {
                        "name": "calculator", "arguments": [1, 2]}}]},
                "messages[2].tool_calls[0].id": {**assistant, "tool_calls": [{**call, "id": 3}]},
                "messages[2].tool_calls[0].type": {**assistant,
                                                   "tool_calls": [{**call, "type": "code"}]},
                "messages[2].content": {**assistant, "content": {"text": "hi"}},
                "messages[2].role": {**assistant, "role": 5},
                "messages[2].name": {**assistant, "name": ["me"]},
                "messages[3].tool_call_id": {**messages[3], "tool_call_id": 1.5},
                "messages[3].content[0].text": {**messages[3],
                                                "content": [{"type": "text", "text": None}]},
                "messages[3].content[0]": {**messages[3], "content": ["84"]},
                "messages[3].tool_calls": {**messages[3], "tool_calls": []},
                "messages[2]": "just text",
            }
            client = client_for(proxy, rollout)
            before, results = snapshot(rollout), {}
            for param, message in cases.items():
                index = int(param[9])
                changed = [*messages[:index], message, *messages[index + 1:]]
                try:
                    await client.chat.completions.create(model="tiny", messages=changed,
                                                         tools=TOOLS)
                except openai.BadRequestError as error:
                    results[param] = error
            # wrong types in the request's other fields, and in its tools
            for param, extra in {"tools[0].function.name": {"tools": [
                    {"type": "function", "function": {"name": 5}}]},
                    "tools[0]": {"tools": ["calculator"]},
                    "temperature": {"temperature": "hot"},
                    "max_tokens": {"max_tokens": 0}, "n": {"n": 3},
                    "stream": {"stream": "sometimes"}}.items():
                try:
                    await client.chat.completions.create(
                        model="tiny", messages=messages, **{"tools": TOOLS, **extra})
                except openai.BadRequestError as error:
                    results[param] = error
            await client.close()
            return cases, results, before, snapshot(rollout), rollout.refused

    cases, results, before, after, refused = asyncio.run(scenario())
    assert len(results) == refused == len(cases) + 6
    for param, error in results.items():
        assert error.status_code == 400 and error.param == param, (param, error)
        assert param.split(".")[-1].split("[")[0] in error.message, (param, error.message)
    assert after == before
    assert_no_tracebacks(caplog.records)


def test_bad_encodings_nesting_and_oversized_bodies_on_raw_sockets(vllm_server, caplog):
    """Byte-level damage and broken HTTP on a raw socket: each gets an answer (aiohttp's
    own 400 for what its parser cannot read), the proxy keeps serving, nothing is logged
    with a traceback, and the recording is unchanged."""
    caplog.set_level(logging.INFO)

    async def scenario():
        async with recorded_rollout(vllm_server) as (proxy, rollout, follow_up):
            port = int(proxy.url.rsplit(":", 1)[1])
            path = f"/rollout/{rollout.id}/v1/chat/completions"
            token = rollout.token
            good = json.dumps(follow_up).encode()
            deep_content = json.dumps({**follow_up, "messages": [
                {"role": "user", "content": "__X__"}]}).encode().replace(
                b'"__X__"', DEEP.encode())
            requests = {  # name: (bytes on the wire, expected status, counted by the rollout)
                "invalid utf-8": (http(path, good.replace(b"12 * 7", b"12 \xff 7"),
                                       token=token), 400, True),
                "utf-16 body": (http(path, good.decode().encode("utf-16"), token=token), 400, True),
                "latin-1 body": (http(path, good.replace(b"is", "\u00efs".encode("latin-1")),
                                      token=token), 400, True),
                "100,000-deep body": (http(path, b"[" * 100_000 + b"]" * 100_000,
                                           token=token), 400, True),
                "100,000-deep content": (http(path, deep_content, token=token), 400, True),
                "truncated JSON": (http(path, good[:len(good) // 2], token=token), 400, True),
                "empty body": (http(path, b"", token=token), 400, True),
                "not an object": (http(path, b"[1, 2]", token=token), 400, True),
                "huge number": (http(path, good.replace(b'"max_tokens": 2', b'"max_tokens": '
                                                        + b"9" * 5000), token=token), 400, True),
                "oversized body": (http(path, b'{"messages": "' + b"x" * (2 << 20) + b'"}',
                                        token=token), 413, True),
                "oversized Content-Length": (http(path, good, "Content-Length: 99999999",
                                                  token=token), 413, True),
                "bad gzip": (http(path, b"\x1f\x8b not gzip", "Content-Encoding: gzip",
                                  token=token), 400, True),
                "gzip bomb": (http(path, gzip.compress(b" " * (3 << 20) + good),
                                   "Content-Encoding: gzip", token=token), 413, True),
                "form body": (http(path, b"messages=hi", "Content-Type: application/"
                                   "x-www-form-urlencoded", token=token), 400, True),
                "bad chunk size": (http(path, b"zz\r\nab\r\n0\r\n\r\n",
                                        "Transfer-Encoding: chunked", token=token), 400, False),
                "negative Content-Length": (http(path, b"{}", "Content-Length: -5",
                                                 token=token), 400, False),
                "bad request line": (b"GARBAGE\r\n\r\n", 400, False),
                "bad header": (b"POST " + path.encode() + b" HTTP/1.1\r\nHost a\r\n\r\n", 400,
                               False),
                "GET on chat": (f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                .encode(), 405, False),
                "unknown path": (http(f"/rollout/{rollout.id}/v2/x", good, token=token), 404,
                                 False),
            }
            before, results = snapshot(rollout), {}
            for name, (data, _, _) in requests.items():
                results[name] = await raw_request(port, data)
            after, refused = snapshot(rollout), rollout.refused
            async with aiohttp.ClientSession() as session:  # still serving
                async with session.post(f"{proxy.url}{path}", json=follow_up,
                                        headers={"Authorization": f"Bearer {token}"}) as r:
                    status = r.status
            return requests, results, before, after, refused, proxy.refused_without_rollout, \
                status

    requests, results, before, after, refused, unattributed, status = asyncio.run(scenario())
    for name, (_, expected, _) in requests.items():
        code, body = results[name]
        assert code == expected, (name, code, body[:300])
        assert body.strip(), name  # says what is wrong
    assert refused == sum(counted for _, _, counted in requests.values())
    assert unattributed == sum(not counted for _, _, counted in requests.values())
    assert after == before and status == 200
    assert_no_tracebacks(caplog.records)
