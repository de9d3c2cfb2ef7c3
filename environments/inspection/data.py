"""Data preparation for ``lachesis inspect`` and ``lachesis report``: no rendering here.

Everything streams: a JSONL file is read one line at a time
(:func:`environments.jsonl_store.iter_located_groups`), bad lines are recorded with their
line numbers and skipped, and what is kept per group is small (statistics accumulate
into counters and one float per trajectory; the report keeps byte offsets and re-reads
only the groups it embeds).
"""

from __future__ import annotations

import bisect
import math
import random
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.jsonl_store import LocatedGroup, ReadReport, iter_located_groups
from environments.trajectory import (
    MASKED,
    Message,
    ScoredGroup,
    ScoredTrajectory,
    equal_scores,
)

FLAGS = ("truncated", "tool-errors", "not-trainable")
"""Trajectory flags a filter can ask for."""


# -- filters --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Filter:
    """Which trajectories to show. A group is shown when one of its trajectories matches."""

    env: str | None = None
    min_score: float | None = None
    """Lowest outcome (the scalar score, or the last turn's score), inclusive."""
    max_score: float | None = None
    flags: tuple[str, ...] = ()
    """All of these must hold: ``truncated``, ``tool-errors``, ``not-trainable``."""

    def __post_init__(self) -> None:
        unknown = [f for f in self.flags if f not in FLAGS]
        if unknown:
            raise ValueError(f"unknown flag {unknown[0]!r}; known: {', '.join(FLAGS)}")

    @property
    def active(self) -> bool:
        return bool(self.env or self.min_score is not None or self.max_score is not None
                    or self.flags)

    def matches(self, t: ScoredTrajectory) -> bool:
        outcome = t.outcome
        if self.min_score is not None and outcome < self.min_score:
            return False
        if self.max_score is not None and outcome > self.max_score:
            return False
        for flag in self.flags:
            if flag == "truncated" and not t.flags.truncated:
                return False
            if flag == "tool-errors" and not t.flags.tool_errors:
                return False
            if flag == "not-trainable" and t.flags.trainable:
                return False
        return True

    def matching(self, group: ScoredGroup) -> list[int]:
        """Indices of the group's trajectories that match (none if the env differs)."""
        if self.env is not None and group.env != self.env:
            return []
        return [i for i, t in enumerate(group.trajectories) if self.matches(t)]

    def describe(self) -> str:
        parts = []
        if self.env:
            parts.append(f"env {self.env}")
        if self.min_score is not None and self.max_score is not None:
            parts.append(f"{self.min_score:g} <= outcome <= {self.max_score:g}")
        elif self.min_score is not None:
            parts.append(f"outcome >= {self.min_score:g}")
        elif self.max_score is not None:
            parts.append(f"outcome <= {self.max_score:g}")
        parts += self.flags
        return ", ".join(parts) if parts else "none"


class SourceError(ValueError):
    """A path that ``inspect`` / ``report`` cannot read groups from."""


def jsonl_files(path: str | Path) -> list[Path]:
    """The JSONL files behind ``path``: the file itself, or a directory's ``*.jsonl`` files
    in name order. A directory without any that has a ``trajectories/`` directory with
    some (a ``lachesis run`` directory, ``runs/NAME``) gives those. Raises
    :class:`SourceError` naming the path when there is nothing to read."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        for directory in (path, path / "trajectories"):
            files = sorted(p for p in directory.glob("*.jsonl") if p.is_file())
            if files:
                return files
        raise SourceError(f"{path}: a directory without *.jsonl files (and without a "
                          "trajectories/ directory holding some, as a `lachesis run` "
                          "directory has)")
    if path.exists():
        raise SourceError(f"{path}: not a regular file or a directory")
    raise SourceError(f"{path}: no such file or directory")


@dataclass
class Match:
    """A group read from the file, with its position and which trajectories matched."""

    index: int
    """The group's position among the valid groups of the file (or of the directory's
    files, in name order), from 0 (``--group N``)."""
    located: LocatedGroup
    matching: list[int]
    from_directory: bool = False
    """Read from one of a directory's files: its location names the file."""

    @property
    def group(self) -> ScoredGroup:
        return self.located.group

    @property
    def line_no(self) -> int:
        return self.located.line_no

    @property
    def location(self) -> str:
        """``line N``, or ``FILE.jsonl:N`` for a group read from a directory."""
        if self.from_directory:
            return f"{self.located.path.name}:{self.line_no}"
        return f"line {self.line_no}"


