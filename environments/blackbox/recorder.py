"""The recorder under every wire dialect of the interception proxy: one assistant turn,
token-in/token-out on vLLM, appended to the rollout's exact trajectory.

A dialect (:mod:`environments.blackbox.dialects`) turns its request into
:class:`Message` objects (OpenAI chat messages as the chat template renders them, plus a
comparison key) and function tools in the OpenAI form, calls :func:`record_turn`, and
turns the :class:`TurnReply` back into its own response. So the four wire APIs share
one recording: the same extension check, segments, retries, limits and tokens.

What :func:`record_turn` does:

1. checks that the request's history *extends* what it recorded for the rollout: the
   messages it saw before plus the assistant replies it sent, unchanged, with only new
   non-assistant messages (tool results, user turns) after them. If so, the new messages
   are appended as context tokens exactly as the framework's own agent loop does
   (:meth:`ChatRenderer.continuation`); if not (the agent edited, dropped or invented
   messages, or changed its tools) nothing is re-tokenized: a new *segment* starts (the
   whole request rendered as a fresh prompt), with the reason recorded;
2. generates one assistant turn on vLLM (the env's sampling settings, never the
   agent's), appends the sampled ids and logprobs as trained tokens and parses the tool
   calls with the env's parser.

Messages are compared by role, text (outer whitespace left out: clients strip it) and
tool calls by name and parsed arguments; call ids and formatting are left out, so a reply
sent back in any dialect matches the turn that produced it.

A request whose history is the recorded one without the reply just sent (the same
messages and tools as the request that got it) is a retry of a request whose reply the
agent never saw: that reply is taken out of the trajectory (kept in
``extra["abandoned_replies"]``, not trained) and the turn is sampled again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

from environments.inference.backends import VLLMBackend, sampling_seeds
from environments.inference.chat_template import ChatRenderer, ChatTemplateError
from environments.inference.tool_parsers import ToolCallParser
from environments.inference.vllm_client import ContextLengthError
from environments.rollout import AssistantTurn, Rollout, turn_versions

log = logging.getLogger("environments.blackbox.proxy")


class RequestError(ValueError):
    """A request the proxy refuses (HTTP 400 unless ``status`` says otherwise), with an
    error code and the field it is about (``param``, e.g.
    ``messages[2].tool_calls[0].function.name``), in the dialect's own field names."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None,
                 status: int = 400):
        super().__init__(message)
        self.code = code
        self.param = param
        self.status = status


def type_name(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string",
                                         bool: "boolean", int: "number", float: "number"}.get(
        type(value), type(value).__name__)


def check_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where}: must be a string, got {type_name(value)}", param=where)
    return value


def check_object(value: Any, where: str, what: str = "an object") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(f"{where}: must be {what}, got {type_name(value)}", param=where)
    return value


def parse_arguments(value: Any) -> Any:
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


