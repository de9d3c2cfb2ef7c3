"""The bias check, exact: each advantage estimator's expected update against the true
gradient of the objective it claims to optimise, on a small episodic MDP where the policy
decides when to stop, and on a fixed-horizon control (docs/credit-bias.md).

    PYTHONPATH=. python experiments/termination_bias.py
    PYTHONPATH=. python experiments/termination_bias.py --aggregation token_mean
    PYTHONPATH=. python experiments/termination_bias.py --policies 20 --group-size 3

The MDP ("search, then answer"). A turn is one action of a tabular softmax policy whose
state is whether the answer has been found (``searching`` / ``found``); logits
``theta[state, action]``, 2 x 3 parameters. Actions: ``search_a`` (a relevant tool call:
turn reward 0.3, the answer is found), ``search_b`` (an irrelevant one: 0.1, nothing
changes) and ``answer`` (stop; the outcome is 1 if the answer was found, else 0, and it is
the stopping turn's score). The last turn (``horizon - 1``) must answer. In the
*policy-controlled stop* MDP ``answer`` may be chosen at any turn, so trajectories take 1
to ``horizon`` turns; in the *fixed-horizon* control it is not available before the last
turn, so every trajectory takes ``horizon`` turns and only the choice of tool is learnt.

What is enumerated. Every trajectory with its probability and its per-turn score
``grad log pi(a_k | s_k)`` (exactly); every group of ``G`` as a multiset with its
multinomial probability; for each, the estimator (the trainer's own code,
``trainer.advantages.ESTIMATORS``) on one token per turn, and the update the loss applies
on the first, on-policy step (PPO ratio 1, no mismatch weight): with
``aggregation: constant``, ``(1/G) sum_i sum_k A_{i,k} grad log pi(a_{i,k} | s_{i,k})``
(``--aggregation token_mean``: the sum over the group's turns divided by their number and
multiplied by E[K], a batch of one group). Its expectation over groups is exact up to
rounding: there is no sampling error.

Besides the trainer's estimators the table has ``per_index_sum``, the form verl RFC #7244
analyses (each turn reward normalised per turn index over the members that reached it,
then summed to go; :func:`per_index_sum`), to check the RFC's claim itself.

Targets (the true gradients, by the score-function formula over the enumerated
trajectories): ``grpo`` claims ``grad E[outcome]``; ``grpo_merged``, ``turn_rtg``,
``gigpo``, ``mt_grpo`` and the variants ``grad E[sum of turn rewards]`` (lambda = omega =
1, gamma = 1); ``mt_grpo`` and its variant are also compared with their credit rule, ``credit``:
``E[sum_k (outcome + u_k) grad log pi(a_k | s_k)]`` with ``u_k`` turn ``k``'s
intermediate reward (0 on the stopping turn): each intermediate reward credited to the
turn that earned it only, which is not ``grad E[sum r]`` even at a fixed horizon, so the
second comparison isolates what the baseline does.

Columns. ``cos``: cosine of the expected update with the target. ``rel.err``:
``|E[g]/c - grad J| / |grad J|``, with ``c`` the scale an unbiased estimator of that form
has: ``(G-1)/G`` for centred advantages (the member's own share of the group mean), times
``1 + omega`` for GiGPO (episode plus step advantage); z-scored advantages have no such
scale, so for them ``c`` is the best-fitting one and ``rel.err`` is ``tan`` of the angle.
``stop``: the same error projected on the stop parameters (the ``answer`` logits, centred
per state), over ``|grad J|``; positive: the update pushes towards stopping more than the
objective does. ``noise``: the standard deviation of one group's update at the same
scale, ``sqrt(E|g/c - E[g]/c|^2) / |grad J|`` (what an unbiased variant may pay for being
unbiased).
"""

import argparse
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.advantages import ESTIMATORS, TrajectoryRewards  # noqa: E402

STATES = ("searching", "found")
ACTIONS = ("search_a", "search_b", "answer")
TOOL_REWARD = {"search_a": 0.3, "search_b": 0.1}
"""Intermediate (turn) reward of each tool call."""
THETA = np.array([[0.3, -0.2, 0.0],    # searching: search_a, search_b, answer
                  [0.2, 0.4, 0.1]])    # found
"""The policy the check is made at: the stop probability is 0.32 while searching and 0.29
once found, so lengths vary over all of 1..horizon."""
TARGETS = ("outcome", "return", "credit")


