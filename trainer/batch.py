"""From scored groups to padded training tensors, refusing what cannot be trained on.

Conventions (shared with :func:`trainer.losses.token_logprobs` and the data contract):
position ``t`` of every ``[B, T]`` tensor describes ``tokens[t]``: ``mask[t]`` says
whether it is trained, ``old_logprobs[t]`` is vLLM's logprob of sampling it (or, for a
row whose trajectory came without ``inference_logprobs``, the trainer's own logprob at the
batch's start, filled in by the training loop: ``behaviour`` says which rows have vLLM's),
and ``advantages[t]`` its advantage. Position 0 is never trained (nothing predicts it).

A row of the batch is a whole trajectory (``samples: sequence``) or, with
``samples: turn_prefix``, one prefix of it per assistant turn (:func:`turn_prefix_samples`).
A trajectory with ``segment_starts`` (several independent contexts) gets its advantages
on the whole trajectory, then gives one row per segment, or per turn within each segment
(:func:`segment_samples`): no row ever joins two contexts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from environments.trajectory import (
    MASKED,
    ScoredGroup,
    ScoredTrajectory,
    TrajectoryError,
)


class BatchError(ValueError):
    """A batch that must not be trained on; the message names the group and sequence."""


def check_trajectory(t: ScoredTrajectory, where: str, *, vocab_size: int | None = None,
                     need_trainable: bool = True) -> None:
    """Raise :class:`BatchError` if ``t`` cannot be trained on by the RL loss: the data
    contract (:meth:`ScoredTrajectory.check`, the rules the rollout API applies too), plus
    what only the trainer knows: its model's vocabulary, and that the tokens were sampled
    by the policy (``flags.trainable``). A trajectory without ``inference_logprobs`` is
    fine: the trainer takes its own logprobs at the batch's start as pi_old."""
    try:
        t.check(None)
    except TrajectoryError as error:
        raise BatchError(f"{where}: {error}") from None
    if need_trainable and not t.flags.trainable:
        raise BatchError(f"{where}: marked not trainable (not sampled by the policy)")
    if vocab_size is not None:
        tokens = np.asarray(t.tokens)
        bad = np.flatnonzero(tokens >= vocab_size)
        if bad.size:
            i = int(bad[0])
            raise BatchError(f"{where}: tokens[{i}] = {t.tokens[i]} is outside the "
                             f"model's vocabulary ({vocab_size})")
    values = [*(t.inference_logprobs or []), *(t.advantages or []),
              *(t.scores if isinstance(t.scores, list) else [t.scores])]
    if not all(math.isfinite(x) for x in values):  # the model refuses them; built by hand?
        raise BatchError(f"{where}: non-finite logprob, advantage or score")


def check_group(group: ScoredGroup, where: str, *, vocab_size: int | None = None,
                need_trainable: bool = True) -> None:
    """:func:`check_trajectory` on every member; the error names the sequence."""
    for i, t in enumerate(group.trajectories):
        check_trajectory(t, f"{where} sequence {i}", vocab_size=vocab_size,
                         need_trainable=need_trainable)


def check_groups(groups: list[ScoredGroup], *, vocab_size: int | None = None,
                 need_trainable: bool = True) -> None:
    for g, group in enumerate(groups):
        check_group(group, f"group {g} ({group.group_id}, item {group.item_id})",
                    vocab_size=vocab_size, need_trainable=need_trainable)


@dataclass
class Sample:
    """One training row that is not a whole trajectory (the fields :func:`pack` reads)."""

    tokens: list[int]
    masks: list[int]
    """The token id where trained, ``-100`` elsewhere (the data contract's convention)."""
    inference_logprobs: list[float] | None
    turn: int | None = None
    """The assistant turn whose tokens this row trains; ``None`` when it trains all the
    turns of its tokens (a segment row of :func:`segment_samples`)."""
    start: int = 0
    """Position of the row's first token in its trajectory."""
    segment: int = 0
    """The trajectory's segment (context) the row comes from (see ``segment_starts``)."""


def _segments(trajectory: ScoredTrajectory) -> list[tuple[int, int]]:
    bounds = [0, *(trajectory.segment_starts or []), len(trajectory.tokens)]
    return list(zip(bounds[:-1], bounds[1:]))