def scan(path: str | Path, filter: Filter | None = None,
         report: ReadReport | None = None) -> Iterator[Match]:
    """Stream the groups of ``path`` (a JSONL file, or a directory: see :func:`jsonl_files`)
    that have a matching trajectory; bad lines go to ``report.bad_lines`` (with their file
    and line number) and are skipped."""
    filter = filter or Filter()
    files = jsonl_files(path)
    from_directory = Path(path).is_dir()
    index = 0
    for file in files:
        for located in iter_located_groups(file, skip_bad=True, report=report):
            matching = filter.matching(located.group)
            if matching:
                yield Match(index, located, matching, from_directory)
            index += 1


# -- one group, one trajectory ---------------------------------------------------------------
def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


@dataclass
class GroupSummary:
    """One row of a list of groups."""

    index: int
    line_no: int
    location: str
    """``line N``, or ``FILE.jsonl:N`` for a group read from a directory."""
    group_id: str
    env: str | None
    item_id: str | None
    outcomes: list[float]
    matching: list[int]
    policy_version: int | None
    truncated: int
    tool_errors: int
    """Trajectories with at least one tool error."""
    mean_turns: float
    tokens: int
    trained_tokens: int

    @property
    def spread(self) -> float:
        """Standard deviation of the outcomes: zero means no GRPO signal in the group."""
        return _std(self.outcomes)

    @property
    def mean(self) -> float:
        return _mean(self.outcomes)


def summarize(match: Match) -> GroupSummary:
    group = match.group
    trajectories = group.trajectories
    item_id = group.item_id
    if item_id is None:  # BaseEnv puts it in the trajectories' metadata too
        item_id = trajectories[0].metadata.get("item_id")
    return GroupSummary(
        index=match.index, line_no=match.line_no, location=match.location,
        group_id=group.group_id, env=group.env,
        item_id=None if item_id is None else str(item_id),
        outcomes=[t.outcome for t in trajectories], matching=match.matching,
        policy_version=group.policy_version,
        truncated=sum(t.flags.truncated for t in trajectories),
        tool_errors=sum(t.flags.tool_errors > 0 for t in trajectories),
        mean_turns=_mean([n_turns(t) for t in trajectories]),
        tokens=sum(len(t.tokens) for t in trajectories),
        trained_tokens=sum(n_trained(t) for t in trajectories))


def n_trained(t: ScoredTrajectory) -> int:
    return sum(m != MASKED for m in t.masks)


def n_turns(t: ScoredTrajectory) -> int:
    if t.turn_spans is not None:
        return len(t.turn_spans)
    if t.messages is not None:
        return sum(m.role == "assistant" for m in t.messages)
    return 1


@dataclass
class TurnRow:
    """One assistant turn of a trajectory."""

    index: int
    start: int
    end: int
    score: float | None
    """The turn's score when scores are per turn; None for a scalar score."""
    advantage: float | None
    """Mean env-provided advantage over the turn's trained tokens, when present."""
    policy_version: int | None
    n_tokens: int
    n_trained: int
    message: Message | None
    """The assistant message of this turn, when the trajectory has messages."""
    is_last: bool
    segment: int = 0
    """The segment (independent context, see ``segment_starts``) the turn lies in."""
    new_segment: bool = False
    """The first turn of a segment after the first: its context was rebuilt before it."""


def turn_rows(t: ScoredTrajectory) -> list[TurnRow]:
    """The assistant turns of ``t``: span, score, mean advantage, version and message.

    The k-th turn is paired with the k-th of the *last* ``len(turn_spans)`` assistant
    messages (a prompt may hold few-shot assistant messages before the episode starts).
    """
    spans = t.turn_spans or []
    assistant = [m for m in (t.messages or []) if m.role == "assistant"]
    if len(assistant) >= len(spans):
        assistant = assistant[len(assistant) - len(spans):]
    turn_scores = t.turn_scores
    segment_starts = t.segment_starts or []
    rows = []
    for k, (start, end) in enumerate(spans):
        segment = bisect.bisect_right(segment_starts, start)
        trained = [j for j in range(start, end) if t.masks[j] != MASKED]
        advantage = None
        if t.advantages is not None and trained:
            advantage = _mean([t.advantages[j] for j in trained])
        version = t.policy_version
        if t.turn_policy_versions is not None:
            version = t.turn_policy_versions[k]
        rows.append(TurnRow(
            index=k, start=start, end=end,
            score=turn_scores[k] if turn_scores is not None else None,
            advantage=advantage, policy_version=version, n_tokens=end - start,
            n_trained=len(trained), message=assistant[k] if k < len(assistant) else None,
            is_last=k == len(spans) - 1, segment=segment,
            new_segment=segment > (rows[-1].segment if rows else 0)))
    return rows


@dataclass
class ConversationRow:
    """A message of the conversation, with its assistant turn when it is one."""

    role: str
    content: str
    turn: TurnRow | None = None


