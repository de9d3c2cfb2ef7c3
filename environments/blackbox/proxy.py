"""The interception proxy: a model endpoint per rollout that records exact tokens, in
each wire API a harness speaks.

A black-box agent is pointed at ``{proxy}/rollout/{id}/v1`` (OpenAI clients) or
``{proxy}/rollout/{id}`` (Anthropic and Gemini clients, which add ``/v1`` or ``/v1beta``
themselves), with the rollout's token as its API key (``Authorization: Bearer``,
``x-api-key``, ``x-goog-api-key`` or the query's ``key``; compared in constant time).
Unknown rollouts get 404, finished ones 410. Four dialects
(:mod:`environments.blackbox.dialects`) are served over one recorder
(:mod:`environments.blackbox.recorder`):

* ``POST .../v1/chat/completions``: OpenAI Chat Completions (:mod:`.dialects.chat`);
* ``POST .../v1/responses``: the OpenAI Responses API (:mod:`.dialects.responses`);
* ``POST .../v1/messages`` (``?beta=true`` too): Anthropic Messages
  (:mod:`.dialects.messages`), and ``POST .../v1/messages/count_tokens``;
* ``POST .../v1beta/models/{model}:generateContent`` and ``:streamGenerateContent``
  (``?alt=sse``), also under ``/v1/``: Google Gemini (:mod:`.dialects.gemini`), and
  ``:countTokens``.

Each request is rendered through the chat template into the same token-in/token-out path:
its history must extend what was recorded (else a new *segment* starts), one assistant
turn is generated on vLLM with the env's sampling (never the agent's), its ids and
logprobs are appended as trained tokens, its tool calls parsed with the env's parser, and
the reply is sent in the request's dialect (JSON, or server-sent events when it streams).
Also answered: ``GET .../v1/models`` (OpenAI and Anthropic fields), and ``HEAD`` / ``GET``
of ``/rollout/{id}`` and ``/rollout/{id}/v1`` (the reachability probes harnesses send).

Length: a request's own limit (``max_tokens``, ``max_completion_tokens``,
``max_output_tokens``, ``generationConfig.maxOutputTokens``) only shortens a reply below
the env's limits (``max_tokens_per_turn`` and the room left in ``max_token_length``),
never lengthens it; a reply cut there says so in its dialect and flags the rollout truncated. Past
``max_turns`` model calls, or when a segment's context no longer fits in
``max_token_length``, the request is refused with HTTP 400 (``code``:
``max_turns_exceeded`` / ``context_length_exceeded``) and the rollout is flagged
truncated.

Client mistakes: every malformed request gets a 4xx in its dialect's error form (OpenAI:
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field, e.g.
``messages[2].tool_calls[0].function.arguments`` or ``input[3].call_id``; Anthropic:
``{"type": "error", "error": {...}}``; Gemini: ``{"error": {"code", "message", "status",
"details"}}``), is counted in the rollout's ``refused`` and logged
as one line, and leaves the recorded trajectory as it was: a body that is not JSON (400
``invalid_json``), a field of the wrong type (400 ``invalid_request``), a body over
``max_request_bytes`` (413, also after gzip decompression), an unreadable compressed
body (400). A path or method the proxy does not serve gets 404/405; under a known rollout
it is logged once per path and kept in the rollout's ``unserved`` (an agent failure
quotes them). What aiohttp's HTTP parser cannot read it answers 400 itself; the proxy
counts those (``refused_without_rollout``, with unknown rollouts and paths) and logs one
line without aiohttp's traceback. A 5xx means a vLLM failure (502) or a bug of the proxy
(500, logged with its traceback); either fails the rollout. Each model call's status is
kept in the rollout's ``statuses``.

Abandoned replies (an agent that gave up on a request and sent it again) are taken out of
the trajectory and kept in ``extra["abandoned_replies"]``: see the recorder.

The rollout's trajectory (:meth:`InterceptedRollout.to_rollout_state`) is one token
sequence: its segments one after the other, with ``segment_starts`` marking where each new
context begins (the trainer trains each segment as its own row).
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import uuid
from pathlib import Path
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from environments.blackbox.dialects import Dialect, TurnRequest
from environments.blackbox.dialects.chat import ChatDialect, normalize_message  # noqa: F401
from environments.blackbox.dialects.gemini import GeminiDialect
from environments.blackbox.dialects.messages import MessagesDialect
from environments.blackbox.dialects.responses import ResponsesDialect
from environments.blackbox.recorder import (  # noqa: F401  (the proxy's names, as before)
    InterceptedRollout,
    Limits,
    Message,
    RequestError,
    Segment,
    record_turn,
    trajectory_message,
)
from environments.inference.backends import VLLMBackend, current_seeds
from environments.inference.chat_template import ChatRenderer, ChatTemplateError
from environments.inference.tool_parsers import ToolCallParser
from environments.inference.vllm_client import InferenceError

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024 * 1024
"""The largest request body the proxy reads (413 above it)."""
DIALECTS: tuple[Dialect, ...] = (ChatDialect(), ResponsesDialect(), MessagesDialect(),
                                 GeminiDialect())
_ROLLOUT_PATH = re.compile(r"^/rollout/([^/]+)(/.*)?$")


class InterceptionProxy:
    """One aiohttp server for many rollouts (``/rollout/{id}/v1/...``).

    ``backend``: a :class:`VLLMBackend` (its pool, renderer and sampling settings);
    ``policy_version``: read at each turn, recorded per turn; ``scripted_turns``: the
    text of each rollout's first turns, forced token by token instead of sampled (each
    ended with the end-of-turn token; the policy's own logprobs recorded): a scripted
    episode for smoke tests of a harness with a random model.
    """

    def __init__(self, backend: VLLMBackend, parser: ToolCallParser, *, max_turns: int,
                 max_token_length: int, max_tokens_per_turn: int | None = None,
                 model_name: str = "policy",
                 policy_version: Callable[[], int | None] = lambda: None,
                 max_request_bytes: int = MAX_REQUEST_BYTES,
                 scripted_turns: list[str] | None = None):
        self.backend = backend
        self.renderer: ChatRenderer = backend.renderer
        self.parser = parser
        self.max_turns = max_turns
        self.max_token_length = max_token_length
        self.max_tokens_per_turn = max_tokens_per_turn
        self.model_name = model_name
        self.policy_version = policy_version
        tokenizer = self.renderer.tokenizer
        self.script = [tokenizer.encode(text, add_special_tokens=False)
                       + [tokenizer.eos_token_id] for text in scripted_turns or []]
        self.rollouts: dict[str, InterceptedRollout] = {}
        self.max_request_bytes = max_request_bytes
        self.refused_without_rollout = 0
        """Requests refused before a rollout could be told (malformed HTTP, an unknown
        rollout or path); a rollout's own refusals are counted in its ``refused``."""
        self.unserved_requests = 0
        """Requests to a path or method the proxy does not serve (under a rollout)."""
        self.app = web.Application(client_max_size=max_request_bytes,
                                   middlewares=[self._errors_as_json])
        for dialect in DIALECTS:
            for route in dialect.routes():
                self.app.router.add_post(f"/rollout/{{rollout}}{route}", self._handler(dialect))
        self.app.router.add_get("/rollout/{rollout}/v1/models", self._models)
        for probe in ("/rollout/{rollout}", "/rollout/{rollout}/", "/rollout/{rollout}/v1",
                      "/rollout/{rollout}/v1/"):
            self.app.router.add_get(probe, self._probe)  # (GET routes answer HEAD too)
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        self.unix_path: Path | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0,
                    unix_path: str | Path | None = None) -> None:
        """Listen on ``host:port`` (0: any free port; ``self.url`` says which) and, if
        given, on the Unix socket ``unix_path`` (how sandboxed agents reach it)."""
        self._runner = web.AppRunner(self.app, access_log=None, logger=_HTTPErrorLog(self))
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = self._runner.addresses[0][1]  # the one bound, when 0 was asked
        self.url = f"http://{host}:{port}"
        if unix_path is not None:
            self.unix_path = Path(unix_path)
            self.unix_path.parent.mkdir(parents=True, exist_ok=True)
            await web.UnixSite(self._runner, str(self.unix_path)).start()
            self.unix_path.chmod(0o666)  # sandbox uids connect; the token is the guard

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_rollout(self, backend: VLLMBackend | None = None) -> InterceptedRollout:
        """A new rollout: its id (in the URL) and its token (the agent's API key).
        ``backend``: its sampling settings (default: the proxy's; e.g. the eval ones)."""
        rollout = InterceptedRollout(uuid.uuid4().hex, secrets.token_urlsafe(32),
                                     backend or self.backend, seeds=current_seeds())
        self.rollouts[rollout.id] = rollout
        return rollout

    def base_url(self, rollout: InterceptedRollout, server: str | None = None) -> str:
        """``OPENAI_BASE_URL`` for ``rollout`` (``server``: how the agent reaches this
        proxy; default its TCP address). Anthropic clients take it without ``/v1``."""
        return f"{server or self.url}/rollout/{rollout.id}/v1"

    async def finish_rollout(self, rollout: InterceptedRollout) -> Any:
        """Refuse the rollout's further requests, wait for one in flight, and return its
        trajectory."""
        rollout.finished = True
        async with rollout.lock:
            self.rollouts.pop(rollout.id, None)
            return rollout.to_rollout_state()

    # -- HTTP ----------------------------------------------------------------------------
    @staticmethod
    def _error(status: int, message: str, code: str, kind: str = "invalid_request_error",
               param: str | None = None, dialect: Dialect = DIALECTS[0]) -> web.Response:
        return web.json_response(dialect.error_body(message, code, kind, param, status),
                                 status=status)

    def _refuse(self, rollout: InterceptedRollout, error: RequestError,
                dialect: Dialect = DIALECTS[0]) -> web.Response:
        """Count and answer a refused request (one log line, no traceback)."""
        rollout.refused += 1
        log.info("rollout %s: refused a request (%d, %s): %s", rollout.id, error.status,
                 error.code, error)
        response = self._error(error.status, str(error), error.code, param=error.param,
                               dialect=dialect)
        if error.status == 413 or error.code == "unreadable_body":
            response.force_close()  # the rest of the body is not read
        return response

    @web.middleware
    async def _errors_as_json(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp's own refusals (unknown path 404, wrong method 405) as errors in the
        request's dialect; under a known rollout, logged once per path and kept."""
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            self.refused_without_rollout += 1
            match = _ROLLOUT_PATH.match(request.path)
            dialect = _dialect_for(match.group(2) or "" if match else request.path)
            rollout = self.rollouts.get(match.group(1)) if match else None
            if rollout is not None and error.status in (404, 405):
                what = f"{request.method} {match.group(2) or '/'}"
                self.unserved_requests += 1
                if what not in rollout.unserved:
                    log.warning("rollout %s: the agent asked for %s, which the proxy does not "
                                "serve (%d)", rollout.id, what, error.status)
                rollout.unserved.append(what)
            kind = "not_found_error" if error.status in (404, 405) else "invalid_request_error"
            return self._error(error.status, f"{request.method} {request.path}: {error.reason}",
                               error.reason.lower().replace(" ", "_"), kind, dialect=dialect)

    def _authorize(self, request: web.Request, dialect: Dialect = DIALECTS[0]
                   ) -> InterceptedRollout | web.Response:
        rollout_id = request.match_info["rollout"]
        rollout = self.rollouts.get(rollout_id)
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        given = (given or request.headers.get("x-api-key", "").strip()
                 or request.headers.get("x-goog-api-key", "").strip()
                 or request.query.get("key", "").strip())
        if rollout is None:
            self.refused_without_rollout += 1
            return self._error(404, f"unknown or finished rollout {rollout_id!r}",
                               "rollout_not_found", "not_found_error", dialect=dialect)
        if not hmac.compare_digest(given.encode(), rollout.token.encode()):
            rollout.refused += 1
            return self._error(401, "wrong or missing API key for this rollout",
                               "invalid_api_key", "authentication_error", dialect=dialect)
        if rollout.finished:
            return self._error(410, f"rollout {rollout_id!r} has finished", "rollout_finished",
                               "not_found_error", dialect=dialect)
        return rollout

    async def _probe(self, request: web.Request) -> web.Response:
        rollout = self._authorize(request)
        if isinstance(rollout, web.Response) and rollout.status != 401:
            return rollout
        return web.json_response({"status": "ok"})  # (reachability: no key needed)

    async def _models(self, request: web.Request) -> web.Response:
        rollout = self._authorize(request)
        if isinstance(rollout, web.Response):
            return rollout
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "lachesis",
                 "type": "model", "display_name": self.model_name,
                 "created_at": "1970-01-01T00:00:00Z"}
        return web.json_response({"object": "list", "data": [model], "has_more": False,
                                  "first_id": self.model_name, "last_id": self.model_name})

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body; :class:`RequestError` when it is too large or unreadable."""
        limit = self.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(f"the request body has {request.content_length} bytes; the "
                               f"proxy takes {limit} at most", "request_too_large", "body", 413)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"the request body is over the proxy's {limit}-byte limit",
                               "request_too_large", "body", 413) from None
        except Exception as error:  # a broken gzip stream, a bad chunked encoding
            raise RequestError(f"unreadable request body ({type(error).__name__}: "
                               f"{str(error).strip()})", "unreadable_body", "body") from None

    def _handler(self, dialect: Dialect) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            kind = dialect.kind(request)
            if kind is None:
                raise web.HTTPNotFound()  # (an action it does not serve: logged, kept)
            rollout = self._authorize(request, dialect)
            if isinstance(rollout, web.Response):
                return rollout
            if kind == "count":
                return await self._count_tokens(request, rollout, dialect)
            response = await self._call(request, rollout, dialect)
            rollout.statuses.append(response.status)
            return response
        return handle

    async def _call(self, request: web.Request, rollout: InterceptedRollout,
                    dialect: Dialect) -> web.StreamResponse:
        try:
            turn = dialect.parse(await self._read_body(request), rollout,
                                 **dialect.request_options(request))
        except RequestError as error:
            return self._refuse(rollout, error, dialect)
        async with rollout.lock:
            if rollout.finished:
                return self._error(410, "rollout has finished", "rollout_finished",
                                   "not_found_error", dialect=dialect)
            rollout.requests += 1
            rollout.dialects.add(dialect.name)
            try:
                reply = await self._turn(rollout, turn, dialect)
            except RequestError as error:
                return self._refuse(rollout, error, dialect)
            except InferenceError as error:
                rollout.failure = str(error)
                log.error("rollout %s: inference failed: %s", rollout.id, error)
                return self._error(502, f"inference failed: {error}", "inference_failed",
                                   "api_error", dialect=dialect)
            except Exception as error:  # a bug of the proxy: the rollout cannot be trusted
                rollout.failure = f"proxy error: {type(error).__name__}: {error}"
                log.exception("rollout %s: the proxy failed on a request", rollout.id)
                return self._error(500, f"the proxy failed: {type(error).__name__}: {error}",
                                   "proxy_error", "api_error", dialect=dialect)
        if turn.stream:
            return await self._stream(request, dialect.events(turn, reply), reply)
        return web.json_response(reply)

    async def _turn(self, rollout: InterceptedRollout, turn: TurnRequest,
                    dialect: Dialect) -> dict[str, Any]:
        """One recorded turn, as the dialect replies it."""
        reply = await record_turn(
            rollout, turn.messages, turn.tools, turn.max_tokens, renderer=self.renderer,
            parser=self.parser, policy_version=self.policy_version,
            limits=Limits(self.max_turns, self.max_token_length, self.max_tokens_per_turn),
            call_id=dialect.call_id, script=self.script)
        return dialect.reply(turn, reply, self.model_name, rollout)

    async def _count_tokens(self, request: web.Request, rollout: InterceptedRollout,
                            dialect: Dialect) -> web.Response:
        """Anthropic's ``count_tokens``, Gemini's ``countTokens``: the prompt's length;
        nothing is recorded."""
        try:
            messages, tools = dialect.count(await self._read_body(request), rollout)
            prompt = self.renderer.prompt_ids([m.rendered for m in messages], tools)
        except RequestError as error:
            return self._refuse(rollout, error, dialect)
        except ChatTemplateError as error:
            return self._refuse(rollout, RequestError(f"messages: {error}", param="messages"),
                                dialect)
        return web.json_response(dialect.count_body(len(prompt)))

    @staticmethod
    async def _stream(request: web.Request, events: list[bytes],
                      reply: dict[str, Any]) -> web.StreamResponse:
        """The finished reply as server-sent events."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            for event in events:
                await response.write(event)
            await response.write_eof()
        except ConnectionResetError:  # the agent hung up; the turn is recorded all the same
            log.info("the agent disconnected during the streamed reply %s", reply.get("id"))
        return response