def segment_samples(trajectory: ScoredTrajectory, advantages: np.ndarray
                    ) -> tuple[list[Sample], list[np.ndarray]]:
    """Split a trajectory into one training row per segment (independent context).

    With ``segment_starts`` ``b_1 < ... < b_{S-1}`` (and ``b_0 = 0``, ``b_S = len(x)``),
    row ``j`` is segment ``j`` alone, as the model saw it::

        tokens_j = x[b_j : b_{j+1}]      masks_j = m[b_j : b_{j+1}]
        mu_j     = mu[b_j : b_{j+1}]     A_j     = A[b_j : b_{j+1}]

    where ``A`` are the per-token advantages computed on the *whole* trajectory (one
    group member, one score list over all its turns). No row holds tokens of two
    segments, so no token is trained in a context the model did not see. The token at
    each segment start is masked (the data contract), so the rows train exactly the
    trajectory's trained tokens, each once; a segment without a trained token gives no
    row. A trajectory without segment starts is one row, as is.
    """
    advantages = np.asarray(advantages, dtype=np.float32)
    if not trajectory.segment_starts:
        return ([Sample(list(trajectory.tokens), list(trajectory.masks),
                        trajectory.inference_logprobs)], [advantages])
    logprobs = trajectory.inference_logprobs
    rows, row_advantages = [], []
    for j, (start, end) in enumerate(_segments(trajectory)):
        masks = list(trajectory.masks[start:end])
        if all(m == MASKED for m in masks):
            continue
        rows.append(Sample(list(trajectory.tokens[start:end]), masks,
                           None if logprobs is None else list(logprobs[start:end]),
                           start=start, segment=j))
        row_advantages.append(advantages[start:end])
    return rows, row_advantages


def _turn_prefix_rows(row: Sample, advantages: np.ndarray,
                      spans: list[tuple[int, tuple[int, int]]] | None,
                      where: str) -> tuple[list[Sample], list[np.ndarray]]:
    """Turn-prefix rows of one context ``row`` (see :func:`turn_prefix_samples`);
    ``spans``: ``(turn, (start, end))`` of the turns inside it, in the row's coordinates
    (``None``: the trajectory has no turn spans, the row is kept whole)."""
    if spans is None:
        return [replace(row, turn=0)], [advantages]
    inside = np.zeros(len(row.tokens), dtype=bool)
    for _, (start, end) in spans:
        inside[start:end] = True
    trained = np.asarray(row.masks) != MASKED
    outside = np.flatnonzero(trained & ~inside)
    if outside.size:
        raise BatchError(f"{where}: token {row.start + int(outside[0])} is trained but "
                         "outside every turn span; samples: turn_prefix trains each token "
                         "in its turn's row")
    rows, row_advantages = [], []
    for turn, (start, end) in spans:
        if not trained[start:end].any():
            continue
        masks = [MASKED] * start + list(row.masks[start:end])
        logprobs = None if row.inference_logprobs is None else list(row.inference_logprobs[:end])
        values = np.zeros(end, dtype=np.float32)
        values[start:end] = advantages[start:end]
        rows.append(Sample(list(row.tokens[:end]), masks, logprobs, turn,
                           start=row.start, segment=row.segment))
        row_advantages.append(values)
    return rows, row_advantages


def turn_prefix_samples(trajectory: ScoredTrajectory, advantages: np.ndarray,
                        where: str = "trajectory") -> tuple[list[Sample], list[np.ndarray]]:
    """Expand an ``N``-turn trajectory into one training row per assistant turn.

    With tokens ``x``, masks ``m``, behaviour logprobs ``mu``, per-token advantages ``A``
    (the estimator's output for this trajectory) and turn spans ``[s_k, e_k)``, row ``k``
    is the conversation up to the end of turn ``k``, trained on turn ``k`` only::

        tokens_k     = x[0 : e_k]
        masks_k[t]   = m[t] if s_k <= t < e_k else -100
        mu_k         = mu[0 : e_k]
        A_k[t]       = A[t] if s_k <= t < e_k else 0

    Every built-in estimator gives one value per turn (constant on the span), so row ``k``
    carries a single scalar: turn ``k``'s advantage under that estimator. Turns without
    a trained token give no row. A trajectory without turn spans is one row, as is. Since
    ``log p(x_t | x_<t)`` does not depend on the tokens after ``t``, every trained token
    gets the same log-probability, ratio and advantage as in its whole trajectory: the
    rows train the same tokens, each once, at the cost of re-reading the context (the
    row lengths sum to ``sum_k e_k`` tokens instead of ``len(x)``).

    With ``segment_starts``, the expansion happens within each segment
    (:func:`segment_samples`): turn ``k`` of segment ``[b, b')`` gives the row
    ``x[b : e_k]``, trained on turn ``k`` only (without turn spans: one row per segment).

    Raises :class:`BatchError` if a trained token lies outside every turn span (no row
    would train it).
    """
    spans = [(k, (int(s), int(e))) for k, (s, e) in enumerate(trajectory.turn_spans or [])]
    rows, row_advantages = [], []
    for segment, segment_advantages in zip(*segment_samples(trajectory, advantages)):
        end = segment.start + len(segment.tokens)
        inside = None if not spans else [(k, (s - segment.start, e - segment.start))
                                         for k, (s, e) in spans if segment.start <= s and e <= end]
        more_rows, more_advantages = _turn_prefix_rows(segment, segment_advantages, inside, where)
        rows += more_rows
        row_advantages += more_advantages
    return rows, row_advantages


