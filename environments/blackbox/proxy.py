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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from environments.inference.backends import VLLMBackend
from environments.inference.chat_template import ChatRenderer, ChatTemplateError
from environments.inference.tool_parsers import ToolCallParser
from environments.inference.vllm_client import InferenceError
from environments.rollout import AssistantTurn, Rollout

log = logging.getLogger(__name__)


class ChatCompletionRequest(BaseModel):
    """The fields of an OpenAI chat-completions request the proxy reads; others are
    accepted and ignored (sampling is the env's). ``max_tokens`` and
    ``max_completion_tokens`` may only shorten a reply below the env's limits."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1


class RequestError(ValueError):
    """A request the proxy refuses (HTTP 400), with an OpenAI-style error code."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of ``text`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.content[{i}]: only text parts are supported, "
                                   f"got {kind!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(f"{where}.content: must be a string, null or a list of text parts")


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


def normalize_message(message: dict[str, Any], index: int) -> Message:
    """An OpenAI message as the chat template's input plus a comparison key (role,
    text, tool calls by name and parsed arguments; call ids and formatting left out)."""
    where = f"messages[{index}]"
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestError(f"{where}.role: {role!r} is not system, developer, user, "
                           "assistant or tool")
    text = _text_content(message.get("content"), where)
    rendered: dict[str, Any] = {"role": role, "content": text}
    calls = []
    if role == "assistant" and message.get("tool_calls"):
        rendered_calls = []
        for j, call in enumerate(message["tool_calls"]):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"{where}.tool_calls[{j}].function.name: missing")
            arguments = _arguments(function.get("arguments", "{}"))
            calls.append([function["name"], arguments])
            rendered_calls.append({
                **({"id": call["id"]} if isinstance(call.get("id"), str) else {}),
                "type": "function", "function": {"name": function["name"],
                                                 "arguments": arguments}})
        rendered["tool_calls"] = rendered_calls
    if role == "tool":
        for name in ("tool_call_id", "name"):
            if isinstance(message.get(name), str):
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
                 policy_version: Callable[[], int | None] = lambda: None):
        self.backend = backend
        self.renderer: ChatRenderer = backend.renderer
        self.parser = parser
        self.max_turns = max_turns
        self.max_token_length = max_token_length
        self.max_tokens_per_turn = max_tokens_per_turn
        self.model_name = model_name
        self.policy_version = policy_version
        self.rollouts: dict[str, InterceptedRollout] = {}
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
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
        self._runner = web.AppRunner(self.app, access_log=None)
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
                                     backend or self.backend)
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
    def _error(status: int, message: str, code: str, kind: str = "invalid_request_error"
               ) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "code": code}},
                                 status=status)

    def _authorize(self, request: web.Request) -> InterceptedRollout | web.Response:
        rollout_id = request.match_info["rollout"]
        rollout = self.rollouts.get(rollout_id)
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if rollout is None:
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

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        rollout = self._authorize(request)
        if isinstance(rollout, web.Response):
            return rollout
        try:
            body = ChatCompletionRequest.model_validate(await request.json())
        except (json.JSONDecodeError, ValidationError) as error:
            rollout.refused += 1
            return self._error(400, f"bad request body: {error}", "invalid_request")
        async with rollout.lock:
            if rollout.finished:
                return self._error(410, "rollout has finished", "rollout_finished")
            rollout.requests += 1
            try:
                reply = await self._turn(rollout, body)
            except RequestError as error:
                rollout.refused += 1
                return self._error(400, str(error), error.code)
            except InferenceError as error:
                rollout.failure = str(error)
                log.error("rollout %s: inference failed: %s", rollout.id, error)
                return self._error(502, f"inference failed: {error}", "inference_failed",
                                   "api_error")
        if body.stream:
            return await self._stream(request, reply, body)
        return web.json_response(reply)

    # -- one turn ------------------------------------------------------------------------
    async def _turn(self, rollout: InterceptedRollout, body: ChatCompletionRequest
                    ) -> dict[str, Any]:
        if body.n != 1:
            raise RequestError(f"n: only 1 choice per request is supported, got {body.n}")
        messages = [normalize_message(m, i) for i, m in enumerate(body.messages)]
        tools = body.tools or None
        tools_key = json.dumps(tools, sort_keys=True, default=str)
        state = rollout.state
        if len(state.turns) >= self.max_turns:
            rollout.limit = "max_turns"
            raise RequestError(f"this rollout may call the model {self.max_turns} times at "
                               "most", "max_turns_exceeded")

        segment = rollout.segments[-1] if rollout.segments else None
        reason = self._extends(segment, messages, tools_key)
        if reason is None:  # append the new messages as context
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
            prompt = self.renderer.prompt_ids([m.rendered for m in messages], tools)
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
        generated = await rollout.backend.generate_from(context, max_tokens)
        start = len(state.tokens)
        state.append(generated.token_ids, sampled=True, logprobs=generated.logprobs)
        segment.ended_with_eos = generated.ended_with_eos
        parsed = self.parser.parse(generated.text)
        turn = AssistantTurn((start, len(state.tokens)), generated.finish_reason, parsed.calls,
                             [f"malformed tool call: {e}" for e in parsed.errors], version,
                             generated.text)
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

        await response.write(chunk({"role": "assistant", "content": ""}))
        if message.get("content"):
            await response.write(chunk({"content": message["content"]}))
        for j, call in enumerate(message.get("tool_calls", [])):
            await response.write(chunk({"tool_calls": [{"index": j, **call}]}))
        await response.write(chunk({}, choice["finish_reason"]))
        if (body.stream_options or {}).get("include_usage"):
            data = {**base, "choices": [], "usage": reply["usage"]}
            await response.write(f"data: {json.dumps(data)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
