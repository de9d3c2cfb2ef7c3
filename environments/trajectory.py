"""The trajectory data contract: messages, scored trajectories and scored groups.

One trajectory is the full token sequence of one rollout, exactly as the model saw and
produced it, with:

* ``masks``: Atropos convention, the token id where the token is trained (sampled by the
  policy) and ``-100`` elsewhere (prompt, tool results, user turns);
* ``inference_logprobs``: the behaviour policy's logprob per token, ``1.0`` at masked
  positions;
* ``scores``: a float, or one float per assistant turn (the last one is the outcome),
  with ``turn_spans`` giving each assistant turn's ``[start, end)`` token range;
* ``segment_starts`` (optional): where the rollout's context was rebuilt (an agent that
  edited or dropped earlier messages), so ``tokens`` is the concatenation of independent
  contexts; the trainer scores the whole trajectory but trains each segment as its own row.

A :class:`ScoredGroup` holds the ``group_size`` trajectories sampled for one item. It
converts losslessly to and from Atropos's parallel-list ``ScoredData`` form
(:class:`ScoredData`), which is what travels over HTTP. Atropos consumers see a plain
float per sequence in ``scores`` (the outcome); the per-turn scores ride along in the
extension field ``turn_scores``, which Atropos ignores.

Every validation error names the field and the index, e.g. ``masks[2]: length 1023 does
not match tokens[2] (1024)``.
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MASKED = -100
"""Mask value of a token that is context, not trained (Atropos convention)."""
MAX_TOKEN_ID = 2**31 - 1
"""Largest token id the contract accepts (vocabularies are far smaller; a model's own
vocabulary size is checked by the trainer)."""
MAX_INT = 2**63 - 1
"""Largest env id or policy version (they are stored as 64-bit integers)."""
MAX_DEPTH = 64
"""Deepest nesting accepted in free-form JSON fields (metadata, overrides, images...)."""

Id = Annotated[int, Field(ge=0, le=MAX_INT)]
"""An env id or policy version: a non-negative 64-bit integer."""


class TrajectoryError(ValueError):
    """A data-contract violation; ``field`` names the offending field and index."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def _name(field: str, index: int | None) -> str:
    return field if index is None else f"{field}[{index}]"


def check_sequence(
    index: int | None,
    *,
    n_tokens: int,
    n_masks: int,
    n_logprobs: int | None = None,
    n_advantages: int | None = None,
    n_ref_logprobs: int | None = None,
    turn_scores: list[float] | None = None,
    turn_spans: list[list[int]] | None = None,
    turn_policy_versions: list[int] | None = None,
    segment_starts: list[int] | None = None,
    n_turn_anchors: int | None = None,
) -> None:
    """Check the shape rules of one sequence; raise :class:`TrajectoryError` on the first.

    ``segment_starts`` must be strictly increasing, each in ``(0, n_tokens)``, and no turn
    span may cross one (``start < s < end``); that the token at each segment start is
    masked is checked by :meth:`ScoredTrajectory.check`, which has the masks.

    Works on lengths, not on the arrays themselves, so the rollout API can apply exactly
    the same rules to a body it has not decoded into Python lists. ``index`` is the
    sequence's position in its group (``None`` for a standalone trajectory).
    """
    if n_tokens == 0:
        raise TrajectoryError(_name("tokens", index), "must not be empty")
    for field, n in (("masks", n_masks), ("inference_logprobs", n_logprobs),
                     ("advantages", n_advantages), ("ref_logprobs", n_ref_logprobs)):
        if n is not None and n != n_tokens:
            raise TrajectoryError(
                _name(field, index),
                f"length {n} does not match {_name('tokens', index)} ({n_tokens})")
    if turn_spans is not None:
        previous_end = 0
        for k, span in enumerate(turn_spans):
            where = f"{_name('turn_spans', index)}[{k}]"
            if len(span) != 2:
                raise TrajectoryError(where, f"must be [start, end], got {list(span)}")
            start, end = span
            if not 0 <= start < end <= n_tokens:
                raise TrajectoryError(
                    where, f"[{start}, {end}) is empty or outside the {n_tokens} tokens")
            if start < previous_end:
                raise TrajectoryError(
                    where, f"starts at {start}, before the previous turn ends ({previous_end})"
                    " (spans must be ordered and non-overlapping)")
            previous_end = end
    if segment_starts is not None:
        _check_segment_starts(index, n_tokens, segment_starts, turn_spans)
    if turn_scores is not None:
        if turn_spans is None:
            raise TrajectoryError(_name("turn_spans", index),
                                  "required when scores are given per turn")
        if len(turn_scores) == 0:
            raise TrajectoryError(_name("turn_scores", index), "must not be empty")
        if len(turn_scores) != len(turn_spans):
            raise TrajectoryError(
                _name("turn_spans", index),
                f"{len(turn_spans)} spans for {len(turn_scores)} turn scores (need one each)")
    if turn_policy_versions is not None:
        if turn_spans is None or len(turn_policy_versions) != len(turn_spans):
            n_spans = 0 if turn_spans is None else len(turn_spans)
            raise TrajectoryError(
                _name("turn_policy_versions", index),
                f"{len(turn_policy_versions)} versions for {n_spans} turn spans")
    if n_turn_anchors is not None:
        n_spans = 0 if turn_spans is None else len(turn_spans)
        if n_turn_anchors != n_spans:
            raise TrajectoryError(_name("turn_anchors", index),
                                  f"{n_turn_anchors} anchors for {n_spans} turn spans "
                                  "(need one each)")


