"""What ``BaseEnv.evaluate()`` reports from its rollouts (a pure function).

Every held-out item is played ``eval_samples`` times. The samples of one item are not
independent (the same question, the same policy), so the unit of the report is the item:
each metric is the mean over items of each item's mean over its finished samples, and
its 95 % interval is computed over the item means (an interval over episodes would count
every item ``eval_samples`` times and be too narrow). With one sample per item the item
means are the episodes' values and every number is the per-episode one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from environments.framework.stats import ci95
from environments.rollout import Rollout
from environments.trajectory import ScoredTrajectory


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def item_interval(item_means: Sequence[float], rate: bool) -> list[float] | None:
    """The 95 % interval of the mean of ``item_means`` (:func:`ci95`: Wilson when every
    item mean is 0 or 1, else normal). ``rate``: every episode's value was 0 or 1, so the
    interval is clipped to [0, 1] (a normal interval over item means such as 0.25 can
    cross 0 near the floor; at one sample per item a rate's item means are 0 or 1 and
    get Wilson's, which stays inside)."""
    ci = ci95(item_means)
    if ci is None:
        return None
    return [max(0.0, ci[0]), min(1.0, ci[1])] if rate else list(ci)


def summarize(finished: Sequence[Sequence[tuple[Rollout, ScoredTrajectory]]],
              failed: int) -> dict[str, Any]:
    """The evaluation's figures from each item's finished samples (``finished[i]``, in
    sample order; an item none of whose samples finished is counted in ``items`` and
    enters no mean) and the number of rollouts that ``failed``."""
    played = [samples for samples in finished if samples]
    names = sorted({k for samples in played for _, t in samples
                    for k in t.metadata.get("metrics", {})})
    per_episode = {  # per item, the value of each finished sample
        "mean_outcome": [[t.outcome for _, t in s] for s in played],
        "tool_errors_per_episode": [[r.tool_errors for r, _ in s] for s in played],
        "truncated_rate": [[float(r.truncated) for r, _ in s] for s in played],
        **{name: [[t.metadata.get("metrics", {}).get(name, 0.0) for _, t in s]
                  for s in played] for name in names},
    }
    item_means = {name: [_mean(v) for v in values] for name, values in per_episode.items()}
    return {
        "items": len(finished), "episodes": sum(len(s) for s in finished), "failed": failed,
        "mean_turns": _mean([_mean([len(r.turns) for r, _ in s]) for s in played]),
        "tool_calls_per_episode": _mean([_mean([r.tool_calls for r, _ in s]) for s in played]),
        **{name: _mean(means) for name, means in item_means.items()},
        # 95 % interval of each mean, over the item means (Wilson for rates), [low, high]
        **{f"{name}_ci95": item_interval(item_means[name], all(
            v in (0, 1) for values in per_episode[name] for v in values))
           for name in per_episode},
    }
