"""OpenAI Chat Completions: ``POST /rollout/{id}/v1/chat/completions``.

Honoured: ``messages`` (roles ``system``/``developer`` (as system), ``user``,
``assistant`` with ``tool_calls``, ``tool``; content a string, null or ``text`` parts),
function ``tools``, ``stream`` (the finished reply as ``chat.completion.chunk`` events,
with a usage chunk when ``stream_options.include_usage``), and ``max_tokens`` /
``max_completion_tokens`` (the smaller; they only shorten a reply below the env's limits,
never lengthen it). Ignored, though type-checked (the env's sampling applies: the trainer
needs the behaviour policy it assumes): ``temperature``, ``top_p``, penalties, ``seed``,
``stop``, ``logit_bias``, ``logprobs``, ``response_format``, ``tool_choice``,
``parallel_tool_calls``, ``user``; any other field is ignored. Refused (400 naming the
field): ``n`` > 1, non-text content parts, tools that are not functions.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from environments.blackbox.dialects import Dialect, TurnRequest, sse, validate_json
from environments.blackbox.recorder import (
    InterceptedRollout,
    Message,
    RequestError,
    TurnReply,
    check_text,
    make_message,
    type_name,
)


class ChatCompletionRequest(BaseModel):
    """The fields of a chat-completions request the proxy reads or type-checks; others
    are accepted and ignored. A sampling field of the wrong type is still refused (400,
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
                                   f"{type_name(part)}", param=at)
            if part.get("type") != "text":
                raise RequestError(f"{at}: only text parts are supported, got "
                                   f"{part.get('type')!r}", param=f"{at}.type")
            parts.append(check_text(part.get("text"), f"{at}.text"))
        return "".join(parts)
    raise RequestError(f"{where}.content: must be a string, null or a list of text parts, "
                       f"got {type_name(content)}", param=f"{where}.content")


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The request's ``tools``: each ``{"type": "function", "function": {"name": str,
    "description"?: str, "parameters"?: object}}``; anything else is refused naming it."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where}: must be an object, got {type_name(tool)}", param=where)
        if tool.get("type", "function") != "function":
            raise RequestError(f"{where}.type: only function tools are supported, got "
                               f"{tool.get('type')!r}", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function: must be an object, got "
                               f"{type_name(function)}", param=f"{where}.function")
        check_text(function.get("name"), f"{where}.function.name")
        if function.get("description") is not None:
            check_text(function["description"], f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(f"{where}.function.parameters: must be a JSON schema object, "
                               f"got {type_name(parameters)}",
                               param=f"{where}.function.parameters")
    return tools


def normalize_message(message: Any, index: int) -> Message:
    """An OpenAI chat message as the chat template's input plus a comparison key. A field
    of the wrong type is refused (:class:`RequestError` naming it)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where}: must be a message object, got {type_name(message)}",
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
        check_text(message["name"], f"{where}.name")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise RequestError(f"{where}.tool_calls: only assistant messages have tool calls",
                           param=f"{where}.tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise RequestError(f"{where}.tool_calls: must be an array of tool calls, got "
                           f"{type_name(tool_calls)}", param=f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(tool_calls or []):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise RequestError(f"{at}: must be a tool call object, got {type_name(call)}",
                               param=at)
        if call.get("type", "function") != "function":
            raise RequestError(f"{at}.type: only function calls are supported, got "
                               f"{call.get('type')!r}", param=f"{at}.type")
        if call.get("id") is not None:
            check_text(call["id"], f"{at}.id")
        function = call.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{at}.function: must be an object with name and arguments, "
                               f"got {type_name(function)}", param=f"{at}.function")
        name = check_text(function.get("name"), f"{at}.function.name")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise RequestError(f"{at}.function.arguments: must be a JSON string (or an "
                               f"object), got {type_name(arguments)}",
                               param=f"{at}.function.arguments")
        calls.append((call.get("id"), name, arguments))
    tool_call_id = None
    if role == "tool" and message.get("tool_call_id") is not None:
        tool_call_id = check_text(message["tool_call_id"], f"{where}.tool_call_id")
    return make_message(role, text, calls, tool_call_id=tool_call_id,
                        name=message.get("name") if role == "tool" else None)


class ChatDialect(Dialect):
    name = "chat"
    path = "/v1/chat/completions"

    def parse(self, raw: bytes, rollout: InterceptedRollout) -> TurnRequest:
        body = validate_json(ChatCompletionRequest, raw)
        if body.n != 1:
            raise RequestError(f"n: only 1 choice per request is supported, got {body.n}",
                               param="n")
        messages = [normalize_message(m, i) for i, m in enumerate(body.messages)]
        limits = [x for x in (body.max_tokens, body.max_completion_tokens) if x is not None]
        return TurnRequest(messages, check_tools(body.tools), min(limits, default=None),
                           body.stream, body)

    def reply(self, request: TurnRequest, turn: TurnReply, model: str,
              rollout: InterceptedRollout) -> dict[str, Any]:
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments_json}}
                 for c in turn.calls]
        return {
            "id": f"chatcmpl-{rollout.id[:12]}-{turn.index}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "finish_reason": turn.finish, "logprobs": None,
                         "message": {"role": "assistant", "content": turn.content or None,
                                     **({"tool_calls": calls} if calls else {})}}],
            "usage": {"prompt_tokens": turn.prompt_tokens,
                      "completion_tokens": turn.completion_tokens,
                      "total_tokens": turn.prompt_tokens + turn.completion_tokens},
        }

    def events(self, request: TurnRequest, reply: dict[str, Any]) -> list[bytes]:
        choice = reply["choices"][0]
        message = choice["message"]
        base = {"id": reply["id"], "object": "chat.completion.chunk",
                "created": reply["created"], "model": reply["model"]}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish}]})

        events = [chunk({"role": "assistant", "content": ""})]
        if message.get("content"):
            events.append(chunk({"content": message["content"]}))
        for j, call in enumerate(message.get("tool_calls", [])):
            events.append(chunk({"tool_calls": [{"index": j, **call}]}))
        events.append(chunk({}, choice["finish_reason"]))
        if (request.body.stream_options or {}).get("include_usage"):
            events.append(sse({**base, "choices": [], "usage": reply["usage"]}))
        events.append(b"data: [DONE]\n\n")
        return events
