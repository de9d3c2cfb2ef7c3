"""Atropos's ``/generate`` route in front of plain vLLM OpenAI servers.

atroposlib 0.4.0 gets exact tokens and logprobs only with ``server_type: vllm``, whose
``tokens_and_logprobs_completion`` (behind ``ManagedServer``, the way Atropos envs track
tokens, masks and logprobs) posts to ``BASE/generate``, a route of Atropos's own vLLM
server script that vLLM's OpenAI server does not have. This small server gives an
unchanged Atropos env that route on top of the vLLM servers Lachesis runs:

* ``POST /generate`` ``{"prompt": {"prompt_token_ids": [...]}, "n": N, "max_tokens": M,
  "logprobs": 0, <other sampling params>}`` samples ``N`` continuations of those exact
  token ids through :class:`~environments.inference.vllm_client.VLLMServerPool`
  (``N`` requests to ``/v1/completions`` with ``return_token_ids``, routed and retried
  by the pool; a ``seed`` thus gives ``N`` equal samples) and answers as Atropos's
  server does:
  ``{"logprobs": [[[{"<id>": logprob}], ...] per completion], "finish_reasons": [...],
  "token_ids": [...], "prompt_token_ids": [...]}``.
* ``GET /health``: 200 while a vLLM server is healthy.
* With a token (``LACHESIS_API_TOKEN``, which ``lachesis run`` sets to the run's): every
  route but ``/health`` refuses a request without ``Authorization: Bearer TOKEN`` (401),
  and the token goes on to the vLLM servers.
* ``/v1/...``: passed through to a healthy vLLM server (atroposlib's plain
  ``chat_completion``/``completion`` calls go there); no streaming.

``lachesis atropos-generate --vllm-url URL --port 9001``; the env then gets
``--openai.server_type vllm --openai.base_url http://HOST:9001/v1``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from aiohttp import web

from environments.inference.vllm_client import InferenceError, VLLMServerPool
from environments.settings import run_token, token_matches

log = logging.getLogger(__name__)

POOL_KEY = web.AppKey("pool", VLLMServerPool)
NOT_SAMPLING = ("prompt", "n", "logprobs", "model", "stream", "input_ids")
"""Request keys that are not passed on to vLLM as sampling parameters."""


class GenerateRequestError(ValueError):
    """A ``/generate`` body this server cannot serve; the message names the field."""


def prompt_token_ids(body: dict[str, Any]) -> list[int]:
    """The prompt of a ``/generate`` body: ``{"prompt_token_ids": [...]}`` (what
    atroposlib sends) or a bare list of ids. Text prompts are refused: tokenizing here
    could differ from the env's tokenizer."""
    prompt = body.get("prompt")
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    if not isinstance(ids, list) or not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise GenerateRequestError(
            "prompt: must be {\"prompt_token_ids\": [non-negative ints, ...]} (text prompts "
            "are not accepted: tokenize with the env's tokenizer)")
    return ids


def sampling_params(body: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """``(n, max_tokens, other sampling parameters)`` of a ``/generate`` body."""
    n = body.get("n", 1)
    max_tokens = body.get("max_tokens", body.get("max_new_tokens", 16))
    for name, value in (("n", n), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GenerateRequestError(f"{name}: must be a positive integer, got {value!r}")
    if body.get("stream"):
        raise GenerateRequestError("stream: streaming is not supported")
    rest = {k: v for k, v in body.items()
            if k not in NOT_SAMPLING and k not in ("max_tokens", "max_new_tokens")}
    return n, max_tokens, rest


async def handle_generate(request: web.Request) -> web.Response:
    pool = request.app[POOL_KEY]
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise GenerateRequestError("body: must be a JSON object")
        ids = prompt_token_ids(body)
        n, max_tokens, sampling = sampling_params(body)
    except (ValueError, GenerateRequestError) as error:  # JSONDecodeError is a ValueError
        return web.json_response({"error": str(error)}, status=400)
    try:
        completions = await asyncio.gather(*(
            pool.complete(ids, max_tokens=max_tokens, sampling=sampling) for _ in range(n)))
    except InferenceError as error:  # vLLM refused it, or every retry failed: it says which
        return web.json_response({"error": str(error)}, status=502)
    return web.json_response({
        "logprobs": [[[{str(t): lp}] for t, lp in zip(c.token_ids, c.logprobs)]
                     for c in completions],
        "finish_reasons": [c.finish_reason for c in completions],
        "token_ids": [c.token_ids for c in completions],
        "prompt_token_ids": ids,
    })


async def handle_health(request: web.Request) -> web.Response:
    pool = request.app[POOL_KEY]
    healthy = any(s.healthy for s in pool.servers)
    return web.json_response({"healthy": healthy, "servers": pool.describe()},
                             status=200 if healthy else 503)


async def handle_passthrough(request: web.Request) -> web.Response:
    """Forward ``/v1/...`` to a healthy vLLM server, as is."""
    pool = request.app[POOL_KEY]
    server = next((s for s in pool.servers if s.healthy), pool.servers[0])
    headers = {k: v for k, v in request.headers.items()  # the pool's token goes on
               if k.lower() in ("content-type", "accept")}
    try:
        async with pool.session.request(request.method, server.url + request.rel_url.path_qs,
                                        data=await request.read(), headers=headers) as response:
            return web.Response(body=await response.read(), status=response.status,
                                content_type=response.content_type)
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        return web.json_response({"error": f"{server.url}: {type(error).__name__}: {error}"},
                                 status=502)


def token_required(token: str) -> Any:
    """aiohttp middleware: 401 on every route but ``/health`` without ``token``."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/health" \
                and not token_matches(request.headers.get("Authorization"), token):
            return web.json_response({"error": "missing or wrong bearer token "
                                               "(Authorization header)"}, status=401)
        return await handler(request)

    return check


def build_app(pool: VLLMServerPool, token: str | None = None) -> web.Application:
    """``token``: required on every route but ``/health`` (None: none required)."""
    app = web.Application(client_max_size=64 * 2**20,
                          middlewares=[token_required(token)] if token else [])
    app[POOL_KEY] = pool

    async def lifecycle(app: web.Application):
        await pool.start()
        log.info("Atropos /generate for %s (model %s)", [s.url for s in pool.servers], pool.model)
        yield
        await pool.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/generate", handle_generate)
    app.router.add_get("/health", handle_health)
    app.router.add_route("*", "/v1/{tail:.*}", handle_passthrough)
    return app


def serve(vllm_urls: list[str], *, host: str = "127.0.0.1", port: int = 9001,
          model: str | None = None) -> None:
    """Run the server until interrupted."""
    token = run_token()
    web.run_app(build_app(VLLMServerPool(vllm_urls, model, api_key=token), token),
                host=host, port=port,
                print=lambda _: log.info("listening on http://%s:%d", host, port))