@dataclass(frozen=True)
class Mdp:
    """``can_stop``: ``answer`` is available before the last turn (the policy controls
    termination); else only at turn ``horizon - 1`` (the fixed-horizon control)."""

    name: str
    horizon: int
    can_stop: bool

    def __post_init__(self) -> None:
        if self.horizon < 2:
            raise ValueError(f"horizon must be at least 2 (a tool call, then the answer), "
                             f"got {self.horizon}")

    def actions(self, k: int) -> tuple[str, ...]:
        if k == self.horizon - 1:
            return ("answer",)
        return ACTIONS if self.can_stop else ACTIONS[:2]


def mdps(horizon: int) -> list[Mdp]:
    return [Mdp("fixed horizon", horizon, False), Mdp("policy stops", horizon, True)]


@dataclass
class Trajectory:
    actions: tuple[str, ...]
    states: tuple[str, ...]
    rewards: tuple[float, ...]   # one per turn; the last is the outcome
    prob: float
    scores: np.ndarray           # [K, n_params]: grad log pi(a_k | s_k) per turn
    rewards_view: TrajectoryRewards

    @property
    def outcome(self) -> float:
        return self.rewards[-1]

    @property
    def intermediate(self) -> np.ndarray:
        """u_k: the turn reward of each tool call, 0 on the stopping turn."""
        return np.array([*self.rewards[:-1], 0.0])


def step(state: str, action: str) -> tuple[float, str | None]:
    """(turn reward, next state); None: the episode ended."""
    if action == "answer":
        return (1.0 if state == "found" else 0.0), None
    return TOOL_REWARD[action], ("found" if action == "search_a" else state)


def policy(theta: np.ndarray, mdp: Mdp, k: int, state: str) -> dict[str, float]:
    """pi(. | s_k): softmax of the state's logits over the actions available at turn k."""
    allowed = mdp.actions(k)
    logits = np.array([theta[STATES.index(state), ACTIONS.index(a)] for a in allowed])
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return dict(zip(allowed, p.tolist()))


def grad_log_policy(theta: np.ndarray, mdp: Mdp, k: int, state: str, action: str) -> np.ndarray:
    """d log pi(action | s_k) / d theta, flattened (0 where the turn has no choice)."""
    pi = policy(theta, mdp, k, state)
    g = np.zeros_like(theta)
    row = STATES.index(state)
    for a, p in pi.items():
        g[row, ACTIONS.index(a)] -= p
    g[row, ACTIONS.index(action)] += 1.0
    return g.ravel()


def trajectories(mdp: Mdp, theta: np.ndarray = THETA) -> list[Trajectory]:
    """Every trajectory of the MDP under ``theta``, with its probability (they sum to 1)."""
    out: list[Trajectory] = []

    def extend(k, state, actions, states, rewards, prob, scores):
        for action, p in policy(theta, mdp, k, state).items():
            reward, following = step(state, action)
            path = (actions + (action,), states + (state,), rewards + (reward,), prob * p,
                    scores + [grad_log_policy(theta, mdp, k, state, action)])
            if following is None:
                n = len(path[0])
                view = TrajectoryRewards(n_tokens=n, turn_spans=[(j, j + 1) for j in range(n)],
                                         turn_scores=list(path[2]), turn_anchors=list(path[1]))
                out.append(Trajectory(*path[:4], np.array(path[4]), view))
            else:
                extend(k + 1, following, *path)

    extend(0, "searching", (), (), (), 1.0, [])
    return out


def target_gradient(trajs: Sequence[Trajectory], target: str) -> np.ndarray:
    """``outcome``: grad E[outcome]; ``return``: grad E[sum_k r_k] (score-function formula);
    ``credit``: MT-GRPO's credit rule, E[sum_k (outcome + u_k) grad log pi(a_k | s_k)]."""
    total = np.zeros(trajs[0].scores.shape[1])
    for t in trajs:
        if target == "outcome":
            total += t.prob * t.outcome * t.scores.sum(0)
        elif target == "return":
            total += t.prob * sum(t.rewards) * t.scores.sum(0)
        elif target == "credit":
            total += t.prob * ((t.outcome + t.intermediate)[:, None] * t.scores).sum(0)
        else:
            raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    return total


def groups(n: int, size: int):
    """Every multiset of ``size`` trajectory indices out of ``n`` with its multiplicity
    ``size! / prod(m_t!)`` (the number of ordered groups it stands for)."""
    if size < 2:
        raise ValueError(f"group size must be at least 2, got {size}")
    for members in itertools.combinations_with_replacement(range(n), size):
        counts = np.bincount(members)
        yield members, math.factorial(size) / math.prod(math.factorial(int(c)) for c in counts)