def _check_segment_starts(index: int | None, n_tokens: int, segment_starts: list[int],
                          turn_spans: list[list[int]] | None) -> None:
    previous = 0
    for k, start in enumerate(segment_starts):
        where = f"{_name('segment_starts', index)}[{k}]"
        if not 0 < start < n_tokens:
            raise TrajectoryError(
                where, f"{start} is not inside the {n_tokens} tokens (must be in (0, {n_tokens}))")
        if start <= previous:
            raise TrajectoryError(
                where, f"{start} does not come after the previous segment start ({previous})"
                " (segment starts must be strictly increasing)")
        previous = start
    for j, (span_start, span_end) in enumerate(turn_spans or []):
        inside = bisect.bisect_right(segment_starts, span_start)
        if inside < len(segment_starts) and segment_starts[inside] < span_end:
            raise TrajectoryError(
                f"{_name('segment_starts', index)}[{inside}]",
                f"{segment_starts[inside]} falls inside {_name('turn_spans', index)}[{j}] "
                f"[{span_start}, {span_end}) (a turn lies within one segment)")


def check_token_values(index: int | None, tokens: Any, masks: Any,
                       segment_starts: list[int] | None = None) -> None:
    """Check the values of one sequence's ``tokens`` and ``masks`` (same length, already
    checked by :func:`check_sequence`); raise :class:`TrajectoryError` on the first bad one.

    * every token id is in ``[0, MAX_TOKEN_ID]``;
    * ``masks[j]`` is ``MASKED`` or ``tokens[j]`` (the Atropos convention);
    * ``masks[0]`` and the mask at every segment start are ``MASKED``: nothing in the
      model's context predicts a first token, so it cannot be trained.

    Vectorised: ``tokens``/``masks`` may be lists or int64 arrays (the rollout API parses
    the raw JSON arrays straight into arrays).
    """
    t = _int64_array(tokens, "tokens", index)
    m = _int64_array(masks, "masks", index)
    bad = np.flatnonzero((t < 0) | (t > MAX_TOKEN_ID))
    if bad.size:
        j = int(bad[0])
        value = _INT64_BOUNDS.get(int(t[j]), int(t[j]))
        raise TrajectoryError(f"{_name('tokens', index)}[{j}]",
                              f"{value} is not a token id (0 to {MAX_TOKEN_ID})")
    bad = np.flatnonzero((m != MASKED) & (m != t))
    if bad.size:
        j = int(bad[0])
        raise TrajectoryError(f"{_name('masks', index)}[{j}]",
                              f"is {int(m[j])}; must be {MASKED} or the token id {int(t[j])}")
    if m.size and m[0] != MASKED:
        raise TrajectoryError(f"{_name('masks', index)}[0]",
                              f"is {int(m[0])}; the first token must be masked ({MASKED}): "
                              "nothing predicts it, so it cannot be trained")
    for k, start in enumerate(segment_starts or []):
        if m[start] != MASKED:
            raise TrajectoryError(
                f"{_name('segment_starts', index)}[{k}]",
                f"token {start} begins a new context, so nothing predicts it; it must be "
                f"masked ({MASKED}), but masks[{start}] is {int(m[start])}")


