"""Fast validation of pushed groups, without decoding the token arrays into Python lists.

A group of 8 x 1024 tokens is ~16k integers; building Python objects for them costs
~0.5 ms on a small CPU, more than everything else a push does. The rollout API only needs
to know that each token/mask array *is* a JSON list of integers and how long it is, so it
decodes those arrays as ``msgspec.Raw`` byte spans and checks them at C speed:

    a syntactically valid JSON array whose bytes are only digits, ``-``, ``,`` and
    whitespace is a list of integers, and its length is (number of commas) + 1.

Everything else (scores, spans, float arrays, messages, flags) is decoded and checked in
full, and the shape rules are the very same :func:`check_parallel_lists` that
:class:`~environments.trajectory.ScoredData` applies, so a body is accepted here exactly
when ``ScoredData.model_validate_json`` accepts it (tests hold the two side by side).
The accepted body is stored as received and served to trainers byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import TypeAdapter, ValidationError

from environments.trajectory import (
    Message,
    TrajectoryError,
    TrajectoryFlags,
    check_parallel_lists,
    field_path,
    new_group_id,
)


class _Group(msgspec.Struct):
    tokens: list[msgspec.Raw]
    masks: list[msgspec.Raw]
    scores: list[float]
    advantages: list[msgspec.Raw] | None = None
    ref_logprobs: list[msgspec.Raw] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[msgspec.Raw] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any = None
    env_id: int | None = None
    group_id: str | None = None
    env: str | None = None
    item_id: str | None = None
    turn_scores: list[list[float] | None] | None = None
    turn_spans: list[list[list[int]] | None] | None = None
    policy_versions: list[int | None] | None = None
    turn_policy_versions: list[list[int] | None] | None = None
    segment_starts: list[list[int] | None] | None = None
    flags: list[dict[str, Any]] | None = None
    trajectory_metadata: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


_GROUP = msgspec.json.Decoder(_Group)
_GROUP_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_FLOATS = msgspec.json.Decoder(list[float])
_MESSAGES = TypeAdapter(list[list[Message]])
_FLAGS = TypeAdapter(list[TrajectoryFlags])
_INT_ARRAY_BYTES = b"0123456789-, \t\r\n"
MAX_GROUP_ID_LENGTH = 200


class WireError(ValueError):
    """A rejected body; ``field`` names what is wrong (``"body"`` for malformed JSON)."""

    def __init__(self, field: str, message: str, status: int = 422):
        self.field = field
        self.message = message
        self.status = status
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class AcceptedGroup:
    """A validated group, ready to be stored. ``body`` is its JSON, served as is."""

    group_id: str
    env_id: int | None
    n_sequences: int
    policy_version: int | None
    body: bytes


def _int_array_length(raw: msgspec.Raw, field: str) -> int:
    data = bytes(raw)
    if data[:1] != b"[" or data[1:-1].translate(None, _INT_ARRAY_BYTES):
        raise WireError(field, "must be a list of integers")
    return data.count(b",") + 1 if data[1:-1].strip() else 0


def _float_array_length(raw: msgspec.Raw, field: str) -> int:
    try:
        return len(_FLOATS.decode(raw))
    except msgspec.ValidationError as error:
        raise WireError(field, f"must be a list of finite numbers ({error})") from None


def _lengths(arrays: list[msgspec.Raw] | None, field: str, measure) -> list[int] | None:
    if arrays is None:
        return None
    return [measure(raw, f"{field}[{i}]") for i, raw in enumerate(arrays)]


def _msgspec_field(error: msgspec.ValidationError) -> str:
    """``"Expected `int`, got `str` - at `$.tokens[0][3]`"`` -> ``"tokens[0][3]"``;
    ``"Object missing required field `scores`"`` -> ``"scores"``."""
    text = str(error)
    path = text.rsplit("at `$", 1)[1].rstrip("`").lstrip(".") if "at `$" in text else ""
    missing = re.search(r"missing required field `([^`]+)`", text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or "body"


def _pydantic_field(prefix: str, error: ValidationError) -> tuple[str, str]:
    first = error.errors()[0]
    return field_path(first["loc"], prefix), first["msg"]


def decode_group(body: bytes | msgspec.Raw, where: str = "") -> AcceptedGroup:
    """Validate one Atropos/Lachesis ``ScoredData`` JSON body.

    ``where`` prefixes field names (``"[3]."`` for the 4th group of a list).
    """
    try:
        group = _GROUP.decode(body)
    except msgspec.ValidationError as error:
        message = str(error).rsplit(" - at `", 1)[0]
        raise WireError(where + _msgspec_field(error), message) from None
    except msgspec.DecodeError as error:
        raise WireError(where.rstrip(".") or "body", f"malformed JSON ({error})", status=400) from None

    if not group.tokens:
        raise WireError(where + "tokens", "must hold at least one sequence")
    if group.group_id is not None and not 0 < len(group.group_id) <= MAX_GROUP_ID_LENGTH:
        raise WireError(where + "group_id", f"must be 1 to {MAX_GROUP_ID_LENGTH} characters")
    for field, values, adapter in (("messages", group.messages, _MESSAGES),
                                   ("flags", group.flags, _FLAGS)):
        if values is not None:
            try:
                adapter.validate_python(values, strict=True)
            except ValidationError as error:
                raise WireError(*_pydantic_field(where + field, error)) from None
    try:
        check_parallel_lists(
            n_tokens=_lengths(group.tokens, "tokens", _int_array_length),
            n_masks=_lengths(group.masks, "masks", _int_array_length),
            n_logprobs=_lengths(group.inference_logprobs, "inference_logprobs", _float_array_length),
            n_advantages=_lengths(group.advantages, "advantages", _float_array_length),
            n_ref_logprobs=_lengths(group.ref_logprobs, "ref_logprobs", _float_array_length),
            scores=group.scores,
            turn_scores=group.turn_scores,
            turn_spans=group.turn_spans,
            turn_policy_versions=group.turn_policy_versions,
            segment_starts=group.segment_starts,
            per_sequence={"messages": group.messages, "overrides": group.overrides,
                          "policy_versions": group.policy_versions, "flags": group.flags,
                          "trajectory_metadata": group.trajectory_metadata},
        )
    except (TrajectoryError, WireError) as error:
        raise WireError(where + error.field, error.message) from None

    data = bytes(body).strip()
    group_id = group.group_id
    if group_id is None:  # Atropos envs send no id: give the group one, inside its body.
        group_id = new_group_id()
        data = b'{"group_id":"' + group_id.encode() + b'",' + data[1:].lstrip()
    versions = [v for v in (group.policy_versions or []) if v is not None]
    versions += [v for vs in (group.turn_policy_versions or []) if vs for v in vs]
    return AcceptedGroup(
        group_id=group_id,
        env_id=group.env_id,
        n_sequences=len(group.tokens),
        policy_version=min(versions) if versions else None,
        body=data,
    )


def decode_group_list(body: bytes) -> list[AcceptedGroup]:
    """Validate a JSON list of groups (``/scored_data_list``); all or nothing."""
    try:
        raws = _GROUP_LIST.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise WireError("body", f"must be a JSON list of groups ({error})", status=400) from None
    if not raws:
        raise WireError("body", "the list of groups is empty")
    return [decode_group(raw, where=f"[{i}].") for i, raw in enumerate(raws)]
