"""Fast validation of pushed groups, without decoding the token arrays into Python lists.

A group of 8 x 1024 tokens is ~16k integers; building Python objects for them costs
~0.5 ms on a small CPU, more than everything else a push does. The rollout API only needs
to know that each token/mask array *is* a JSON list of integers and how long it is, so it
decodes those arrays as ``msgspec.Raw`` byte spans and checks them at C speed:

    a syntactically valid JSON array whose bytes are only digits, ``-``, ``,`` and
    whitespace is a list of integers; numpy parses it into an int64 array in C.

The token values are then checked by the same :func:`check_token_values` that
:class:`~environments.trajectory.ScoredTrajectory` applies (ids in range, each mask the
token id or -100). Everything else (scores, spans, float arrays, messages, flags) is decoded and checked in
full, and the shape rules are the very same :func:`check_parallel_lists` that
:class:`~environments.trajectory.ScoredData` applies, so a body is accepted here exactly
when ``ScoredData.model_validate_json`` accepts it (tests hold the two side by side).
The accepted body is stored as received and served to trainers byte for byte, except
that the Atropos keys it leaves out are added as ``null`` (Atropos trainers index every
key, e.g. ``item["overrides"]``), a ``group_id`` is added when it has none, and the
per-sequence lists that atroposlib sends empty to mean "none" (``advantages: []``...)
are stored as ``null``, and per-turn lists in ``scores`` are stored as ``turn_scores``
(with ``turn_spans`` from the masks when absent) and their last entries as ``scores``.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson
from msgspec import UNSET, UnsetType
from pydantic import TypeAdapter, ValidationError

from environments.trajectory import (
    EMPTY_MEANS_NONE,
    FREE_FORM_FIELDS,
    MAX_INT,
    Message,
    TrajectoryError,
    TrajectoryFlags,
    check_depth,
    check_parallel_lists,
    check_token_values,
    field_path,
    new_group_id,
    per_turn_scores,
)

_Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]  # = trajectory.Id


class _Group(msgspec.Struct):
    """:class:`~environments.trajectory.ScoredData` as msgspec decodes it (a test holds the
    two field lists equal). ``UNSET``: the key was absent (Atropos keys are then added as
    null to the stored body)."""

    tokens: list[msgspec.Raw]
    masks: list[msgspec.Raw]
    scores: list[float | list[float]]
    """One float per sequence, or a list of per-turn scores (moved to ``turn_scores``)."""
    advantages: list[msgspec.Raw] | None | UnsetType = UNSET
    ref_logprobs: list[msgspec.Raw] | None | UnsetType = UNSET
    messages: list[list[dict[str, Any]]] | None | UnsetType = UNSET
    generation_params: dict[str, Any] | None | UnsetType = UNSET
    inference_logprobs: list[msgspec.Raw] | None | UnsetType = UNSET
    overrides: list[dict[str, Any]] | None | UnsetType = UNSET
    group_overrides: dict[str, Any] | None | UnsetType = UNSET
    images: list[Any] | None | UnsetType = UNSET
    env_id: _Id | None | UnsetType = UNSET
    group_id: str | None = None
    env: str | None = None
    item_id: str | None = None
    turn_scores: list[list[float] | None] | None = None
    turn_spans: list[list[list[int]] | None] | None = None
    policy_versions: list[_Id | None] | None = None
    turn_policy_versions: list[list[_Id] | None] | None = None
    segment_starts: list[list[int] | None] | None = None
    turn_anchors: list[list[Annotated[str, msgspec.Meta(max_length=200)]] | None] | None = None
    flags: list[dict[str, Any]] | None = None
    trajectory_metadata: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    # Atropos's distillation data: stored and served as sent, not read by Lachesis.
    distill_token_ids: msgspec.Raw | UnsetType = UNSET
    distill_logprobs: msgspec.Raw | UnsetType = UNSET


_GROUP_FIELDS = _Group.__struct_fields__
ATROPOS_OPTIONAL_KEYS = ("advantages", "ref_logprobs", "messages", "generation_params",
                         "inference_logprobs", "overrides", "group_overrides", "images",
                         "env_id", "distill_token_ids", "distill_logprobs")
"""The optional keys of atroposlib 0.4.0's ``ScoredData``: its ``GET /batch`` returns
every one of them (null where absent), and Atropos trainers rely on that. The two
``distill_*`` keys are Atropos's on-policy distillation data, which Lachesis stores and
serves as sent but does not read."""


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


def _int_array(raw: msgspec.Raw, field: str) -> np.ndarray:
    """A JSON list of integers (already known to be valid JSON) as an int64 array;
    integers beyond int64 become its bounds, which the range checks then refuse."""
    data = bytes(raw)
    if data[:1] != b"[" or data[1:-1].translate(None, _INT_ARRAY_BYTES):
        raise WireError(field, "must be a list of integers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.fromstring(data[1:-1], dtype=np.int64, sep=",")


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


def too_deep(body: bytes, limit: int = 200) -> str:
    """The field of a JSON ``body`` where nesting first goes past ``limit`` levels, as
    ``metadata`` or ``[3].metadata`` (a list of groups); ``body`` if it is not inside
    one. A plain scan, used only when a decoder has already hit its recursion limit."""
    path: list[str] = []  # per open container: the current key (object) or index (array)
    kinds: list[int] = []
    in_string = escaped = expecting_key = False
    key_start = -1
    for i, c in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # closing quote
                in_string = False
                if key_start >= 0:
                    path[-1] = body[key_start:i].decode(errors="replace")
                    key_start = -1
            continue
        if c == 0x22:
            in_string = True
            if kinds and kinds[-1] == 0x7B and expecting_key:
                key_start, expecting_key = i + 1, False
        elif c in (0x7B, 0x5B):  # { [
            kinds.append(c)
            path.append("" if c == 0x7B else "0")
            expecting_key = c == 0x7B
            if len(kinds) > limit:
                break
        elif c in (0x7D, 0x5D):
            kinds.pop()
            path.pop()
        elif c == 0x2C and kinds:  # comma: next key or index
            if kinds[-1] == 0x7B:
                expecting_key = True
            else:
                path[-1] = str(int(path[-1]) + 1)
    else:
        return "body"
    field = ""
    for kind, part in zip(kinds[:2], path[:2]):
        field += f"[{part}]" if kind == 0x5B else f".{part}"
        if kind == 0x7B and field.lstrip("."):
            break  # the top-level key of the (first) object names the field
    return field.lstrip(".") or "body"


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
    except RecursionError:
        raise WireError(where + too_deep(bytes(body)), "JSON nested too deeply") from None
    present = {name: value for name in _GROUP_FIELDS
               if (value := getattr(group, name)) is not UNSET}
    empty = [name for name in EMPTY_MEANS_NONE if present.get(name) == []]
    for name in empty:  # atroposlib's default collect_trajectories sends [] for "none"
        present[name] = None

    if not group.tokens:
        raise WireError(where + "tokens", "must hold at least one sequence")
    if group.group_id is not None and not 0 < len(group.group_id) <= MAX_GROUP_ID_LENGTH:
        raise WireError(where + "group_id", f"must be 1 to {MAX_GROUP_ID_LENGTH} characters")
    get = lambda name: present.get(name)  # noqa: E731  (absent = None from here on)
    try:
        for name in FREE_FORM_FIELDS:
            check_depth(get(name), name)
    except TrajectoryError as error:
        raise WireError(where + error.field, error.message) from None
    for field, values, adapter in (("messages", get("messages"), _MESSAGES),
                                   ("flags", group.flags, _FLAGS)):
        if values is not None:
            try:
                adapter.validate_python(values, strict=True)
            except ValidationError as error:
                raise WireError(*_pydantic_field(where + field, error)) from None
    try:
        tokens = [_int_array(raw, f"tokens[{i}]") for i, raw in enumerate(group.tokens)]
        masks = [_int_array(raw, f"masks[{i}]") for i, raw in enumerate(group.masks)]
        moved = per_turn_scores(group.scores, group.turn_scores, group.turn_spans, masks)
        if moved is not None:  # per-turn lists in scores (a rare, slow path: re-encoded)
            group.scores, group.turn_scores, group.turn_spans = moved
        check_parallel_lists(
            n_tokens=[len(t) for t in tokens],
            n_masks=[len(m) for m in masks],
            n_logprobs=_lengths(get("inference_logprobs"), "inference_logprobs", _float_array_length),
            n_advantages=_lengths(get("advantages"), "advantages", _float_array_length),
            n_ref_logprobs=_lengths(get("ref_logprobs"), "ref_logprobs", _float_array_length),
            scores=group.scores,
            turn_scores=group.turn_scores,
            turn_spans=group.turn_spans,
            turn_policy_versions=group.turn_policy_versions,
            segment_starts=group.segment_starts,
            turn_anchors=group.turn_anchors,
            per_sequence={"messages": get("messages"), "overrides": get("overrides"),
                          "policy_versions": group.policy_versions, "flags": group.flags,
                          "trajectory_metadata": group.trajectory_metadata,
                          "images": get("images")},
        )
        for i, (t, m) in enumerate(zip(tokens, masks)):
            check_token_values(i, t, m, group.segment_starts[i] if group.segment_starts else None)
    except (TrajectoryError, WireError) as error:
        raise WireError(where + error.field, error.message) from None

    data = bytes(body).strip()
    if empty or moved is not None:  # stored as null / as the contract's fields, so the
        # trainers' models read the group (a rare, slow path)
        rewrite: dict[str, Any] = dict.fromkeys(empty)
        if moved is not None:  # Atropos trainers get one float per sequence in scores
            rewrite.update(scores=group.scores, turn_scores=group.turn_scores,
                           turn_spans=group.turn_spans)
        data = orjson.dumps({**orjson.loads(data), **rewrite})
    head = b"".join(b'"' + name.encode() + b'":null,' for name in ATROPOS_OPTIONAL_KEYS
                    if name not in present)
    group_id = group.group_id
    if group_id is None:  # Atropos envs send no id: give the group one, inside its body.
        group_id = new_group_id()
        head = b'"group_id":"' + group_id.encode() + b'",' + head
    if head:
        data = b"{" + head + data[1:].lstrip()
    versions = [v for v in (group.policy_versions or []) if v is not None]
    versions += [v for vs in (group.turn_policy_versions or []) if vs for v in vs]
    return AcceptedGroup(
        group_id=group_id,
        env_id=get("env_id"),
        n_sequences=len(group.tokens),
        policy_version=min(versions) if versions else None,
        body=data,
    )


def decode_group_list(body: bytes) -> list[AcceptedGroup]:
    """Validate a JSON list of groups (``/scored_data_list``); all or nothing."""
    try:
        raws = _GROUP_LIST.decode(body)
    except RecursionError:
        raise WireError(too_deep(body), "JSON nested too deeply") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise WireError("body", f"must be a JSON list of groups ({error})", status=400) from None
    if not raws:
        raise WireError("body", "the list of groups is empty")
    return [decode_group(raw, where=f"[{i}].") for i, raw in enumerate(raws)]