_INT64_BOUNDS = {2**63 - 1: ">= 2^63", -(2**63): "< -2^63"}
"""How an int64 array shows integers beyond its range (the rollout API parses into one)."""


def _int64_array(values: Any, field: str, index: int | None) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        j = next(j for j, v in enumerate(values) if not -(2**63) <= v < 2**63)
        raise TrajectoryError(f"{_name(field, index)}[{j}]",
                              f"{values[j]} does not fit in 64 bits") from None


def check_depth(value: Any, field: str, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`TrajectoryError` if ``value`` nests lists/dicts deeper than ``limit``
    (deep JSON breaks recursive encoders and decoders downstream)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = item
        elif isinstance(item, BaseModel):  # e.g. a Message and its extra keys
            children = list(item.__dict__.values()) + list((item.__pydantic_extra__ or {}).values())
        else:
            continue
        if depth > limit:
            raise TrajectoryError(field, f"nested more than {limit} levels deep")
        stack.extend((child, depth + 1) for child in children)


def field_path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """A pydantic error location as a field name: ``("tokens", 2, 5)`` -> ``tokens[2][5]``."""
    path = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    return path.lstrip(".")


def _custom_error(error: TrajectoryError) -> PydanticCustomError:
    # Keeps the field name in the error's context so HTTP responses can report it.
    return PydanticCustomError("trajectory", "{field}: {message}",
                               {"field": error.field, "message": error.message})


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"
    """JSON-encoded arguments, as in the OpenAI chat API."""


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message. Unknown keys are kept (Atropos messages may carry extras)."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class TrajectoryFlags(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    truncated: bool = False
    """Generation stopped at the token limit, not at a natural end."""
    tool_errors: int = Field(default=0, ge=0)
    """Tool calls that raised, timed out or could not be parsed."""
    trainable: bool = True
    """False for trajectories whose tokens were not sampled by the policy (e.g. a hosted
    OpenAI-API model used for evaluation or SFT data)."""


class ScoredTrajectory(BaseModel):
    """One rollout: its tokens, what is trained, the behaviour logprobs and its scores."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid",
                              validate_assignment=True)

    tokens: list[int]
    masks: list[int]
    scores: float | list[float]
    """A float, or one score per assistant turn in order; the last one is the outcome."""
    inference_logprobs: list[float] | None = None
    turn_spans: list[list[int]] | None = None
    """``[start, end)`` token range of each assistant turn."""
    advantages: list[float] | None = None
    """Per-token advantages set by the env; they override the trainer's estimator."""
    ref_logprobs: list[float] | None = None
    messages: list[Message] | None = None
    policy_version: Id | None = None
    """Weight version that generated the first sampled tokens."""
    turn_policy_versions: list[Id] | None = None
    """Weight version per assistant turn, when it changed during the rollout."""
    segment_starts: list[int] | None = None
    """Token positions where a new, independent context begins: the tokens before a
    segment start are not part of what the model saw for the tokens after it (the agent
    rebuilt its conversation, e.g. edited or dropped earlier messages), so ``tokens`` is
    the concatenation of the segments. Strictly increasing, each in ``(0, len(tokens))``;
    no turn span crosses one, and the token at each is masked (nothing in its context
    predicts it). Scores, spans and advantages stay in whole-trajectory coordinates: the
    trajectory is one member of its group; the trainer trains each segment as its own
    row. ``None``: one context."""
    turn_anchors: list[Annotated[str, Field(max_length=200)]] | None = None
    """One key per assistant turn naming the state the turn starts from (the env's
    ``turn_anchors`` hook; by default a hash of the observation before the turn). Turns of
    a group with the same key start from the same state: GiGPO compares them
    (``trainer.advantages.gigpo``). ``None``: no anchors (every turn gets GiGPO's episode
    advantage only)."""
    flags: TrajectoryFlags = Field(default_factory=TrajectoryFlags)
    overrides: dict[str, Any] | None = None
    """Atropos per-sequence overrides, kept as they are."""
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_shapes(self) -> ScoredTrajectory:
        try:
            self.check(None)
        except TrajectoryError as error:
            raise _custom_error(error) from None
        return self

    def check(self, index: int | None) -> None:
        """Apply the data-contract rules, naming fields with ``index`` when given."""
        check_sequence(
            index,
            n_tokens=len(self.tokens),
            n_masks=len(self.masks),
            n_logprobs=_len(self.inference_logprobs),
            n_advantages=_len(self.advantages),
            n_ref_logprobs=_len(self.ref_logprobs),
            turn_scores=self.scores if isinstance(self.scores, list) else None,
            turn_spans=self.turn_spans,
            turn_policy_versions=self.turn_policy_versions,
            segment_starts=self.segment_starts,
            n_turn_anchors=_len(self.turn_anchors),
        )
        check_token_values(index, self.tokens, self.masks, self.segment_starts)
        for name in ("overrides", "metadata"):
            check_depth(getattr(self, name), _name(name, index))

    @property
    def outcome(self) -> float:
        """The scalar score, or the last turn's score."""
        return self.scores[-1] if isinstance(self.scores, list) else self.scores

    @property
    def turn_scores(self) -> list[float] | None:
        return self.scores if isinstance(self.scores, list) else None


def equal_scores(trajectories: Sequence[ScoredTrajectory]) -> bool:
    """Whether a group has no score signal: two or more trajectories, all scored the same
    turn by turn (the same number of turn scores, each equal; a float score is one), up to
    rounding (1e-12 relative, as the trainer's z-score). Such a group gives the outcome
    estimators (GRPO, merged GRPO, MT-GRPO) zeros; it is *not* a statement about every
    estimator: ``turn_rtg`` and GiGPO with ``gamma`` < 1 discount by the turns left, so
    equal scores over trajectories of different lengths still give them non-zero
    advantages (the trainer's dynamic sampling asks the configured estimator instead:
    ``trainer.shaping.has_signal``). Equal *outcomes* are not enough either: turn scores
    that differ give a turn-level signal (MT-GRPO), so such a group is not counted.

    The one definition of an equal-score group: ``env process`` / ``env serve`` count (and,
    without ``keep_equal_score_groups``, drop) these groups; ``inspect --stats`` and the
    HTML report count them."""
    if len(trajectories) < 2:
        return False
    rows = [t.scores if isinstance(t.scores, list) else [t.scores] for t in trajectories]
    if any(len(row) != len(rows[0]) for row in rows):
        return False
    for column in zip(*rows):
        top = max(abs(v) for v in column)
        if max(column) - min(column) > 1e-12 * max(1.0, top):
            return False
    return True


def _len(values: list | None) -> int | None:
    return None if values is None else len(values)


def new_group_id() -> str:
    return uuid.uuid4().hex


class ScoredGroup(BaseModel):
    """The trajectories sampled for one item (one GRPO group)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid",
                              validate_assignment=True)

    group_id: str = Field(default_factory=new_group_id, min_length=1, max_length=200)
    """Client-chosen id; pushing the same id twice stores the group once."""
    env: str | None = None
    env_id: Id | None = None
    item_id: str | None = None
    trajectories: list[ScoredTrajectory] = Field(min_length=1)
    generation_params: dict[str, Any] | None = None
    group_overrides: dict[str, Any] | None = None
    images: list[Any] | None = None
    """Atropos multimodal inputs: one entry per trajectory."""
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_group(self) -> ScoredGroup:
        try:
            if self.images is not None and len(self.images) != len(self.trajectories):
                raise TrajectoryError("images", f"has {len(self.images)} entries for "
                                      f"{len(self.trajectories)} trajectories")
            for name in ("generation_params", "group_overrides", "images", "metadata"):
                check_depth(getattr(self, name), name)
        except TrajectoryError as error:
            raise _custom_error(error) from None
        return self

    @property
    def policy_version(self) -> int | None:
        """The oldest weight version that generated any token of the group."""
        versions = [v for t in self.trajectories
                    for v in ([t.policy_version] + (t.turn_policy_versions or []))
                    if v is not None]
        return min(versions) if versions else None

    def to_scored_data(self) -> ScoredData:
        """Atropos parallel-list form (plus Lachesis extension fields)."""
        trajs = self.trajectories

        def column(attribute: str) -> list | None:
            values = [getattr(t, attribute) for t in trajs]
            return None if all(v is None for v in values) else values

        def all_or_none(attribute: str) -> list | None:
            values = column(attribute)
            if values is not None and any(v is None for v in values):
                missing = next(i for i, v in enumerate(values) if v is None)
                raise TrajectoryError(
                    f"trajectories[{missing}].{attribute}",
                    "missing while other trajectories of the group have it "
                    "(Atropos needs it on all sequences or none)")
            return values

        messages = all_or_none("messages")
        flags = [t.flags.model_dump() for t in trajs]
        default_flags = TrajectoryFlags().model_dump()
        metadata = [t.metadata for t in trajs]
        return ScoredData(
            tokens=[t.tokens for t in trajs],
            masks=[t.masks for t in trajs],
            scores=[t.outcome for t in trajs],
            advantages=all_or_none("advantages"),
            ref_logprobs=all_or_none("ref_logprobs"),
            messages=messages,
            generation_params=self.generation_params,
            inference_logprobs=all_or_none("inference_logprobs"),
            overrides=all_or_none("overrides"),
            group_overrides=self.group_overrides,
            images=self.images,
            env_id=self.env_id,
            group_id=self.group_id,
            env=self.env,
            item_id=self.item_id,
            turn_scores=column("turn_scores"),
            turn_spans=column("turn_spans"),
            policy_versions=column("policy_version"),
            turn_policy_versions=column("turn_policy_versions"),
            segment_starts=column("segment_starts"),
            turn_anchors=column("turn_anchors"),
            flags=None if all(f == default_flags for f in flags) else flags,
            trajectory_metadata=None if not any(metadata) else metadata,
            metadata=self.metadata or None,
        )

    @classmethod
    def from_scored_data(cls, data: ScoredData | dict[str, Any]) -> ScoredGroup:
        """Inverse of :meth:`to_scored_data`; also accepts plain Atropos ``ScoredData``."""
        sd = data if isinstance(data, ScoredData) else ScoredData.model_validate(data)

        def at(values: list | None, i: int) -> Any:
            return None if values is None else values[i]

        trajectories = []
        for i, tokens in enumerate(sd.tokens):
            turn_scores = at(sd.turn_scores, i)
            trajectories.append(ScoredTrajectory(
                tokens=tokens,
                masks=sd.masks[i],
                scores=sd.scores[i] if turn_scores is None else turn_scores,
                inference_logprobs=at(sd.inference_logprobs, i),
                turn_spans=at(sd.turn_spans, i),
                advantages=at(sd.advantages, i),
                ref_logprobs=at(sd.ref_logprobs, i),
                messages=at(sd.messages, i),
                policy_version=at(sd.policy_versions, i),
                turn_policy_versions=at(sd.turn_policy_versions, i),
                segment_starts=at(sd.segment_starts, i),
                turn_anchors=at(sd.turn_anchors, i),
                flags=at(sd.flags, i) or TrajectoryFlags(),
                overrides=at(sd.overrides, i),
                metadata=at(sd.trajectory_metadata, i) or {},
            ))
        return cls(
            group_id=sd.group_id or new_group_id(),
            env=sd.env,
            env_id=sd.env_id,
            item_id=sd.item_id,
            trajectories=trajectories,
            generation_params=sd.generation_params,
            group_overrides=sd.group_overrides,
            images=sd.images,
            metadata=sd.metadata or {},
        )


class ScoredData(BaseModel):
    """Atropos's parallel-list ``ScoredData`` (one entry per sequence), plus extensions.

    The Atropos fields keep Atropos's meaning: ``scores`` is one float per sequence (the
    outcome). The extension fields (``group_id`` and below) are ignored by Atropos
    consumers and carry what Atropos has no place for.
    """

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _empty_means_none(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k) == [] for k in EMPTY_MEANS_NONE):
            data = {k: None if k in EMPTY_MEANS_NONE and v == [] else v
                    for k, v in data.items()}
        return data

    @model_validator(mode="before")
    @classmethod
    def _per_turn_lists_in_scores(cls, data: Any) -> Any:
        """``scores`` may hold one list of per-turn scores per sequence
        (:func:`per_turn_scores`): they move to ``turn_scores``, ``scores`` keeps the
        outcomes."""
        if not isinstance(data, dict) or not isinstance(data.get("scores"), list) \
                or not isinstance(data.get("masks"), list):
            return data
        try:
            moved = per_turn_scores(data["scores"], data.get("turn_scores"),
                                    data.get("turn_spans"), data["masks"])
        except TrajectoryError as error:
            raise _custom_error(error) from None
        if moved is None:
            return data
        scores, turn_scores, turn_spans = moved
        return {**data, "scores": scores, "turn_scores": turn_scores, "turn_spans": turn_spans}

    tokens: list[list[int]] = Field(min_length=1)
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[Message]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: list[Any] | None = None
    """One entry per sequence (Atropos's multimodal envs send a list)."""
    env_id: Id | None = None
    # Lachesis extensions.
    group_id: str | None = Field(default=None, min_length=1, max_length=200)
    env: str | None = None
    item_id: str | None = None
    turn_scores: list[list[float] | None] | None = None
    turn_spans: list[list[list[int]] | None] | None = None
    policy_versions: list[Id | None] | None = None
    turn_policy_versions: list[list[Id] | None] | None = None
    segment_starts: list[list[int] | None] | None = None
    turn_anchors: list[list[Annotated[str, Field(max_length=200)]] | None] | None = None
    flags: list[TrajectoryFlags] | None = None
    trajectory_metadata: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_shapes(self) -> ScoredData:
        try:
            check_parallel_lists(
                n_tokens=[len(t) for t in self.tokens],
                n_masks=[len(m) for m in self.masks],
                n_logprobs=_lens(self.inference_logprobs),
                n_advantages=_lens(self.advantages),
                n_ref_logprobs=_lens(self.ref_logprobs),
                scores=self.scores,
                turn_scores=self.turn_scores,
                turn_spans=self.turn_spans,
                turn_policy_versions=self.turn_policy_versions,
                segment_starts=self.segment_starts,
                turn_anchors=self.turn_anchors,
                per_sequence={"messages": self.messages, "overrides": self.overrides,
                              "policy_versions": self.policy_versions, "flags": self.flags,
                              "trajectory_metadata": self.trajectory_metadata,
                              "images": self.images},
            )
            for i, (tokens, masks) in enumerate(zip(self.tokens, self.masks)):
                starts = self.segment_starts[i] if self.segment_starts else None
                check_token_values(i, tokens, masks, starts)
            for name in FREE_FORM_FIELDS:
                check_depth(getattr(self, name), name)
        except TrajectoryError as error:
            raise _custom_error(error) from None
        return self


def trained_runs(masks: Any) -> list[list[int]]:
    """``[start, end)`` of each maximal run of trained tokens (``masks != -100``): the
    assistant turns of a trajectory whose tool results and prompts are masked."""
    trained = np.concatenate([[False], np.asarray(masks) != MASKED, [False]])
    edges = np.flatnonzero(trained[1:] != trained[:-1])
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2])]


