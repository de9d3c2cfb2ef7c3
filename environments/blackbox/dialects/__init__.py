"""The wire APIs the interception proxy speaks, one module each over one recorder
(:mod:`environments.blackbox.recorder`):

* :mod:`.chat`: OpenAI Chat Completions, ``POST .../v1/chat/completions``;
* :mod:`.responses`: the OpenAI Responses API, ``POST .../v1/responses``;
* :mod:`.messages`: Anthropic Messages, ``POST .../v1/messages`` (and ``count_tokens``);
* :mod:`.gemini`: Google Gemini, ``POST .../v1beta/models/{model}:generateContent`` /
  ``:streamGenerateContent`` (and ``:countTokens``).

A dialect parses its request into :class:`TurnRequest` (messages and function tools as
the chat template takes them), and turns the recorder's :class:`TurnReply` into its
response: one JSON object, or its server-sent events when the request streams. Field
rules (honoured, ignored, refused) are in each module's docstring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from environments.blackbox.recorder import (
    InterceptedRollout,
    Message,
    RequestError,
    TurnReply,
    check_text,
    type_name,
)


@dataclass
class TurnRequest:
    """A model call as the recorder takes it."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    stream: bool
    """Whether the reply goes as server-sent events."""
    body: Any
    """The dialect's parsed request (what its reply echoes)."""
    json_stream: bool = False
    """A stream asked for as one JSON array of chunks (Gemini without ``alt=sse``)."""


class Dialect:
    """One wire API: its path under ``/rollout/{id}``, parsing, replies and errors."""

    name: str
    path: str
    call_prefix = "call"

    def routes(self) -> list[str]:
        """The POST routes under ``/rollout/{rollout}`` it is served at."""
        return [self.path]

    def matches(self, path: str) -> bool:
        """Whether a model call to ``path`` (under ``/rollout/{id}``) is this dialect's."""
        return path == self.path

    def kind(self, request: Any) -> str | None:
        """What a request to one of its routes asks: ``turn`` (a model call), ``count``
        (count tokens) or None (nothing served: 404)."""
        return "turn"

    def request_options(self, request: Any) -> dict[str, Any]:
        """What :meth:`parse` takes from the request besides its body (its path, query)."""
        return {}

    def parse(self, raw: bytes, rollout: InterceptedRollout, **options: Any) -> TurnRequest:
        raise NotImplementedError

    def count(self, raw: bytes, rollout: InterceptedRollout
              ) -> tuple[list[Message], list[dict[str, Any]] | None]:
        """A count-tokens request's messages and tools (dialects with ``count``)."""
        raise NotImplementedError

    def count_body(self, n: int) -> dict[str, Any]:
        return {"input_tokens": n}

    def reply(self, request: TurnRequest, turn: TurnReply, model: str,
              rollout: InterceptedRollout) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, request: TurnRequest, reply: dict[str, Any]) -> list[bytes]:
        """The reply as server-sent events (``stream: true``)."""
        raise NotImplementedError

    def error_body(self, message: str, code: str, kind: str, param: str | None,
                   status: int = 400) -> dict:
        """An error in the OpenAI form (``{"error": {message, type, param, code}}``)."""
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def call_id(self, turn: int, j: int) -> str:
        return f"{self.call_prefix}_{turn}_{j}"


def validate_json(model: type[BaseModel], raw: bytes) -> Any:
    """``raw`` parsed into ``model``; :class:`RequestError` naming the field (or
    ``body``) for a body that is not JSON (bad UTF-8, lone surrogates, truncated, nested
    too deep, numbers too long) or a field of the wrong type."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            raise RequestError(f"the body is not valid JSON: {first['msg']}", "invalid_json",
                               "body") from None
        if first["type"] == "model_type":
            raise RequestError(f"the body must be a JSON object: {first['msg']}",
                               "invalid_request", "body") from None
        # the top-level field (a union's member names are not fields)
        where = str(first["loc"][0]) if first["loc"] else "body"
        raise RequestError(f"{where}: {first['msg']}", "invalid_request", where) from None


def note_dropped_tools(rollout: InterceptedRollout, names: list[str]) -> None:
    """Tools the request declared that the proxy left out (not functions it can serve),
    kept in the rollout's ``extra["dropped_tools"]``."""
    if names:
        extra = rollout.state.extra
        extra["dropped_tools"] = sorted(set(extra.get("dropped_tools", [])) | set(names))


def sse(data: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """A function tool in the OpenAI chat form, its parts checked (errors name ``where``)."""
    check_text(name, f"{where}.name")
    if description is not None:
        check_text(description, f"{where}.description")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"{where}.parameters: must be a JSON schema object, got "
                           f"{type_name(parameters)}", param=f"{where}.parameters")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}
