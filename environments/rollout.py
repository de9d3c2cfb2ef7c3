"""What an agent loop records: the rollout as it happens, turn by turn.

* :class:`Rollout`: the token sequence built so far (``tokens``, ``masks``, ``logprobs``),
  the conversation, the turns, and why the episode stopped. Reward hooks receive it. (It
  was called ``RolloutState``; that name stays as an alias. Not to be confused with an
  env's per-rollout *state object*, ``BaseEnv.new_rollout_state`` /
  ``environments.rollout_state()``.)
* :class:`AssistantTurn`: one assistant turn: its token span, tool calls, tool results.
* :class:`ParsedToolCall` / :class:`ParsedTurn`: tool calls parsed from a turn's text.
* :class:`GeneratedTurn` / :class:`TurnBackend`: one turn as a generation backend returns
  it, and the interface of such backends.

The data-model layer: it imports nothing of the env framework, so inference backends, the
interception proxy and the framework all use the same records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from environments.trajectory import MASKED


@dataclass
class ParsedToolCall:
    """One well-formed call: the tool's name, its arguments, and its exact source text."""

    name: str
    arguments: dict[str, Any]
    raw: str


@dataclass
class ParsedTurn:
    """An assistant turn split into its text (call blocks removed, stripped), its
    well-formed calls in order, and one message per malformed call block."""

    content: str
    calls: list[ParsedToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class GeneratedTurn:
    """One assistant turn as a backend produced it."""

    token_ids: list[int]
    logprobs: list[float] | None
    """Per sampled token; None when the backend gives none (OpenAI-API mode)."""
    text: str
    """The turn's text without the end-of-turn token."""
    finish_reason: str
    ended_with_eos: bool
    parsed: ParsedTurn | None = None
    """The turn's tool calls, when the backend parsed them itself (OpenAI API)."""


class TurnBackend(Protocol):
    trainable: bool

    async def generate(self, state: Rollout, max_tokens: int) -> GeneratedTurn: ...


@dataclass
class AssistantTurn:
    """What one assistant turn did."""

    span: tuple[int, int]
    """``[start, end)`` of its sampled tokens in the trajectory."""
    finish_reason: str
    tool_calls: list[ParsedToolCall]
    tool_errors: list[str]
    policy_version: int | None
    text: str
    tool_results: list[str] = field(default_factory=list)
    """The content sent back for each call, in order (errors included)."""


@dataclass
class Rollout:
    """A rollout in progress, and its result once ``run_agent_loop`` returns."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tokens: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[AssistantTurn] = field(default_factory=list)
    truncated: bool = False
    stop: str = ""
    """Why the episode ended: ``answer``, ``max_turns``, ``max_tokens`` or ``done`` (the
    environment behind the tools ended it, see ``run_agent_loop(episode_done=...)``)."""
    prefix_preserving: bool = True
    trainable: bool = True
    n_prompt_tokens: int = 0
    segment_starts: list[int] = field(default_factory=list)
    """Where a new context begins in ``tokens`` (the interception proxy, when an agent
    edited its history; the agent loop with ``reasoning_history: rerender``); empty: one
    context."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What an env records during the rollout for its reward hooks (e.g. a file the agent
    left in its sandbox); not part of the trajectory."""
    env_state: Any = None
    """Set by ``BaseEnv`` when the rollout finished: the snapshot of the env's per-rollout
    state (``snapshot_state(new_rollout_state(item))`` after the tools ran), what the
    reward hooks score."""
    reward_values: dict[str, Any] = field(default_factory=dict)
    """Set by ``BaseEnv`` when scored with reward functions: each function's value (a
    float, or one per turn), by name."""

    @property
    def tool_errors(self) -> int:
        return sum(len(t.tool_errors) for t in self.turns)

    @property
    def tool_calls(self) -> int:
        return sum(len(t.tool_calls) for t in self.turns)

    @property
    def final_text(self) -> str:
        return self.turns[-1].text if self.turns else ""

    @property
    def context(self) -> list[int]:
        """The tokens the model is given for its next turn: those of the last segment."""
        return self.tokens[self.segment_starts[-1]:] if self.segment_starts else self.tokens

    def append(self, token_ids: list[int], *, sampled: bool,
               logprobs: list[float] | None = None) -> None:
        self.tokens += token_ids
        if sampled:
            self.masks += token_ids
            self.logprobs += logprobs if logprobs is not None else [1.0] * len(token_ids)
        else:
            self.masks += [MASKED] * len(token_ids)
            self.logprobs += [1.0] * len(token_ids)


RolloutState = Rollout
"""The former name of :class:`Rollout`."""
