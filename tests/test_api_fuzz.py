"""Fuzzing the rollout API with bad client input over real HTTP.

Every mutated body gets a 4xx that names a field of the body, or a 200 exactly when the
data model (``ScoredData`` -> ``ScoredGroup``, the rules the trainer applies) accepts it;
nothing rejected is stored, and the server keeps serving. The mutations are seeded, so a
failure reproduces; each case's description is in the assertion message.

Classes of bad input covered: wrong JSON types in every field, wrong lengths (truncated,
extended, emptied lists), masks that are neither -100 nor the token, a trained first
token, negative and >= 2^63 integers (token ids, env ids, policy versions, spans, segment
starts), floats out of range (1e999), lone UTF-16 surrogates in strings, JSON nested
~2,000 deep, malformed JSON, broken and mislabelled gzip, non-JSON content types, and the
same for the other JSON endpoints (register, register-env, status-env, lease, ack,
policy_version).
"""

from __future__ import annotations

import gzip
import json
import random

import aiohttp
import pytest
from conftest import make_group, run, running_api
from pydantic import ValidationError

from environments.trajectory import ScoredData, ScoredGroup, TrajectoryError

DEEP = "[" * 2000 + "]" * 2000
SPECIAL = {"__INF__": "1e999", "__NEGINF__": "-1e999", "__DEEP__": DEEP,
           "__SURROGATE__": '"\\ud800x"', "__BIG__": str(2**64 + 5)}
BAD_VALUES = [-1, -100, 2**31, 2**63, "__BIG__", -(2**63) - 1, "__INF__", "__NEGINF__", "x",
              "__SURROGATE__", None, [], {}, True, 1.5, [[]], [None], "__DEEP__", [-5],
              {"a": "__DEEP__"}]


def encode(body) -> bytes:
    raw = json.dumps(body)
    for key, text in SPECIAL.items():
        raw = raw.replace(f'"{key}"', text)
    return raw.encode()


def base_body() -> dict:
    group = make_group(2, length=8, turn_scores=True, policy_version=1, env_id=0)
    body = group.to_scored_data().model_dump(mode="json", exclude_none=True)
    body["messages"] = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    body["metadata"] = {"note": "fuzz"}
    body.pop("group_id")
    return body