def _dialect_for(path: str) -> Dialect:
    """The dialect whose errors a request to ``path`` (under ``/rollout/{id}``) gets."""
    if "/v1/messages" in path:
        return DIALECTS[2]
    if path.startswith(("/v1beta/", "/v1/models/")):
        return DIALECTS[3]
    return DIALECTS[0]


class _HTTPErrorLog(logging.LoggerAdapter):
    """aiohttp's server log for the proxy. A request aiohttp's HTTP parser cannot read (a
    bad request line, header, Content-Length or chunk; a broken compressed body) is the
    client's mistake: aiohttp answers it 400 itself, and here it is counted and logged as
    one line, without aiohttp's traceback. Anything else is logged as aiohttp logs it."""

    def __init__(self, proxy: InterceptionProxy):
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.proxy = proxy

    def _client_mistake(self, exc_info: Any) -> bool:
        if isinstance(exc_info, RequestPayloadError):  # a body the proxy already refused
            log.debug("the refused request's body: %s", " ".join(str(exc_info).split()))
            return True
        if not isinstance(exc_info, HttpProcessingError):
            return False
        self.proxy.refused_without_rollout += 1
        log.warning("refused a malformed HTTP request: %s",
                    " ".join(str(exc_info).split())[:300])
        return True

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if not self._client_mistake(exc_info):
            self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not self._client_mistake(kwargs.get("exc_info")):
            self.logger.debug(msg, *args, **kwargs)
