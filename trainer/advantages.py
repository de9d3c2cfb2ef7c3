"""Per-token advantages for one group (the trajectories sampled for one item).

Every estimator takes the group's :class:`TrajectoryRewards` and returns one float32 array
per trajectory, one value per token. Only the values at trained positions (``masks !=
-100``) reach the loss, but every token of every assistant turn span is filled, so the
arrays can be inspected and plotted as they are.

Conventions shared by all estimators
------------------------------------
* Group normalisation is :func:`group_zscore`: ``(x - mean) / (std + eps)`` with the
  *sample* standard deviation (``ddof=1``, Bessel's correction) and ``eps = 1e-4``. This is
  what the MT-GRPO reference code computes (``torch.Tensor.std``, unbiased by default, plus
  ``1e-4``); verl's GRPO and TRL also use the unbiased ``torch.std``. ``ddof`` is a
  parameter for those who want the population value.
* A group with one member, or whose values are all equal, gets exactly 0.
* Tokens outside the assistant turn spans get the trajectory-level value for ``grpo`` and
  ``grpo_merged`` (every token the same) and 0 for the turn-level estimators
  (``mt_grpo``, ``turn_rtg``): outside the spans there is no turn to credit, and those
  tokens (prompt, tool results) are never trained anyway. A trajectory with no spans at
  all is one turn covering every token.
* Env-provided per-token ``advantages`` replace the estimator's output for that
  trajectory (Atropos semantics). Its rewards still count in the group statistics of the
  other members: the override changes what it is trained with, not what it observed.

The estimators
--------------
``grpo``        GRPO-OR: ``A = z(outcome)`` on every token.
``grpo_merged`` GRPO-MR: ``A = z(sum of turn scores)`` on every token.
``mt_grpo``     MT-GRPO (arXiv 2505.11821): outcome advantage plus per-turn-index turn
                advantages on the turns before the final one.
``turn_rtg``    Lachesis's length-robust estimator: discounted return-to-go per turn with a
                per-turn-index *state* baseline (see :func:`turn_rtg`).
``gigpo``       GiGPO (arXiv 2505.10978): group-normalised episode return plus a step
                advantage among turns that start from the same anchor state
                (see :func:`gigpo`); needs only outcome rewards.
``mt_grpo_unbiased``, ``turn_rtg_unbiased``, ``gigpo_unbiased``
                the same credit rules with baselines that do not depend on the
                trajectory's own actions (every member in every turn column; the others'
                mean), so that with centred advantages the expected update is exactly
                ``(G-1)/G`` times the rule's target even when the policy decides when to
                stop (docs/credit-bias.md, ``experiments/termination_bias.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from environments.trajectory import ScoredTrajectory

EPS = 1e-4
"""The z-score's denominator offset, as in the MT-GRPO reference code."""
DDOF = 1
"""Sample standard deviation, as ``torch.std`` (the reference code's choice)."""


def _all_equal(values: np.ndarray) -> bool:
    """Equal up to rounding (a spread of at most 1e-12 relative): ``0.1 + 0.2`` and ``0.3``
    are the same reward, and a group of them must not look like it has variance."""
    spread = float(values.max() - values.min())
    return spread <= 1e-12 * max(1.0, float(np.abs(values).max()))


def group_zscore(x: Sequence[float] | np.ndarray, eps: float = EPS,
                 ddof: int = DDOF, scale: bool = True) -> np.ndarray:
    """Group z-score ``z_i = (x_i - mean(x)) / (std(x) + eps)``; with ``scale=False`` only
    centred, ``x_i - mean(x)`` (Dr. GRPO, arXiv 2503.20783: no std scaling).

    ``std`` is ``sqrt(sum_i (x_i - mean)^2 / (n - ddof))``; the default ``ddof=1`` is the
    unbiased sample estimate that ``torch.std`` (and so the MT-GRPO reference code) uses.
    Groups of fewer than two members, and groups whose values are all equal (up to
    rounding, 1e-12 relative), give exactly 0 -- not ``~1e-13`` from rounding in the mean,
    so zero-variance groups are recognised. Returns float64 of the input's length.
    """
    values = np.asarray(x, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"group_zscore expects a 1-D array, got shape {values.shape}")
    if values.size < 2 or values.size <= ddof or _all_equal(values):
        return np.zeros_like(values)
    if not scale:
        return values - values.mean()
    return (values - values.mean()) / (values.std(ddof=ddof) + eps)