def paths(value, prefix=()):
    """Every path into a JSON value (dict keys and list indices)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


def set_path(body, path, value):
    target = body
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value


def get_path(body, path):
    for p in path:
        body = body[p]
    return body


def mutate(rng: random.Random) -> tuple[bytes, str]:
    body = base_body()
    kind = rng.choice(["replace", "replace", "replace", "length", "mask", "extra_key"])
    if kind == "mask":  # a trained mask that is not the token, or a trained first token
        i, j = rng.randrange(2), rng.choice([0, rng.randrange(1, 8)])
        body["masks"][i][j] = rng.choice([body["tokens"][i][j], body["tokens"][i][j] + 1, 7, -1])
        return encode(body), f"masks[{i}][{j}] = {body['masks'][i][j]}"
    if kind == "extra_key":  # Atropos's optional keys and ours with odd values
        key = rng.choice(["images", "env_id", "policy_versions", "overrides", "advantages",
                          "ref_logprobs", "generation_params", "group_overrides",
                          "trajectory_metadata", "flags", "segment_starts", "group_id"])
        value = rng.choice(BAD_VALUES + [[1, 2], [{}, {}], [[0.5] * 8, [0.5] * 8]])
        body[key] = value
        return encode(body), f"{key} = {value!r}"
    candidates = [p for p in paths(body) if p]
    path = rng.choice(candidates)
    if kind == "length":
        value = get_path(body, path)
        if not isinstance(value, list) or not value:
            path = path[:-1] or path
            value = get_path(body, path)
        if isinstance(value, list) and value:
            new = rng.choice([value[:-1], value + value[-1:], []])
            set_path(body, path, new)
            return encode(body), f"{path}: length {len(value)} -> {len(new)}"
    value = rng.choice(BAD_VALUES)
    set_path(body, path, value)
    return encode(body), f"{path} = {value!r}"


def model_accepts(raw: bytes) -> bool:
    try:
        ScoredGroup.from_scored_data(ScoredData.model_validate_json(raw))
        return True
    except (ValidationError, TrajectoryError, ValueError):
        return False


async def post(session, url, data, headers=None):
    async with session.post(url, data=data, headers=headers or {}) as r:
        return r.status, await r.json(content_type=None)


def assert_served(api, before):
    st = api.status()
    assert st["queue_size"] == before["queue_size"]
    assert st["counters"].get("received_groups", 0) == before["counters"].get("received_groups", 0)


def test_fuzzed_groups_get_4xx_naming_the_field_and_nothing_is_stored():
    rng = random.Random(20261123)

    async def scenario():
        async with running_api() as (url, api), aiohttp.ClientSession() as s:
            accepted = 0
            for case in range(400):
                raw, what = mutate(rng)
                before = api.status()
                code, out = await post(s, url + "/scored_data", raw,
                                       {"Content-Type": "application/json"})
                where = f"case {case}: {what} -> {code} {out}"
                assert code < 500, where
                if model_accepts(raw):
                    assert code == 200, where
                    accepted += 1
                    await api.reset()
                    continue
                assert code in (400, 413, 422), where
                top = out["field"].lstrip("[0123456789].").split("[")[0].split(".")[0]
                assert top in base_body() or top in what or top == "body", where
                assert_served(api, before)
                # the same body inside a list: the group's index is named, nothing stored
                code, out = await post(s, url + "/scored_data_list", b"[" + raw + b"]")
                assert code in (400, 422) and out["field"], where
                assert_served(api, before)
            assert 0 < accepted < 200  # both outcomes happened
            # still serving, and a good group is still taken
            code, out = await post(s, url + "/scored_data", encode(base_body()))
            assert code == 200 and api.status()["queue_size"] == 1
    run(scenario())


@pytest.mark.parametrize("path, payload", [
    ("/register", {"batch_size": 2**63, "max_token_len": 8}),
    ("/register", {"batch_size": "__BIG__", "max_token_len": 8}),
    ("/register", {"batch_size": 4, "max_token_len": 8, "wandb_group": "__SURROGATE__"}),
    ("/register", {"batch_size": 4, "max_token_len": 8, "starting_step": -1}),
    ("/register-env", {"max_token_length": 8, "desired_name": "__SURROGATE__", "group_size": 2}),
    ("/register-env", {"max_token_length": 8, "desired_name": "__DEEP__", "group_size": 2}),
    ("/register-env", {"max_token_length": 2**63, "desired_name": "e", "group_size": 2}),
    ("/register-env", {"max_token_length": 8, "desired_name": "e", "group_size": 2,
                       "weight": "__INF__"}),
    ("/policy_version", {"version": 2**63}),
    ("/policy_version", {"version": -1}),
    ("/lease", {"batch_size": 2**63}),
    ("/lease", {"batch_size": 4, "trainer_id": "__SURROGATE__"}),
    ("/ack", {"lease_id": "__DEEP__"}),
    ("/ack", {"lease_id": "__SURROGATE__"}),
    ("/status-env", {"env_id": 2**64}),
    ("/disconnect-env", {"env_id": -(2**63) - 1}),
])
def test_other_endpoints_refuse_bad_input_with_4xx(path, payload):
    async def scenario():
        async with running_api() as (url, api), aiohttp.ClientSession() as s:
            method = "GET" if path == "/status-env" else "POST"
            async with s.request(method, url + path, data=encode(payload)) as r:
                code, out = r.status, await r.json(content_type=None)
            assert 400 <= code < 500, (code, out)
            assert out["error"]
            async with s.get(url + "/status") as r:  # status still encodes
                assert r.status == 200
    run(scenario())


def test_bad_gzip_and_content_types_keep_the_connection_usable():
    good = encode(base_body())

    async def scenario():
        async with running_api() as (url, api):
            # one connection, kept alive: a bad body must not break the next request
            connector = aiohttp.TCPConnector(limit=1, force_close=False)
            async with aiohttp.ClientSession(connector=connector) as s:
                for data, headers in [
                    (b"\x1f\x8b garbage" * 100, {"Content-Encoding": "gzip"}),
                    (gzip.compress(good)[:40], {"Content-Encoding": "gzip"}),
                    (good, {"Content-Encoding": "gzip"}),  # says gzip, is not
                    (gzip.compress(good), {}),  # is gzip, does not say so
                    (b"tokens=1&masks=2", {"Content-Type": "application/x-www-form-urlencoded"}),
                    (good.decode().encode("utf-16"), {"Content-Type": "application/json"}),
                    (b"\xff\xfe\x00garbage", {"Content-Type": "text/plain"}),
                ]:
                    code, out = await post(s, url + "/scored_data", data, headers)
                    assert code in (400, 415, 422), (headers, code, out)
                    assert out["field"] == "body" and out["error"]
                    code, out = await post(s, url + "/scored_data", good,
                                           {"Content-Type": "application/json"})
                    assert code == 200, (headers, out)
                    await api.reset()
    run(scenario())
