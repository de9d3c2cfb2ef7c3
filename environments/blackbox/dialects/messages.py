"""Anthropic Messages: ``POST /rollout/{id}/v1/messages`` (Claude Code).

The agent's key comes as ``x-api-key`` (or ``Authorization: Bearer``); a query such as
``?beta=true`` and the ``anthropic-version`` / ``anthropic-beta`` headers are accepted.
Errors have Anthropic's form (``{"type": "error", "error": {"type", "message"}}``).

Input: ``system`` (a string or ``text`` blocks: one system message), ``messages`` with
roles ``user`` / ``assistant``, content a string or blocks: ``text``; in user messages
``tool_result`` (``tool_use_id``, ``content`` a string or ``text`` blocks, ``is_error``):
each a tool message, in order, before the message's text; in assistant messages
``tool_use`` (``id``, ``name``, ``input``): the turn's tool calls. ``thinking`` and
``redacted_thinking`` blocks are skipped (the proxy never emits any). A message with
role ``system`` (Claude Code 2.1 sends one after the task: the list of its agent types)
is a system message where it stands (its content a string or text blocks). Refused (400
naming the field): images, documents and other block types; other roles.

Tools: custom tools (``name``, ``description``, ``input_schema``) are served; server
tools (a ``type`` such as ``web_search_20250305``, ``bash_20250124``) are accepted and
left out (listed in the rollout's ``extra["dropped_tools"]``). ``cache_control`` is
ignored everywhere.

Honoured: ``max_tokens`` (required by the API; it only shortens a reply below the env's
limits), ``stream`` (named events ``message_start``, ``content_block_start``, ``ping``,
``content_block_delta`` with ``text_delta`` / ``input_json_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``; without ``stream`` one JSON
message). ``stop_reason``: ``tool_use``, ``max_tokens`` or ``end_turn``. Ignored:
sampling (``temperature``, ``top_p``, ``top_k``, ``stop_sequences``), ``thinking`` (no
thinking blocks are returned: the turn is sampled as the env says), ``tool_choice``,
``metadata``, ``context_management``, ``service_tier``, ``container``, ``mcp_servers``.

``POST .../v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the request's
prompt as the chat template renders it, counted; nothing is recorded.
"""

from __future__ import annotations

import json
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

SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


