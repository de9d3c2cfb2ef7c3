"""The run's token (docs/security.md): every server of a run refuses a request without it.

The rollout API's routes are in tests/test_api.py; the whole system under ``lachesis
run`` (one machine: tests/test_run.py, two Ray nodes on loopback: tests/test_ray.py) is
probed by :func:`check_the_run_is_guarded` below."""

from __future__ import annotations

import importlib
import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer
from conftest import run, running_api

from environments.settings import TOKEN_VARIABLE

WRONG = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "not-even-bearer"})
"""Headers a guarded route must refuse: none, a wrong token, a malformed header."""


def test_every_route_of_vllms_server_refuses_a_request_without_the_run_token(monkeypatch):
    """vLLM's own app, built as its server builds it in dev mode (which the weight sync
    needs) with the middleware that VLLMProcess adds: each of its routes (read off the app,
    so a route a new vLLM adds is covered too), the dev routes (/pause, /collective_rpc,
    weight transfer, sleep) and the OpenAI ones included, answers 401 without the token or
    with a wrong one before reaching vLLM (whose handlers would fail here: no engine runs);
    /health and a request with the token go through."""
    pytest.importorskip("vllm")
    from starlette.routing import Route
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from environments.inference.vllm_process import VLLMProcess

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv(TOKEN_VARIABLE, "s3cret")
    command = VLLMProcess("/models/x", guarded=True, port=1).command()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        command[command.index("--model"):])
    client = TestClient(build_app(args, ("generate",)), raise_server_exceptions=False)
    routes = [(method, route.path) for route in client.app.routes if isinstance(route, Route)
              for method in sorted(route.methods - {"HEAD"})]
    paths = {path for _, path in routes}
    assert {"/pause", "/resume", "/collective_rpc", "/init_weight_transfer_engine",
            "/update_weights", "/sleep", "/wake_up", "/v1/completions", "/metrics"} <= paths
    for method, path in routes:
        url = path.replace("{response_id}", "x")
        for headers in WRONG:
            response = client.request(method, url, headers=headers, json={})
            expected = 401 if path != "/health" else 500  # the handler ran: no engine
            assert response.status_code == expected, (method, path, headers, response.text)
    assert client.post("/pause", headers={"Authorization": "Bearer s3cret"}).status_code == 500
    from starlette.websockets import WebSocketDisconnect  # e.g. vLLM's /v1/realtime

    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect("/v1/realtime"):
        pass
    assert closed.value.code == 1008

    monkeypatch.delenv(TOKEN_VARIABLE)  # told to guard without a token: it does not start
    with pytest.raises(RuntimeError, match=TOKEN_VARIABLE):
        with TestClient(build_app(args, ("generate",))):
            pass


