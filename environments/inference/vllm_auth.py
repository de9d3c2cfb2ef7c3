"""The run's token on every route of a vLLM server but ``/health``.

vLLM's own ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``: with ``VLLM_SERVER_DEV_MODE=1`` (which the weight sync needs) anyone who
reaches the port could still ``POST /pause``, load weights from a path of their choosing
(``/collective_rpc``, the weight-transfer routes), put the server to sleep or read its
``/metrics``. :class:`RunTokenMiddleware` refuses every request, HTTP or WebSocket, whose
``Authorization`` header is not ``Bearer TOKEN`` (the token from ``LACHESIS_API_TOKEN``),
before vLLM's routing sees it: a refused request changes nothing. ``/health`` stays open
(supervisors and load balancers probe it; it says only up or down).

vLLM installs it through its ``--middleware`` flag, which takes an import path (the token
itself stays in the environment: a command line is visible to every user of the machine
in ``ps``); :func:`middleware_args` gives the flag, and
:class:`~environments.inference.vllm_process.VLLMProcess` adds it when it starts a
guarded server. It is the hook vLLM offers for this: its general plugins (our weight
transfer, :mod:`environments.inference.weight_transfer`) load before the app exists, and
its endpoint plugins load only where ``VLLM_PLUGINS`` names them, which would also filter
out every other general plugin.
"""

from __future__ import annotations

from typing import Any

from environments.settings import TOKEN_VARIABLE, run_token, token_matches

OPEN_PATHS = frozenset({"/health"})
"""Answered without the token."""
MIDDLEWARE = f"{__name__}.RunTokenMiddleware"


def middleware_args() -> list[str]:
    """vLLM's command-line arguments that install :class:`RunTokenMiddleware`."""
    return ["--middleware", MIDDLEWARE]


class RunTokenMiddleware:
    """Pure ASGI middleware: 401 (HTTP) or a closed socket (WebSocket) without the run's
    token. A server told to use it without a token refuses to start, rather than serve
    unguarded."""

    def __init__(self, app: Any, token: str | None = None) -> None:
        self.app = app
        self.token = token or run_token()
        if not self.token:
            raise RuntimeError(f"{MIDDLEWARE} guards this server with the run's token, "
                               f"but {TOKEN_VARIABLE} is not set")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        from starlette.datastructures import Headers  # vLLM's server brings starlette
        from starlette.responses import JSONResponse

        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS \
                or token_matches(Headers(scope=scope).get("authorization"), self.token):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = JSONResponse({"error": "missing or wrong bearer token (Authorization "
                                          "header)"}, status_code=401)
        await response(scope, receive, send)
