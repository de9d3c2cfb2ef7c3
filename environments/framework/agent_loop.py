"""The multi-turn agent loop: sample a turn, run its tool calls, append the results, repeat.

The loop builds the trajectory's token sequence as it goes (see
:mod:`environments.inference.chat_template`): prompt tokens, then each turn's sampled ids
exactly as the inference server returned them (mask = the id, logprob as returned), then
the tokens of the tool results and the next generation prompt (mask ``-100``, logprob
``1.0``). Nothing sampled is ever re-tokenized.

An episode ends when the model answers without calling a tool, when the environment
behind the tools says it is over (``episode_done``), when ``max_turns``
assistant turns have been sampled, or when the token budget (``max_token_length``) is
spent (by the context the model is given: the whole trajectory, or its last segment);
the last two set ``truncated``. So does a context the inference server refuses as longer
than its ``max_model_len`` after the first turn (a server whose limit the start check
could not read): the episode ends where the previous turn did, as when no room is left.
A tool that raises, times out, gets bad arguments or does not exist sends an error
message back to the model as the tool result, and is counted in ``tool_errors``; so is a
malformed tool-call block.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any, Callable

from environments.framework.tools import Tool, ToolError
from environments.inference.chat_template import ChatRenderer
from environments.inference.tool_parsers import (
    ToolCallParser,
    to_message_tool_calls,
)
from environments.inference.vllm_client import ContextLengthError
from environments.rollout import (  # noqa: F401  (re-exported: their old home)
    AssistantTurn,
    GeneratedTurn,
    ParsedToolCall,
    Rollout,
    RolloutState,
    TurnBackend,
    turn_versions,
)


class PromptTooLongError(ValueError):
    pass


async def run_tool_call(call: ParsedToolCall, tools: dict[str, Tool]) -> tuple[str, str | None]:
    """Run one call; returns (tool message content, error or None)."""
    tool = tools.get(call.name)
    if tool is None:
        error = f"unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or 'none'}"
        return f"Error: {error}", error
    try:
        return await tool.call(call.arguments), None
    except ToolError as error:
        return f"Error: {error}", str(error)


async def run_agent_loop(
    backend: TurnBackend,
    renderer: ChatRenderer,
    messages: list[dict[str, Any]],
    *,
    tools: list[Tool] = (),
    parser: ToolCallParser,
    max_turns: int,
    max_token_length: int,
    max_tokens_per_turn: int | None = None,
    policy_version: Callable[[], int | None] | int | None = None,
    episode_done: Callable[[], bool] | None = None,
    reasoning_history: str = "keep",
) -> Rollout:
    """Run one episode from ``messages`` and return its trajectory.

    ``policy_version``: the weight version serving the requests, or a function returning
    it (read again at every turn, so a weight update mid-episode shows per turn).
    ``episode_done``: asked after each turn's tool calls ran; ``True`` ends the episode
    there (``stop = "done"``: the environment behind the tools says it is over), with the
    tool results in ``messages`` but no further tokens.
    ``reasoning_history``: ``keep`` or ``rerender``, for a template that re-renders earlier
    turns differently (see ``EnvConfig.reasoning_history``): with ``rerender`` such a step
    starts a new segment holding the whole conversation as the template renders it.
    """
    by_name = {t.name: t for t in tools}
    schemas = [t.schema() for t in tools] or None
    state = Rollout(messages=[dict(m) for m in messages], tools=schemas,
                         trainable=backend.trainable)
    prompt = renderer.prompt_ids(state.messages, schemas)
    if len(prompt) >= max_token_length:
        raise PromptTooLongError(f"the prompt has {len(prompt)} tokens; max_token_length is "
                                 f"{max_token_length}")
    state.append(prompt, sampled=False)
    state.n_prompt_tokens = len(prompt)

    undo = None  # how to take back the last continuation, if the server refuses it
    for turn_index in range(max_turns):
        budget = max_token_length - len(state.context)
        max_tokens = min(budget, max_tokens_per_turn or budget)
        version = policy_version() if callable(policy_version) else policy_version
        asked = time.monotonic()
        try:
            generated = await backend.generate(state, max_tokens)
        except ContextLengthError:
            if undo is None:
                raise  # the prompt alone is too long for the server: the rollout fails
            n_tokens, n_messages, n_starts, segments = undo
            del state.tokens[n_tokens:], state.masks[n_tokens:], state.logprobs[n_tokens:]
            del state.messages[n_messages:], state.segment_starts[n_starts:]
            if segments is None:
                state.extra.pop("segments", None)
            else:
                state.extra["segments"] = segments
            state.truncated, state.stop = True, "max_tokens"  # as with no room left
            break
        state.generation_seconds += time.monotonic() - asked
        start = len(state.tokens)
        state.append(generated.token_ids, sampled=True, logprobs=generated.logprobs)

        parsed = generated.parsed or parser.parse(generated.text)
        calls, parse_errors = parsed.calls, list(parsed.errors)
        assistant: dict[str, Any] = {"role": "assistant", "content": generated.text}
        if calls:
            assistant["tool_calls"] = [c.model_dump() for c in to_message_tool_calls(calls)]
        state.messages.append(assistant)
        version, spans = turn_versions(generated, start, version)
        turn = AssistantTurn((start, len(state.tokens)), generated.finish_reason, calls,
                             [f"malformed tool call: {e}" for e in parse_errors],
                             version, generated.text, version_spans=spans)
        state.turns.append(turn)

        if generated.finish_reason == "length" or len(state.context) >= max_token_length:
            state.truncated, state.stop = True, "max_tokens"
            break
        if not calls and not parse_errors:
            state.stop = "answer"
            break
        if turn_index == max_turns - 1:
            state.truncated, state.stop = True, "max_turns"
            break

        results = await asyncio.gather(*(run_tool_call(c, by_name) for c in calls))
        new_messages = []
        for i, (call, (content, error)) in enumerate(zip(calls, results)):
            new_messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                                 "name": call.name, "content": content})
            turn.tool_results.append(content)
            if error is not None:
                turn.tool_errors.append(error)
        for error in parse_errors:
            new_messages.append({"role": "tool", "content": f"Error: malformed tool call: {error}"})
        if episode_done is not None and episode_done():
            state.messages += new_messages
            state.stop = "done"
            break

        continuation = renderer.continuation(state.messages, new_messages, schemas,
                                             ended_with_eos=generated.ended_with_eos)
        segments = state.extra.get("segments")
        undo = (len(state.tokens), len(state.messages), len(state.segment_starts),
                None if segments is None else [dict(s) for s in segments])
        state.prefix_preserving &= continuation.prefix_preserving
        new_context = not continuation.prefix_preserving and reasoning_history == "rerender"
        following = renderer.prompt_ids(state.messages + new_messages, schemas) \
            if new_context else continuation.token_ids
        if len(following) + (0 if new_context else len(state.context)) >= max_token_length:
            state.truncated, state.stop = True, "max_tokens"  # no room for another turn
            break
        state.messages += new_messages
        if new_context:
            segments = state.extra.setdefault("segments", [
                {"start": 0, "reason": "prompt", "messages": len(messages)}])
            segments.append({"start": len(state.tokens), "reason": "the chat template "
                             "re-renders earlier turns", "messages": len(state.messages)})
            state.segment_starts.append(len(state.tokens))
        state.append(following, sampled=False)
    return state


def describe_turns(state: Rollout) -> list[dict[str, Any]]:
    """Per-turn records for trajectory metadata (JSON-friendly)."""
    return [{"span": list(t.span), "finish_reason": t.finish_reason,
             "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in t.tool_calls],
             "tool_errors": t.tool_errors, "policy_version": t.policy_version,
             **({"version_spans": [list(s) for s in t.version_spans]}
                if t.version_spans and len(t.version_spans) > 1 else {})}
            for t in state.turns]



def observation_anchors(messages: list[dict[str, Any]], n_turns: int) -> list[str] | None:
    """One key per assistant turn: a hash of the observation that precedes it, i.e. the
    run of non-assistant messages (tool results, user or system messages) just before the
    turn's assistant message, by role, name and content. Two turns with the same key start
    from the same observed state (GiGPO's anchor states). ``None`` when the messages do
    not hold one assistant message per turn (a rebuilt context), or a turn follows another
    assistant message with nothing observed in between."""
    keys, observation = [], []
    for message in messages:
        if message.get("role") != "assistant":
            observation.append([message.get("role"), message.get("name"),
                                message.get("content")])
            continue
        if not observation:
            return None
        text = json.dumps(observation, sort_keys=True, default=str)
        keys.append(hashlib.sha256(text.encode()).hexdigest()[:16])
        observation = []
    return keys if len(keys) == n_turns else None
