"""Tools an agent can call: a schema for the model, and a safe way to run the call.

A :class:`Tool` pairs a Python callable with the OpenAI-style JSON schema the model sees.
The easiest way to make one is the :func:`tool` decorator, which reads the schema from
the function's type hints and docstring::

    @tool(timeout_s=5)
    def get_weather(city: str, units: Literal["C", "F"] = "C") -> dict:
        '''Current weather for a city.

        Args:
            city: The city's name, e.g. "Paris".
            units: Temperature unit.
        '''

:meth:`Tool.call` is what an environment runs on a parsed call. Whatever goes wrong
(bad arguments from the model, an exception in the function, a timeout) comes back as a
:class:`ToolError` whose message is meant to be shown to the model as the tool result,
so it names the argument or the error precisely. Sync functions run in a worker thread,
so a slow tool never blocks the event loop (and the other rollouts on it).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Union

__all__ = ["Tool", "ToolError", "tool", "tool_schemas", "tools_by_name"]

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""Tool names the OpenAI API (and most chat templates) accept."""


class ToolError(Exception):
    """A tool call failed; the message is fit to be returned to the model as the result."""


@dataclass
class Tool:
    """A callable the model can use, with the JSON schema of its arguments.

    ``parameters`` is a JSON schema of type ``object``; it is also what :meth:`call`
    validates the model's arguments against (the subset :func:`tool` generates:
    ``type``, ``enum``, ``anyOf``, ``items``, ``properties``, ``required``,
    ``additionalProperties``; other keywords are shown to the model but not enforced).
    Arguments not listed in ``properties`` are refused unless the schema says
    ``"additionalProperties": true``.

    ``function`` may be sync (run in a worker thread) or async (awaited on the loop).
    ``timeout_s`` bounds one call; ``None`` means no limit. A sync function that times
    out cannot be interrupted: its thread runs on in the background until it returns.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]
    timeout_s: float | None = 10.0
    inline: bool = False
    """Run a sync function on the event loop instead of a worker thread: for cheap, pure
    functions (a calculator), where the thread hop costs more than the call (~3-6 ms per
    call measured under load, waiting for the GIL). An inline call cannot time out."""
    state_arg: str | None = None
    """Name of a parameter of ``function`` that receives the current rollout's state
    (``BaseEnv.new_rollout_state``; ``None`` outside a rollout or when the env keeps
    none). It is not part of the schema, and the model cannot set it."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_PATTERN.match(self.name):
            raise ValueError(f"tool name {self.name!r} is invalid: use 1 to 64 letters, "
                             "digits, '_' or '-'")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type "
                             f"'object', got {self.parameters!r}")
        if not callable(self.function):
            raise TypeError(f"tool {self.name!r}: function {self.function!r} is not callable")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0 or None, "
                             f"got {self.timeout_s!r}")

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style tool schema, as given to the chat template or API."""
        return {"type": "function", "function": {
            "name": self.name,
            "description": self.description,
            "parameters": copy.deepcopy(self.parameters),
        }}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function directly (no validation, no timeout)."""
        return self.function(*args, **kwargs)

    async def call(self, arguments: dict[str, Any]) -> str:
        """Validate ``arguments``, run the function and return its result as a string.

        Raises :class:`ToolError` for invalid arguments (naming each bad argument), for
        a timeout, and for any exception the function raises (``"ValueError: ..."``);
        a :class:`ToolError` raised by the function itself is passed on unchanged.
        """
        kwargs = validate_arguments(self.parameters, arguments)
        try:
            if self.timeout_s is None:
                result = await self._run(kwargs)
            else:
                result = await asyncio.wait_for(self._run(kwargs), self.timeout_s)
        except TimeoutError:
            # Only wait_for's own timeout reaches here: _run turns the function's
            # exceptions (TimeoutError included) into ToolError.
            raise ToolError(f"tool {self.name!r} timed out after {self.timeout_s:g} s") from None
        return result_to_str(result)

    async def _run(self, kwargs: dict[str, Any]) -> Any:
        if self.state_arg is not None:
            from environments.framework.rewards import rollout_state

            kwargs = {**kwargs, self.state_arg: rollout_state(None)}
        try:
            if _is_async(self.function):
                result = await self.function(**kwargs)
            elif self.inline:
                result = self.function(**kwargs)
            else:
                result = await asyncio.to_thread(self.function, **kwargs)
                if inspect.isawaitable(result):  # a sync wrapper around a coroutine
                    result = await result
        except ToolError:
            raise
        except Exception as error:
            message = str(error)
            raise ToolError(f"{type(error).__name__}: {message}" if message
                            else type(error).__name__) from error
        return result


