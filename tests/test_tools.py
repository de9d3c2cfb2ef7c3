"""Tools and tool-call parsers: schemas from hints, validated calls whose every failure is
a ToolError naming what is wrong, sync tools off the event loop, and parsers that report
malformed calls instead of raising."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Literal, Optional

import pytest

from environments.framework.tools import (
    Tool,
    ToolError,
    tool,
    tool_schemas,
    tools_by_name,
)
from environments.inference.tool_parsers import (
    ParsedToolCall,
    ToolCallParser,
    available_parsers,
    get_parser,
    register_parser,
    to_message_tool_calls,
)
from environments.trajectory import Message


@tool(timeout_s=5)
def get_weather(city: str, days: int = 1, units: Literal["C", "F"] = "C",
                hours: list[int] | None = None, detail: Optional[bool] = None) -> dict:
    """Weather forecast for a city.

    More detail that is not part of the description.

    Args:
        city: The city's name,
            e.g. "Paris".
        days (int): Number of days.
        units: Temperature unit.

    Returns:
        The forecast.
    """
    return {"city": city, "days": days, "units": units, "hours": hours, "detail": detail}


def run(coro):
    return asyncio.run(coro)


def call_error(t: Tool, arguments) -> str:
    with pytest.raises(ToolError) as error:
        run(t.call(arguments))
    return str(error.value)


# --- schemas ---------------------------------------------------------------------

def test_schema_from_hints_and_docstring():
    assert get_weather.schema() == {"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": 'The city\'s name, e.g. "Paris".'},
                "days": {"type": "integer", "description": "Number of days.", "default": 1},
                "units": {"type": "string", "enum": ["C", "F"],
                          "description": "Temperature unit.", "default": "C"},
                "hours": {"anyOf": [{"type": "array", "items": {"type": "integer"}},
                                    {"type": "null"}], "default": None},
                "detail": {"type": ["boolean", "null"], "default": None},
            },
            "required": ["city"],
        },
    }}


def test_schema_of_other_types_and_all_decorator_forms():
    def f(x: float, tags: dict[str, int], anything: list, flag: bool) -> str:
        """Does f."""
        return ""

    props = tool(f).parameters["properties"]
    assert props == {"x": {"type": "number"},
                     "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
                     "anything": {"type": "array"}, "flag": {"type": "boolean"}}
    assert tool(f).name == "f" and tool(f).description == "Does f."

    @tool
    def g() -> str:
        return "g"

    @tool(name="renamed", description="Custom.", timeout_s=None)
    def h() -> str:
        return "h"

    assert (g.name, g.description, g.parameters) == ("g", "", {"type": "object", "properties": {}})
    assert (h.name, h.description, h.timeout_s) == ("renamed", "Custom.", None)
    assert run(h.call({})) == "h" and h() == "h"  # a Tool still calls like the function


def test_missing_type_hint_names_function_and_parameter():
    def untyped(city: str, days) -> str:
        return ""

    with pytest.raises(TypeError, match=r"'.*untyped'.*parameter 'days' has no type hint"):
        tool(untyped)


def test_unsupported_hints_are_refused_at_definition():
    def with_set(ids: set[int]) -> str:
        return ""

    def with_int_keys(m: dict[int, str]) -> str:
        return ""

    def with_kwargs(**options: str) -> str:
        return ""

    with pytest.raises(TypeError, match=r"parameter 'ids': unsupported type"):
        tool(with_set)
    with pytest.raises(TypeError, match=r"parameter 'm': dict keys must be str"):
        tool(with_int_keys)
    with pytest.raises(TypeError, match=r"parameter 'options' is variadic keyword"):
        tool(with_kwargs)


def test_tool_lists_refuse_duplicate_names():
    other = tool(get_weather.function, name="other")
    assert list(tools_by_name([get_weather, other])) == ["get_weather", "other"]
    assert [s["function"]["name"] for s in tool_schemas([get_weather, other])] == \
        ["get_weather", "other"]
    for build in (tools_by_name, tool_schemas):
        with pytest.raises(ValueError, match="duplicate tool name 'get_weather'"):
            build([get_weather, other, get_weather])


def test_bad_tool_definitions():
    with pytest.raises(ValueError, match="tool name 'has space' is invalid"):
        tool(get_weather.function, name="has space")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        tool(get_weather.function, timeout_s=0)


# --- calls -----------------------------------------------------------------------

def test_call_validates_and_converts():
    result = json.loads(run(get_weather.call(
        {"city": "Paris", "days": 3.0, "units": "F", "hours": [6, 12], "detail": True})))
    assert result == {"city": "Paris", "days": 3, "units": "F", "hours": [6, 12],
                      "detail": True}
    assert json.loads(run(get_weather.call({"city": "Oslo"})))["days"] == 1


@pytest.mark.parametrize("arguments, message", [
    ({}, "missing required argument 'city'"),
    ({"city": "Paris", "country": "FR"}, "unknown argument 'country'"),
    ({"city": 42}, "argument 'city': expected string, got integer 42"),
    ({"city": "Paris", "days": "three"}, "argument 'days': expected integer, got string \"three\""),
    ({"city": "Paris", "days": True}, "argument 'days': expected integer, got boolean true"),
    ({"city": "Paris", "days": 1.5}, "argument 'days': expected integer, got number 1.5"),
    ({"city": "Paris", "units": "K"}, "argument 'units': must be one of \"C\", \"F\", got \"K\""),
    ({"city": "Paris", "hours": [6, "noon"]}, "argument 'hours[1]'"),
    ({"city": "Paris", "detail": "yes"}, "argument 'detail': expected boolean or null"),
    (["Paris"], "arguments must be a JSON object, got array"),
])
def test_bad_arguments_are_a_tool_error_naming_the_argument(arguments, message):
    assert message in call_error(get_weather, arguments)


def test_all_argument_problems_are_reported_together():
    message = call_error(get_weather, {"days": "x", "zone": 1})
    assert "missing required argument 'city'" in message
    assert "argument 'days'" in message and "unknown argument 'zone'" in message


def test_float_and_dict_arguments():
    @tool
    def scale(x: float, weights: dict[str, float]) -> dict:
        return {"x": x, "weights": weights}

    assert run(scale.call({"x": 2, "weights": {"a": 1}})) == '{"x": 2.0, "weights": {"a": 1.0}}'
    assert "argument 'weights[\"b\"]': expected number" in call_error(
        scale, {"x": 1, "weights": {"b": "heavy"}})


def test_sync_timeout_does_not_block_the_event_loop():
    release = threading.Event()

    @tool(timeout_s=0.2)
    def slow() -> str:
        release.wait(10)  # a blocking call, like time.sleep
        return "late"

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        started = time.monotonic()
        with pytest.raises(ToolError, match=r"tool 'slow' timed out after 0.2 s"):
            await slow.call({})
        elapsed = time.monotonic() - started
        ticking.cancel()
        release.set()  # let the worker thread finish so the loop can shut down
        return elapsed, ticks

    elapsed, ticks = run(main())
    assert elapsed < 1.0
    assert ticks >= 5  # the loop kept running while the tool blocked its thread


def test_sync_tools_run_concurrently():
    # Four blocking calls meet at a barrier: it opens only if all four are in flight at
    # once, so calls run one after another break it (no wall-clock bound to race).
    meet = threading.Barrier(4, timeout=10)

    @tool(timeout_s=30)
    def rendezvous() -> str:
        meet.wait()
        return "done"

    async def main():
        return await asyncio.gather(*(rendezvous.call({}) for _ in range(4)))

    assert run(main()) == ["done"] * 4


def test_async_tool_and_async_timeout():
    @tool
    async def fetch(url: str) -> list:
        await asyncio.sleep(0)
        return [url, "ok"]

    @tool(timeout_s=0.05)
    async def hang() -> str:
        await asyncio.sleep(10)
        return "never"

    assert run(fetch.call({"url": "https://x"})) == '["https://x", "ok"]'
    assert call_error(hang, {}) == "tool 'hang' timed out after 0.05 s"


def test_exceptions_are_wrapped_and_tool_errors_pass_through():
    @tool
    def divide(a: int, b: int) -> float:
        return a / b

    @tool
    async def raises_timeout() -> str:
        raise TimeoutError("upstream took too long")

    @tool
    def refuses(path: str) -> str:
        raise ToolError(f"no such file: {path}")

    assert call_error(divide, {"a": 1, "b": 0}) == "ZeroDivisionError: division by zero"
    # The function's own TimeoutError is its error, not the tool's timeout.
    assert call_error(raises_timeout, {}) == "TimeoutError: upstream took too long"
    assert call_error(refuses, {"path": "a.txt"}) == "no such file: a.txt"


def test_results_become_strings():
    class Opaque:
        def __str__(self) -> str:
            return "<opaque>"

    def returning(value):
        return Tool(name="r", description="", parameters={"type": "object"},
                    function=lambda: value)

    assert run(returning("plain text").call({})) == "plain text"
    assert run(returning({"é": [1, 2.5, None]}).call({})) == '{"é": [1, 2.5, null]}'
    assert run(returning(7).call({})) == "7"
    assert run(returning(Opaque()).call({})) == "<opaque>"


def test_hand_written_schema_is_enforced():
    echo = Tool(name="echo", description="Echo.", timeout_s=None,
                parameters={"type": "object", "properties": {"text": {"type": "string"}},
                            "required": ["text"]},
                function=lambda text: text)
    assert run(echo.call({"text": "hi"})) == "hi"
    assert "missing required argument 'text'" in call_error(echo, {})
    assert "unknown argument 'loud'" in call_error(echo, {"text": "hi", "loud": True})


# --- parsers ---------------------------------------------------------------------

hermes = get_parser("hermes")


def block(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_hermes_is_the_default_and_parsers_are_registered():
    assert get_parser().name == "hermes"
    assert {"hermes", "mistral"} <= set(available_parsers())


def test_unknown_parser_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown tool call parser 'nope'; registered: .*hermes"):
        get_parser("nope")


def test_hermes_one_call():
    text = block("get_weather", {"city": "Paris"})
    turn = hermes.parse(text)
    assert turn.calls == [ParsedToolCall("get_weather", {"city": "Paris"}, raw=text)]
    assert (turn.content, turn.errors) == ("", [])


def test_hermes_two_calls_with_surrounding_text():
    first, second = block("a", {"x": 1}), block("b", {})
    turn = hermes.parse(f"Let me check.\n{first}\n{second}\nDone.")
    assert [(c.name, c.arguments, c.raw) for c in turn.calls] == \
        [("a", {"x": 1}, first), ("b", {}, second)]
    assert turn.content == "Let me check.\n\n\nDone."
    assert turn.errors == []


def test_hermes_tight_json_and_string_arguments():
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>'
    assert hermes.parse(text).calls == [ParsedToolCall("a", {"x": [1, 2]}, raw=text)]


def test_hermes_no_calls():
    turn = hermes.parse("  The answer is 4.\n")
    assert (turn.content, turn.calls, turn.errors) == ("The answer is 4.", [], [])


def test_hermes_malformed_calls_are_reported_not_raised():
    good = block("ok", {"n": 1})
    text = "\n".join([
        "<tool_call>{'name': 'py_dict'}</tool_call>",  # 0: invalid JSON
        '<tool_call>{"arguments": {}}</tool_call>',     # 1: no name
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # 2: arguments not object
        '<tool_call>{"name": "b", "arguments": "[1]"}</tool_call>',  # 3: string, not object
        '<tool_call>["a"]</tool_call>',                 # 4: not an object
        good,                                            # 5: fine
    ])
    turn = hermes.parse(text)
    assert [c.name for c in turn.calls] == ["ok"]
    assert len(turn.errors) == 5
    assert turn.errors[0].startswith("tool call 0: invalid JSON")
    assert turn.errors[1] == "tool call 1: missing 'name'"
    assert turn.errors[2] == "tool call 2: call to 'a': 'arguments' must be an object, got array"
    assert "tool call 3: call to 'b': 'arguments' is a string holding array" in turn.errors[3]
    assert turn.errors[4].startswith("tool call 4: expected a JSON object")
    assert turn.content == ""


def test_hermes_unclosed_tag():
    good = block("a", {})
    turn = hermes.parse(f"Calling.\n{good}\n<tool_call>\n{{\"name\": \"b\", \"argum")
    assert [c.name for c in turn.calls] == ["a"]
    assert turn.errors == ["tool call 1: <tool_call> is not closed by </tool_call>"]
    assert turn.content == "Calling."

    # An unclosed tag followed by a complete call: the complete one still counts.
    turn = hermes.parse(f"<tool_call>{{\"name\": \"x\"\n{good}")
    assert [c.name for c in turn.calls] == ["a"]
    assert turn.errors == ["tool call 0: <tool_call> is not closed by </tool_call>"]


def test_mistral_format():
    parser = get_parser("mistral")
    raw = '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{}"}]'
    turn = parser.parse(f"Sure. {raw}</s>")
    assert [(c.name, c.arguments, c.raw) for c in turn.calls] == [("a", {"x": 1}, raw),
                                                                  ("b", {}, raw)]
    assert (turn.content, turn.errors) == ("Sure. </s>", [])

    turn = parser.parse('[TOOL_CALLS] [{"name": "a"}, {"arguments": {}}]')
    assert [(c.name, c.arguments) for c in turn.calls] == [("a", {})]
    assert turn.errors == ["tool call block 0, call 1: missing 'name'"]

    turn = parser.parse("text [TOOL_CALLS][{\"name\": ")
    assert turn.calls == [] and turn.content == "text"
    assert turn.errors[0].startswith("tool call block 0: invalid JSON after [TOOL_CALLS]")


def test_register_a_parser():
    @register_parser("test-upper")
    class UpperParser(ToolCallParser):
        def parse(self, text):
            return get_parser("hermes").parse(text.replace("<TOOL>", "<tool_call>")
                                              .replace("</TOOL>", "</tool_call>"))

    assert "test-upper" in available_parsers()
    turn = get_parser("test-upper").parse('<TOOL>{"name": "a", "arguments": {}}</TOOL>')
    assert [c.name for c in turn.calls] == ["a"]
    with pytest.raises(ValueError, match="'hermes' is already registered"):
        register_parser("hermes")(UpperParser)


def test_to_message_tool_calls():
    calls = hermes.parse(block("a", {"city": "Zürich"}) + block("b", {})).calls
    message = Message(role="assistant", content="", tool_calls=to_message_tool_calls(calls))
    assert [(c.id, c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == [("call_0", "a", {"city": "Zürich"}),
                                              ("call_1", "b", {})]
    assert message.tool_calls[0].function.arguments == '{"city": "Zürich"}'
