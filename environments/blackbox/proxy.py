"""The interception proxy: an OpenAI-compatible endpoint per rollout that records exact tokens.

A black-box agent (any program using an OpenAI client) is pointed at
``{proxy}/rollout/{id}/v1`` with the rollout's token as its API key. For every
``POST .../v1/chat/completions`` the proxy

1. checks the token (``Authorization: Bearer``; compared in constant time) and refuses
   unknown (404) or finished (410) rollouts;
2. checks that the request's history *extends* what it recorded for the rollout: the
   messages it saw before plus the assistant replies it sent, unchanged, with only new
   non-assistant messages (tool results, user turns) after them. If so, the new messages
   are appended as context tokens exactly as the framework's own agent loop does
   (:meth:`ChatRenderer.continuation`); if not (the agent edited, dropped or invented
   messages, or changed its tools) nothing is re-tokenized: a new *segment* starts
   (the whole request rendered as a fresh prompt), with the reason recorded;
3. generates one assistant turn token-in/token-out on vLLM (the env's sampling settings,
   not the agent's: the trainer needs the behaviour policy it assumes), appends the sampled
   ids and logprobs as trained tokens, parses the tool calls with the env's parser and
   replies with an OpenAI ``chat.completion`` (or, with ``stream: true``, the same reply as
   server-sent ``chat.completion.chunk`` events).

Sampling: every field that would change the distribution the tokens are drawn from
(``temperature``, ``top_p``, ``top_k``, penalties, ``logit_bias``, ``seed``, ``stop``,
``response_format``...) is ignored; the env's settings apply. The one exception is length:
``max_tokens`` / ``max_completion_tokens`` (the smaller, when both are given) are honoured,
but only to shorten a reply below the env's limits (``max_tokens_per_turn`` and the room
left in ``max_token_length``), never to lengthen it. A reply cut there has
``finish_reason: "length"`` and flags the rollout truncated, as any reply cut at a limit.

Limits: past ``max_turns`` model calls, or when a segment's context no longer fits in
``max_token_length``, the request is refused with HTTP 400 (``code``:
``max_turns_exceeded`` / ``context_length_exceeded``) and the rollout is flagged truncated.
Anything else the agent asks for that cannot be honoured exactly (``n > 1``, non-text
content) is refused with 400 and a message naming the field; sampling fields are ignored
(see above; ``max_tokens`` only shortens).

Client mistakes: every malformed request gets a 4xx in the OpenAI error form
(``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field, e.g.
``messages[2].tool_calls[0].function.arguments``, or ``body``), is counted in the
rollout's ``refused`` and logged as one line, and leaves the recorded trajectory as it
was: a body that is not JSON (bad UTF-8, lone surrogates, truncated, nested deeper than
200 levels, numbers past 4300 digits: 400 ``invalid_json``), a field of the wrong type
(sampling fields too, although their values are ignored: 400 ``invalid_request``), a body
over ``max_request_bytes`` (413, also after gzip decompression), an unreadable compressed
body (400). What aiohttp's HTTP parser cannot read (a bad request line, header,
Content-Length or chunk) it answers 400 itself; the proxy counts those
(``refused_without_rollout``, with unknown rollouts and paths) and logs one line without
aiohttp's traceback. A 5xx means a vLLM failure (502) or a bug of the proxy (500, logged
with its traceback); either fails the rollout.

Abandoned replies: an agent whose client gave up on a request (a timeout) and sent it
again never saw the first reply, which the proxy generated and recorded all the same. A
request whose history is the recorded one without the reply just sent (the same messages
and tools as the request that got it) is that retry: the unseen reply is taken out of
the trajectory (its tokens are not trained, and the retry's context is what it was for
the first request, so the tokens stay exactly what vLLM saw), kept in
``extra["abandoned_replies"]`` (its text, token ids, finish reason, turn, and why), and
the turn is sampled again. Reward hooks see only the turns the agent saw; an abandoned
reply still counts as a model call toward ``max_turns``.

The rollout's trajectory (:meth:`InterceptedRollout.to_rollout_state`) is one token
sequence: its segments one after the other, with ``segment_starts`` marking where each new
context begins (the trainer trains each segment as its own row).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from environments.inference.backends import VLLMBackend, current_seeds, sampling_seeds
from environments.inference.chat_template import ChatRenderer, ChatTemplateError
from environments.inference.tool_parsers import ToolCallParser
from environments.inference.vllm_client import ContextLengthError, InferenceError
from environments.rollout import AssistantTurn, Rollout, turn_versions

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024 * 1024
"""The largest request body the proxy reads (413 above it)."""


class ChatCompletionRequest(BaseModel):
    """The fields of an OpenAI chat-completions request the proxy reads or type-checks;
    others are accepted and ignored (sampling is the env's). ``max_tokens`` and
    ``max_completion_tokens`` may only shorten a reply below the env's limits. The
    sampling fields are ignored, but a value of the wrong type is still refused (400,
    naming the field), as the OpenAI API would."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    """Checked one by one (:func:`normalize_message`), so that errors name the field."""
    tools: list[Any] | None = None
    """Checked by :func:`check_tools`."""
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    # ignored (the env's sampling applies), but typed
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class RequestError(ValueError):
    """A request the proxy refuses (HTTP 400 unless ``status`` says otherwise), with an
    OpenAI-style error code and the field it is about (``param``, e.g.
    ``messages[2].tool_calls[0].function.name``)."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None,
                 status: int = 400):
        super().__init__(message)
        self.code = code
        self.param = param
        self.status = status