def per_turn_scores(scores: list, turn_scores: list | None, turn_spans: list | None,
                    masks: list) -> tuple[list[float], list | None, list | None] | None:
    """Per-turn lists in ``scores`` (one list per sequence, as hermes-agent's
    ``TurnLevelRewardMixin`` sends them) in the contract's form, or None when every
    score is a float (nothing to do).

    For sequence ``i`` whose ``scores[i]`` is a list: ``turn_scores[i]`` is that list,
    ``scores[i]`` its last entry (the outcome), and, when ``turn_spans[i]`` is absent,
    the spans are the runs of trained tokens in ``masks[i]`` (:func:`trained_runs`); a
    run count that differs from the list's length is a :class:`TrajectoryError` naming
    both counts."""
    if not any(isinstance(s, list) for s in scores):
        return None
    if not all(isinstance(x, (list, type(None))) for x in (turn_scores, turn_spans)):
        return None  # the type rules name what is wrong
    n = len(scores)
    outcomes = list(scores)
    turns = list(turn_scores) if turn_scores is not None else [None] * n
    spans = list(turn_spans) if turn_spans is not None else [None] * n
    if len(turns) != n or len(spans) != n or len(masks) != n:
        return None  # the length rules (check_parallel_lists) name what is wrong
    for i, score in enumerate(scores):
        if not isinstance(score, list):
            continue
        if not score:
            raise TrajectoryError(f"scores[{i}]", "is an empty list (one score per "
                                  "assistant turn, the last one the outcome)")
        if turns[i] is not None and list(turns[i]) != score:
            raise TrajectoryError(f"turn_scores[{i}]", f"{turns[i]} differs from the "
                                  f"per-turn list in scores[{i}] ({score})")
        if spans[i] is None:
            if not isinstance(masks[i], (list, np.ndarray)):
                return None
            runs = trained_runs(masks[i])
            if len(runs) != len(score):
                raise TrajectoryError(
                    f"scores[{i}]", f"{len(score)} turn scores, but masks[{i}] has "
                    f"{len(runs)} runs of trained tokens (one per assistant turn); send "
                    "turn_spans to say where each turn is")
            spans[i] = runs
        outcomes[i], turns[i] = score[-1], score
    return outcomes, turns, spans