def per_index_sum(trajs: Sequence[TrajectoryRewards], *, eps: float = 1e-4, scale: bool = True,
                  **_) -> list[np.ndarray]:
    """The form verl RFC #7244 analyses (a reference, not a Lachesis estimator): each turn
    reward normalised over the members that reached its index, then summed to go,
    ``A_{i,k} = sum_{j=k}^{K_i-1} z_j(r_{i,j})``, one token per turn."""
    rewards = [t.turn_rewards for t in trajs]
    width = max(len(r) for r in rewards)
    z = [np.zeros(len(r)) for r in rewards]
    for j in range(width):
        rows = [i for i, r in enumerate(rewards) if len(r) > j]
        column = np.array([rewards[i][j] for i in rows])
        if len(rows) < 2 or np.ptp(column) <= 1e-12:
            continue
        centred = column - column.mean()
        if scale:
            centred = centred / (column.std(ddof=1) + eps)
        for i, value in zip(rows, centred):
            z[i][j] = value
    return [np.cumsum(v[::-1])[::-1].astype(np.float32) for v in z]


REFERENCES = {"per_index_sum": per_index_sum}
"""Reference forms the table includes beside ``trainer.advantages.ESTIMATORS``."""


def update_moments(trajs: Sequence[Trajectory], estimator: str, group_size: int, *,
                   scale: bool = False, aggregation: str = "constant",
                   turn_advantage_coef: float = 1.0,
                   gamma: float = 1.0) -> tuple[np.ndarray, float]:
    """``(E[g], E[|g|^2])`` over groups of the loss's ascent direction ``g`` for
    ``estimator`` (module docstring), exactly, by enumerating every group."""
    if aggregation not in ("constant", "token_mean"):
        raise ValueError(f"aggregation must be 'constant' or 'token_mean', got {aggregation!r}")
    fn = ESTIMATORS[estimator] if estimator in ESTIMATORS else REFERENCES[estimator]
    mean_turns = sum(t.prob * len(t.rewards) for t in trajs)
    total = np.zeros(trajs[0].scores.shape[1])
    square = 0.0
    for members, multiplicity in groups(len(trajs), group_size):
        group = [trajs[i] for i in members]
        prob = multiplicity * math.prod(t.prob for t in group)
        advantages = fn([t.rewards_view for t in group], turn_advantage_coef=turn_advantage_coef,
                        gamma=gamma, scale=scale)
        update = sum((a.astype(np.float64)[:, None] * t.scores).sum(0)
                     for a, t in zip(advantages, group))
        if aggregation == "constant":
            update = update / group_size
        else:
            update = update * mean_turns / sum(len(t.rewards) for t in group)
        total += prob * update
        square += prob * float(update @ update)
    return total, square


def expected_update(trajs: Sequence[Trajectory], estimator: str, group_size: int,
                    **kwargs) -> np.ndarray:
    """E over groups of the loss's ascent direction (:func:`update_moments`)."""
    return update_moments(trajs, estimator, group_size, **kwargs)[0]


def stop_direction(theta_shape=THETA.shape) -> np.ndarray:
    """Unit vector on the ``answer`` logits, centred per state (softmax gradients are)."""
    d = np.zeros(theta_shape)
    d[:, ACTIONS.index("answer")] = 1.0
    d -= d.mean(axis=1, keepdims=True)
    return (d / np.linalg.norm(d)).ravel()


@dataclass
class Row:
    estimator: str
    mdp: str
    scaled: bool
    target: str
    cos: float
    rel_err: float
    stop: float | None
    noise: float


def nominal_scale(estimator: str, group_size: int, coef: float) -> float:
    return (group_size - 1) / group_size * (1.0 + coef if estimator.startswith("gigpo") else 1.0)


def compare(update: np.ndarray, truth: np.ndarray, scale: float | None,
            stop: np.ndarray | None) -> tuple[float, float, float | None]:
    """(cos, relative error, stop-parameter error) of ``update / scale`` against ``truth``;
    ``scale=None``: the best-fitting scale."""
    norm = float(np.linalg.norm(truth))
    cos = float(update @ truth) / (float(np.linalg.norm(update)) * norm)
    c = float(update @ truth) / norm ** 2 if scale is None else scale
    error = update / c - truth
    return cos, float(np.linalg.norm(error)) / norm, \
        (None if stop is None else float(error @ stop) / norm)


ROWS = [("grpo", "outcome"), ("grpo_merged", "return"), ("mt_grpo", "return"),
        ("mt_grpo", "credit"), ("mt_grpo_unbiased", "return"), ("mt_grpo_unbiased", "credit"),
        ("turn_rtg", "return"), ("turn_rtg_unbiased", "return"), ("gigpo", "return"),
        ("gigpo_unbiased", "return"), ("per_index_sum", "return")]