def message_text(m: Message) -> str:
    text = m.content or ""
    for call in m.tool_calls or []:
        text += f"{chr(10) if text else ''}→ {call.function.name}({call.function.arguments})"
    return text


def conversation(t: ScoredTrajectory, decoder: TokenDecoder | None = None
                 ) -> list[ConversationRow]:
    """The messages turn by turn, each assistant turn carrying its :class:`TurnRow`.

    Without messages, each turn's text is decoded from its tokens (``decoder``; token
    ids without a tokenizer), or is empty without a decoder."""
    turns = turn_rows(t)
    if not turns and not t.messages:  # e.g. an Atropos line: the tokens, by mask runs
        return [ConversationRow("sampled" if trained else "context",
                                decoder.decode(t.tokens[start:end]) if decoder else "")
                for start, end, trained in mask_runs(t.masks)]
    by_message = {id(r.message): r for r in turns if r.message is not None}
    rows = [ConversationRow(m.role, message_text(m), by_message.get(id(m)))
            for m in t.messages or []]
    for r in turns:
        if r.message is None:
            text = decoder.decode(t.tokens[r.start:r.end]) if decoder is not None else ""
            rows.append(ConversationRow("assistant", text, r))
    return rows


def mask_runs(masks: list[int]) -> list[tuple[int, int, bool]]:
    """``(start, end, trained)`` runs of consecutive context or trained positions."""
    runs: list[tuple[int, int, bool]] = []
    start = 0
    for j in range(1, len(masks) + 1):
        if j == len(masks) or (masks[j] != MASKED) != (masks[start] != MASKED):
            runs.append((start, j, masks[start] != MASKED))
            start = j
    return runs


# -- tokens ----------------------------------------------------------------------------------
class TokenDecoder:
    """Token ids -> text with an optional HF tokenizer; without one, ids are shown."""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    @classmethod
    def load(cls, path: str | Path | None) -> TokenDecoder:
        if path is None:
            return cls()
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    @property
    def has_text(self) -> bool:
        return self.tokenizer is not None

    def text(self, token_id: int) -> str:
        """One token's text (a byte that is part of a longer character shows as '�')."""
        if self.tokenizer is None:
            return f"⟨{token_id}⟩"
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


@dataclass
class TokenRow:
    position: int
    token_id: int
    text: str
    trained: bool
    """Sampled by the policy (mask = the id); False for context (prompt, tool results)."""
    logprob: float | None
    """The inference logprob of a trained token (None for context, or when unknown)."""
    advantage: float | None
    turn: int | None
    """The assistant turn the token belongs to."""


def token_rows(t: ScoredTrajectory, decoder: TokenDecoder | None = None) -> list[TokenRow]:
    decoder = decoder or TokenDecoder()
    turn_of = [None] * len(t.tokens)
    for k, (start, end) in enumerate(t.turn_spans or []):
        turn_of[start:end] = [k] * (end - start)
    rows = []
    for j, token in enumerate(t.tokens):
        trained = t.masks[j] != MASKED
        rows.append(TokenRow(
            position=j, token_id=token, text=decoder.text(token), trained=trained,
            logprob=t.inference_logprobs[j] if trained and t.inference_logprobs else None,
            advantage=t.advantages[j] if t.advantages is not None else None,
            turn=turn_of[j]))
    return rows


# -- statistics ------------------------------------------------------------------------------
@dataclass
class Stats:
    """What ``--stats`` and the report's header show, over the matching trajectories."""

    groups: int = 0
    trajectories: int = 0
    outcome_mean: float | None = None
    outcome_std: float | None = None
    outcome_min: float | None = None
    outcome_max: float | None = None
    outcome_histogram: list[tuple[str, int]] = field(default_factory=list)
    """(label, count): one entry per distinct outcome when there are few, else 10 bins."""
    turns: dict[int, int] = field(default_factory=dict)
    """Number of assistant turns -> trajectories."""
    turn_score_means: list[tuple[int, float, int]] = field(default_factory=list)
    """(turn index, mean score, trajectories) over trajectories scored per turn."""
    truncated: int = 0
    with_tool_errors: int = 0
    tool_errors: int = 0
    not_trainable: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    equal_score_groups: int = 0
    """Groups with no score signal (:func:`equal_scores`): what ``env process`` counts as
    ``groups_kept_equal_scores`` (or drops)."""
    policy_versions: dict[str, int] = field(default_factory=dict)
    """Policy version -> trajectories, in numeric order (``none`` last)."""
    envs: dict[str, int] = field(default_factory=dict)

    @property
    def tool_error_rate(self) -> float:
        """Share of trajectories with at least one tool error."""
        return self.with_tool_errors / self.trajectories if self.trajectories else 0.0

    @property
    def truncated_rate(self) -> float:
        return self.truncated / self.trajectories if self.trajectories else 0.0