def make_message(role: str, text: str, calls: list[tuple[str | None, str, Any]] | None = None,
                 *, tool_call_id: str | None = None, name: str | None = None) -> Message:
    """A :class:`Message` from its parts. ``calls``: ``(id, name, arguments)`` of an
    assistant message's tool calls (arguments as an object, or a string that is not
    JSON); ``tool_call_id`` / ``name``: of a tool result."""
    rendered: dict[str, Any] = {"role": role, "content": text}
    if calls:
        rendered["tool_calls"] = [
            {**({"id": call_id} if call_id is not None else {}), "type": "function",
             "function": {"name": fn, "arguments": parse_arguments(arguments)}}
            for call_id, fn, arguments in calls]
    if role == "tool":
        if tool_call_id is not None:
            rendered["tool_call_id"] = tool_call_id
        if name is not None:
            rendered["name"] = name
    key = json.dumps([role, text.strip(), [[fn, parse_arguments(arguments)]
                                           for _, fn, arguments in calls or []]],
                     sort_keys=True, default=str)
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
    statuses: list[int] = field(default_factory=list)
    """The HTTP status of each model call, in order (what an agent failure quotes)."""
    unserved: list[str] = field(default_factory=list)
    """``METHOD path`` of each request to a path or method the proxy does not serve."""
    dialects: set[str] = field(default_factory=set)
    """The wire APIs the agent's model calls used (``chat``, ``responses``, ``messages``)."""
    responses: dict[str, list[Message]] = field(default_factory=dict)
    """Responses API: the conversation up to and including each reply, by response id
    (what ``previous_response_id`` continues)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    seeds: Iterator[int] | None = None
    """The sampling seeds of the rollout that opened it (``seeded_sampling``): the
    agent's requests draw from them in the order they arrive."""
    unseen: tuple[bool, bool] | None = None
    """Set while the last thing recorded is a reply no later request has built on: the
    segment's ``ended_with_eos`` and the rollout's ``truncated`` from before it (what
    :func:`_take_back_abandoned` restores)."""
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
        state.extra["wire_apis"] = sorted(self.dialects)
        if self.unserved:
            state.extra["unserved_requests"] = list(self.unserved)
        if self.abandoned:
            state.extra["abandoned_replies"] = self.abandoned
        if self.limit is not None:
            state.truncated, state.stop = True, self.limit
        elif state.turns and not state.stop:
            state.stop = "answer"
        return state


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: Any
    """An object (or the raw text when the model wrote no JSON object)."""

    @property
    def arguments_json(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)


@dataclass
class TurnReply:
    """One generated turn as every dialect replies it."""

    index: int
    """The turn's index in the rollout (ids are made from it)."""
    content: str
    """The text the agent is shown: without the tool-call markup when there are calls."""
    calls: list[ToolCall]
    finish: str
    """``tool_calls``, ``length`` (cut at a limit) or ``stop``."""
    prompt_tokens: int
    completion_tokens: int
    messages: list[Message]
    """The segment's conversation with this reply (for ``previous_response_id``)."""


@dataclass
class Limits:
    max_turns: int
    max_token_length: int
    max_tokens_per_turn: int | None = None


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True, default=str)