EMPTY_MEANS_NONE = ("advantages", "ref_logprobs", "messages", "inference_logprobs",
                    "overrides", "images")
"""Per-sequence lists of :class:`ScoredData` where an empty list means "none": atroposlib's
default ``BaseEnv.collect_trajectories`` sends ``[]`` for each of them that no
``ScoredDataItem`` of the group had (Atropos stores and serves that as is)."""

ScoredDataItem = ScoredTrajectory
"""Atropos's name for one scored trajectory. Unlike Atropos's, ``scores`` may be a list
with one score per assistant turn (the last is the outcome), with ``turn_spans``."""

ScoredDataGroup = ScoredData
"""Atropos's name for one scored group in parallel-list form (``tokens``, ``masks``,
``scores``... one entry per sequence); per-turn scores ride in ``turn_scores``.
``ScoredGroup(trajectories=[ScoredDataItem(...), ...]).to_scored_data()`` builds one
from items, ``ScoredGroup.from_scored_data`` goes back."""


FREE_FORM_FIELDS = ("generation_params", "overrides", "group_overrides", "images",
                    "trajectory_metadata", "metadata", "messages")
"""Fields of :class:`ScoredData` that hold arbitrary JSON (their depth is limited)."""


def _lens(values: list[list] | None) -> list[int] | None:
    return None if values is None else [len(v) for v in values]