class StatsAccumulator:
    """Streams groups in; keeps counters and one float per trajectory (the outcome)."""

    def __init__(self) -> None:
        self.stats = Stats()
        self._outcomes = array("d")
        self._turns: Counter[int] = Counter()
        self._turn_sums: dict[int, list[float]] = {}
        self._versions: Counter[int | None] = Counter()
        self._envs: Counter[str] = Counter()

    def add(self, group: ScoredGroup, matching: list[int] | None = None) -> None:
        s = self.stats
        s.groups += 1
        self._envs[group.env or "(none)"] += 1
        if equal_scores(group.trajectories):
            s.equal_score_groups += 1
        indices = range(len(group.trajectories)) if matching is None else matching
        for i in indices:
            t = group.trajectories[i]
            s.trajectories += 1
            self._outcomes.append(t.outcome)
            self._turns[n_turns(t)] += 1
            for k, score in enumerate(t.turn_scores or []):
                sums = self._turn_sums.setdefault(k, [0.0, 0])
                sums[0] += score
                sums[1] += 1
            s.truncated += t.flags.truncated
            s.with_tool_errors += t.flags.tool_errors > 0
            s.tool_errors += t.flags.tool_errors
            s.not_trainable += not t.flags.trainable
            s.tokens += len(t.tokens)
            s.trained_tokens += n_trained(t)
            self._versions[t.policy_version] += 1

    def result(self) -> Stats:
        s = self.stats
        s.turns = dict(sorted(self._turns.items()))
        s.turn_score_means = [(k, total / n, n) for k, (total, n)
                              in sorted(self._turn_sums.items())]
        s.policy_versions = {"none" if v is None else str(v): n for v, n in sorted(
            self._versions.items(), key=lambda item: (item[0] is None, item[0] or 0))}
        s.envs = dict(self._envs.most_common())
        values = self._outcomes
        if values:
            s.outcome_min, s.outcome_max = min(values), max(values)
            s.outcome_mean = math.fsum(values) / len(values)
            s.outcome_std = math.sqrt(math.fsum((v - s.outcome_mean) ** 2 for v in values)
                                      / len(values))
            s.outcome_histogram = histogram(values)
        return s


def histogram(values: array | list[float], bins: int = 10,
              max_distinct: int = 12) -> list[tuple[str, int]]:
    distinct: Counter[float] = Counter()
    for v in values:
        distinct[v] += 1
        if len(distinct) > max_distinct:
            break
    else:
        return [(f"{v:g}", n) for v, n in sorted(distinct.items())]
    lo, hi = min(values), max(values)
    width = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / width), bins - 1)] += 1
    return [(f"[{lo + b * width:.3g}, {lo + (b + 1) * width:.3g}{']' if b == bins - 1 else ')'}",
             n) for b, n in enumerate(counts)]


def compute_stats(path: str | Path, filter: Filter | None = None,
                  report: ReadReport | None = None) -> Stats:
    accumulator = StatsAccumulator()
    for match in scan(path, filter, report):
        accumulator.add(match.group, match.matching)
    return accumulator.result()


# -- which groups a report embeds -------------------------------------------------------------
@dataclass
class Selection:
    """The groups a report embeds, out of ``total`` matching ones, and how they were chosen."""

    indices: list[int]
    """Positions in the list of matching groups, in file order."""
    total: int
    method: str
    """``all``, ``first`` or ``random``."""
    limited_by: list[str]
    """Which limits cut the selection (``max_groups``, ``max_bytes``)."""


def select(sizes: array | list[int], *, max_groups: int, max_bytes: int,
           method: str = "random", seed: int = 0) -> Selection:
    """Pick the groups to embed: all if they fit in ``max_groups`` and ``max_bytes`` (of
    JSONL lines), else the first ones or a uniform random sample (``seed``) that fits.

    At least one group is embedded whenever there is one, even if it alone is larger."""
    total = len(sizes)
    if total <= max_groups and sum(sizes) <= max_bytes:
        return Selection(list(range(total)), total, "all", [])
    if method not in ("first", "random"):
        raise ValueError(f"sampling method must be 'first' or 'random', got {method!r}")
    candidates = (range(min(total, max_groups)) if method == "first"
                  else random.Random(seed).sample(range(total), min(total, max_groups)))
    chosen, used, limited = [], 0, ["max_groups"] if total > max_groups else []
    for i in candidates:  # in sampled order, so stopping at the budget keeps it uniform
        if chosen and used + sizes[i] > max_bytes:
            limited.append("max_bytes")
            break
        chosen.append(i)
        used += sizes[i]
    return Selection(sorted(chosen), total, method, limited)