def test_the_atropos_bridge_wants_the_token_and_passes_it_on(vllm_server):
    """``lachesis atropos-generate`` with a token: /generate and the /v1 passthrough
    answer 401 without it (vLLM never sees the request) and generate with it."""
    from environments.inference.atropos_generate import build_app
    from environments.inference.vllm_client import VLLMServerPool

    async def scenario():
        pool = VLLMServerPool([vllm_server.url], vllm_server.model_name, api_key="s3cret")
        server = TestServer(build_app(pool, token="s3cret"), host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        body = {"prompt": {"prompt_token_ids": [1, 2, 3]}, "n": 1, "max_tokens": 2,
                "ignore_eos": True}  # (a random model may end at once)
        try:
            async with aiohttp.ClientSession() as session:
                before = pool.stats.requests
                for path in ("/generate", "/v1/completions"):
                    for headers in WRONG:
                        async with session.post(url + path, json=body,
                                                headers=headers) as response:
                            assert response.status == 401, path
                assert pool.stats.requests == before
                async with session.get(url + "/health") as response:
                    assert response.status == 200
                async with session.post(url + "/generate", json=body, headers={
                        "Authorization": "Bearer s3cret"}) as response:
                    assert response.status == 200
                    assert len((await response.json())["token_ids"][0]) == 2
        finally:
            await server.close()
    run(scenario())


def test_an_atropos_envs_own_sessions_carry_the_token_to_the_run_and_nowhere_else(
        monkeypatch, tmp_path):
    """An unchanged atroposlib env opens plain aiohttp sessions to the rollout API and
    calls its inference servers through the ``openai`` client (httpx2 in openai 3.x):
    ``lachesis env serve`` makes those to the run's API and bridge (named in its settings
    file) carry the token, and requests to any other address none."""
    import httpx
    import openai

    from lachesis.env_kinds import atropos_token_origins, send_token_to

    monkeypatch.setattr(aiohttp.ClientSession, "_request", aiohttp.ClientSession._request)
    for name in ("httpx", "httpx2"):
        if (module := _optional(name)) is not None:
            monkeypatch.setattr(module.AsyncClient, "send", module.AsyncClient.send)
    seen, bridge_seen = [], []

    async def echo(request):
        seen.append(request.headers.get("Authorization"))
        return aiohttp.web.json_response({})

    async def models(request):
        bridge_seen.append(request.headers.get("Authorization"))
        return aiohttp.web.json_response({"object": "list", "data": []})

    async def scenario():
        other_app, bridge_app = aiohttp.web.Application(), aiohttp.web.Application()
        other_app.router.add_route("*", "/{tail:.*}", echo)
        bridge_app.router.add_get("/v1/models", models)
        other = TestServer(other_app, host="127.0.0.1")
        bridge = TestServer(bridge_app, host="127.0.0.1")
        await other.start_server()
        await bridge.start_server()
        async with running_api(token="s3cret") as (api_url, api):
            settings = tmp_path / "env.yaml"
            settings.write_text(yaml.safe_dump({
                "env": {"rollout_server_url": api_url},
                "openai": [{"base_url": str(other.make_url("/v1")).replace("127.0.0.1",
                                                                           "localhost")},
                           {"base_url": str(bridge.make_url("/v1"))}]}))
            origins = atropos_token_origins(["serve", "--config", str(settings)])
            async with aiohttp.ClientSession() as session:
                async with session.get(api_url + "/status") as response:
                    assert response.status == 401
            send_token_to(origins, "s3cret")
            async with aiohttp.ClientSession() as session:
                async with session.get(api_url + "/status") as response:
                    assert response.status == 200
                async with session.get(str(other.make_url("/x"))) as response:
                    assert response.status == 200
            async with httpx.AsyncClient() as client:
                assert (await client.get(api_url + "/status")).status_code == 200
                await client.get(str(other.make_url("/y")))
            inference = openai.AsyncOpenAI(api_key="x", base_url=str(bridge.make_url("/v1")))
            await inference.models.list()  # how atroposlib's chat_completion calls reach it
            await inference.close()
        await other.close()
        await bridge.close()
    run(scenario())
    assert seen == [None, None]  # another port of this machine got no token
    assert bridge_seen == ["Bearer s3cret"]  # the run's bridge got it, not the env's api_key


def _optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# -- under `lachesis run` ----------------------------------------------------------------
def http(method: str, url: str, token: str | None = None, body: dict | None = None,
         headers: dict | None = None) -> tuple[int, bytes]:
    headers = dict(headers or {})
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def run_token_of(pids: list[int]) -> str:
    """The one token that every process of the run carries in its environment."""
    tokens = set()
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        found = [e.split(b"=", 1)[1] for e in environ if e.startswith(TOKEN_VARIABLE.encode() + b"=")]
        assert found, f"process {pid} of the run has no {TOKEN_VARIABLE}"
        tokens.update(found)
    assert len(tokens) == 1, "the processes of one run carry different tokens"
    token = tokens.pop().decode()
    assert len(token) >= 32
    return token


def command_lines() -> dict[int, bytes]:
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                pass
    return lines


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket that one of ``pids`` listens on."""
    import ipaddress

    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue  # exited meanwhile
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw)
            found.add((str(getattr(ip, "ipv4_mapped", None) or ip), int(port, 16)))
    return found


def trainer_pids(pids: list[int]) -> list[int]:
    found = []
    for pid in pids:
        try:
            if b"train" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            pass
    return found


def check_the_run_is_guarded(run_dir: Path, pids: list[int]) -> None:
    """While the run of ``run_dir`` (processes ``pids``) trains: the run's token is in
    every process's environment and in no command line on this machine; a request without
    it or with a wrong one to the rollout API, and to vLLM's /collective_rpc, /pause and
    /v1/completions, gets 401 and changes nothing; every socket a process of the run
    listens on is on 127.0.0.1.
    (The trainer is held meanwhile, so that nothing else changes the policy version or
    pauses vLLM.)"""
    token = run_token_of(pids)
    assert not [pid for pid, line in command_lines().items() if token.encode() in line]
    api = yaml.safe_load((run_dir / "configs" / "api.yaml").read_text())
    vllm_urls = yaml.safe_load((run_dir / "configs" / "train.yaml").read_text())["vllm_urls"]
    assert api["host"] == "127.0.0.1"
    assert all(u.startswith("http://127.0.0.1:") for u in vllm_urls)
    sockets = listening(pids)
    assert (api["host"], api["port"]) in sockets
    assert {a for a, _ in sockets} <= {"127.0.0.1", "::1"}, sockets
    api_url = f"http://{api['host']}:{api['port']}"

    def status() -> dict:
        code, body = http("GET", api_url + "/status", token)
        assert code == 200, body
        return json.loads(body)

    def paused(url: str) -> bool:
        code, body = http("GET", url + "/is_paused", token)
        assert code == 200, body
        return json.loads(body)["is_paused"]

    held = trainer_pids(pids)
    assert held
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        before = status()
        was_paused = [paused(url) for url in vllm_urls]
        refused = 0
        for headers in WRONG:
            for method, path, body in (
                    ("POST", "/policy_version", {"version": 10**6}),
                    ("POST", "/reset_data", None), ("POST", "/register", {
                        "batch_size": 1, "max_token_len": 1, "wandb_group": "x",
                        "wandb_project": "x", "checkpoint_dir": "x",
                        "save_checkpoint_interval": 1, "starting_step": 0, "num_steps": 1}),
                    ("GET", "/batch", None), ("GET", "/status", None)):
                code, _ = http(method, api_url + path, body=body, headers=headers)
                assert code == 401, (path, headers)
                refused += 1
            for url in vllm_urls:
                assert http("POST", url + "/pause?mode=abort", headers=headers)[0] == 401
                assert http("POST", url + "/collective_rpc", headers=headers, body={
                    "method": "reload_weights",
                    "kwargs": {"weights_path": "/nonexistent"}})[0] == 401
                assert http("POST", url + "/v1/completions", headers=headers, body={
                    "model": "policy", "prompt": [1, 2], "max_tokens": 1})[0] == 401
        after = status()
        assert after["policy_version"] == before["policy_version"]
        assert after["trainer_registered"] == before["trainer_registered"]
        unauthorized = "rejected_unauthorized"
        assert after["counters"][unauthorized] - before["counters"].get(unauthorized, 0) \
            == refused
        assert http("GET", api_url + "/health")[0] == 200
        assert [paused(url) for url in vllm_urls] == was_paused
        for url, was in zip(vllm_urls, was_paused):
            assert http("GET", url + "/health")[0] == 200
            if not was:  # a paused server holds new requests until the trainer resumes it
                code, body = http("POST", url + "/v1/completions", token, {
                    "model": "policy", "prompt": [1, 2], "max_tokens": 1})
                assert code == 200, body
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