def _is_async(function: Callable[..., Any]) -> bool:
    return (inspect.iscoroutinefunction(function)
            or inspect.iscoroutinefunction(getattr(function, "__call__", None)))


def result_to_str(value: Any) -> str:
    """A tool's return value as text: strings as they are, else JSON, else ``str()``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


# --- argument validation -----------------------------------------------------------

_JSON_TYPE_NAMES = {str: "string", bool: "boolean", int: "integer", float: "number",
                    list: "array", dict: "object", type(None): "null"}


def _json_type(value: Any) -> str:
    for python_type, name in _JSON_TYPE_NAMES.items():
        if isinstance(value, python_type):
            return name
    return type(value).__name__


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def validate_arguments(parameters: dict[str, Any], arguments: Any) -> dict[str, Any]:
    """Check ``arguments`` against an object schema; return them with numbers converted.

    Every problem is reported, in one :class:`ToolError`, e.g. ``missing required
    argument 'city'; argument 'days': expected integer, got string "three"``.
    """
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments must be a JSON object, got {_json_type(arguments)}")
    properties: dict[str, Any] = parameters.get("properties", {})
    extra_allowed = parameters.get("additionalProperties") is True
    problems: list[str] = []
    for name in parameters.get("required", []):
        if name not in arguments:
            problems.append(f"missing required argument {name!r}")
    checked: dict[str, Any] = {}
    for name, value in arguments.items():
        if name not in properties:
            if extra_allowed:
                checked[name] = value
            else:
                known = ", ".join(repr(k) for k in properties) or "none"
                problems.append(f"unknown argument {name!r} (expected: {known})")
            continue
        try:
            checked[name] = _check(properties[name], value, name)
        except _Mismatch as mismatch:
            problems.append(f"argument {mismatch.path!r}: {mismatch.message}")
    if problems:
        raise ToolError("; ".join(problems))
    return checked


class _Mismatch(Exception):
    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def _check(schema: dict[str, Any], value: Any, path: str) -> Any:
    """``value`` checked against ``schema`` (possibly converted), or raise _Mismatch."""
    if "anyOf" in schema:
        deeper: list[_Mismatch] = []
        for option in schema["anyOf"]:
            try:
                return _check(option, value, path)
            except _Mismatch as mismatch:
                if mismatch.path != path:  # the right kind of value, a bad item inside
                    deeper.append(mismatch)
        if deeper:
            raise deeper[0]
        raise _Mismatch(path, f"expected {_describe(schema)}, got {_json_type(value)} "
                              f"{_show(value)}")
    if "enum" in schema:
        if not any(value == allowed and _json_type(value) == _json_type(allowed)
                   for allowed in schema["enum"]):
            choices = ", ".join(_show(v) for v in schema["enum"])
            raise _Mismatch(path, f"must be one of {choices}, got {_show(value)}")
        return value
    expected = schema.get("type")
    if expected is None:
        return value
    for type_name in [expected] if isinstance(expected, str) else expected:
        converted = _convert(type_name, schema, value, path)
        if converted is not _NO_MATCH:
            return converted
    raise _Mismatch(path, f"expected {_describe(schema)}, got {_json_type(value)} "
                          f"{_show(value)}")


_NO_MATCH = object()


def _convert(type_name: str, schema: dict[str, Any], value: Any, path: str) -> Any:
    """``value`` as JSON type ``type_name``, or _NO_MATCH; raise _Mismatch for bad items."""
    if isinstance(value, bool):
        return value if type_name == "boolean" else _NO_MATCH
    if type_name == "integer":
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():  # JSON 3.0 is the integer 3
            return int(value)
        return _NO_MATCH
    if type_name == "number":
        return float(value) if isinstance(value, (int, float)) else _NO_MATCH
    if type_name == "string":
        return value if isinstance(value, str) else _NO_MATCH
    if type_name == "null":
        return value if value is None else _NO_MATCH
    if type_name == "array":
        if not isinstance(value, list):
            return _NO_MATCH
        items = schema.get("items")
        if not items:
            return value
        return [_check(items, item, f"{path}[{i}]") for i, item in enumerate(value)]
    if type_name == "object":
        if not isinstance(value, dict):
            return _NO_MATCH
        if "properties" in schema:
            try:
                return validate_arguments(schema, value)
            except ToolError as error:
                raise _Mismatch(path, str(error)) from None
        values = schema.get("additionalProperties")
        if not isinstance(values, dict) or not values:
            return value
        return {key: _check(values, item, f"{path}[{json.dumps(key, ensure_ascii=False)}]")
                for key, item in value.items()}
    return _NO_MATCH


def _describe(schema: dict[str, Any]) -> str:
    if "anyOf" in schema:
        return " or ".join(_describe(option) for option in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(_show(v) for v in schema["enum"])
    expected = schema.get("type", "any value")
    return expected if isinstance(expected, str) else " or ".join(expected)


# --- schemas from type hints -------------------------------------------------------

_SIMPLE_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _schema_for(annotation: Any) -> dict[str, Any]:
    """JSON schema of a supported type hint; TypeError (with the hint) otherwise."""
    if annotation in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[annotation]}
    if annotation is Any:
        return {}
    if annotation is type(None) or annotation is None:
        return {"type": "null"}
    if annotation is list:
        return {"type": "array"}
    if annotation is dict:
        return {"type": "object"}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is list:
        return {"type": "array", "items": _schema_for(args[0])}
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"dict keys must be str (JSON object keys), got {annotation!r}")
        return {"type": "object", "additionalProperties": _schema_for(args[1])}
    if origin is Literal:
        for value in args:
            if not isinstance(value, (str, int, float, bool, type(None))):
                raise TypeError(f"Literal values must be JSON scalars, got {value!r}")
        kinds = {_json_type(value) for value in args}
        schema: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1:
            schema = {"type": kinds.pop(), **schema}
        return schema
    if origin is Union or origin is types.UnionType:
        options = [_schema_for(arg) for arg in args]
        if all(set(option) == {"type"} for option in options):
            return {"type": [option["type"] for option in options]}
        return {"anyOf": options}
    raise TypeError(f"unsupported type {annotation!r} (use int, float, str, bool, "
                    "list[X], dict[str, X], Literal[...], X | None or Any)")


_SECTIONS = ("Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters"
             "|Returns|Return|Yields|Yield|Raises|Examples|Example|Notes|Note|Attributes"
             "|See Also|Warnings|Warning|Todo|References")
_SECTION = re.compile(rf"^({_SECTIONS}):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def parse_docstring(docstring: str | None) -> tuple[str, dict[str, str]]:
    """The description (first paragraph) and Google-style ``Args:`` descriptions."""
    lines = inspect.cleandoc(docstring or "").splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line):
            break
        summary.append(line.strip())
    arguments: dict[str, str] = {}
    in_args = False
    entry_indent: int | None = None
    current: str | None = None
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        section = _SECTION.match(line)
        if indent == 0 and section:
            in_args = section.group(1) in ("Args", "Arguments", "Parameters", "Params")
            entry_indent, current = None, None
            continue
        if not in_args:
            continue
        if indent == 0:  # prose after the section ends it
            in_args = False
            continue
        if entry_indent is None:
            entry_indent = indent
        entry = _ARG_LINE.match(line.strip())
        if indent == entry_indent and entry:
            current = entry.group(1)
            arguments[current] = entry.group(2).strip()
        elif indent > entry_indent and current is not None:
            arguments[current] = f"{arguments[current]} {line.strip()}".strip()
    return " ".join(summary), arguments


def _schema_from_function(function: Callable[..., Any], skip: str | None = None
                          ) -> tuple[dict[str, Any], str]:
    """(parameters schema, description) of ``function``, without parameter ``skip``;
    TypeError names what is wrong."""
    label = getattr(function, "__qualname__", None) or repr(function)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as error:
        raise TypeError(f"tool function {label!r}: cannot read its signature ({error})") from None
    # Where the hints (and, for a partial, the docstring) live.
    target = function
    if isinstance(function, functools.partial):
        target = function.func
    elif not (inspect.isfunction(function) or inspect.ismethod(function)):
        target = type(function).__call__  # a callable object
    try:
        hints = typing.get_type_hints(target)
    except Exception as error:
        raise TypeError(f"tool function {label!r}: cannot resolve its type hints "
                        f"({type(error).__name__}: {error})") from None
    # A callable object's docstring is its class's; a partial's is its function's.
    docstring = inspect.getdoc(target if isinstance(function, functools.partial) else function)
    description, arg_docs = parse_docstring(docstring)
    properties: dict[str, Any] = {}
    required: list[str] = []
    if skip is not None and skip not in signature.parameters:
        raise TypeError(f"tool function {label!r}: state_arg {skip!r} is not one of its "
                        "parameters")
    for name, parameter in signature.parameters.items():
        if name == skip:
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD,
                              parameter.POSITIONAL_ONLY):
            raise TypeError(f"tool function {label!r}: parameter {name!r} is "
                            f"{parameter.kind.description}; tools take keyword arguments only")
        if name not in hints:
            raise TypeError(f"tool function {label!r}: parameter {name!r} has no type hint")
        try:
            schema = _schema_for(hints[name])
        except TypeError as error:
            raise TypeError(f"tool function {label!r}: parameter {name!r}: {error}") from None
        if name in arg_docs:
            schema["description"] = arg_docs[name]
        if parameter.default is parameter.empty:
            required.append(name)
        else:
            try:
                json.dumps(parameter.default)
                schema["default"] = parameter.default
            except (TypeError, ValueError):
                pass
        properties[name] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return parameters, description


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None, timeout_s: float | None = 10.0,
         inline: bool = False, state_arg: str | None = None) -> Any:
    """Build a :class:`Tool` from a function's type hints and docstring.

    Use as ``tool(fn)``, ``@tool`` or ``@tool(name=..., timeout_s=..., inline=...,
    state_arg=...)``. ``state_arg`` names a parameter that receives the rollout's state
    (see :func:`environments.framework.rewards.rollout_state`) and is left out of the schema. The name
    defaults to the function's name, the description to the docstring's first
    paragraph; a Google-style ``Args:`` section gives the parameters' descriptions.
    Parameters with a default are optional. Every parameter needs a type hint among
    int, float, str, bool, list[X], dict[str, X], Literal[...], X | None and Any;
    anything else raises TypeError naming the function and the parameter.
    """
    def build(function: Callable[..., Any]) -> Tool:
        tool_name = name or getattr(function, "__name__", None)
        if tool_name is None:
            raise TypeError(f"tool({function!r}): it has no __name__; pass name=...")
        parameters, doc_description = _schema_from_function(function, skip=state_arg)
        return Tool(name=tool_name,
                    description=doc_description if description is None else description,
                    parameters=parameters, function=function, timeout_s=timeout_s,
                    inline=inline, state_arg=state_arg)

    return build if fn is None else build(fn)


def tools_by_name(tools: Iterable[Tool]) -> dict[str, Tool]:
    """``{tool.name: tool}``; ValueError when two tools share a name."""
    by_name: dict[str, Tool] = {}
    for t in tools:
        if t.name in by_name:
            raise ValueError(f"duplicate tool name {t.name!r}")
        by_name[t.name] = t
    return by_name


def tool_schemas(tools: Iterable[Tool]) -> list[dict[str, Any]]:
    """The OpenAI-style schemas of ``tools``, in order; ValueError on duplicate names."""
    return [t.schema() for t in tools_by_name(tools).values()]