async def record_turn(rollout: InterceptedRollout, messages: list[Message],
                      tools: list[dict[str, Any]] | None, max_tokens: int | None, *,
                      renderer: ChatRenderer, parser: ToolCallParser, limits: Limits,
                      policy_version: Callable[[], int | None],
                      call_id: Callable[[int, int], str],
                      script: list[list[int]] | None = None) -> TurnReply:
    """Record the request's new messages and one generated turn (see the module
    docstring); ``max_tokens`` only shortens a reply below the env's limits; ``call_id``
    makes the id of call ``j`` of turn ``i`` in the dialect's style; ``script``: the
    token ids of the rollout's first turns, forced instead of sampled (the policy's
    logprobs of them recorded: :mod:`environments.inference.forced_tokens`)."""
    key = tools_key(tools)
    state = rollout.state
    if len(state.turns) + len(rollout.abandoned) >= limits.max_turns:
        rollout.limit = "max_turns"
        raise RequestError(f"this rollout may call the model {limits.max_turns} times at "
                           "most", "max_turns_exceeded")

    segment = rollout.segments[-1] if rollout.segments else None
    if _is_retry(rollout, segment, messages, key):
        _take_back_abandoned(rollout, segment)  # the context is as it was for it
        reason = None
        undo = _undo_point(rollout)
    else:
        undo = _undo_point(rollout)
        reason = _extends(segment, messages, key)
    if reason is None and len(messages) > len(segment.messages):  # new messages
        new = messages[len(segment.messages):]
        try:
            continuation = renderer.continuation(
                [m.rendered for m in segment.messages], [m.rendered for m in new], tools,
                ended_with_eos=segment.ended_with_eos)
        except ChatTemplateError as error:
            reason = f"the chat template cannot extend the conversation ({error})"
        else:
            _check_room(rollout, limits, len(state.tokens) - segment.start
                        + len(continuation.token_ids))
            _record_tool_results(rollout, new)
            state.prefix_preserving &= continuation.prefix_preserving
            state.append(continuation.token_ids, sampled=False)
            segment.messages += new
    if reason is not None:  # a new context
        try:
            prompt = renderer.prompt_ids([m.rendered for m in messages], tools)
        except ChatTemplateError as error:
            raise RequestError(f"messages: {error}", param="messages") from None
        _check_room(rollout, limits, len(prompt))
        if segment is not None:
            log.info("rollout %s: new segment at token %d: %s", rollout.id,
                     len(state.tokens), reason)
        segment = Segment(len(state.tokens), None if segment is None else reason,
                          list(messages), tools, key)
        rollout.segments.append(segment)
        state.append(prompt, sampled=False)
        if len(rollout.segments) == 1:
            state.n_prompt_tokens = len(prompt)

    context = state.tokens[segment.start:]
    room = limits.max_token_length - len(context)
    budget = min(x for x in (room, limits.max_tokens_per_turn, max_tokens) if x is not None)
    version = policy_version()
    asked = time.monotonic()
    try:
        with sampling_seeds(rollout.seeds):  # (the handler is not the rollout's task)
            forced = script[len(state.turns)] if len(state.turns) < len(script or ()) else None
            generated = await rollout.backend.generate_from(context, budget, forced=forced)
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
    parsed = parser.parse(generated.text)
    version, spans = turn_versions(generated, start, version)
    state.turns.append(AssistantTurn(
        (start, len(state.tokens)), generated.finish_reason, parsed.calls,
        [f"malformed tool call: {e}" for e in parsed.errors], version, generated.text,
        version_spans=spans))
    index = len(state.turns) - 1
    content = parsed.content if parsed.calls else generated.text
    calls = [ToolCall(call_id(index, j), c.name, c.arguments) for j, c in enumerate(parsed.calls)]
    # What is recorded: the turn as sampled (the template renders its raw text); the
    # key: the reply as the agent will send it back.
    echo = make_message("assistant", content, [(c.id, c.name, c.arguments) for c in calls])
    recorded = make_message("assistant", generated.text,
                            [(c.id, c.name, c.arguments) for c in calls])
    segment.messages.append(Message(recorded.rendered, echo.key))
    rollout.limit = None  # an agent that shortened its context after a refusal went on
    if generated.finish_reason == "length":
        state.truncated = True
    finish = "tool_calls" if calls else (
        "length" if generated.finish_reason == "length" else "stop")
    return TurnReply(index, content, calls, finish, len(context), len(generated.token_ids),
                     list(segment.messages))


def _is_retry(rollout: InterceptedRollout, segment: Segment | None, messages: list[Message],
              key: str) -> bool:
    """Whether the request is the one that got the last reply, sent again: its messages
    are the recorded ones without that reply (which no request built on)."""
    if rollout.unseen is None or segment is None or key != segment.tools_key:
        return False
    before = segment.messages[:-1]
    return len(messages) == len(before) and all(
        old.key == new.key for old, new in zip(before, messages))


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
    log.info("rollout %s: the agent re-sent its request; reply %d (%d tokens) was never "
             "seen: taken out of the trajectory", rollout.id, len(state.turns), end - start)


def _extends(segment: Segment | None, messages: list[Message], key: str) -> str | None:
    """None if ``messages`` extend ``segment``'s conversation, else why not."""
    if segment is None:
        return "first request"
    recorded = segment.messages
    if key != segment.tools_key:
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


def _undo_point(rollout: InterceptedRollout) -> Callable[[], None]:
    """A function that puts ``rollout``'s recording back as it is now (a request refused
    after its messages were appended leaves nothing behind)."""
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


def _check_room(rollout: InterceptedRollout, limits: Limits, n_context: int) -> None:
    if n_context >= limits.max_token_length:
        rollout.limit = "max_tokens"
        raise RequestError(f"the conversation has {n_context} tokens; this rollout's "
                           f"limit is {limits.max_token_length}", "context_length_exceeded")


def _record_tool_results(rollout: InterceptedRollout, new: list[Message]) -> None:
    """The tool messages that follow a turn are its tool results, in order."""
    if rollout.state.turns:
        turn = rollout.state.turns[-1]
        turn.tool_results += [m.rendered["content"] for m in new
                              if m.rendered["role"] == "tool"]