@dataclass
class TrajectoryRewards:
    """What the estimators need to know about one trajectory.

    ``turn_spans`` are the ``[start, end)`` token ranges of the assistant turns (empty: one
    turn over every token). ``turn_scores`` has one score per assistant turn, the last one
    being the outcome; ``score`` is the outcome (derived from ``turn_scores`` when left
    out). ``reached_tool_result=False`` forces MT-GRPO's single-turn fallback; ``None``
    infers it from the number of turns. ``advantages`` (one per token) overrides the
    estimator for this trajectory. ``turn_anchors`` (one key per turn span) name the state
    each turn starts from (GiGPO).
    """

    n_tokens: int
    turn_spans: Sequence[tuple[int, int]] | None = None
    turn_scores: Sequence[float] | None = None
    score: float | None = None
    reached_tool_result: bool | None = None
    advantages: Sequence[float] | None = None
    turn_anchors: Sequence[str] | None = None
    spans: list[tuple[int, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n_tokens <= 0:
            raise ValueError(f"n_tokens must be positive, got {self.n_tokens}")
        self.spans = [(int(s), int(e)) for s, e in (self.turn_spans or [])]
        previous_end = 0
        for k, (start, end) in enumerate(self.spans):
            if not previous_end <= start < end <= self.n_tokens:
                raise ValueError(f"turn_spans[{k}]: [{start}, {end}) is empty, overlaps the "
                                 f"previous turn or lies outside the {self.n_tokens} tokens")
            previous_end = end
        if self.turn_scores is not None:
            self.turn_scores = [float(s) for s in self.turn_scores]
            if not self.turn_scores:
                raise ValueError("turn_scores must not be empty")
            if len(self.turn_scores) != len(self.spans):
                raise ValueError(f"{len(self.turn_scores)} turn scores for "
                                 f"{len(self.spans)} turn spans (need one each)")
            if self.score is None:
                self.score = self.turn_scores[-1]
            elif float(self.score) != self.turn_scores[-1]:
                raise ValueError(f"score {self.score} is not the last turn score (the "
                                 f"outcome) {self.turn_scores[-1]}")
        if self.score is None:
            raise ValueError("give score or turn_scores")
        self.score = float(self.score)
        if not all(math.isfinite(v) for v in [self.score, *(self.turn_scores or [])]):
            raise ValueError("scores must be finite")
        if self.turn_anchors is not None and len(self.turn_anchors) != len(self.spans):
            raise ValueError(f"{len(self.turn_anchors)} turn anchors for {len(self.spans)} "
                             "turn spans (need one each)")
        if self.advantages is not None and len(self.advantages) != self.n_tokens:
            raise ValueError(f"advantages: length {len(self.advantages)} does not match "
                             f"n_tokens ({self.n_tokens})")

    @property
    def outcome(self) -> float:
        """The scalar score, or the last turn's score."""
        return float(self.score)  # type: ignore[arg-type]

    @property
    def merged(self) -> float:
        """Sum of the turn scores (the scalar score when there are none)."""
        return math.fsum(self.turn_scores) if self.turn_scores is not None else self.outcome

    @property
    def n_turns(self) -> int:
        return max(len(self.spans), 1)

    @property
    def turn_rewards(self) -> np.ndarray:
        """One reward per turn: the turn scores, or ``[0, ..., 0, score]``."""
        if self.turn_scores is not None:
            return np.asarray(self.turn_scores, dtype=np.float64)
        rewards = np.zeros(self.n_turns)
        rewards[-1] = self.outcome
        return rewards

    @property
    def has_turn_credit(self) -> bool:
        """Whether MT-GRPO splits this trajectory into turns (else: merged fallback)."""
        return (self.turn_scores is not None and len(self.turn_scores) >= 2
                and self.reached_tool_result is not False)

    def spans_or_whole(self) -> list[tuple[int, int]]:
        return self.spans or [(0, self.n_tokens)]


def from_scored(traj: ScoredTrajectory) -> TrajectoryRewards:
    """The :class:`TrajectoryRewards` of a :class:`~environments.trajectory.ScoredTrajectory`.

    ``score`` is its outcome; ``turn_scores`` its per-turn list when ``scores`` is one;
    ``reached_tool_result`` is left to be inferred from the number of turns.
    """
    return TrajectoryRewards(
        n_tokens=len(traj.tokens),
        turn_spans=[(s, e) for s, e in (traj.turn_spans or [])],
        turn_scores=traj.turn_scores,
        score=traj.outcome,
        advantages=traj.advantages,
        turn_anchors=traj.turn_anchors,
    )


# -- helpers -----------------------------------------------------------------------------

def _fill(traj: TrajectoryRewards, value: float) -> np.ndarray:
    return np.full(traj.n_tokens, value, dtype=np.float32)


def _fill_turns(traj: TrajectoryRewards, per_turn: np.ndarray) -> np.ndarray:
    """Turn ``k``'s value on the tokens of span ``k``; 0 outside the spans."""
    out = np.zeros(traj.n_tokens, dtype=np.float32)
    for (start, end), value in zip(traj.spans_or_whole(), per_turn, strict=True):
        out[start:end] = value
    return out


def _padded(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows as a ``[n, K]`` matrix (0 where absent) and its presence mask."""
    width = max((len(r) for r in rows), default=0)
    values = np.zeros((len(rows), width))
    present = np.zeros((len(rows), width), dtype=bool)
    for i, row in enumerate(rows):
        values[i, :len(row)] = row
        present[i, :len(row)] = True
    return values, present


def _column_zscores(values: np.ndarray, present: np.ndarray, eps: float,
                    ddof: int, scale: bool = True) -> np.ndarray:
    """:func:`group_zscore` of each column over its present entries; 0 where absent."""
    out = np.zeros_like(values)
    for k in range(values.shape[1]):
        rows = present[:, k]
        out[rows, k] = group_zscore(values[rows, k], eps, ddof, scale)
    return out


# -- estimators --------------------------------------------------------------------------

def grpo(trajs: Sequence[TrajectoryRewards], *, eps: float = EPS, ddof: int = DDOF,
         scale: bool = True, **_: Any) -> list[np.ndarray]:
    """GRPO-OR: ``A_i = z(r)_i`` on every token, ``r_i`` = outcome of trajectory ``i``."""
    z = group_zscore([t.outcome for t in trajs], eps, ddof, scale)
    return [_fill(t, a) for t, a in zip(trajs, z)]


def grpo_merged(trajs: Sequence[TrajectoryRewards], *, eps: float = EPS, ddof: int = DDOF,
                scale: bool = True, **_: Any) -> list[np.ndarray]:
    """GRPO-MR: ``A_i = z(r)_i`` on every token, ``r_i = sum_k r_{i,k}`` (turn scores; the
    scalar score when there are none)."""
    z = group_zscore([t.merged for t in trajs], eps, ddof, scale)
    return [_fill(t, a) for t, a in zip(trajs, z)]


def mt_grpo(trajs: Sequence[TrajectoryRewards], *, turn_advantage_coef: float = 1.0,
            eps: float = EPS, ddof: int = DDOF, scale: bool = True, **_: Any) -> list[np.ndarray]:
    """MT-GRPO (Zeng et al., arXiv 2505.11821), generalised to any number of turns.

    For trajectory ``i`` with ``K_i`` turns and turn scores ``r_{i,0..K_i-1}``::

        A^O_i    = z_group(outcome)_i                       (outcome = r_{i,K_i-1})
        A^T_{i,k} = z over {j : k < K_j - 1} of r_{j,k}     (turn k before j's final turn)
        A_{i,k}  = A^O_i + lambda * A^T_{i,k}   for k < K_i - 1
        A_{i,K_i-1} = A^O_i                     (the final turn, after the last tool result)

    with ``lambda = turn_advantage_coef``. A trajectory with a single turn (it never
    reached a tool result), without turn scores, or with ``reached_tool_result=False``
    gets the merged advantage ``z_group(sum_k r_{i,k})_i`` on *all* its tokens, as the
    reference code does. The outcome and merged z-scores are taken over the whole group;
    the turn-``k`` z-score over the members that have a turn ``k`` before their final one
    (so groups with mixed turn counts work; an index reached by one member gives 0).
    Tokens outside the spans of a split trajectory get 0.
    """
    outcome_adv = group_zscore([t.outcome for t in trajs], eps, ddof, scale)
    merged_adv = group_zscore([t.merged for t in trajs], eps, ddof, scale)
    # Intermediate (pre-final) turn scores of the members that are split into turns.
    intermediate = [np.asarray(t.turn_scores[:-1]) if t.has_turn_credit else np.zeros(0)
                    for t in trajs]  # type: ignore[index]
    turn_adv = _column_zscores(*_padded(intermediate), eps, ddof, scale)
    out = []
    for i, traj in enumerate(trajs):
        if not traj.has_turn_credit:
            out.append(_fill(traj, merged_adv[i]))
            continue
        per_turn = np.full(traj.n_turns, outcome_adv[i])
        per_turn[:-1] += turn_advantage_coef * turn_adv[i, :traj.n_turns - 1]
        out.append(_fill_turns(traj, per_turn))
    return out


def mt_grpo_unbiased(trajs: Sequence[TrajectoryRewards], *, turn_advantage_coef: float = 1.0,
                     eps: float = EPS, ddof: int = DDOF, scale: bool = True,
                     **_: Any) -> list[np.ndarray]:
    """MT-GRPO with a turn baseline that does not depend on when the trajectory stops
    (docs/credit-bias.md): the same credit rule, unbiased for it when the policy decides
    how many turns to take.

    For trajectory ``i`` with ``K_i`` turns, over all ``G`` members of the group::

        u_{i,k}   = r_{i,k} for k < K_i - 1 (a turn another turn follows), else 0
                    (the stopping turn, whose score is the outcome, and every index after it)
        A^O_i     = z_group(outcome)_i
        A^T_{i,k} = z over all G members of u_{., k}      (one column per turn index)
        A_{i,k}   = A^O_i + lambda * A^T_{i,k}    on the tokens of every turn k < K_i

    What changes against :func:`mt_grpo`. MT-GRPO's turn-``k`` column holds only the
    members for which turn ``k`` is followed by another, so whether member ``i`` is in it
    -- and so the baseline subtracted from its turn reward -- is decided by ``a_{i,k}``
    itself (continue or stop): an action-dependent baseline, and the mean reward of
    continuing is erased (verl RFC #7244). Here every member is in every column, with an
    intermediate reward of 0 where it stopped, so the baseline's only dependence on member
    ``i`` is its own ``1/G`` share, the same for every turn as in GRPO. With centred
    advantages (``scale=False``) the expected update is exactly ``(G-1)/G`` times
    ``E[sum_k (outcome + lambda u_k) grad log pi(a_k | h_k)]``, MT-GRPO's credit rule:
    the outcome on every turn and each intermediate reward on the turn that earned it
    (``experiments/termination_bias.py`` enumerates it). The stopping turn now gets
    ``A^O_i - lambda * mean(u_{., k})`` (up to the scale): stopping forgoes what
    continuing earns on average. There is no single-turn (merged) fallback, and
    ``reached_tool_result`` is not read: a trajectory with one turn is a member that
    stopped at turn 0. When every member takes the same number of turns this is exactly
    :func:`mt_grpo` (the last column is all 0); a scalar-scored trajectory has no
    intermediate rewards (all ``u = 0``).
    """
    outcome_adv = group_zscore([t.outcome for t in trajs], eps, ddof, scale)
    values, _ = _padded([np.append(t.turn_rewards[:-1], 0.0) for t in trajs])
    turn_adv = np.zeros_like(values)
    for k in range(values.shape[1]):
        turn_adv[:, k] = group_zscore(values[:, k], eps, ddof, scale)
    return [_fill_turns(t, outcome_adv[i] + turn_advantage_coef * turn_adv[i, :t.n_turns])
            for i, t in enumerate(trajs)]


def turn_rtg(trajs: Sequence[TrajectoryRewards], *, turn_advantage_coef: float = 1.0,
             gamma: float = 1.0, eps: float = EPS, ddof: int = DDOF,
             scale: bool = True, **_: Any) -> list[np.ndarray]:
    """Turn-level return-to-go with a state baseline: free of the per-index length bias
    when the policy picks the number of turns, up to its self-share (below;
    :func:`turn_rtg_unbiased` removes that too).

    Rewards: ``r_{i,k}`` for the ``K_i`` turns of trajectory ``i`` (turn scores; a
    scalar-scored trajectory is ``[0, ..., 0, score]``), intermediate ones (``k < K_i-1``)
    scaled by ``lambda = turn_advantage_coef``. Then::

        G_{i,k} = sum_{j=k}^{K_i-1} gamma^(j-k) r_{i,j}            (return-to-go)
        b_k     = mean of G_{j,k} over the members j with K_j > k   (state baseline)
        c_{i,k} = G_{i,k} - b_k          (exactly 0 when index k's returns are all equal)
        s       = sqrt( sum_{i,k} c_{i,k}^2 / (N - ddof * K_max) )  (pooled within-index
                                                                     std, N = sum_i K_i)
        A_{i,k} = c_{i,k} / (s + eps)       on the tokens of turn k; 0 outside the spans

    A group of single-turn trajectories gets GRPO's ``z(outcome)`` (same ``eps``, ``ddof``).

    Why per-turn-index normalisation is length-biased (verl issue #7244). The
    score-function identity ``E[grad log pi(a_k | h_k) * b] = 0`` holds only for a
    baseline ``b`` that does not depend on the action ``a_k`` -- and in an agent, ``a_k``
    includes *whether to take another turn*. Normalising rewards per turn index and
    accumulating them, ``A_{i,k} = sum_{j=k}^{K_i-1} (r_{i,j} - mu_j)``, subtracts the
    baseline ``sum_{j=k}^{K_i-1} mu_j``, whose number of terms is the trajectory's own
    stopping turn ``K_i``: an action-dependent baseline. Its bias is ``-mu_j`` for every
    extra turn taken: whatever the group earns on average by taking turn ``j`` is silently
    cancelled, a hidden length preference of the size of the intermediate rewards.
    MT-GRPO's per-index z-score has the same defect in its plainest form: the score a
    trajectory earns at turn ``j > 0`` is compared only with the members that chose to
    reach turn ``j``, so what continuing earns on average is erased (a tool call that
    always costs 0.5 is invisible), while a trajectory that stops at turn 0 falls back to
    the merged sum and is compared against everybody's accumulated turn rewards.

    Why this estimator is not. Future rewards enter ``G_{i,k}`` un-normalised, and the
    only thing subtracted at turn ``k`` is ``b_k``, one term, determined by the fact that
    the trajectory *has reached* turn ``k`` -- part of the history ``h_k``, fixed before
    ``a_k`` is chosen -- never by how many turns it takes afterwards. So
    ``E[grad log pi(a_k | h_k) b_k] = 0`` up to the member's own share ``1/n_k`` of the
    mean, ``n_k`` the number of members that reached turn ``k``. Unlike GRPO's ``1/G``
    that share is not one constant: turn ``k``'s expected update is scaled by
    ``E[1 - 1/n_k]``, which shrinks with ``k`` when members stop at different turns, so
    the later turns (and the decisions to go on) are under-weighted: in the enumerated
    MDP of docs/credit-bias.md a bias towards stopping, +0.038 of ``|grad J|`` on the stop
    logits at ``G = 4``, shrinking with ``G`` (:func:`turn_rtg_unbiased` takes the
    others' mean instead). Otherwise the gradient favours a longer or shorter trajectory
    as much as its rewards do. When taking more turns does
    not change what a trajectory earns (uninformative turn rewards), the advantages carry
    no length preference: e.g. if every member's return ``G_{i,0}`` is equal, every
    turn-0 advantage is 0 whatever the turn counts, and if the extra turns' rewards are
    zero-mean the mean advantage of the long members equals that of the short ones. The
    scale ``s`` is one scalar for the whole group (not one per index, which would blow
    up tiny differences between the few members that reach a late turn), so it does not
    reweight turns either. Consequence for env authors: a constant per-turn bonus or cost
    *is* a statement about length and is passed through as such; make turn rewards score
    progress if length should not matter.
    """
    values, present = _returns_to_go(trajs, turn_advantage_coef, gamma)
    centred = np.zeros_like(values)
    for k in range(values.shape[1]):
        rows = present[:, k]
        column = values[rows, k]
        if not _all_equal(column):
            centred[rows, k] = column - column.mean()
    scaled = _pooled_scale(centred, present, eps, ddof, scale)
    return [_fill_turns(traj, scaled[i, :traj.n_turns]) for i, traj in enumerate(trajs)]


def turn_rtg_unbiased(trajs: Sequence[TrajectoryRewards], *, turn_advantage_coef: float = 1.0,
                      gamma: float = 1.0, eps: float = EPS, ddof: int = DDOF,
                      scale: bool = True, **_: Any) -> list[np.ndarray]:
    """:func:`turn_rtg` with a leave-one-out baseline: unbiased when the policy decides how
    many turns to take (docs/credit-bias.md).

    Same returns-to-go ``G_{i,k}`` (turn rewards, intermediate ones times ``lambda``,
    discount ``gamma``); with ``G`` the group's size::

        m_{-i,k} = mean of G_{j,k} over the other members j != i with K_j > k
                   (0 when no other member reached turn k)
        c_{i,k}  = (1 - 1/G) * (G_{i,k} - m_{-i,k})
        A_{i,k}  = c_{i,k} / (s + eps),  s = sqrt( sum_{i,k} c_{i,k}^2 / (N - ddof * K_max) )

    (``scale=False``: ``A = c``). Why. :func:`turn_rtg` subtracts the mean over the
    ``n_k`` members that reached turn ``k``, member ``i`` included: its own share ``1/n_k``
    scales turn ``k``'s expected update by ``E[1 - 1/n_k]``, and ``n_k`` shrinks with
    ``k`` when trajectories stop at different turns, so later turns -- and the decisions
    to go on -- are under-weighted (an index reached by one member gets 0); with a fixed
    horizon ``n_k = G`` everywhere and this is only GRPO's ``(G-1)/G``. Here the baseline
    is the others' alone (a function of the other members, independent of member ``i``'s
    actions), and the factor is ``1 - 1/G`` at every index, so with centred advantages the
    expected update is exactly ``(G-1)/G`` times ``E[sum_k G_k grad log pi(a_k | h_k)]``,
    the policy gradient of ``E[sum_k gamma^k r_k]`` (at ``gamma = 1``: ``E[sum of turn
    rewards]``). Where ``n_k = G`` this equals :func:`turn_rtg`'s centred value; a member
    alone at an index gets ``(1 - 1/G) G_{i,k}`` (no baseline is available that does not
    depend on it), so the variance is higher where few members go on.
    """
    values, present = _returns_to_go(trajs, turn_advantage_coef, gamma)
    size = len(trajs)
    centred = np.zeros_like(values)
    for k in range(values.shape[1]):
        rows = present[:, k]
        column, n = values[rows, k], int(rows.sum())
        if n == 1:
            centred[rows, k] = (1.0 - 1.0 / size) * column
        elif not _all_equal(column):
            others = (column.sum() - column) / (n - 1)
            centred[rows, k] = (1.0 - 1.0 / size) * (column - others)
    scaled = _pooled_scale(centred, present, eps, ddof, scale)
    return [_fill_turns(traj, scaled[i, :traj.n_turns]) for i, traj in enumerate(trajs)]


def _returns_to_go(trajs: Sequence[TrajectoryRewards], turn_advantage_coef: float,
                   gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Each member's returns-to-go ``G_{i,k}`` (intermediate turn rewards times
    ``turn_advantage_coef``, discount ``gamma``), padded: ``(values, present)``."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    returns = []
    for traj in trajs:
        rewards = traj.turn_rewards.copy()
        rewards[:-1] *= turn_advantage_coef
        returns.append(discounted_returns(rewards, gamma))
    return _padded(returns)


def _pooled_scale(centred: np.ndarray, present: np.ndarray, eps: float, ddof: int,
                  scale: bool) -> np.ndarray:
    """``centred`` over one scale for the whole group, ``sqrt(sum c^2 / (N - ddof *
    K_max)) + eps`` (``scale=False``: as it is; all zero when nothing varies)."""
    dof = int(present.sum()) - ddof * centred.shape[1]
    if not scale:
        return centred
    if dof <= 0 or not centred.any():
        return np.zeros_like(centred)
    return centred / (math.sqrt(float((centred ** 2).sum()) / dof) + eps)


def discounted_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """``G_k = sum_{j>=k} gamma^(j-k) r_j`` for every turn ``k``."""
    g = np.empty_like(rewards, dtype=np.float64)
    running = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        g[k] = running
    return g


def gigpo(trajs: Sequence[TrajectoryRewards], *, turn_advantage_coef: float = 1.0,
          gamma: float = 1.0, eps: float = EPS, ddof: int = DDOF, scale: bool = True,
          **_: Any) -> list[np.ndarray]:
    """GiGPO (Feng et al., arXiv 2505.10978): an episode advantage plus a step advantage
    among the turns of the group that start from the same state.

    For trajectory ``i`` with turn rewards ``r_{i,0..K_i-1}`` (its turn scores, or
    ``[0, ..., 0, outcome]`` when it is scored as a whole) and turn anchors ``s_{i,k}``::

        A^E_i     = z_group(sum_k r_{i,k})_i                      (episode return)
        R_{i,k}   = sum_{j>=k} gamma^(j-k) r_{i,j}                (discounted return)
        A^S_{i,k} = z over {(j, l) : s_{j,l} = s_{i,k}} of R_{j,l}   (anchor group)
        A_{i,k}   = A^E_i + omega * A^S_{i,k}    on the tokens of turn k; 0 outside

    with ``omega = turn_advantage_coef`` (paper: 1) and ``gamma`` (paper: 0.95). An anchor
    group of one turn (a state no other turn of the group started from), or a trajectory
    without anchors, gets ``A^S = 0``: the episode advantage only. Anchor groups may hold
    several turns of the same trajectory (a state visited twice). The z-score is
    :func:`group_zscore` (``scale=False``: centred only).
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    episode = group_zscore([float(t.turn_rewards.sum()) for t in trajs], eps, ddof, scale)
    returns = [discounted_returns(t.turn_rewards, gamma) for t in trajs]
    members: dict[str, list[tuple[int, int]]] = {}
    for i, traj in enumerate(trajs):
        for k, key in enumerate(traj.turn_anchors or []):
            members.setdefault(key, []).append((i, k))
    step = [np.zeros(t.n_turns) for t in trajs]
    for turns in members.values():
        z = group_zscore([returns[i][k] for i, k in turns], eps, ddof, scale)
        for (i, k), value in zip(turns, z):
            step[i][k] = value
    return [_fill_turns(t, episode[i] + turn_advantage_coef * step[i])
            for i, t in enumerate(trajs)]


def gigpo_unbiased(trajs: Sequence[TrajectoryRewards], *, turn_advantage_coef: float = 1.0,
                   gamma: float = 1.0, eps: float = EPS, ddof: int = DDOF, scale: bool = True,
                   **_: Any) -> list[np.ndarray]:
    """:func:`gigpo` with a step baseline taken from the other trajectories only: unbiased
    when states repeat within a trajectory and when the policy decides when to stop
    (docs/credit-bias.md).

    ``A^E`` and ``R_{i,k}`` as in :func:`gigpo`; with ``G`` the group's size::

        b_{-i}(s)  = mean of R_{j,l} over the turns (j, l) of the *other* trajectories
                     j != i with anchor s_{j,l} = s      (0 when there is none)
        c_{i,k}    = (1 - 1/G) * (R_{i,k} - b_{-i}(s_{i,k}))
        A_{i,k}    = A^E_i + omega * c_{i,k} / (s_S + eps)
        s_S        = sqrt( sum c_{i,k}^2 / (N - ddof * n_anchors) )   (pooled over the
                     anchored turns, N of them in n_anchors anchor groups)

    (``scale=False``: ``A = A^E + omega * c``). Why. GiGPO's anchor group of a turn
    includes the turn itself and the same trajectory's other turns from that state (a
    state visited twice); whether those exist and what they return is decided by the
    turn's own action, so its baseline is action-dependent, and the self-share ``1/n``
    varies with the anchor group's size ``n``, reweighting states. Here the baseline is a
    function of the other trajectories alone and the factor is ``1 - 1/G`` everywhere, so
    with centred advantages the step part's expected update is exactly ``(G-1)/G`` times
    ``E[sum_k R_k grad log pi(a_k | h_k)]`` (at ``gamma = 1`` the policy gradient of
    ``E[sum r]``), like the episode part. Where an anchor group holds one turn of each of
    the ``G`` members (every member's first turn) the centred value equals GiGPO's; a turn
    whose state no other trajectory visited gets ``(1 - 1/G) R_{i,k}`` where GiGPO gives
    0. The z-score is one pooled scale over the group's anchored turns, not one per anchor
    group (an anchor group of one trajectory has no spread of its own). Trajectories
    without anchors get the episode advantage only, as in GiGPO.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    size = len(trajs)
    episode = group_zscore([float(t.turn_rewards.sum()) for t in trajs], eps, ddof, scale)
    returns = [discounted_returns(t.turn_rewards, gamma) for t in trajs]
    members: dict[str, list[tuple[int, int]]] = {}
    for i, traj in enumerate(trajs):
        for k, key in enumerate(traj.turn_anchors or []):
            members.setdefault(key, []).append((i, k))
    step = [np.zeros(t.n_turns) for t in trajs]
    for turns in members.values():
        for i, k in turns:
            others = [returns[j][l] for j, l in turns if j != i]
            baseline = math.fsum(others) / len(others) if others else 0.0
            step[i][k] = (1.0 - 1.0 / size) * (returns[i][k] - baseline)
    if scale:
        n_turns = sum(len(turns) for turns in members.values())
        dof = n_turns - ddof * len(members)
        total = math.fsum(float((s ** 2).sum()) for s in step)
        spread = math.sqrt(total / dof) if dof > 0 and total > 0 else 0.0
        step = [s / (spread + eps) if spread > 0 else np.zeros_like(s) for s in step]
    return [_fill_turns(t, episode[i] + turn_advantage_coef * step[i])
            for i, t in enumerate(trajs)]


Estimator = Callable[..., list[np.ndarray]]

ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo,
    "grpo_merged": grpo_merged,
    "mt_grpo": mt_grpo,
    "turn_rtg": turn_rtg,
    "mt_grpo_unbiased": mt_grpo_unbiased,
    "turn_rtg_unbiased": turn_rtg_unbiased,
    "gigpo_unbiased": gigpo_unbiased,
    "gigpo": gigpo,
}
"""Estimator name -> function ``(trajs, *, turn_advantage_coef, gamma, eps, ddof, scale)``."""


@dataclass
class GroupAdvantages:
    """The per-token advantages of one group.

    ``advantages[i]`` is a float32 array of trajectory ``i``'s length. ``zero_variance``:
    no trajectory carries any signal (every value is 0: all rewards equal under the
    estimator and no env override with a non-zero value). ``overridden[i]``: trajectory
    ``i``'s advantages came from the env. A dropped group is returned as ``None``.
    """

    advantages: list[np.ndarray]
    estimator: str
    zero_variance: bool
    overridden: list[bool]


def compute_group_advantages(
    trajs: Sequence[TrajectoryRewards | ScoredTrajectory],
    estimator: str,
    *,
    turn_advantage_coef: float = 1.0,
    gamma: float = 1.0,
    zero_variance: Literal["zero", "drop"] = "zero",
    eps: float = EPS,
    ddof: int = DDOF,
    scale: bool = True,
) -> GroupAdvantages | None:
    """Per-token advantages of one group with the named estimator (see ``ESTIMATORS``).

    ``ScoredTrajectory`` inputs are converted with :func:`from_scored`. Env-provided
    ``advantages`` override the estimator for their trajectory. A zero-variance group
    gets all-zero advantages (``zero_variance="zero"``) or is dropped (``"drop"``:
    returns ``None``). ``turn_advantage_coef`` is MT-GRPO's lambda (and ``turn_rtg``'s
    weight on intermediate turn rewards, and GiGPO's step weight omega); ``gamma`` is
    ``turn_rtg``'s and GiGPO's discount. ``scale=False``: advantages are centred, not
    divided by the std (Dr. GRPO).
    """
    try:
        fn = ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of: "
                         f"{', '.join(ESTIMATORS)}") from None
    if zero_variance not in ("zero", "drop"):
        raise ValueError(f"zero_variance must be 'zero' or 'drop', got {zero_variance!r}")
    if not trajs:
        raise ValueError("a group needs at least one trajectory")
    rewards = [t if isinstance(t, TrajectoryRewards) else from_scored(t) for t in trajs]
    advantages = fn(rewards, turn_advantage_coef=turn_advantage_coef, gamma=gamma,
                    eps=eps, ddof=ddof, scale=scale)
    overridden = [t.advantages is not None for t in rewards]
    for i, traj in enumerate(rewards):
        if traj.advantages is not None:
            advantages[i] = np.asarray(traj.advantages, dtype=np.float32)
    no_signal = not any(a.any() for a in advantages)
    if no_signal and zero_variance == "drop":
        return None
    return GroupAdvantages(advantages=advantages, estimator=estimator,
                           zero_variance=no_signal, overridden=overridden)