class MessagesRequest(BaseModel):
    """The fields of a Messages request the proxy reads or type-checks."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    thinking: dict[str, Any] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    pass


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of content blocks, got "
                           f"{type_name(content)}", param=where)
    for i, block in enumerate(content):
        check_object(block, f"{where}[{i}]", "a content block object")
    return content


def _block_text(content: Any, where: str) -> str:
    """Text of a string or of ``text`` blocks (a system prompt, a tool result)."""
    if content is None:
        return ""
    parts = []
    for i, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text":
            raise RequestError(f"{where}[{i}].type: only text blocks are supported here, got "
                               f"{block.get('type')!r}", param=f"{where}[{i}].type")
        parts.append(check_text(block.get("text"), f"{where}[{i}].text"))
    return "".join(parts)


def _message(message: Any, index: int) -> list[Message]:
    where = f"messages[{index}]"
    check_object(message, where, "a message object")
    role = message.get("role")
    if role == "system":  # (Claude Code sends one, a list of agent types, after the task)
        return [make_message("system", _block_text(message.get("content"), f"{where}.content"))]
    if role not in ("user", "assistant"):
        got = "missing" if role is None else f"{role!r} is not"
        raise RequestError(f"{where}.role: {got} user, assistant or system",
                           param=f"{where}.role")
    texts, calls, results = [], [], []
    for i, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
        at = f"{where}.content[{i}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(check_text(block.get("text"), f"{at}.text"))
        elif kind == "tool_use" and role == "assistant":
            check_text(block.get("id"), f"{at}.id")
            name = check_text(block.get("name"), f"{at}.name")
            calls.append((block["id"], name, check_object(block.get("input", {}),
                                                          f"{at}.input")))
        elif kind == "tool_result" and role == "user":
            call_id = check_text(block.get("tool_use_id"), f"{at}.tool_use_id")
            results.append(make_message("tool", _block_text(block.get("content"),
                                                            f"{at}.content"),
                                        tool_call_id=call_id))
        elif kind in SKIPPED_BLOCKS:
            continue
        else:
            raise RequestError(f"{at}.type: {kind!r} blocks are not supported in {role} "
                               "messages", param=f"{at}.type")
    text = "".join(texts)
    if role == "assistant":
        return [make_message("assistant", text, calls)]
    return results + ([make_message("user", text)] if texts or not results else [])


def _parse(body: MessagesRequest, rollout: InterceptedRollout
           ) -> tuple[list[Message], list[dict[str, Any]] | None]:
    messages = []
    if body.system:
        messages.append(make_message("system", _block_text(body.system, "system")))
    for i, message in enumerate(body.messages):
        messages += _message(message, i)
    tools, dropped = [], []
    for i, tool in enumerate(body.tools or []):
        where = f"tools[{i}]"
        check_object(tool, where)
        if tool.get("type") in (None, "custom"):
            tools.append(function_tool(tool.get("name"), tool.get("description"),
                                       tool.get("input_schema"), where))
        else:
            dropped.append(str(tool.get("name") or tool.get("type")))
    note_dropped_tools(rollout, dropped)
    return messages, tools or None


class MessagesDialect(Dialect):
    name = "messages"
    path = "/v1/messages"
    call_prefix = "toolu"

    def kind(self, request: Any) -> str | None:
        return "count" if request.path.endswith("/count_tokens") else "turn"

    def routes(self) -> list[str]:
        return [self.path, f"{self.path}/count_tokens"]

    def parse(self, raw: bytes, rollout: InterceptedRollout) -> TurnRequest:
        body = validate_json(MessagesRequest, raw)
        messages, tools = _parse(body, rollout)
        return TurnRequest(messages, tools, body.max_tokens, body.stream, body)

    def count(self, raw: bytes, rollout: InterceptedRollout
              ) -> tuple[list[Message], list[dict[str, Any]] | None]:
        return _parse(validate_json(CountTokensRequest, raw), rollout)

    def error_body(self, message: str, code: str, kind: str, param: str | None,
                   status: int = 400) -> dict:
        kind = {"invalid_request_error": "invalid_request_error",
                "authentication_error": "authentication_error",
                "not_found_error": "not_found_error"}.get(kind, "api_error")
        if code == "request_too_large":
            kind = "request_too_large"
        return {"type": "error", "error": {"type": kind, "message": message, "code": code,
                                           **({"param": param} if param else {})}}

    def reply(self, request: TurnRequest, turn: TurnReply, model: str,
              rollout: InterceptedRollout) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if turn.content or not turn.calls:
            content.append({"type": "text", "text": turn.content})
        for call in turn.calls:
            arguments = call.arguments if isinstance(call.arguments, dict) else {
                "input": call.arguments}
            content.append({"type": "tool_use", "id": call.id, "name": call.name,
                            "input": arguments})
        return {"id": f"msg_{rollout.id[:12]}{turn.index:04d}", "type": "message",
                "role": "assistant", "model": model, "content": content,
                "stop_reason": STOP_REASONS[turn.finish], "stop_sequence": None,
                "usage": {"input_tokens": turn.prompt_tokens,
                          "output_tokens": turn.completion_tokens,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    def events(self, request: TurnRequest, reply: dict[str, Any]) -> list[bytes]:
        start = {**reply, "content": [], "stop_reason": None,
                 "usage": {**reply["usage"], "output_tokens": 0}}
        events = [sse({"type": "message_start", "message": start}, "message_start")]
        for i, block in enumerate(reply["content"]):
            empty = {"type": "text", "text": ""} if block["type"] == "text" else {
                **block, "input": {}}
            events.append(sse({"type": "content_block_start", "index": i,
                               "content_block": empty}, "content_block_start"))
            if i == 0:
                events.append(sse({"type": "ping"}, "ping"))
            delta = ({"type": "text_delta", "text": block["text"]} if block["type"] == "text"
                     else {"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            events.append(sse({"type": "content_block_delta", "index": i, "delta": delta},
                              "content_block_delta"))
            events.append(sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
        events.append(sse({"type": "message_delta",
                           "delta": {"stop_reason": reply["stop_reason"], "stop_sequence": None},
                           "usage": {"output_tokens": reply["usage"]["output_tokens"]}},
                          "message_delta"))
        events.append(sse({"type": "message_stop"}, "message_stop"))
        return events

