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
    weight_versions: list[tuple[str, int, int]] | None = None
    """``(label, start, end)`` over ``token_ids``: which weights sampled which tokens, as
    the server labelled them (None: it did not say)."""


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
    """The oldest weight version that sampled any of its tokens."""
    text: str
    tool_results: list[str] = field(default_factory=list)
    """The content sent back for each call, in order (errors included)."""
    version_spans: list[tuple[int, int, int]] | None = None
    """``(start, end, version)`` in the trajectory's tokens, one per run of tokens that one
    weight version sampled; more than one when the turn ran across an in-flight weight
    update. None: the server did not say (the whole turn is ``policy_version``)."""


def turn_versions(generated: GeneratedTurn, start: int,
                  known: int | None) -> tuple[int | None, list[tuple[int, int, int]] | None]:
    """The policy version of a turn that starts at token ``start`` of its trajectory (the
    oldest that sampled any of its tokens), and its version spans
    (:attr:`AssistantTurn.version_spans`).

    ``known``: the version the env knew when it sent the request (from the rollout API).
    The server's labels win where it gave them (the trainer labels every full-weight
    update with its version; an env learns of an update only at its next status poll).
    Tokens labelled ``default`` were sampled by the weights the server started with:
    ``known``, or 0 when the env knows none (a fresh run before its first sync). A turn
    whose tokens all carry ``default`` (a server the trainer never labelled) is
    ``known``, with no spans."""
    labels = generated.weight_versions or []
    if not any(label.isdigit() for label, _, _ in labels):
        return known, None
    spans: list[tuple[int, int, int]] = []
    for label, s, e in labels:
        version = int(label) if label.isdigit() else (known if known is not None else 0)
        if spans and spans[-1][2] == version and spans[-1][1] == start + s:
            spans[-1] = (spans[-1][0], start + e, version)
        else:
            spans.append((start + s, start + e, version))
    return min(v for _, _, v in spans), spans


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
    generation_seconds: float = 0.0
    """Time spent waiting for the inference server's turns (the agent loop, the
    interception proxy add to it)."""
    env_seconds: float = 0.0
    """Set by ``BaseEnv``: the rest of the rollout's time (tools, sandboxes, the agent's
    own work, rewards)."""
    queue_wait_seconds: float = 0.0
    """Set by ``BaseEnv``: time waiting for a rollout slot (``concurrency``)."""

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