def _type_name(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string",
                                         bool: "boolean", int: "number", float: "number"}.get(
        type(value), type(value).__name__)


def _check_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where}: must be a string, got {_type_name(value)}", param=where)
    return value


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of ``text`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            at = f"{where}.content[{i}]"
            if not isinstance(part, dict):
                raise RequestError(f"{at}: must be a content part object, got "
                                   f"{_type_name(part)}", param=at)
            if part.get("type") != "text":
                raise RequestError(f"{at}: only text parts are supported, got "
                                   f"{part.get('type')!r}", param=f"{at}.type")
            parts.append(_check_text(part.get("text"), f"{at}.text"))
        return "".join(parts)
    raise RequestError(f"{where}.content: must be a string, null or a list of text parts, "
                       f"got {_type_name(content)}", param=f"{where}.content")


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The request's ``tools``: each ``{"type": "function", "function": {"name": str,
    "description"?: str, "parameters"?: object}}``; anything else is refused naming it."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where}: must be an object, got {_type_name(tool)}", param=where)
        if tool.get("type", "function") != "function":
            raise RequestError(f"{where}.type: only function tools are supported, got "
                               f"{tool.get('type')!r}", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function: must be an object, got "
                               f"{_type_name(function)}", param=f"{where}.function")
        _check_text(function.get("name"), f"{where}.function.name")
        if function.get("description") is not None:
            _check_text(function["description"], f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(f"{where}.function.parameters: must be a JSON schema object, "
                               f"got {_type_name(parameters)}",
                               param=f"{where}.function.parameters")
    return tools


def _arguments(value: Any) -> Any:
    """Tool-call arguments as an object when they are JSON, else as given."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


@dataclass
class Message:
    """One request message: what the chat template renders, and the key it is compared by."""

    rendered: dict[str, Any]
    key: str


def normalize_message(message: Any, index: int) -> Message:
    """An OpenAI message as the chat template's input plus a comparison key (role,
    text, tool calls by name and parsed arguments; call ids and formatting left out).
    A field of the wrong type is refused (:class:`RequestError` naming it)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where}: must be a message object, got {_type_name(message)}",
                           param=where)
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        got = "missing" if role is None else f"{role!r} is not"
        raise RequestError(f"{where}.role: {got} system, developer, user, assistant or tool",
                           param=f"{where}.role")
    text = _text_content(message.get("content"), where)
    if message.get("name") is not None:
        _check_text(message["name"], f"{where}.name")
    rendered: dict[str, Any] = {"role": role, "content": text}
    calls = []
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise RequestError(f"{where}.tool_calls: only assistant messages have tool calls",
                           param=f"{where}.tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise RequestError(f"{where}.tool_calls: must be an array of tool calls, got "
                           f"{_type_name(tool_calls)}", param=f"{where}.tool_calls")
    if tool_calls:
        rendered_calls = []
        for j, call in enumerate(tool_calls):
            at = f"{where}.tool_calls[{j}]"
            if not isinstance(call, dict):
                raise RequestError(f"{at}: must be a tool call object, got {_type_name(call)}",
                                   param=at)
            if call.get("type", "function") != "function":
                raise RequestError(f"{at}.type: only function calls are supported, got "
                                   f"{call.get('type')!r}", param=f"{at}.type")
            if call.get("id") is not None:
                _check_text(call["id"], f"{at}.id")
            function = call.get("function")
            if not isinstance(function, dict):
                raise RequestError(f"{at}.function: must be an object with name and arguments, "
                                   f"got {_type_name(function)}", param=f"{at}.function")
            name = _check_text(function.get("name"), f"{at}.function.name")
            raw_arguments = function.get("arguments", "{}")
            if not isinstance(raw_arguments, (str, dict)):
                raise RequestError(f"{at}.function.arguments: must be a JSON string (or an "
                                   f"object), got {_type_name(raw_arguments)}",
                                   param=f"{at}.function.arguments")
            arguments = _arguments(raw_arguments)
            calls.append([name, arguments])
            rendered_calls.append({
                **({"id": call["id"]} if call.get("id") is not None else {}),
                "type": "function", "function": {"name": name, "arguments": arguments}})
        rendered["tool_calls"] = rendered_calls
    if role == "tool":
        if message.get("tool_call_id") is not None:
            _check_text(message["tool_call_id"], f"{where}.tool_call_id")
        for name in ("tool_call_id", "name"):
            if message.get(name) is not None:
                rendered[name] = message[name]
    key = json.dumps([role, text, calls], sort_keys=True, default=str)
    return Message(rendered, key)


def trajectory_message(rendered: dict[str, Any]) -> dict[str, Any]:
    """A recorded message in the trajectory's form (:class:`environments.trajectory.Message`):
    tool-call arguments as JSON strings, as in the OpenAI API. (The chat template gets
    them as objects: templates such as Qwen2.5's write ``arguments | tojson``, which would
    encode a string a second time.)"""
    if not rendered.get("tool_calls"):
        return dict(rendered)
    calls = []
    for call in rendered["tool_calls"]:
        arguments = call["function"]["arguments"]
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**rendered, "tool_calls": calls}


@dataclass
class Segment:
    """One context of a rollout: where its tokens start, and the conversation in it."""

    start: int
    reason: str | None
    """Why it was started (None for the first)."""
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    tools_key: str
    ended_with_eos: bool = True


@dataclass
class InterceptedRollout:
    """What the proxy records for one rollout."""

    id: str
    token: str
    backend: VLLMBackend
    state: Rollout = field(default_factory=lambda: Rollout(messages=[], tools=None))
    segments: list[Segment] = field(default_factory=list)
    finished: bool = False
    limit: str | None = None
    """``max_turns`` or ``max_tokens`` when a request was refused for a limit."""
    failure: str | None = None
    """An inference failure (vLLM down): the rollout must not be scored."""
    requests: int = 0
    refused: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    seeds: Iterator[int] | None = None
    """The sampling seeds of the rollout that opened it (``seeded_sampling``): the
    agent's requests draw from them in the order they arrive."""
    unseen: tuple[bool, bool] | None = None
    """Set while the last thing recorded is a reply no later request has built on: the
    segment's ``ended_with_eos`` and the rollout's ``truncated`` from before it (what
    :meth:`InterceptionProxy._take_back_abandoned` restores)."""
    abandoned: list[dict[str, Any]] = field(default_factory=list)
    """Replies the agent never saw (it re-sent the request): see the module docstring."""

    def to_rollout_state(self) -> Rollout:
        """The trajectory so far: tokens of every segment, turns in order, the last
        segment's conversation as ``messages`` (in the trajectory's form, see
        :func:`trajectory_message`), segment starts and reasons in ``extra``."""
        state = self.state
        if self.segments:
            last = self.segments[-1]
            state.messages = [trajectory_message(m.rendered) for m in last.messages]
            state.tools = last.tools
        state.segment_starts = [s.start for s in self.segments[1:]]
        state.extra["segments"] = [{"start": s.start, "reason": s.reason,
                                    "messages": len(s.messages)} for s in self.segments]
        if self.abandoned:
            state.extra["abandoned_replies"] = self.abandoned
        if self.limit is not None:
            state.truncated, state.stop = True, self.limit
        elif state.turns and not state.stop:
            state.stop = "answer"
        return state


class InterceptionProxy:
    """One aiohttp server for many rollouts (``/rollout/{id}/v1/...``).

    ``backend``: a :class:`VLLMBackend` (its pool, renderer and sampling settings);
    ``policy_version``: read at each turn, recorded per turn.
    """

    def __init__(self, backend: VLLMBackend, parser: ToolCallParser, *, max_turns: int,
                 max_token_length: int, max_tokens_per_turn: int | None = None,
                 model_name: str = "policy",
                 policy_version: Callable[[], int | None] = lambda: None,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        self.backend = backend
        self.renderer: ChatRenderer = backend.renderer
        self.parser = parser
        self.max_turns = max_turns
        self.max_token_length = max_token_length
        self.max_tokens_per_turn = max_tokens_per_turn
        self.model_name = model_name
        self.policy_version = policy_version
        self.rollouts: dict[str, InterceptedRollout] = {}
        self.max_request_bytes = max_request_bytes
        self.refused_without_rollout = 0
        """Requests refused before a rollout could be told (malformed HTTP, an unknown
        rollout or path); a rollout's own refusals are counted in its ``refused``."""
        self.app = web.Application(client_max_size=max_request_bytes,
                                   middlewares=[self._errors_as_json])
        self.app.router.add_post("/rollout/{rollout}/v1/chat/completions", self._chat)
        self.app.router.add_get("/rollout/{rollout}/v1/models", self._models)
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
        proxy; default its TCP address)."""
        return f"{server or self.url}/rollout/{rollout.id}/v1"

    async def finish_rollout(self, rollout: InterceptedRollout) -> Rollout:
        """Refuse the rollout's further requests, wait for one in flight, and return its
        trajectory."""
        rollout.finished = True
        async with rollout.lock:
            self.rollouts.pop(rollout.id, None)
            return rollout.to_rollout_state()

    # -- HTTP ----------------------------------------------------------------------------
    @staticmethod
    def _error(status: int, message: str, code: str, kind: str = "invalid_request_error",
               param: str | None = None) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                            "code": code}}, status=status)

    def _refuse(self, rollout: InterceptedRollout, error: RequestError) -> web.Response:
        """Count and answer a refused request (one log line, no traceback)."""
        rollout.refused += 1
        log.info("rollout %s: refused a request (%d, %s): %s", rollout.id, error.status,
                 error.code, error)
        response = self._error(error.status, str(error), error.code, param=error.param)
        if error.status == 413 or error.code == "unreadable_body":
            response.force_close()  # the rest of the body is not read
        return response

    @web.middleware
    async def _errors_as_json(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp's own refusals (unknown path 404, wrong method 405) as OpenAI errors."""
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            self.refused_without_rollout += 1
            kind = "not_found_error" if error.status in (404, 405) else "invalid_request_error"
            return self._error(error.status, f"{request.method} {request.path}: {error.reason}",
                               error.reason.lower().replace(" ", "_"), kind)

    def _authorize(self, request: web.Request) -> InterceptedRollout | web.Response:
        rollout_id = request.match_info["rollout"]
        rollout = self.rollouts.get(rollout_id)
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if rollout is None:
            self.refused_without_rollout += 1
            return self._error(404, f"unknown or finished rollout {rollout_id!r}",
                               "rollout_not_found", "not_found_error")
        if not hmac.compare_digest(given.encode(), rollout.token.encode()):
            rollout.refused += 1
            return self._error(401, "wrong or missing API key for this rollout",
                               "invalid_api_key", "authentication_error")
        if rollout.finished:
            return self._error(410, f"rollout {rollout_id!r} has finished", "rollout_finished",
                               "not_found_error")
        return rollout

    async def _models(self, request: web.Request) -> web.Response:
        rollout = self._authorize(request)
        if isinstance(rollout, web.Response):
            return rollout
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "lachesis"}]})

    async def _read_request(self, request: web.Request) -> ChatCompletionRequest:
        """The request body, parsed and type-checked; :class:`RequestError` (naming the
        field, or ``body``) for anything unreadable or malformed."""
        limit = self.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(f"the request body has {request.content_length} bytes; the "
                               f"proxy takes {limit} at most", "request_too_large", "body", 413)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"the request body is over the proxy's {limit}-byte limit",
                               "request_too_large", "body", 413) from None
        except Exception as error:  # a broken gzip stream, a bad chunked encoding
            raise RequestError(f"unreadable request body ({type(error).__name__}: "
                               f"{str(error).strip()})", "unreadable_body", "body") from None
        try:
            return ChatCompletionRequest.model_validate_json(raw)
        except ValidationError as error:
            first = error.errors()[0]
            if first["type"] == "json_invalid":  # also bad UTF-8, lone surrogates, nesting
                raise RequestError(f"the body is not valid JSON: {first['msg']}", "invalid_json",
                                   "body") from None
            # the top-level field (a union's member names are not fields)
            where = str(first["loc"][0]) if first["loc"] else "body"
            raise RequestError(f"{where}: {first['msg']}", "invalid_request", where) from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        rollout = self._authorize(request)
        if isinstance(rollout, web.Response):
            return rollout
        try:
            body = await self._read_request(request)
        except RequestError as error:
            return self._refuse(rollout, error)
        async with rollout.lock:
            if rollout.finished:
                return self._error(410, "rollout has finished", "rollout_finished")
            rollout.requests += 1
            try:
                reply = await self._turn(rollout, body)
            except RequestError as error:
                return self._refuse(rollout, error)
            except InferenceError as error:
                rollout.failure = str(error)
                log.error("rollout %s: inference failed: %s", rollout.id, error)
                return self._error(502, f"inference failed: {error}", "inference_failed",
                                   "api_error")
            except Exception as error:  # a bug of the proxy: the rollout cannot be trusted
                rollout.failure = f"proxy error: {type(error).__name__}: {error}"
                log.exception("rollout %s: the proxy failed on a request", rollout.id)
                return self._error(500, f"the proxy failed: {type(error).__name__}: {error}",
                                   "proxy_error", "api_error")
        if body.stream:
            return await self._stream(request, reply, body)
        return web.json_response(reply)

    # -- one turn ------------------------------------------------------------------------
    async def _turn(self, rollout: InterceptedRollout, body: ChatCompletionRequest
                    ) -> dict[str, Any]:
        if body.n != 1:
            raise RequestError(f"n: only 1 choice per request is supported, got {body.n}",
                               param="n")
        messages = [normalize_message(m, i) for i, m in enumerate(body.messages)]
        tools = check_tools(body.tools)
        tools_key = json.dumps(tools, sort_keys=True, default=str)
        state = rollout.state
        if len(state.turns) + len(rollout.abandoned) >= self.max_turns:
            rollout.limit = "max_turns"
            raise RequestError(f"this rollout may call the model {self.max_turns} times at "
                               "most", "max_turns_exceeded")

        segment = rollout.segments[-1] if rollout.segments else None
        if self._is_retry(rollout, segment, messages, tools_key):
            self._take_back_abandoned(rollout, segment)  # the context is as it was for it
            reason = None
            undo = self._undo_point(rollout)
        else:
            undo = self._undo_point(rollout)
            reason = self._extends(segment, messages, tools_key)
        if reason is None and len(messages) > len(segment.messages):  # new messages
            new = messages[len(segment.messages):]
            try:
                continuation = self.renderer.continuation(
                    [m.rendered for m in segment.messages], [m.rendered for m in new], tools,
                    ended_with_eos=segment.ended_with_eos)
            except ChatTemplateError as error:
                reason = f"the chat template cannot extend the conversation ({error})"
            else:
                self._check_room(rollout, len(state.tokens) - segment.start
                                 + len(continuation.token_ids))
                self._record_tool_results(rollout, new)
                state.prefix_preserving &= continuation.prefix_preserving
                state.append(continuation.token_ids, sampled=False)
                segment.messages += new
        if reason is not None:  # a new context
            try:
                prompt = self.renderer.prompt_ids([m.rendered for m in messages], tools)
            except ChatTemplateError as error:
                raise RequestError(f"messages: {error}", param="messages") from None
            self._check_room(rollout, len(prompt))
            if segment is not None:
                log.info("rollout %s: new segment at token %d: %s", rollout.id,
                         len(state.tokens), reason)
            segment = Segment(len(state.tokens), None if segment is None else reason,
                              list(messages), tools, tools_key)
            rollout.segments.append(segment)
            state.append(prompt, sampled=False)
            if len(rollout.segments) == 1:
                state.n_prompt_tokens = len(prompt)

        context = state.tokens[segment.start:]
        room = self.max_token_length - len(context)
        max_tokens = min(x for x in (room, self.max_tokens_per_turn, body.max_tokens,
                                     body.max_completion_tokens) if x is not None)
        version = self.policy_version()
        asked = time.monotonic()
        try:
            with sampling_seeds(rollout.seeds):  # (the handler is not the rollout's task)
                generated = await rollout.backend.generate_from(context, max_tokens)
        except ContextLengthError as error:  # a server whose limit the start check missed
            undo()
            rollout.limit = "max_tokens"
            raise RequestError(f"the conversation has {len(context)} tokens, more than the "
                               f"inference server serves: {error}",
                               "context_length_exceeded") from None
        state.generation_seconds += time.monotonic() - asked
        start = len(state.tokens)
        rollout.unseen = (segment.ended_with_eos, state.truncated)
        state.append(generated.token_ids, sampled=True, logprobs=generated.logprobs)
        segment.ended_with_eos = generated.ended_with_eos
        parsed = self.parser.parse(generated.text)
        version, spans = turn_versions(generated, start, version)
        turn = AssistantTurn((start, len(state.tokens)), generated.finish_reason, parsed.calls,
                             [f"malformed tool call: {e}" for e in parsed.errors], version,
                             generated.text, version_spans=spans)
        state.turns.append(turn)
        index = len(state.turns) - 1
        content = parsed.content if parsed.calls else generated.text
        calls = [{"id": f"call_{index}_{j}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                 for j, c in enumerate(parsed.calls)]
        # What is recorded: the turn as sampled (the template renders its raw text); the
        # key: the reply as the agent will send it back.
        echo = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        segment.messages.append(Message(
            rendered={"role": "assistant", "content": generated.text,
                      **({"tool_calls": [{"id": call["id"], "type": "function", "function": {
                          "name": c.name, "arguments": c.arguments}}
                          for c, call in zip(parsed.calls, calls)]} if calls else {})},
            key=normalize_message(echo, len(segment.messages)).key))
        rollout.limit = None  # an agent that shortened its context after a refusal went on
        if generated.finish_reason == "length":
            state.truncated = True
        finish = "tool_calls" if calls else (
            "length" if generated.finish_reason == "length" else "stop")
        n_context = len(context)
        return {
            "id": f"chatcmpl-{rollout.id[:12]}-{index}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": {"role": "assistant", "content": content or None,
                                     **({"tool_calls": calls} if calls else {})}}],
            "usage": {"prompt_tokens": n_context, "completion_tokens": len(generated.token_ids),
                      "total_tokens": n_context + len(generated.token_ids)},
        }

    @staticmethod
    def _is_retry(rollout: InterceptedRollout, segment: Segment | None,
                  messages: list[Message], tools_key: str) -> bool:
        """Whether the request is the one that got the last reply, sent again: its
        messages are the recorded ones without that reply (which no request built on)."""
        if rollout.unseen is None or segment is None or tools_key != segment.tools_key:
            return False
        before = segment.messages[:-1]
        return len(messages) == len(before) and all(
            old.key == new.key for old, new in zip(before, messages))

    @staticmethod
    def _take_back_abandoned(rollout: InterceptedRollout, segment: Segment) -> None:
        """Move the last reply, which the agent never saw, out of the trajectory into
        ``rollout.abandoned``."""
        state = rollout.state
        turn = state.turns.pop()
        start, end = turn.span
        rollout.abandoned.append({
            "turn": len(state.turns), "text": turn.text, "token_ids": state.tokens[start:end],
            "finish_reason": turn.finish_reason, "policy_version": turn.policy_version,
            "reason": "the agent sent the request again without this reply (its client "
                      "gave up waiting for it): not trained, not scored"})
        del state.tokens[start:], state.masks[start:], state.logprobs[start:]
        segment.messages.pop()
        segment.ended_with_eos, state.truncated = rollout.unseen
        rollout.unseen = None
        log.info("rollout %s: the agent re-sent its request; reply %d (%d tokens) was "
                 "never seen: taken out of the trajectory", rollout.id, len(state.turns),
                 end - start)

    @staticmethod
    def _extends(segment: Segment | None, messages: list[Message], tools_key: str) -> str | None:
        """None if ``messages`` extend ``segment``'s conversation, else why not."""
        if segment is None:
            return "first request"
        recorded = segment.messages
        if tools_key != segment.tools_key:
            return "the request's tools differ from the recorded ones"
        for i, (old, new) in enumerate(zip(recorded, messages)):
            if old.key != new.key:
                return f"messages[{i}] ({new.rendered['role']}) differs from the recorded one"
        if len(messages) <= len(recorded):
            return (f"the request has {len(messages)} messages, not more than the "
                    f"{len(recorded)} recorded (messages dropped, or a retry)")
        added = messages[len(recorded):]
        if any(m.rendered["role"] == "assistant" for m in added):
            return "the request adds an assistant message the model did not generate"
        return None

    @staticmethod
    def _undo_point(rollout: InterceptedRollout) -> Callable[[], None]:
        """A function that puts ``rollout``'s recording back as it is now (a request
        refused after its messages were appended leaves nothing behind)."""
        state = rollout.state
        n_tokens, n_segments = len(state.tokens), len(rollout.segments)
        segment = rollout.segments[-1] if rollout.segments else None
        n_messages = len(segment.messages) if segment is not None else 0
        turn = state.turns[-1] if state.turns else None
        n_results = len(turn.tool_results) if turn is not None else 0
        preserving, n_prompt = state.prefix_preserving, state.n_prompt_tokens

        def undo() -> None:
            del state.tokens[n_tokens:], state.masks[n_tokens:], state.logprobs[n_tokens:]
            del rollout.segments[n_segments:]
            if segment is not None:
                del segment.messages[n_messages:]
            if turn is not None:
                del turn.tool_results[n_results:]
            state.prefix_preserving, state.n_prompt_tokens = preserving, n_prompt

        return undo

    def _check_room(self, rollout: InterceptedRollout, n_context: int) -> None:
        if n_context >= self.max_token_length:
            rollout.limit = "max_tokens"
            raise RequestError(f"the conversation has {n_context} tokens; this rollout's "
                               f"limit is {self.max_token_length}", "context_length_exceeded")

    @staticmethod
    def _record_tool_results(rollout: InterceptedRollout, new: list[Message]) -> None:
        """The tool messages that follow a turn are its tool results, in order."""
        if rollout.state.turns:
            turn = rollout.state.turns[-1]
            turn.tool_results += [m.rendered["content"] for m in new
                                  if m.rendered["role"] == "tool"]

    async def _stream(self, request: web.Request, reply: dict[str, Any],
                      body: ChatCompletionRequest) -> web.StreamResponse:
        """The finished reply as server-sent ``chat.completion.chunk`` events."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        choice = reply["choices"][0]
        message = choice["message"]
        base = {"id": reply["id"], "object": "chat.completion.chunk",
                "created": reply["created"], "model": reply["model"]}

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            data = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}], **extra}
            return f"data: {json.dumps(data)}\n\n".encode()

        events = [chunk({"role": "assistant", "content": ""})]
        if message.get("content"):
            events.append(chunk({"content": message["content"]}))
        for j, call in enumerate(message.get("tool_calls", [])):
            events.append(chunk({"tool_calls": [{"index": j, **call}]}))
        events.append(chunk({}, choice["finish_reason"]))
        if (body.stream_options or {}).get("include_usage"):
            data = {**base, "choices": [], "usage": reply["usage"]}
            events.append(f"data: {json.dumps(data)}\n\n".encode())
        events.append(b"data: [DONE]\n\n")
        try:
            for event in events:
                await response.write(event)
            await response.write_eof()
        except ConnectionResetError:  # the agent hung up; the turn is recorded all the same
            log.info("the agent disconnected during the streamed reply %s", reply["id"])
        return response


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