def check_parallel_lists(
    *,
    n_tokens: list[int],
    n_masks: list[int],
    n_logprobs: list[int] | None,
    n_advantages: list[int] | None,
    n_ref_logprobs: list[int] | None,
    scores: list[float],
    turn_scores: list[list[float] | None] | None,
    turn_spans: list | None,
    turn_policy_versions: list | None,
    segment_starts: list | None,
    per_sequence: dict[str, list | None],
    turn_anchors: list | None = None,
) -> None:
    """The data-contract rules for a group in parallel-list form, on lengths only.

    Every per-sequence list must have one entry per sequence; then each sequence is
    checked with :func:`check_sequence`; a sequence with per-turn scores must have
    ``scores[i] == turn_scores[i][-1]`` (the outcome).
    """
    n = len(n_tokens)
    lists: dict[str, list | None] = {
        "masks": n_masks, "scores": scores, "inference_logprobs": n_logprobs,
        "advantages": n_advantages, "ref_logprobs": n_ref_logprobs,
        "turn_scores": turn_scores, "turn_spans": turn_spans,
        "turn_policy_versions": turn_policy_versions, "segment_starts": segment_starts,
        "turn_anchors": turn_anchors, **per_sequence,
    }
    for field, values in lists.items():
        if values is not None and len(values) != n:
            raise TrajectoryError(
                field, f"has {len(values)} entries for {n} sequences in tokens")

    def at(values: list | None, i: int) -> Any:
        return None if values is None else values[i]

    for i in range(n):
        sequence_turn_scores = at(turn_scores, i)
        check_sequence(
            i,
            n_tokens=n_tokens[i],
            n_masks=n_masks[i],
            n_logprobs=at(n_logprobs, i),
            n_advantages=at(n_advantages, i),
            n_ref_logprobs=at(n_ref_logprobs, i),
            turn_scores=sequence_turn_scores,
            turn_spans=at(turn_spans, i),
            turn_policy_versions=at(turn_policy_versions, i),
            segment_starts=at(segment_starts, i),
            n_turn_anchors=_len(at(turn_anchors, i)),
        )
        if sequence_turn_scores is not None and scores[i] != sequence_turn_scores[-1]:
            raise TrajectoryError(
                f"scores[{i}]",
                f"is {scores[i]} but the last turn score (the outcome) is "
                f"{sequence_turn_scores[-1]}")
