"""Parsers that extract tool calls from an assistant's raw text, one per model format.

Each model family writes tool calls its own way; a parser turns one assistant turn into
a :class:`ParsedTurn`: the text around the calls, the well-formed calls, and one error
message per malformed call block. Malformed blocks never raise: the environment reports
them to the model (and counts them as tool errors) like any other failed call.

Formats (see :func:`available_parsers`):

* ``hermes`` (the default; Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..,
  "arguments": {..}}</tool_call>``, one block per call;
* ``mistral``: ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]``, a JSON list of
  calls after the marker.

Add a format with :func:`register_parser`::

    @register_parser("myformat")
    class MyParser(ToolCallParser):
        def parse(self, text: str) -> ParsedTurn: ...
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Iterable
from typing import Any

from environments.rollout import ParsedToolCall, ParsedTurn
from environments.trajectory import FunctionCall, ToolCall

__all__ = [
    "DEFAULT_PARSER",
    "ParsedToolCall",
    "ParsedTurn",
    "ToolCallParser",
    "available_parsers",
    "get_parser",
    "register_parser",
    "to_message_tool_calls",
]

DEFAULT_PARSER = "hermes"


class ToolCallParser(abc.ABC):
    """Extracts tool calls from raw assistant text in one model's format."""

    name: str = ""

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """Split ``text`` into content, calls and errors; never raises on bad calls."""


_PARSERS: dict[str, type[ToolCallParser]] = {}


def register_parser(name: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    """Class decorator: register a :class:`ToolCallParser` subclass under ``name``."""
    def register(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
            raise TypeError(f"register_parser({name!r}): {cls!r} is not a ToolCallParser "
                            "subclass")
        existing = _PARSERS.get(name)
        if existing is not None and ((existing.__module__, existing.__qualname__)
                                     != (cls.__module__, cls.__qualname__)):
            raise ValueError(f"a tool call parser named {name!r} is already registered "
                             f"({existing.__qualname__})")
        cls.name = name
        _PARSERS[name] = cls
        return cls
    return register


def get_parser(name: str = DEFAULT_PARSER) -> ToolCallParser:
    """A new parser for format ``name``; ValueError listing the known formats otherwise."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; registered: "
                         f"{', '.join(available_parsers())}") from None


def available_parsers() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(_PARSERS)


def to_message_tool_calls(calls: Iterable[ParsedToolCall]) -> list[ToolCall]:
    """Parsed calls as chat-message tool calls: ids ``call_0``, ``call_1``, ... and
    JSON-encoded arguments (as in the OpenAI chat API)."""
    return [ToolCall(id=f"call_{i}", function=FunctionCall(
                name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False)))
            for i, call in enumerate(calls)]


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return {str: "string", int: "number", float: "number", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _call_from_json(value: Any, raw: str) -> ParsedToolCall | str:
    """A call from its decoded JSON ``{"name": .., "arguments": ..}``, or what is wrong.

    ``arguments`` may be missing (no arguments), an object, or a JSON string holding an
    object (some models double-encode it).
    """
    if not isinstance(value, dict):
        return f"expected a JSON object with 'name' and 'arguments', got {_json_kind(value)}"
    if "name" not in value:
        return "missing 'name'"
    name = value["name"]
    if not isinstance(name, str) or not name.strip():
        return f"'name' must be a non-empty string, got {json.dumps(name)}"
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return f"call to {name!r}: 'arguments' is a string but not valid JSON ({error})"
        if not isinstance(arguments, dict):
            return (f"call to {name!r}: 'arguments' is a string holding "
                    f"{_json_kind(arguments)}, not an object")
    elif not isinstance(arguments, dict):
        return f"call to {name!r}: 'arguments' must be an object, got {_json_kind(arguments)}"
    return ParsedToolCall(name=name.strip(), arguments=arguments, raw=raw)


@register_parser("hermes")
class HermesParser(ToolCallParser):
    """``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks (Hermes, Qwen2.5,
    Qwen3). A ``<tool_call>`` with no closing tag before the next one (or the end of the
    text) is malformed; its text up to there is dropped from the content."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        errors: list[str] = []
        position = 0
        index = 0  # of the call block, for error messages
        while (start := text.find(self.open_tag, position)) != -1:
            content.append(text[position:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            next_open = text.find(self.open_tag, body_start)
            if end == -1 or (next_open != -1 and next_open < end):
                stop = len(text) if next_open == -1 else next_open
                errors.append(f"tool call {index}: {self.open_tag} is not closed by "
                              f"{self.close_tag}")
                position = stop
            else:
                position = end + len(self.close_tag)
                raw = text[start:position]
                result = self._parse_body(text[body_start:end], raw)
                if isinstance(result, str):
                    errors.append(f"tool call {index}: {result}")
                else:
                    calls.append(result)
            index += 1
        content.append(text[position:])
        return ParsedTurn(content="".join(content).strip(), calls=calls, errors=errors)

    @staticmethod
    def _parse_body(body: str, raw: str) -> ParsedToolCall | str:
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            return f"invalid JSON ({error})"
        return _call_from_json(value, raw)


@register_parser("mistral")
class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`` (Mistral v3 tokenizer).

    The calls of one block share its text as ``raw``. A single object instead of a list
    is accepted. When the JSON after the marker is invalid, the text up to the next
    marker (or the end) is dropped from the content and reported.
    """

    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedTurn:
        decoder = json.JSONDecoder()
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        errors: list[str] = []
        position = 0
        block = 0
        while (start := text.find(self.marker, position)) != -1:
            content.append(text[position:start])
            body_start = start + len(self.marker)
            while body_start < len(text) and text[body_start].isspace():
                body_start += 1
            try:
                value, end = decoder.raw_decode(text, body_start)
            except json.JSONDecodeError as error:
                next_marker = text.find(self.marker, body_start)
                position = len(text) if next_marker == -1 else next_marker
                errors.append(f"tool call block {block}: invalid JSON after "
                              f"{self.marker} ({error})")
                block += 1
                continue
            position = end
            raw = text[start:end]
            if isinstance(value, dict):
                value = [value]
            if not isinstance(value, list):
                errors.append(f"tool call block {block}: expected a JSON list of calls "
                              f"after {self.marker}, got {_json_kind(value)}")
            else:
                for i, item in enumerate(value):
                    result = _call_from_json(item, raw)
                    if isinstance(result, str):
                        errors.append(f"tool call block {block}, call {i}: {result}")
                    else:
                        calls.append(result)
            block += 1
        content.append(text[position:])
        return ParsedTurn(content="".join(content).strip(), calls=calls, errors=errors)
