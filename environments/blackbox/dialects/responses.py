"""The OpenAI Responses API: ``POST /rollout/{id}/v1/responses`` (Codex, openai-agents).

Input: ``instructions`` (a system message first), ``input`` as a string (one user
message) or a list of items: ``message`` (role ``system``/``developer`` as system,
``user``, ``assistant``; content a string or ``input_text``/``output_text``/``text``
parts; an item without ``type`` is a message), ``function_call`` (``call_id``, ``name``,
``arguments``; one after an assistant message, or several in a row, make one assistant
turn), ``function_call_output`` (``call_id``, ``output`` a string or text parts: a tool
result). ``reasoning`` items are skipped (the proxy never emits any: it samples plain
turns). ``previous_response_id`` continues the conversation of a reply of this rollout
(the proxy keeps each reply's conversation for the rollout's life, whatever ``store``
says); an unknown id is refused (400).

Tools: ``function`` tools (flat: ``name``, ``description``, ``parameters``) are served.
Tools of other types (``namespace``, ``web_search``, ``custom``, ``local_shell``, ``mcp``,
``file_search``, ...) are accepted and left out of what the model sees: it cannot call
them (the rollout's ``extra["dropped_tools"]`` lists them). Refused (400 naming the
field): non-text input (images, files), other item types (``custom_tool_call``,
``computer_call``...), ``background: true``.

Honoured: ``stream`` (the finished reply as the API's events: ``response.created``,
``response.in_progress``, per output item ``response.output_item.added``, for a message
``response.content_part.added`` / ``response.output_text.delta`` / ``.done`` /
``response.content_part.done``, for a call ``response.function_call_arguments.delta`` /
``.done``, then ``response.output_item.done``, and ``response.completed``), and
``max_output_tokens`` (only shortens). A reply cut at a length limit has ``status:
"incomplete"`` and ``incomplete_details.reason: "max_output_tokens"``; its stream still
ends with ``response.completed``, not the API's ``response.incomplete``: Codex treats
that event as a failed request and retries it, and the openai SDK's stream helper raises
on it, where a truncated turn should reach the harness like any other. Ignored: sampling (``temperature``, ``top_p``, ``text.format``...),
``reasoning`` (no reasoning is returned; ``usage.output_tokens_details.reasoning_tokens``
is 0), ``include``, ``store``, ``prompt_cache_key``, ``tool_choice``,
``parallel_tool_calls``, ``truncation``, ``metadata``, ``user``, ``service_tier``.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from environments.blackbox.dialects import (
    Dialect,
    TurnRequest,
    function_tool,
    note_dropped_tools,
    sse,
    validate_json,
)
from environments.blackbox.recorder import (
    InterceptedRollout,
    Message,
    RequestError,
    TurnReply,
    check_object,
    check_text,
    make_message,
    type_name,
)

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The fields of a Responses request the proxy reads or type-checks."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    previous_response_id: str | None = None
    background: bool | None = None
    store: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of text parts, got "
                           f"{type_name(content)}", param=where)
    parts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        check_object(part, at, "a content part object")
        if part.get("type") not in TEXT_PARTS:
            raise RequestError(f"{at}.type: only text parts ({', '.join(TEXT_PARTS)}) are "
                               f"supported, got {part.get('type')!r}", param=f"{at}.type")
        parts.append(check_text(part.get("text"), f"{at}.text"))
    return "".join(parts)


def input_messages(body: ResponsesRequest) -> list[Message]:
    """``instructions`` and ``input`` as chat messages (see the module docstring)."""
    messages: list[Message] = []
    if body.instructions:
        messages.append(make_message("system", body.instructions))
    if isinstance(body.input, str):
        return messages + [make_message("user", body.input)]
    pending: tuple[str, list[tuple[str | None, str, Any]]] | None = None  # an assistant turn

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            messages.append(make_message("assistant", pending[0], pending[1]))
            pending = None

    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        check_object(item, where, "an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise RequestError(f"{where}.role: {role!r} is not system, developer, user "
                                   "or assistant", param=f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            flush()
            if role == "assistant":
                pending = (text, [])
            else:
                messages.append(make_message("system" if role == "developer" else role, text))
        elif kind == "function_call":
            name = check_text(item.get("name"), f"{where}.name")
            arguments = item.get("arguments", "{}")
            check_text(arguments, f"{where}.arguments")
            call_id = item.get("call_id")
            if call_id is not None:
                check_text(call_id, f"{where}.call_id")
            if pending is None:
                pending = ("", [])
            pending[1].append((call_id, name, arguments))
        elif kind == "function_call_output":
            flush()
            call_id = item.get("call_id")
            if call_id is not None:
                check_text(call_id, f"{where}.call_id")
            messages.append(make_message("tool", _text(item.get("output"), f"{where}.output"),
                                         tool_call_id=call_id))
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(f"{where}.type: input items of type {kind!r} are not "
                               "supported (message, function_call, function_call_output, "
                               "reasoning are)", param=f"{where}.type")
    flush()
    return messages


def function_tools(tools: list[Any] | None) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """The function tools in the chat form, and the names/types of the tools left out."""
    served, dropped = [], []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        check_object(tool, where)
        if tool.get("type") == "function":
            served.append(function_tool(tool.get("name"), tool.get("description"),
                                        tool.get("parameters"), where))
        else:
            dropped.append(str(tool.get("name") or tool.get("type")))
    return served or None, dropped


class ResponsesDialect(Dialect):
    name = "responses"
    path = "/v1/responses"

    def parse(self, raw: bytes, rollout: InterceptedRollout) -> TurnRequest:
        body = validate_json(ResponsesRequest, raw)
        if body.background:
            raise RequestError("background: background responses are not supported",
                               param="background")
        messages = input_messages(body)
        if body.previous_response_id is not None:
            before = rollout.responses.get(body.previous_response_id)
            if before is None:
                raise RequestError(f"previous_response_id: no response "
                                   f"{body.previous_response_id!r} in this rollout",
                                   "previous_response_not_found", "previous_response_id")
            start = 1 if body.instructions and before and messages and (
                before[0].key == messages[0].key) else 0
            messages = before + messages[start:]
        if not messages:
            raise RequestError("input: no messages", param="input")
        tools, dropped = function_tools(body.tools)
        note_dropped_tools(rollout, dropped)
        return TurnRequest(messages, tools, body.max_output_tokens, body.stream, body)

    def reply(self, request: TurnRequest, turn: TurnReply, model: str,
              rollout: InterceptedRollout) -> dict[str, Any]:
        response_id = f"resp_{rollout.id[:12]}{turn.index:04d}"
        rollout.responses[response_id] = turn.messages
        output: list[dict[str, Any]] = []
        if turn.content or not turn.calls:
            output.append({"type": "message", "id": f"msg_{rollout.id[:12]}{turn.index:04d}",
                           "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": turn.content,
                                        "annotations": [], "logprobs": []}]})
        for j, call in enumerate(turn.calls):
            output.append({"type": "function_call", "id": f"fc_{rollout.id[:12]}{turn.index}{j}",
                           "call_id": call.id, "name": call.name,
                           "arguments": call.arguments_json, "status": "completed"})
        cut = turn.finish == "length"
        body = request.body
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.instructions, "model": model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "max_output_tokens": body.max_output_tokens, "reasoning": {"effort": None},
            "store": bool(body.store), "temperature": 1.0, "top_p": 1.0,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto",
            "tools": [t for t in body.tools or [] if isinstance(t, dict)
                      and t.get("type") == "function"], "truncation": "disabled",
            "usage": {"input_tokens": turn.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": turn.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": turn.prompt_tokens + turn.completion_tokens},
            "metadata": {},
        }

    def events(self, request: TurnRequest, reply: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []

        def emit(kind: str, **data: Any) -> None:
            events.append(sse({"type": kind, "sequence_number": len(events), **data}, kind))

        started = {**reply, "status": "in_progress", "output": [], "usage": None,
                   "incomplete_details": None}
        emit("response.created", response=started)
        emit("response.in_progress", response=started)
        for n, item in enumerate(reply["output"]):
            emit("response.output_item.added", output_index=n,
                 item={**item, "status": "in_progress",
                       **({"content": []} if item["type"] == "message" else {"arguments": ""})})
            if item["type"] == "message":
                part = item["content"][0]
                ids = {"item_id": item["id"], "output_index": n, "content_index": 0}
                emit("response.content_part.added", **ids, part={**part, "text": ""})
                if part["text"]:
                    emit("response.output_text.delta", **ids, delta=part["text"], logprobs=[])
                emit("response.output_text.done", **ids, text=part["text"], logprobs=[])
                emit("response.content_part.done", **ids, part=part)
            else:
                ids = {"item_id": item["id"], "output_index": n}
                emit("response.function_call_arguments.delta", **ids, delta=item["arguments"])
                emit("response.function_call_arguments.done", **ids,
                     arguments=item["arguments"], name=item["name"])
            emit("response.output_item.done", output_index=n, item=item)
        emit("response.completed", response=reply)  # (also when incomplete: see the docstring)
        return events