def table(horizon: int = 4, group_size: int = 4, aggregation: str = "constant",
          theta: np.ndarray = THETA, rows=ROWS, coef: float = 1.0,
          can_stop: Sequence[bool] = (False, True),
          scalings: Sequence[bool] = (False, True)) -> list[Row]:
    out = []
    for mdp in mdps(horizon):
        if mdp.can_stop not in can_stop:
            continue
        trajs = trajectories(mdp, theta)
        stop = stop_direction(theta.shape) if mdp.can_stop else None
        truths = {target: target_gradient(trajs, target) for target in TARGETS}
        for scaled in scalings:
            moments: dict[str, tuple[np.ndarray, float]] = {}
            for estimator, target in rows:
                if estimator not in moments:
                    moments[estimator] = update_moments(
                        trajs, estimator, group_size, scale=scaled, aggregation=aggregation,
                        turn_advantage_coef=coef)
                mean, square = moments[estimator]
                truth = truths[target]
                scale = None if scaled else nominal_scale(estimator, group_size, coef)
                cos, rel, stop_error = compare(mean, truth, scale, stop)
                c = float(mean @ truth) / float(truth @ truth) if scale is None else scale
                spread = math.sqrt(max(square - float(mean @ mean), 0.0)) / abs(c)
                out.append(Row(estimator, mdp.name, scaled, target, cos, rel, stop_error,
                               spread / float(np.linalg.norm(truth))))
    return out


def format_table(rows: Sequence[Row]) -> str:
    lines = [f"{'estimator':<17} {'MDP':<14} {'advantages':<10} {'target':<8} "
             f"{'cos':>7} {'rel.err':>8} {'stop':>8} {'noise':>7}"]
    for r in rows:
        stop = "-" if r.stop is None else f"{r.stop:+.4f}"
        lines.append(f"{r.estimator:<17} {r.mdp:<14} {'z-scored' if r.scaled else 'centred':<10} "
                     f"{r.target:<8} {r.cos:7.4f} {r.rel_err:8.4f} {stop:>8} {r.noise:7.2f}")
    return "\n".join(lines)


def spread_over_policies(n: int, horizon: int, group_size: int, seed: int = 0,
                         scaled: bool = False) -> str:
    """min / median / max of each row's ``rel.err`` and ``stop`` in the policy-stop MDP over
    ``n`` policies with logits drawn from N(0, 1): is the finding one of ``THETA``'s?"""
    rng = np.random.default_rng(seed)
    rows: dict[tuple[str, str], list[Row]] = {}
    for _ in range(n):
        theta = rng.normal(size=THETA.shape)
        for r in table(horizon, group_size, theta=theta, can_stop=[True], scalings=[scaled]):
            rows.setdefault((r.estimator, r.target), []).append(r)
    lines = [f"{'estimator':<17} {'target':<8} {'rel.err min / median / max':>27} "
             f"{'stop min / median / max':>27}"]
    for (estimator, target), found in rows.items():
        rel = np.array([r.rel_err for r in found])
        stop = np.array([r.stop for r in found])
        lines.append(f"{estimator:<17} {target:<8} "
                     f"{rel.min():9.4f}{np.median(rel):9.4f}{rel.max():9.4f} "
                     f"{stop.min():+9.4f}{np.median(stop):+9.4f}{stop.max():+9.4f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horizon", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--aggregation", choices=["constant", "token_mean"], default="constant")
    parser.add_argument("--policies", type=int, default=0, metavar="N",
                        help="instead of the table at THETA: min / median / max over N "
                             "random policies (policy-stop MDP, centred advantages)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 2 <= args.group_size <= 8 or not 2 <= args.horizon <= 6:
        parser.error("--group-size must be in 2..8 and --horizon in 2..6 (the enumeration "
                     "grows as (2^horizon)^group_size)")
    if args.policies:
        print(f"G = {args.group_size}; {args.policies} policies, logits ~ N(0, 1) "
              f"(seed {args.seed}); policy stops, centred advantages\n")
        print(spread_over_policies(args.policies, args.horizon, args.group_size, args.seed))
        return 0
    for mdp in mdps(args.horizon):
        trajs = trajectories(mdp)
        lengths = {}
        for t in trajs:
            lengths[len(t.rewards)] = lengths.get(len(t.rewards), 0.0) + t.prob
        print(f"{mdp.name}: {len(trajs)} trajectories; P(K turns) "
              + ", ".join(f"{k}: {p:.3f}" for k, p in sorted(lengths.items())))
    print(f"G = {args.group_size}, aggregation {args.aggregation}, lambda = omega = 1, "
          "gamma = 1; exact enumeration of every group\n")
    print(format_table(table(args.horizon, args.group_size, args.aggregation)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