@dataclass
class TrainBatch:
    tokens: torch.Tensor        # [B, T] long, right-padded with pad_id
    mask: torch.Tensor          # [B, T] bool, trained positions
    old_logprobs: torch.Tensor  # [B, T] float32, vLLM's; 0 where not trained
    advantages: torch.Tensor    # [B, T] float32; 0 where not trained
    lengths: torch.Tensor       # [B] long
    proximal_logprobs: torch.Tensor | None = None
    """[B, T] float32, the trainer's own logprobs at the start of the batch (pi_old of
    several optimizer steps per batch); None: each step's own logprobs, detached."""
    behaviour: torch.Tensor | None = None
    """[B] bool: whether the row has the behaviour policy's (vLLM's) logprobs in
    ``old_logprobs``. A row without them (an env that sent no ``inference_logprobs``)
    takes the trainer's own logprobs at the batch's start as pi_old, and gets no
    train/inference mismatch correction. None: every row has them."""

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def without_behaviour(self) -> torch.Tensor | None:
        """``[B, T]`` bool: trained tokens of rows without behaviour logprobs; None when
        every row has them."""
        if self.behaviour is None or bool(self.behaviour.all()):
            return None
        return self.mask & ~self.behaviour.unsqueeze(-1)

    def to(self, device: torch.device | str) -> TrainBatch:
        move = lambda x: None if x is None else x.to(device)  # noqa: E731
        return TrainBatch(self.tokens.to(device), self.mask.to(device),
                          self.old_logprobs.to(device), self.advantages.to(device),
                          self.lengths.to(device), move(self.proximal_logprobs),
                          move(self.behaviour))

    def _rows(self, index: torch.Tensor | slice) -> TrainBatch:
        lengths = self.lengths[index]
        width = int(lengths.max()) if len(lengths) else 0
        proximal = self.proximal_logprobs
        return TrainBatch(self.tokens[index, :width], self.mask[index, :width],
                          self.old_logprobs[index, :width], self.advantages[index, :width],
                          lengths, None if proximal is None else proximal[index, :width],
                          None if self.behaviour is None else self.behaviour[index])

    def select(self, rows: list[int]) -> TrainBatch:
        """The sequences ``rows`` (e.g. one data-parallel rank's share)."""
        return self._rows(torch.tensor(rows, dtype=torch.long))

    def slice(self, rows: slice) -> TrainBatch:
        return self._rows(rows)


def plan_micro_batches(lengths: Sequence[int], *, max_tokens: int | None = None,
                       max_rows: int | None = None) -> list[list[int]]:
    """Group rows (given their lengths) into micro-batches; returns row indices per
    micro-batch, every row exactly once.

    ``max_tokens`` (packing): first-fit decreasing on the row lengths: rows, longest
    first, each go into the first micro-batch whose total stays ``<= max_tokens`` with
    it, else into a new one; a row longer than ``max_tokens`` is a micro-batch alone.
    ``max_rows`` (padding): runs of ``max_rows`` consecutive rows."""
    if (max_tokens is None) == (max_rows is None):
        raise ValueError("give exactly one of max_tokens and max_rows")
    if max_rows is not None:
        return [list(range(s, min(s + max_rows, len(lengths))))
                for s in range(0, len(lengths), max_rows)]
    plans: list[list[int]] = []
    totals: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = int(lengths[row])
        for k, total in enumerate(totals):
            if total + n <= max_tokens:
                plans[k].append(row)
                totals[k] += n
                break
        else:
            plans.append([row])
            totals.append(n)
    return [sorted(plan) for plan in plans]


def pack(trajectories: Sequence[ScoredTrajectory | Sample], advantages: list, *,
         pad_id: int = 0, with_logprobs: bool = True) -> TrainBatch:
    """Right-pad trajectories (or :class:`Sample` rows) into one :class:`TrainBatch`
    (``advantages``: per-token arrays)."""
    width = max(len(t.tokens) for t in trajectories)
    b = len(trajectories)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.bool)
    old = torch.zeros((b, width), dtype=torch.float32)
    adv = torch.zeros((b, width), dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    behaviour = torch.ones(b, dtype=torch.bool)
    for i, (t, a) in enumerate(zip(trajectories, advantages)):
        n = len(t.tokens)
        lengths[i] = n
        tokens[i, :n] = torch.tensor(t.tokens)
        mask[i, :n] = torch.tensor([m != MASKED for m in t.masks])
        if with_logprobs and t.inference_logprobs is not None:
            old[i, :n] = torch.tensor(t.inference_logprobs, dtype=torch.float32)
        else:
            behaviour[i] = False
        adv[i, :n] = torch.as_tensor(a, dtype=torch.float32)
    old = torch.where(mask, old, torch.zeros_like(old))
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    return TrainBatch(tokens, mask, old, adv, lengths,
                      behaviour=behaviour if with_logprobs else None)
